"""A directory's files and their bytes, for tests that assert what a command left untouched."""

from __future__ import annotations

from pathlib import Path


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (recursively), by its path relative to ``root``, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
