"""The coordinator's round loop against a scripted grid: what it records when sites misbehave.

The grid is a stand-in for Flower's transport only (send_and_receive / get_node_ids); replies are
real Flower messages carrying real protocol records, and the Coordinator, ledger and aggregation
are the production code. The integration tests cover the same paths over real Flower processes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

import coordinator.rounds as rounds_module
from coordinator.rounds import Coordinator
from fedpose.federation import protocol
from fedpose.federation.deployment import CoordinatorRunConfig
from fedpose.federation.ledger import BudgetLedger

Script = Callable[[int, Message], Message]


@pytest.fixture(autouse=True)
def flower_task_identity(monkeypatch: pytest.MonkeyPatch) -> Iterable[None]:
    """Flower stamps every message with the running task's identity; give this process one."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)
    monkeypatch.setattr(rounds_module, "NODE_SETTLE_S", 0.0)
    yield


class ScriptedGrid:
    """Nodes answer with whatever ``script(round, message)`` returns (Flower's Grid surface only)."""

    def __init__(self, nodes: list[int], script: Script):
        self.nodes, self.script = nodes, script

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def send_and_receive(self, messages: list[Message], timeout: float) -> list[Message]:
        return [self.script(int(m.metadata.group_id), m) for m in messages]


def _run(tmp_path: Path, rounds: int) -> CoordinatorRunConfig:
    return CoordinatorRunConfig.model_validate({"run_id": "r", "coordinator": {
        "checkpoint_dir": str(tmp_path / "coordinator"), "data": {"input_size": [64, 64]}, "rounds": rounds, "min_sites": 1,
        "model": {"backbone": "tiny_vit_test", "scenario": "scratch"}}})


def _privacy(epsilon: float, rounds_spent: int) -> protocol.PrivacyReport:
    return protocol.PrivacyReport(guarantee="DP", unit="record", adjacency="add_remove", accountant="rdp", epsilon=epsilon,
                                  delta=1e-5, eps_max=10.0, steps=2 * rounds_spent, rounds_spent=rounds_spent,
                                  orders=[2.0], rdp=[epsilon / 2], next_round_affordable=True)


def ok_reply(message: Message, site_id: str, epsilon: float, round_id: int, trainable: list[str]) -> Message:
    """A site's "ok" reply with a zero update of the trainable tensors (shapes as sent)."""
    reply = protocol.SiteReply(site_id=site_id, run_id="r", round=round_id, status="ok", privacy=_privacy(epsilon, round_id),
                               local_steps=2)
    update = {k: Array(np.zeros_like(message.content[protocol.GLOBAL_RECORD][k].numpy())) for k in trainable}
    return Message(RecordDict({protocol.REPLY_RECORD: ConfigRecord(protocol.encode_reply(reply)),
                               protocol.UPDATE_RECORD: ArrayRecord(update)}), reply_to=message)


def test_a_site_reporting_less_epsilon_than_the_ledger_holds_is_rejected(tmp_path: Path) -> None:
    """A site whose budget state was reset reports a lower cumulative ε: the ledger keeps the
    higher value, the update is not aggregated, and the console says what happened."""
    reported = {1: 2.0, 2: 0.9, 3: 2.4}  # round 2: the site's budget.json was deleted and restarted from zero
    lines: list[str] = []
    coordinator = Coordinator(_run(tmp_path, 3), echo=lines.append)
    trainable = list(coordinator._model().trainable_parameters())
    grid = ScriptedGrid([11], lambda r, m: ok_reply(m, "site-1", reported[r], r, trainable))
    coordinator.run_rounds(grid)

    with BudgetLedger(tmp_path / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        rows = {e.round: e for e in ledger.entries("site-1")}
        (summary,) = ledger.site_summaries()
    assert [rows[r].status for r in (1, 2, 3)] == ["ok", "rejected", "ok"]
    assert "below the 2 the ledger already holds" in rows[2].reason
    assert summary.epsilon == 2.4 and summary.rounds_joined == 3  # the reset never lowered the ledger's ε
    assert any("round 2: rejected site 'site-1'" in line and "reset or replaced" in line for line in lines), lines
    history = rounds_module.load_history(tmp_path / "coordinator")
    assert history[1]["sites"]["site-1"]["status"] == "rejected" and not history[1]["aggregated"]
    assert history[1]["sites"]["site-1"]["reject_reason"] == "epsilon_regressed"


class DroppingGrid(ScriptedGrid):
    """As ScriptedGrid, but nodes in ``silent[round]`` send nothing (they disconnected)."""

    def __init__(self, nodes: list[int], script: Script, silent: dict[int, set[int]]):
        super().__init__(nodes, script)
        self.silent = silent

    def send_and_receive(self, messages: list[Message], timeout: float) -> list[Message]:
        return [self.script(int(m.metadata.group_id), m) for m in messages
                if m.metadata.dst_node_id not in self.silent.get(int(m.metadata.group_id), set())]


def test_a_site_that_disconnects_is_missing_with_the_true_reason(tmp_path: Path) -> None:
    """The round ends early without one node: its reason says it disconnected, not that it timed
    out; a node that never said which site it is appears as an unidentified node, not as a site."""
    lines: list[str] = []
    coordinator = Coordinator(_run(tmp_path, 2), echo=lines.append)
    trainable = list(coordinator._model().trainable_parameters())
    site_of = {11: "site-1", 12: "site-2", 13: "site-3"}
    grid = DroppingGrid([11, 12, 13], lambda r, m: ok_reply(m, site_of[m.metadata.dst_node_id], 1.0 * r, r, trainable),
                        silent={1: {13}, 2: {12}})
    coordinator.run_rounds(grid)

    history = rounds_module.load_history(tmp_path / "coordinator")
    assert history[0]["unidentified_missing_nodes"] == [13] and "site-3" not in history[0]["sites"]
    missing = history[1]["sites"]["site-2"]
    assert missing["status"] == "missing" and missing["reason"].startswith("no reply: the node disconnected")
    assert "node 13: missing" in lines[0] and "site-2: missing (no reply: the node disconnected" in lines[1]
    report = json.loads((tmp_path / "coordinator" / "report.json").read_text())
    assert [(f["round"], f["site"]) for f in report["site_failures"]] == [(1, "node 13"), (2, "site-2")]
