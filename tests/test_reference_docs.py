"""docs/configuration.md and docs/cli.md are generated from the code and must be current and complete."""

from __future__ import annotations

import argparse
import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from fedpose import reference_docs
from fedpose.config_reference import CONFIG_FILES, _model, _submodel, configuration_page, markdown_text
from fedpose.reference_docs import REGENERATE, cli_page, pages, stale_pages


def test_generated_reference_pages_are_current() -> None:
    stale = [str(path.relative_to(path.parents[1])) for path in stale_pages()]
    assert not stale, f"{', '.join(stale)} out of date: regenerate with `{REGENERATE}`"


def test_check_names_the_stale_page_and_the_command_and_write_fixes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(reference_docs, "DOCS", tmp_path)
    (tmp_path / "cli.md").write_text("# an old page\n")
    assert reference_docs.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "cli.md is out of date" in err and "configuration.md is out of date" in err and REGENERATE in err
    assert reference_docs.main([]) == 0
    assert reference_docs.main(["--check"]) == 0
    assert {p.name for p in pages()} == {"cli.md", "configuration.md"}


def test_pages_do_not_depend_on_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    wide = cli_page()
    monkeypatch.setenv("COLUMNS", "40")
    assert cli_page() == wide


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> typing.Iterator[tuple[str, str]]:
    """(key as the page writes it, its section) for every scalar field of ``model``."""
    for name, field in model.model_fields.items():
        sub = _submodel(field.annotation)
        if sub is None and typing.get_origin(field.annotation) is list:
            (item,) = typing.get_args(field.annotation)
            sub = _submodel(item)
            if sub is not None:
                yield from _leaf_keys(sub, f"{prefix}{name}[].")
                continue
        if sub is not None:
            yield from _leaf_keys(sub, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field.description or ""


def _sections(page: str, level: str) -> dict[str, str]:
    chunks = re.split(rf"^{level} (.+)$", page, flags=re.M)
    return dict(zip(chunks[1::2], chunks[2::2]))


def test_configuration_page_has_every_key_with_type_default_and_meaning() -> None:
    files = _sections(configuration_page(), "##")
    for heading, path, _, _ in CONFIG_FILES:
        text = files[heading]
        model = _model(path)
        rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([^`]+)` \|.*\|$", text, flags=re.M)}
        for section in model.model_fields:
            assert f"`[{section}]`" in text or f"`[[{section}]]`" in text or section in rows, f"{heading}: no section {section}"
        tables = _sections(text, "###")
        linked = {name for name in model.model_fields
                  if "| key |" not in tables.get(f"`[{name}]`", tables.get(f"`[[{name}]]`", "| key |"))}
        for name in linked:  # documented once, under the file it links to
            section = tables.get(f"`[{name}]`", tables.get(f"`[[{name}]]`"))
            assert re.search(r"\]\(#[\w-]+\)", section), f"{heading}: [{name}] neither a table nor a link"
        for key, description in _leaf_keys(model):
            if key.split(".")[0].removesuffix("[]") in linked:
                continue
            assert key in rows, f"{heading}: {key} missing"
            cells = [c.strip() for c in rows[key].strip("|").split(" | ")]
            assert len(cells) == 4 and all(cells[:3]), f"{heading}: {key} lacks type or default: {rows[key]}"
            assert markdown_text(" ".join(description.split()).replace("|", "\\|")) == cells[3], f"{heading}: {key} description"


def test_configuration_page_links_shared_tables_instead_of_copying_them() -> None:
    federation = _sections(configuration_page(), "##")["Federation"]
    assert "`coordinator.rounds`" not in federation and "`sites[].eps_max`" not in federation
    assert "](#coordinator)" in federation and "](#site)" in federation
    assert "`coordinator.rounds`" in _sections(configuration_page(), "##")["Coordinator"]
    assert "`eps_max`" in _sections(configuration_page(), "##")["Site"]


def _commands(parser: argparse.ArgumentParser) -> typing.Iterator[argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield sub
                yield from _commands(sub)


def test_cli_page_has_every_subcommand_and_argument_with_its_help() -> None:
    from fedpose.cli import build_parser

    commands = _sections(cli_page(), "##")
    parsers = list(_commands(build_parser()))
    assert len(parsers) == len(commands) > 10
    for parser in parsers:
        text = commands[f"`{parser.prog}`"]
        assert f"usage: {parser.prog}" in text
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
                continue
            row = next((line for line in text.splitlines()
                        if line.startswith("| `") and (set(action.option_strings) & set(re.split(r"[ ,`]+", line.split("|")[1]))
                                                       or not action.option_strings and f"`{action.metavar or action.dest}" in line)),
                       None)
            assert row is not None, f"{parser.prog}: {action.option_strings or action.dest} missing"
            if action.help:
                words = re.sub(r"%\(\w+\)s", "", action.help).split()[:4]
                assert markdown_text(" ".join(words).replace("%%", "%").replace("|", "\\|")) in row, f"{parser.prog}: help of {action.dest}"


def test_angle_bracket_placeholders_survive_rendering_and_code_spans_stay_verbatim() -> None:
    assert markdown_text("default: <checkpoint_dir>/ledger.sqlite, `<dir>/x`, ``a <b>``") == \
        "default: &lt;checkpoint_dir>/ledger.sqlite, `<dir>/x`, ``a <b>``"
    for page in (configuration_page(), cli_page()):
        outside_code = re.sub(r"`+[^`]*`+", "", re.sub(r"^```text\n.*?^```$", "", page, flags=re.M | re.S))
        assert not re.findall(r"<(?!!--)[a-z]", outside_code.replace("-->", "")), "an unescaped <tag> in a generated page"
