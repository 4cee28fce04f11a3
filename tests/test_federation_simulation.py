"""The federation under Flower's simulation runtime (Ray), as `fedpose simulate` runs it; a site
whose update is corrupted on the way out is rejected and logged, the round goes on."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from federation_helpers import history, ledger_rows, tiny_federation

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def corrupt_site_2(msg, context, call_next):
    """Outside the egress guard: turn site-2's (valid) update into NaNs, as a broken site would."""
    reply = call_next(msg, context)
    if reply.has_content() and reply.content["site"]["site-id"] == "site-2" and "update" in reply.content:
        update = reply.content["update"]
        reply.content["update"] = ArrayRecord({k: Array(np.full(a.shape, np.nan, dtype=np.float32)) for k, a in update.items()})
    return reply


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_simulation_rejects_a_corrupted_update_and_keeps_going(tmp_path: Path) -> None:
    from fedpose.cli.simulate import ensure_synthetic, resolve_federation, run_federation_simulation

    data_dir = tmp_path / "data"
    config = tiny_federation(tmp_path, data_dir, sites=2, rounds=1)
    federation, synthetic, resolved = resolve_federation(config, [])
    ensure_synthetic({**synthetic, "dir": str(data_dir)}, len(federation.sites))
    records = _Records()
    logging.getLogger("fedpose.coordinator").addHandler(records)
    try:
        run_federation_simulation(federation, resolved, client_mods=(corrupt_site_2,))
    finally:
        logging.getLogger("fedpose.coordinator").removeHandler(records)

    (entry,) = history(tmp_path)
    assert entry["sites"]["site-1"]["status"] == "ok"
    assert entry["sites"]["site-2"]["status"] == "rejected"
    assert entry["sites"]["site-2"]["reject_reason"] == "non_finite"
    assert entry["aggregated"] and entry["accepted"] == 1
    rows = {e.site_id: e for e in ledger_rows(tmp_path)}
    assert rows["site-2"].status == "rejected" and "non_finite" in rows["site-2"].reason
    assert rows["site-2"].epsilon is not None  # it trained: its spend is on record
    assert any("site-2" in m and "rejected" in m and "non_finite" in m for m in records.messages), records.messages

    from fedpose.federation.aggregation import load_array_checkpoint

    weights, _ = load_array_checkpoint(tmp_path / "coordinator" / "global.npz")
    assert all(np.isfinite(w).all() for w in weights.values() if w.dtype.kind == "f")
    report = json.loads((tmp_path / "coordinator" / "report.json").read_text())
    assert report["rounds_completed"] == 1
