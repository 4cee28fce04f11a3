"""Fixtures of the federation tests (tests/federation and its subdirectories)."""

from __future__ import annotations

import pytest


@pytest.fixture
def flower_task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower stamps every message with the running task's identity (set when a SuperNode starts a
    ClientApp); tests that call a ClientApp in this process give it one."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)
