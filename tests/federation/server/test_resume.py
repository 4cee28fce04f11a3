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


def test_the_global_model_after_faults_and_a_resume_is_the_server_step_over_exactly_the_accepted_updates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25 item 6 (PCKh@0.5 0.00 after faulted or resumed runs): the global model holds the
    server optimizer (FedAvgM: its momentum carries every update it took) applied to exactly the
    updates accepted in committed rounds. A missing site, a site whose ε went backwards (its update
    rejected), an update over the norm bound, and a coordinator killed while checkpointing round 3
    — its ledger rows and server-optimizer state written, its model not: the round is lost to the
    model, so it must be lost to the momentum too — change nothing else."""
    import numpy as np

    import fedpose.federation.server.rounds as rounds_module
    from fedpose.federation import protocol
    from fedpose.federation.aggregation import FedAvgM
    from fedpose.federation.server.rounds import NodeReply, TrainRequest

    monkeypatch.setattr(rounds_module, "NODE_SETTLE_S", 0.0)
    run = CoordinatorRunConfig.model_validate({"run_id": "r", "coordinator": {
        "checkpoint_dir": str(tmp_path / "coordinator"), "data": {"input_size": [64, 64]}, "rounds": 5, "min_sites": 1,
        "model": {"backbone": "tiny_vit_test", "scenario": "scratch"}, "update_norm_bound": 10.0,
        "aggregation": {"strategy": "fedavgm", "server_lr": 1.0, "momentum": 0.9}}})
    sites = {11: "site-1", 12: "site-2"}

    def update(node: int, round_id: int, scale: float = 1e-3) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(node * 100 + round_id)
        return {k: (scale * rng.standard_normal(shape)).astype(np.float32) for k, shape in trainable.items()}

    def answer(request: TrainRequest) -> NodeReply | None:
        node, round_id = request.node, request.instruction.round
        if (node, round_id) == (12, 2):
            return None  # missing: no reply
        epsilon = 0.5 if (node, round_id) == (12, 3) else float(round_id)  # site-2's state reset in round 3
        scale = 1e3 if (node, round_id) in ((12, 3), (11, 5)) else 1e-3  # site-1's round 5: over the norm bound
        privacy = protocol.PrivacyReport(guarantee="DP", unit="record", adjacency="add_remove", accountant="rdp", epsilon=epsilon,
                                         delta=1e-5, eps_max=10.0, steps=2 * round_id, rounds_spent=round_id, orders=[2.0],
                                         rdp=[epsilon / 2], next_round_affordable=True)
        reply = protocol.SiteReply(site_id=sites[node], run_id="r", round=round_id, status="ok", privacy=privacy, local_steps=2)
        return NodeReply(node, reply, update=lambda: update(node, round_id, scale))

    class Transport:
        def node_ids(self) -> list[int]:
            return list(sites)

        def send_and_receive(self, requests: list[TrainRequest], timeout: float) -> list[NodeReply]:
            return [reply for reply in map(answer, requests) if reply is not None]

    runner = RoundRunner(run, echo=lambda *_: None)
    start = {k: v.copy() for k, v in runner.global_state.items()}
    trainable = {k: start[k].shape for k in runner.global_model().trainable_parameters()}
    save_model = rounds_module.save_array_checkpoint

    def killed_at_round_3(path, arrays, meta=None):
        if path.name == "global.npz" and meta["state"]["round"] == 3:
            raise KeyboardInterrupt("coordinator killed while checkpointing round 3")
        save_model(path, arrays, meta)

    monkeypatch.setattr(rounds_module, "save_array_checkpoint", killed_at_round_3)
    with pytest.raises(KeyboardInterrupt):
        runner.run_rounds(Transport())
    monkeypatch.setattr(rounds_module, "save_array_checkpoint", save_model)
    resumed = RoundRunner(run, resume=True, echo=lambda *_: None)
    assert resumed.state.round == 3 and resumed.optimizer.steps == 2  # round 3 is spent, but the model took 2 steps
    resumed.run_rounds(Transport())

    # by hand: the committed rounds' accepted updates, FedAvgM with η = 1, β = 0.9
    accepted = {1: [(11, 1), (12, 1)], 2: [(11, 2)], 4: [(11, 4), (12, 4)], 5: [(12, 5)]}
    expected = FedAvgM(server_lr=1.0, momentum=0.9)
    weights = {k: start[k] for k in trainable}
    for round_id, senders in accepted.items():
        mean = {k: np.mean([update(n, r)[k].astype(np.float64) for n, r in senders], axis=0).astype(np.float32) for k in trainable}
        weights = expected.step(weights, mean)
    for k in trainable:
        np.testing.assert_allclose(resumed.global_state[k], weights[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert all(np.array_equal(resumed.global_state[k], start[k]) for k in start if k not in trainable)
    assert resumed.optimizer.steps == 4
    with BudgetLedger(run.coordinator.ledger_path, read_only=True) as ledger:
        rows = {(e.site_id, e.round): e.status for e in ledger.entries()}
    assert rows == {("site-1", 1): "ok", ("site-2", 1): "ok", ("site-1", 2): "ok", ("site-2", 2): "missing",
                    ("site-1", 3): "ok", ("site-2", 3): "rejected", ("site-1", 4): "ok", ("site-2", 4): "ok",
                    ("site-1", 5): "rejected", ("site-2", 5): "ok"}


def test_the_server_optimizer_resumes_from_the_state_of_the_model_checkpoint(tmp_path: Path) -> None:
    """Killed after moving the committed optimizer state aside and before writing the new one, the
    resume finds it; a checkpoint from before the round stamp resumes as it always did; with no
    state that goes with the model the resume is refused with a clear error, nothing rewritten."""
    from fedpose.federation.aggregation import load_array_checkpoint, save_array_checkpoint
    from fedpose.federation.server.rounds import OPTIMIZER_CHECKPOINT, PREVIOUS_OPTIMIZER_CHECKPOINT

    run = _finished_rounds(tmp_path, 2)
    directory = Path(run.coordinator.checkpoint_dir)
    (directory / OPTIMIZER_CHECKPOINT).replace(directory / PREVIOUS_OPTIMIZER_CHECKPOINT)
    runner = RoundRunner(run, resume=True, echo=lambda *_: None)
    assert runner.state.round == 2
    runner.ledger.close()

    arrays, meta = load_array_checkpoint(directory / PREVIOUS_OPTIMIZER_CHECKPOINT)
    meta.pop("round")
    save_array_checkpoint(directory / OPTIMIZER_CHECKPOINT, arrays, meta)  # the format before the stamp
    (directory / PREVIOUS_OPTIMIZER_CHECKPOINT).unlink()
    RoundRunner(run, resume=True, echo=lambda *_: None).ledger.close()

    save_array_checkpoint(directory / OPTIMIZER_CHECKPOINT, arrays, {**meta, "round": 3})  # not the model's round
    with pytest.raises(ValueError, match=r"no server-optimizer state .* goes with its model checkpoint \(round 2\)"):
        RoundRunner(run, resume=True, echo=lambda *_: None)
    assert load_array_checkpoint(directory / OPTIMIZER_CHECKPOINT)[1]["round"] == 3
