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


#: real-process files in the order the workers should take them up: the two longest first (CI: ~7 and
#: ~5 min), one per worker; xdist hands a worker its next file once it has at most two tests left, so
#: the worker with test_secagg_deploy's two tests takes test_federation_simulation next
REAL_PROCESS_FILES = ("test_secagg_deploy.py", "test_federation_deploy.py", "test_federation_simulation.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (the README's ``-n 2 --dist loadfile --no-loadscope-reorder``), the tests
    that start real Flower processes (marker ``integration``) are collected first: they are the
    long pole, mostly waiting (process starts, heartbeats), and each worker runs whole files in the
    collected order, so they start at once, one file at a time per worker, while the other tests
    fill in. (``loadgroup`` would give finer control, but xdist 3.8 cannot tag pytest 9's node ids.)"""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return

    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("integration") is None:
            return len(REAL_PROCESS_FILES) + 1
        name = item.path.name
        return REAL_PROCESS_FILES.index(name) if name in REAL_PROCESS_FILES else len(REAL_PROCESS_FILES)

    items.sort(key=rank)  # stable: collection order within a rank
