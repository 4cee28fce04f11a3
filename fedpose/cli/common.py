"""Helpers shared by CLI handlers: error reporting, JSON output, config loading."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from fedpose.config import ConfigError
from fedpose.data.annotations import AnnotationError
from fedpose.federation.run_guard import RunStateRefused


class UserError(Exception):
    """Bad input from the user: printed as 'fedpose: error: ...' with exit code 2, no traceback."""


# Errors that are the user's input, not our bug.
# RunStateRefused: starting would overwrite a run's state or share it with a live writer (exit 2 too)
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, ConfigError, AnnotationError, FileNotFoundError, RunStateRefused)


def run_handler(args: argparse.Namespace) -> int:
    try:
        return int(args.handler(args) or 0)
    except USER_ERRORS as exc:
        print(f"fedpose: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedpose: interrupted", file=sys.stderr)
        return 130


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=None, sort_keys=False))


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="TOML config file (see configs/)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.steps=100 (repeatable)",
    )


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
