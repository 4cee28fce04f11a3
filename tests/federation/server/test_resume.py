"""A resumed round runner never silently forgets: a lost ledger is an error, not a fresh one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedpose.federation.deployment import CoordinatorRunConfig
from fedpose.federation.ledger import BudgetLedger, LedgerEntry, LedgerError
from fedpose.federation.server.rounds import RoundRunner


def _run(tmp_path: Path) -> CoordinatorRunConfig:
    return CoordinatorRunConfig.model_validate({"run_id": "r", "coordinator": {
        "checkpoint_dir": str(tmp_path / "coordinator"), "data": {"input_size": [64, 64]},
        "model": {"backbone": "tiny_vit_test", "scenario": "scratch"}}})


def _finished_rounds(tmp_path: Path, rounds: int) -> CoordinatorRunConfig:
    run = _run(tmp_path)
    runner = RoundRunner(run, echo=lambda *_: None)
    runner.ledger.record_many([LedgerEntry(site_id="site-1", round=r, status="missing") for r in range(1, rounds + 1)])
    runner.state.round = rounds
    runner._save_checkpoint()
    runner.ledger.close()
    return run


@pytest.mark.parametrize("damage", ["delete", "empty"])
def test_a_lost_ledger_is_refused_on_resume(tmp_path: Path, damage: str) -> None:
    run = _finished_rounds(tmp_path, 2)
    path = Path(run.coordinator.ledger_path)
    path.unlink() if damage == "delete" else path.write_bytes(b"")
    with pytest.raises(LedgerError, match="missing or empty"):
        RoundRunner(run, resume=True, echo=lambda *_: None)
    assert not path.exists() or path.stat().st_size == 0  # nothing recreated


def test_a_ledger_without_the_checkpointed_rounds_is_refused(tmp_path: Path) -> None:
    run = _finished_rounds(tmp_path, 2)
    path = Path(run.coordinator.ledger_path)
    path.unlink()
    BudgetLedger(path).close()  # a fresh, empty database where the old one was
    with pytest.raises(LedgerError, match="holds no rounds"):
        RoundRunner(run, resume=True, echo=lambda *_: None)


def test_a_sound_ledger_resumes(tmp_path: Path) -> None:
    run = _finished_rounds(tmp_path, 2)
    runner = RoundRunner(run, resume=True, echo=lambda *_: None)
    assert runner.state.round == 2
    runner.ledger.close()


@pytest.mark.parametrize("resume", [False, True])
def test_a_ledger_with_rounds_is_never_overwritten_by_a_fresh_start(tmp_path: Path, resume: bool) -> None:
    """The model checkpoint is gone (or the operator forgot --resume) but the ledger holds rounds:
    starting at round 1 would replace those rows, so the coordinator refuses and says why."""
    run = _finished_rounds(tmp_path, 2)
    (Path(run.coordinator.checkpoint_dir) / "global.npz").unlink()
    with pytest.raises(LedgerError, match="already holds site reports up to round 2") as failure:
        RoundRunner(run, resume=resume, echo=lambda *_: None)
    assert ("restore it from a backup" if resume else "--resume") in str(failure.value)
    with BudgetLedger(run.coordinator.ledger_path, read_only=True) as ledger:
        assert [e.round for e in ledger.entries()] == [1, 2]


def test_a_history_written_as_plain_dicts_still_loads(tmp_path: Path) -> None:
    """history.json / report.json from before the typed records: missing fields take defaults,
    fields no longer recorded are ignored; a file that does not parse is named."""
    from fedpose.federation.report import HISTORY_FILE, load_history, round_line

    (tmp_path / HISTORY_FILE).write_text(json.dumps({"rounds": [
        {"round": 1, "pckh": {"Mean": 12.5, "Head": None}, "aggregated": True, "accepted": 1, "wall_seconds": 2.0,
         "sites": {"site-1": {"status": "ok", "epsilon": 0.7, "delta": 1e-5, "guarantee": "DP", "accountant": "rdp",
                              "some_retired_field": 3},
                   "site-2": {"status": "missing", "epsilon": None, "reason": "no reply"}}},
    ]}))
    (entry,) = load_history(tmp_path)
    assert entry.sites["site-1"].unit is None and entry.sites["site-2"].bytes_up == 0 and entry.basis_version == -1
    assert "site-1: ok, ε = 0.7 (DP" in round_line(entry)
    (tmp_path / HISTORY_FILE).write_text(json.dumps({"rounds": [{"round": 1, "sites": {"site-1": {"status": "lost"}}}]}))
    with pytest.raises(ValueError, match=HISTORY_FILE):
        load_history(tmp_path)
