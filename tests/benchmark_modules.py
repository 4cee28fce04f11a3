"""Benchmark scripts and their helper modules are files, not a package: tests load them by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark_module(path: Path, name: str) -> ModuleType:
    """The module at ``path`` (e.g. ``BENCHMARKS / "distributed_noise" / "skellam.py"``), registered
    as ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their annotations through the module's entry
    spec.loader.exec_module(module)
    return module
