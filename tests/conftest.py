"""Test-suite setup shared by every directory under tests/.

The tests mirror the package layout (``tests/federation/server/`` tests
``fedpose/federation/server/``, and so on) while their helpers (``site_round_helpers``,
``federation_helpers``, ``numerics``, ``test_dp_engine``'s builders) stay here at the top: pytest's
default import mode puts this conftest's directory on ``sys.path``, so a test in any
subdirectory imports them by name.
"""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (the README's ``-n 2 --dist loadfile --no-loadscope-reorder``), the tests
    that start real Flower processes (marker ``integration``) are collected first: they are the
    long pole, mostly waiting (process starts, heartbeats), and each worker runs whole files in the
    collected order, so they start at once, one file at a time per worker, while the other tests
    fill in. (``loadgroup`` would give finer control, but xdist 3.8 cannot tag pytest 9's node ids.)"""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("integration") is None)  # stable
