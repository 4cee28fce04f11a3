"""The layout rule: ``fedpose/`` is the library and imports neither Flower nor the apps built on
it (``coordinator/``, ``sites/``); the one way in is ``fedpose simulate``'s lazy import of
``coordinator.simulation``."""

from __future__ import annotations

import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "fedpose"
#: (module, imported name) pairs allowed to cross the rule, and why
ALLOWED = {
    ("fedpose/cli/simulate.py", "coordinator.simulation"),  # the CLI hands the run to the apps layer
    # secure aggregation reuses Flower's SecAgg+ cryptography (pure functions over bytes, no Flower runtime)
    # instead of writing new cryptography; this adapter is the only module that imports it
    ("fedpose/federation/secagg/crypto.py", "flwr.common.secure_aggregation.crypto.shamir"),
    ("fedpose/federation/secagg/crypto.py", "flwr.common.secure_aggregation.crypto.symmetric_encryption"),
    ("fedpose/federation/secagg/crypto.py", "flwr.common.secure_aggregation.secaggplus_utils"),
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_the_library_imports_no_flower_and_no_app() -> None:
    crossings = sorted(
        (str(path.relative_to(LIBRARY.parent)), name)
        for path in LIBRARY.rglob("*.py")
        for name in _imports(path)
        if name.split(".")[0] in ("flwr", "coordinator", "sites")
    )
    assert set(crossings) == ALLOWED, crossings
