"""Helpers shared by CLI handlers: error reporting, JSON output, config loading."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fedpose.config import ConfigError
from fedpose.data.annotations import AnnotationError


class UserError(Exception):
    """Bad input from the user: printed as 'fedpose: error: ...' with exit code 2, no traceback."""


# Errors that are the user's input, not our bug.
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, ConfigError, AnnotationError, FileNotFoundError)


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
