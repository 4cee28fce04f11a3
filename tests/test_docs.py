"""The documentation: a short README, one page per audience, every relative link resolving, and the
architecture the pages describe (fedpose/ never imports Flower) holding."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from fedpose.config_reference import _anchor
from fedpose.privacy.mechanisms import NOISY_MECHANISM_NAMES

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
BY_AUDIENCE = ("privacy.md", "deployment.md", "benchmarks.md", "architecture.md", "usage.md",
               "configuration.md", "cli.md", "operations.md", "site-state.md")

_FENCE = re.compile(r"^```.*?^```[ \t]*$", flags=re.M | re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (a link in code is not a link)."""
    return re.sub(r"`+[^`\n]*`+", "", _FENCE.sub("", text))


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings (a repeated heading gets -1, -2, …)."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", _FENCE.sub("", page.read_text()), flags=re.M):
        slug = _anchor(heading.replace("`", ""))
        count = seen.get(slug, 0)
        anchors.add(slug if count == 0 else f"{slug}-{count}")
        seen[slug] = count + 1
    return anchors


def relative_links(page: Path) -> list[str]:
    return [target for target in _LINK.findall(_prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: … are not checked


def test_every_relative_link_points_at_an_existing_file_and_anchor() -> None:
    broken = []
    for page in PAGES:
        for target in relative_links(page):
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_checker_finds_a_broken_file_and_a_broken_anchor(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Title\n\n## Some `code` heading — here\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#some-code-heading--here) [gone](missing.md) [bad](a.md#nope) "
                    "[web](https://example.org/x) `[code](skipped.md)`\n```\n[fenced](skipped.md)\n```\n")
    assert relative_links(page) == ["a.md#some-code-heading--here", "missing.md", "a.md#nope"]
    assert _anchors(tmp_path / "a.md") == {"title", "some-code-heading--here"}


def test_readme_is_short_and_indexes_every_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for page in DOCS.glob("*.md"):
        assert f"](docs/{page.name})" in readme, f"the README's docs index lacks docs/{page.name}"


def test_each_audience_has_its_page() -> None:
    for name in BY_AUDIENCE:
        text = (DOCS / name).read_text()
        assert text.startswith("# "), f"docs/{name} has no title"


def test_privacy_pages_name_every_mechanism() -> None:
    privacy = (DOCS / "privacy.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for name in NOISY_MECHANISM_NAMES:
        assert f"`{name}`" in privacy, f"docs/privacy.md does not state the guarantee of {name}"
        assert f"`{name}`" in readme.split("## Privacy in one table", 1)[1], f"the README's privacy table lacks {name}"


def test_privacy_page_states_timing_and_dataset_size_in_one_marked_place() -> None:
    privacy = (DOCS / "privacy.md").read_text()
    begin, end = "<!-- privacy:timing-and-dataset-size:begin", "<!-- privacy:timing-and-dataset-size:end -->"
    assert privacy.count(begin) == 1 and privacy.count(end) == 1
    block = privacy[privacy.index(begin):privacy.index(end)]
    assert "timing" in block and "dataset size" in block
    assert "never released" not in privacy.replace('"never released"', ""), "N is protected by the ε, not never released"


def test_library_never_imports_flower() -> None:
    offenders = []
    for path in sorted((ROOT / "fedpose").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "flwr"
                          # the one crossing: secure aggregation's adapter to Flower's pure cryptography
                          # (tests/test_layout.py names each import it may make, and why)
                          and not (path.relative_to(ROOT).as_posix() == "fedpose/federation/secagg/crypto.py"
                                   and n.startswith("flwr.common.secure_aggregation."))]
    assert not offenders, "fedpose/ must not import Flower (coordinator/ and sites/ are the Flower apps):\n" + "\n".join(offenders)
