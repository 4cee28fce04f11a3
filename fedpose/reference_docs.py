"""The generated reference pages: ``docs/configuration.md`` (the pydantic config models, rendered by
:mod:`fedpose.config_reference`) and ``docs/cli.md`` (the argparse parser of every ``fedpose``
subcommand).

    python -m fedpose.reference_docs           # rewrite both pages
    python -m fedpose.reference_docs --check   # exit 1, naming the stale page, if either is out of date

Both pages are rendered from the code alone (never from the terminal width or the environment), so
regenerating on any machine gives the same bytes; a test fails when either page is stale.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

REGENERATE = "python -m fedpose.reference_docs"
DOCS = Path(__file__).resolve().parents[1] / "docs"
USAGE_WIDTH = 100  #: fixed, so the usage lines do not depend on the terminal that regenerates them


def _cell(text: str) -> str:
    """One table cell: on one line, ``|`` and HTML-like ``<name>`` escaped."""
    from fedpose.config_reference import markdown_text

    return markdown_text(" ".join(text.split()).replace("|", "\\|"))


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[argparse.ArgumentParser, str]]:
    """Every (sub)command parser below ``parser``, depth first, with its one-line help."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            formatter = parser.formatter_class(prog=parser.prog, width=USAGE_WIDTH)
            helps = {choice.dest: formatter._expand_help(choice) if choice.help else "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield sub, helps.get(name, "")
                yield from _subcommands(sub)


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = parser.formatter_class(prog=parser.prog, width=USAGE_WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _argument_rows(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser.formatter_class(prog=parser.prog, width=USAGE_WIDTH)
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            name = ", ".join(action.option_strings)
            if action.nargs != 0:
                name += " " + formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
        else:
            name = formatter._format_args(action, formatter._get_default_metavar_for_positional(action))
        if action.required or not action.option_strings and action.nargs not in ("?", "*"):
            default = "required"
        elif action.nargs == 0 or action.default in (None, argparse.SUPPRESS) or action.default == []:
            default = ""
        else:
            default = f"`{action.default}`"
        help_text = formatter._expand_help(action) if action.help else ""
        if action.choices is not None and action.metavar is not None:  # else the {a,b} metavar shows them
            help_text += f" (one of: {', '.join(f'`{c}`' for c in action.choices)})"
        rows.append(f"| `{name}` | {default} | {_cell(help_text)} |")
    return rows


def cli_page() -> str:
    """``docs/cli.md``: one heading per subcommand with its usage and every argument's default and help."""
    from fedpose.cli import build_parser
    from fedpose.config_reference import _anchor, markdown_text

    root = build_parser()
    commands = list(_subcommands(root))
    parts = [
        "# Command-line reference",
        "",
        f"<!-- generated from the argparse parsers: do not edit; regenerate with `{REGENERATE}` -->",
        "",
        f"{root.description} Every command also takes `-h` / `--help`.",
        "",
        *[f"- [`{sub.prog}`](#{_anchor(sub.prog)}): {markdown_text(summary)}" for sub, summary in commands],
    ]
    for sub, summary in commands:
        parts += ["", f"## `{sub.prog}`", ""]
        if summary:
            parts += [markdown_text(summary + ("" if summary.endswith(".") else ".")), ""]
        parts += ["```text", _usage(sub), "```"]
        if sub.description and sub.description.strip() != summary.strip():
            parts += ["", markdown_text(sub.description.strip())]
        rows = _argument_rows(sub)
        if rows:
            parts += ["", "| argument | default | meaning |", "|---|---|---|", *rows]
    return "\n".join(parts) + "\n"


def pages() -> dict[Path, Callable[[], str]]:
    from fedpose.config_reference import configuration_page

    return {DOCS / "configuration.md": configuration_page, DOCS / "cli.md": cli_page}


def stale_pages() -> list[Path]:
    """The generated pages whose file differs from what the code renders now (or is missing)."""
    return [path for path, render in pages().items() if not path.exists() or path.read_text() != render()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedpose.reference_docs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is out of date")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages()
        for path in stale:
            print(f"{path} is out of date: regenerate with `{REGENERATE}`", file=sys.stderr)
        return 1 if stale else 0
    for path, render in pages().items():
        path.write_text(render())
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
