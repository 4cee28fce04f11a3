"""The README is the front page: its commands and CI must agree with the code, and what moved out of
it (the configuration table, the command table) must be current where it moved."""

from __future__ import annotations

import re
from pathlib import Path

from fedpose.cli import COMMAND_MODULES, build_parser
from fedpose.config_reference import configuration_page

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
USAGE = (ROOT / "docs" / "usage.md").read_text()


def test_config_reference_lives_in_docs_configuration_and_is_current() -> None:
    # The README used to embed the config table; it now links the generated page, the one reference.
    assert "](docs/configuration.md)" in README
    assert "config-reference:begin" not in README, "the README must not carry a second copy of the config table"
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == configuration_page(), "regenerate: python -m fedpose.reference_docs"


def test_ci_runs_the_readme_test_command() -> None:
    block = README.split("## Tests", 1)[1].split("```bash", 1)[1].split("```", 1)[0].strip()
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert block in ci_lines, "CI must run the README's test command verbatim"


def test_every_command_group_is_registered_and_documented() -> None:
    parser = build_parser()
    registered = set(parser._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    for name in ("data", "train", "eval", "predict", "pckh", "privacy", "ldp", "dprp", "simulate", "deploy", "certs", "ledger", "export"):
        assert name in registered, f"fedpose {name} is not registered"
        assert re.search(rf"`fedpose {name}\b", README), f"README does not name fedpose {name}"
        assert re.search(rf"^\| `fedpose {name}\b", USAGE, flags=re.M), f"docs/usage.md's command table lacks fedpose {name}"
    assert len(COMMAND_MODULES) == len(set(COMMAND_MODULES))


def test_configs_named_in_the_readme_and_docs_exist() -> None:
    for page in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for path in set(re.findall(r"configs/[\w.-]+\.toml", page.read_text())):
            assert (ROOT / path).exists(), f"{page.name}: {path}"
