"""The README is the user's manual: its commands, config reference and CI must agree with the code."""

from __future__ import annotations

import re
from pathlib import Path

from fedpose.cli import COMMAND_MODULES, build_parser
from fedpose.config_reference import BEGIN, END, reference_markdown

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_config_reference_is_current() -> None:
    embedded = README[README.index(BEGIN) + len(BEGIN) : README.index(END)].strip()
    assert embedded == reference_markdown().strip(), "regenerate: python -m fedpose.config_reference --write README.md"


def test_ci_runs_the_readme_test_command() -> None:
    block = README.split("## Tests", 1)[1].split("```bash", 1)[1].split("```", 1)[0].strip()
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert block in ci_lines, "CI must run the README's test command verbatim"


def test_every_command_group_is_registered_and_documented() -> None:
    parser = build_parser()
    registered = set(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    for name in ("data", "train", "eval", "predict", "pckh", "privacy", "ldp", "dprp", "simulate", "deploy", "certs", "ledger", "export"):
        assert name in registered, f"fedpose {name} is not registered"
        assert re.search(rf"`fedpose {name}\b", README), f"README does not document fedpose {name}"
    assert len(COMMAND_MODULES) == len(set(COMMAND_MODULES))


def test_readme_configs_exist() -> None:
    for path in set(re.findall(r"configs/[\w.-]+\.toml", README)):
        assert (ROOT / path).exists(), path
