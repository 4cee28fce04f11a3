"""Helpers shared by CLI handlers: error reporting, JSON output, config loading."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from fedpose.config import ConfigError
from fedpose.data.annotations import AnnotationError
from fedpose.federation.run_guard import RunStateRefused


class UserError(Exception):
    """Bad input from the user: printed as 'fedpose: error: ...' with exit code 2, no traceback."""


# Errors that are the user's input, not our bug: among OS errors, a path that is missing, of the wrong
# kind (a directory for a file, a file where a directory must be made) or not readable/writable.
# RunStateRefused: starting would overwrite a run's state or share it with a live writer (exit 2 too)
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, ConfigError, AnnotationError, FileNotFoundError,
                                                IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError,
                                                RunStateRefused)


#: exit status when the reader of stdout went away (``fedpose … --json | head``): 128 + SIGPIPE, as a shell reports it
BROKEN_PIPE_EXIT = 141
#: set to 1 to see the traceback of an internal error (a bug: reported in one line otherwise)
TRACEBACK_ENV = "FEDPOSE_TRACEBACK"


class CliParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the command (exit 2), and ``--delta -1e-5``
    is a (negative) value, not an unknown option: no fedpose option looks like a number."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _SubcommandsAction)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.IGNORECASE)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def format_help(self) -> str:
        # descriptions are often a module's docstring: show its reST as plain text
        return _plain_text(super().format_help())


class HelpFormatter(argparse.HelpFormatter):
    """Wraps descriptions, but keeps an ``examples:`` epilog (see :func:`examples`) line by line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith(EXAMPLES_HEADER) or "\n    " in text:  # examples, or a docstring's indented block
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


EXAMPLES_HEADER = "examples:"


def examples(*lines: str) -> str:
    """An epilog of example command lines (each '# comment' after two spaces is kept)."""
    return EXAMPLES_HEADER + "\n" + "\n".join(f"  {line}" for line in lines)


class _SubcommandsAction(argparse._SubParsersAction):
    """Every subcommand's --help opens with a description: its one-line help unless it has a longer one."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        if kwargs.get("description") is None and kwargs.get("help"):
            help_text = str(kwargs["help"]).replace("%%", "%")
            first = help_text[:1]  # a sentence's first letter; a symbol keeps its case ("ε of T …", not "Ε of T …")
            kwargs["description"] = (first.upper() if first.isascii() else first) + help_text[1:] + "."
        return super().add_parser(name, **kwargs)


#: reST roles (:func:`x`, :data:`~a.b`) and literals (``x``) as they read in a terminal
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def _plain_text(text: str) -> str:
    return _LITERAL.sub(r"`\1`", _ROLE.sub(r"`\1`", text))


def error_line(exc: BaseException) -> str:
    """One line for an error: an OS error as 'PATH: what happened', anything else as its message."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror[:1].lower()}{exc.strerror[1:]}"
    # a message of several lines (a config's problems, one a line) keeps them apart: "; " between them
    parts = [" ".join(line.split()) for line in str(exc).splitlines() if line.strip()]
    text = "".join(part + ("" if i == len(parts) - 1 else " " if part.endswith(":") else "; ")
                   for i, part in enumerate(parts))
    return text or type(exc).__name__


def _quiet_stdout() -> None:
    """stdout's reader is gone: point it at /dev/null so that the interpreter's final flush cannot fail too."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):  # a stdout with no file descriptor (tests capture it)
        pass


def run_handler(args: argparse.Namespace) -> int:
    """Run a subcommand: bad input is one line on stderr and exit 2, never a traceback."""
    try:
        code = int(args.handler(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's shutdown
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return BROKEN_PIPE_EXIT
    except USER_ERRORS as exc:
        print(f"fedpose: error: {error_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedpose: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: one line (the user can ask for the traceback), never a wall of text
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        print(f"fedpose: internal error: {type(exc).__name__}: {error_line(exc)} (please report it; "
              f"{TRACEBACK_ENV}=1 shows the traceback)", file=sys.stderr)
        return 1


def print_json(obj: Any) -> None:
    """One JSON document on stdout, strict: a non-finite number (ε = ∞, a NaN loss) is null."""
    print(json.dumps(_strict(obj), indent=None, sort_keys=False, allow_nan=False, ensure_ascii=False))


def _strict(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(item) for item in value]
    return value


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="TOML config file (see configs/)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.steps=100 (repeatable)",
    )


# -- image arguments: files and directories, the same for every command -------------------------
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp", ".ppm"})


def collect_images(inputs: list[str], exclude: Path | None = None) -> list[Path]:
    """Files as given; directories walked recursively for image files (skipping ``exclude``, the
    output directory). Sorted, deduplicated."""
    skip = exclude.resolve() if exclude is not None else None

    def wanted(p: Path) -> bool:
        return p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES and (skip is None or skip not in p.resolve().parents)

    found: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found.extend(sorted(p for p in path.rglob("*") if wanted(p)))
        elif path.is_file():
            found.append(path)
        else:
            raise UserError(f"{path}: no such file or directory")
    unique = list(dict.fromkeys(p.resolve() for p in found))
    stems: dict[str, Path] = {}
    for path in unique:
        if path.stem in stems:
            raise UserError(f"{path} and {stems[path.stem]} would both be written as '{path.stem}'; rename one")
        stems[path.stem] = path
    if not unique:
        raise UserError("no images found in the given inputs")
    return unique



# -- argparse value types (the error names the bad value; argparse adds the option) -------------
def _parse(text: str, kind: type) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return value


def positive_float(text: str) -> float:
    value = _parse(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    value = _parse(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def open_unit_interval(text: str) -> float:
    value = positive_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(_parse(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value
