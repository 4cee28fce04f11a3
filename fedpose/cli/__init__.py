"""The ``fedpose`` command line.

Each subcommand group lives in its own module under ``fedpose/cli/`` and exposes
``register(subparsers)``; heavy imports (torch, timm, flwr) happen inside the handlers so
``fedpose --help`` stays fast. Handlers return a process exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Registry of subcommand modules, in the order they appear in --help.
COMMAND_MODULES: tuple[str, ...] = (
    "data",
    "train",
    "evaluate",
    "pckh",
    "privacy",
    "audit",
    "ldp",
    "dprp",
    "simulate",
    "deploy",
    "certs",
    "ledger",
    "site",
    "export",
)


def build_parser() -> argparse.ArgumentParser:
    from fedpose.cli.common import CliParser

    from fedpose import __version__

    parser = CliParser(
        prog="fedpose",
        description="Federated, differentially private 2D human-pose training.",
        epilog="Run `fedpose COMMAND --help` for a command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"fedpose {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"fedpose.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``fedpose ARGV``; returns the exit status (usage errors too: 2, one line on stderr)."""
    from fedpose.cli.common import run_handler

    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # bare `fedpose`: what it can do
        parser.print_help()
        return 0
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed in one line
        return exc.code if isinstance(exc.code, int) else 2
    return run_handler(args)


if __name__ == "__main__":
    sys.exit(main())
