"""The round runner against an in-process transport: what it records when sites misbehave.

The transport stands in for Flower only (node ids, send and receive); the runner, the ledger,
aggregation and the protocol objects are the production code. The integration tests cover the
same paths over real Flower processes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import fedpose.federation.server.rounds as rounds_module
from fedpose.federation import protocol
from fedpose.federation.deployment import CoordinatorRunConfig
from fedpose.federation.ledger import BudgetLedger
from fedpose.federation.site_audit import read_log
from fedpose.federation.report import load_history
from fedpose.federation.server.rounds import NodeReply, RoundRunner, TrainRequest

SHIPPED_SETTLE_S = rounds_module.NODE_SETTLE_S  # read before the autouse fixture sets it to 0

#: node id → site id of the scripted sites
SITE_OF = {11: "site-1", 12: "site-2", 13: "site-3"}


@pytest.fixture(autouse=True)
def no_settle_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rounds_module, "NODE_SETTLE_S", 0.0)


class ScriptedTransport:
    """Nodes answer ``answer(request)``; nodes in ``silent[round]`` send nothing (disconnected)."""

    def __init__(self, nodes: list[int], answer: Callable[[TrainRequest], NodeReply], silent: dict[int, set[int]] | None = None):
        self.nodes, self.answer, self.silent = nodes, answer, silent or {}
        self.sent: list[TrainRequest] = []

    def node_ids(self) -> list[int]:
        return list(self.nodes)

    def send_and_receive(self, requests: list[TrainRequest], timeout: float) -> list[NodeReply]:
        self.sent += requests
        return [self.answer(r) for r in requests if r.node not in self.silent.get(r.instruction.round, set())]


def _run(tmp_path: Path, rounds: int, **coordinator: object) -> CoordinatorRunConfig:
    return CoordinatorRunConfig.model_validate({"run_id": "r", "coordinator": {
        "checkpoint_dir": str(tmp_path / "coordinator"), "data": {"input_size": [64, 64]}, "rounds": rounds, "min_sites": 1,
        "model": {"backbone": "tiny_vit_test", "scenario": "scratch"}, **coordinator}})


def _privacy(epsilon: float, rounds_spent: int) -> protocol.PrivacyReport:
    return protocol.PrivacyReport(guarantee="DP", unit="record", adjacency="add_remove", accountant="rdp", epsilon=epsilon,
                                  delta=1e-5, eps_max=10.0, steps=2 * rounds_spent, rounds_spent=rounds_spent,
                                  orders=[2.0], rdp=[epsilon / 2], next_round_affordable=True)


def ok_reply(request: TrainRequest, trainable: list[str], epsilon: float) -> NodeReply:
    """A site's "ok" reply: a zero update of the trainable tensors and its cumulative ε."""
    round_id = request.instruction.round
    reply = protocol.SiteReply(site_id=SITE_OF[request.node], run_id="r", round=round_id, status="ok",
                               privacy=_privacy(epsilon, round_id), local_steps=2)
    return NodeReply(request.node, reply, update=lambda: {k: np.zeros_like(request.global_arrays[k]) for k in trainable})


def test_a_site_reporting_less_epsilon_than_the_ledger_holds_is_rejected(tmp_path: Path) -> None:
    """A site whose budget state was reset reports a lower cumulative ε: the ledger keeps the
    higher value, the update is not aggregated, and the console says what happened."""
    reported = {1: 2.0, 2: 0.9, 3: 2.4}  # round 2: the site's budget.json was deleted and restarted from zero
    lines: list[str] = []
    runner = RoundRunner(_run(tmp_path, 3), echo=lines.append)
    trainable = list(runner.global_model().trainable_parameters())
    runner.run_rounds(ScriptedTransport([11], lambda r: ok_reply(r, trainable, reported[r.instruction.round])))

    with BudgetLedger(tmp_path / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        rows = {e.round: e for e in ledger.entries("site-1")}
        (summary,) = ledger.site_summaries()
    assert [rows[r].status for r in (1, 2, 3)] == ["ok", "rejected", "ok"]
    assert ("reported cumulative ε = 0.9 (DP, δ = 1e-05, RDP) per record, add/remove-one-record adjacency is below the "
            "ε = 2 (DP, δ = 1e-05, RDP) per record, add/remove-one-record adjacency the ledger already holds") in rows[2].reason
    assert summary.epsilon == 2.4 and summary.rounds_joined == 3  # the reset never lowered the ledger's ε
    assert any("round 2: rejected site 'site-1'" in line and "reset or replaced" in line for line in lines), lines
    history = load_history(tmp_path / "coordinator")
    assert history[1].sites["site-1"].status == "rejected" and not history[1].aggregated
    assert history[1].sites["site-1"].reject_reason == "epsilon_regressed"


def test_a_site_that_switches_to_a_tighter_accountant_is_not_taken_for_a_reset(tmp_path: Path) -> None:
    """`fedpose privacy budget --accountant pld --apply` restates the same spends with a lower ε:
    the ledger compares each accountant's ε with its own, so the switch is accepted, and a lower ε
    from the new accountant afterwards is still a reset."""
    reported = {1: ("rdp", 2.0), 2: ("pld", 1.8), 3: ("pld", 1.5)}  # round 3: reset under the new accountant

    def answer(request: TrainRequest) -> NodeReply:
        accountant, epsilon = reported[request.instruction.round]
        node_reply = ok_reply(request, trainable, epsilon)
        privacy = node_reply.reply.privacy.model_copy(update={"accountant": accountant})
        return dataclasses.replace(node_reply, reply=node_reply.reply.model_copy(update={"privacy": privacy}))

    runner = RoundRunner(_run(tmp_path, 3), echo=lambda _: None)
    trainable = list(runner.global_model().trainable_parameters())
    runner.run_rounds(ScriptedTransport([11], answer))
    with BudgetLedger(tmp_path / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        rows = {e.round: e for e in ledger.entries("site-1")}
    assert [rows[r].status for r in (1, 2, 3)] == ["ok", "ok", "rejected"]
    assert [rows[r].accountant for r in (1, 2, 3)] == ["rdp", "pld", "pld"]
    assert "is below the ε = 1.8 (DP, δ = 1e-05, PLD)" in rows[3].reason


def test_a_site_that_disconnects_is_missing_with_the_true_reason(tmp_path: Path) -> None:
    """The round ends early without one node: its reason says it disconnected, not that it timed
    out; a node that never said which site it is appears as an unidentified node, not as a site."""
    lines: list[str] = []
    runner = RoundRunner(_run(tmp_path, 2), echo=lines.append)
    trainable = list(runner.global_model().trainable_parameters())
    transport = ScriptedTransport([11, 12, 13], lambda r: ok_reply(r, trainable, 1.0 * r.instruction.round), silent={1: {13}, 2: {12}})
    runner.run_rounds(transport)

    history = load_history(tmp_path / "coordinator")
    assert history[0].unidentified_missing_nodes == [13] and "site-3" not in history[0].sites
    missing = history[1].sites["site-2"]
    assert missing.status == "missing" and missing.reason.startswith("no reply: the node disconnected")
    round_lines = [line for line in lines if line.startswith("round ")]
    assert "node 13: missing" in round_lines[0] and "site-2: missing (no reply: the node disconnected" in round_lines[1]
    report = json.loads((tmp_path / "coordinator" / "report.json").read_text())
    assert [(f["round"], f["site"]) for f in report["site_failures"]] == [(1, "node 13"), (2, "site-2")]


def test_failures_refusals_and_transport_errors_are_recorded_per_site(tmp_path: Path) -> None:
    """One round, four kinds of answer: ok, a refusal (nothing spent), a site error with its spend,
    and a transport-level failure of a node already known from round 1. The refusing site shows as
    refused in round 2's history and line, and as not asked in round 3's."""
    lines: list[str] = []
    runner = RoundRunner(_run(tmp_path, 3), echo=lines.append)
    trainable = list(runner.global_model().trainable_parameters())

    def answer(request: TrainRequest) -> NodeReply:
        round_id, site_id = request.instruction.round, SITE_OF[request.node]
        if round_id == 1 or site_id == "site-1":
            return ok_reply(request, trainable, 1.0 * round_id)
        if site_id == "site-2":
            reply = protocol.SiteReply(site_id=site_id, run_id="r", round=round_id, status="refused", reason="budget-exhausted",
                                       privacy=_privacy(1.0, 1).model_copy(update={"next_round_affordable": False}), local_steps=2)
            return NodeReply(request.node, reply)
        return NodeReply(request.node, failure="the site's ClientApp failed: OSError: disk full")

    runner.run_rounds(ScriptedTransport([11, 12, 13], answer))
    with BudgetLedger(tmp_path / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        rows = {(e.site_id, e.round): e for e in ledger.entries()}
        exhausted = ledger.exhausted_sites(None)
    assert rows[("site-1", 2)].status == "ok"
    assert rows[("site-2", 2)].status == "refused" and rows[("site-2", 2)].steps == 0 and exhausted == {"site-2"}
    assert rows[("site-3", 2)].status == "missing" and "disk full" in rows[("site-3", 2)].reason
    history = load_history(tmp_path / "coordinator")
    assert history[1].sites["site-2"].status == "refused" and "site-2" not in history[2].sites
    assert history[2].not_asked_exhausted == ["site-2"]
    round_lines = {line.split("|")[0].strip(): line for line in lines if line.startswith("round")}
    assert "site-2: refused" in round_lines["round   2"]
    assert "site-2: not asked (its budget is exhausted)" in round_lines["round   3"]


def test_the_basis_goes_only_to_sites_lacking_its_version(tmp_path: Path) -> None:
    """pdp/fpdp: round 1 ships the basis to everyone; round 2 ships nothing to sites that reported
    holding it; in round 3 site-2 reports a lost cache, so a fresh version (bound to round 3's
    weights) is computed and goes to every selected site."""
    from fedpose.data.synthetic import ensure_dataset

    data = tmp_path / "data"
    ensure_dataset(data, sites=1, per_site=4, public=8, test=4, size=(64, 64), seed=0, progress=False)
    run = _run(tmp_path, 3, public_data=str(data / "public"), basis={"k": 2, "public_samples": 4, "refresh_every_rounds": 10})
    runner = RoundRunner(run, echo=lambda *_: None)
    trainable = list(runner.global_model().trainable_parameters())

    def answer(request: TrainRequest) -> NodeReply:
        reply = ok_reply(request, trainable, 1.0 * request.instruction.round)
        lost = SITE_OF[request.node] == "site-2" and request.instruction.round == 2
        held = -1 if lost else request.instruction.basis_version
        return NodeReply(reply.node, reply.reply.model_copy(update={"basis_version": held}), update=reply.update)

    transport = ScriptedTransport([11, 12], answer)
    runner.run_rounds(transport)
    shipped = {(r.instruction.round, SITE_OF[r.node]): (r.instruction.basis_version, r.basis is not None) for r in transport.sent}
    assert shipped == {(1, "site-1"): (1, True), (1, "site-2"): (1, True),
                       (2, "site-1"): (1, False), (2, "site-2"): (1, False),
                       (3, "site-1"): (3, True), (3, "site-2"): (3, True)}


def test_curves_draw_each_sites_reported_eps_max() -> None:
    """curves.png: every site's ε over rounds with its own ε_max as a dashed line (where its guard refuses)."""
    import matplotlib.pyplot as plt

    from fedpose.federation.report import RoundRecord, SiteRoundRecord, federation_figure

    def site(epsilon: float, eps_max: float, status: str = "ok") -> SiteRoundRecord:
        return SiteRoundRecord(status=status, epsilon=epsilon, delta=1e-5, guarantee="DP", accountant="pld",
                               unit="patient", eps_max=eps_max)

    rounds = [RoundRecord(round=1, sites={"site-1": site(2.0, 8.0), "site-3": site(2.0, 3.0)}),
              RoundRecord(round=2, sites={"site-1": site(3.5, 8.0), "site-3": site(2.0, 3.0, "refused")})]
    fig = federation_figure(rounds, initial_pckh=30.0)
    ax_eps = fig.axes[1]
    dashed = {line.get_label(): line.get_ydata()[0] for line in ax_eps.get_lines() if line.get_linestyle() == "--"}
    assert dashed == {"site-1 ε_max = 8": 8.0, "site-3 ε_max = 3": 3.0}
    assert ax_eps.get_ylim()[0] == 0.0
    mean = next(line for line in fig.axes[0].get_lines() if line.get_label() == "Mean")
    assert list(mean.get_xdata()) == [0] and list(mean.get_ydata()) == [30.0]  # round 0 drawn; rounds 1–2 had no pckh
    plt.close(fig)


def test_curves_never_join_one_accountants_epsilon_to_anothers() -> None:
    """A site that switched from RDP to PLD: one line per accountant, each labelled with its own (and
    every qualifier of its ε: guarantee, unit, δ, accountant, adjacency)."""
    import matplotlib.pyplot as plt

    from fedpose.federation.report import RoundRecord, SiteRoundRecord, federation_figure

    def site(epsilon: float, accountant: str) -> SiteRoundRecord:
        return SiteRoundRecord(status="ok", epsilon=epsilon, delta=1e-5, guarantee="DP", accountant=accountant, unit="patient")

    rounds = [RoundRecord(round=r, sites={"site-1": site(eps, acc)})
              for r, eps, acc in ((1, 2.0, "rdp"), (2, 2.9, "rdp"), (3, 2.7, "pld"), (4, 3.3, "pld"))]
    fig = federation_figure(rounds)
    lines = {line.get_label(): list(line.get_ydata()) for line in fig.axes[1].get_lines()}
    assert lines == {"site-1 (DP per patient, δ=1e-05, RDP, add/remove-one-patient adjacency)": [2.0, 2.9],
                     "site-1 (DP per patient, δ=1e-05, PLD, add/remove-one-patient adjacency)": [2.7, 3.3]}
    plt.close(fig)


def test_the_in_process_transport_runs_real_site_rounds(tmp_path: Path) -> None:
    """InProcessTransport (benchmarks/federated_utility) runs the real site round for each node: the
    sites' budgets and the coordinator's ledger agree after two rounds, and the ledger's digest of each
    update it received is the one the site's audit log holds for what it sent."""
    from fedpose.federation.server.in_process import InProcessTransport
    from site_round_helpers import make_site_data, site_config

    data = make_site_data(tmp_path / "data")
    site = site_config(data, tmp_path / "site-1")
    runner = RoundRunner(_run(tmp_path, rounds=2, local_steps=2), echo=lambda _: None)
    runner.run_rounds(InProcessTransport([site]))
    history = load_history(tmp_path / "coordinator")
    assert [r.sites["site-1"].status for r in history] == ["ok", "ok"] and all(r.aggregated for r in history)
    budget = json.loads((tmp_path / "site-1" / "budget.json").read_text())["payload"]
    with BudgetLedger(tmp_path / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        summary = {s.site_id: s for s in ledger.site_summaries()}["site-1"]
    assert [e["round"] for e in budget["entries"] if e["status"] == "spent"] == [1, 2]
    assert summary.epsilon == pytest.approx(history[-1].sites["site-1"].epsilon) and summary.rounds_joined == 2
    with BudgetLedger(tmp_path / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        received = [e.update_sha256 for e in ledger.entries("site-1")]
    sent = [e.update_sha256 for e in read_log(tmp_path / "site-1")]
    assert received == sent and None not in sent and len(set(sent)) == 2


def test_a_site_s_ldp_slicing_on_its_inputs_reaches_the_ledger_and_the_export(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A site that privatizes its images (LDP-Slicing) states that guarantee in its reply (declared
    settings only); the ledger keeps it and a federated export's card, PRIVACY.txt and `ledger show`
    print it beside the site's DP ε — ε per original pixel, here per 2×2 block (LL pruning: 4 · ε_total)."""
    from fedpose.cli import main
    from fedpose.config import InputPrivacyConfig
    from fedpose.federation.server.in_process import InProcessTransport
    from site_round_helpers import make_site_data, site_config

    site = site_config(make_site_data(tmp_path / "data"), tmp_path / "site-1").model_copy(
        update={"input_privacy": InputPrivacyConfig(mechanism="ldp-slicing", epsilon=2.0)})
    RoundRunner(_run(tmp_path, rounds=1, local_steps=2), echo=lambda _: None).run_rounds(InProcessTransport([site]))
    with BudgetLedger(tmp_path / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        (summary,) = ledger.site_summaries()
    assert (summary.input_ldp_epsilon, summary.input_ldp_ll_prune) == (2.0, True)
    stated = ("ε = 8 (LDP, δ = 0, pure composition) per 2×2 block of an original image (ε_total = 2 per privatized pixel, "
              "LL pruning), any-two-values-of-one-2×2-block (local) adjacency; LDP-Slicing, each training image privatized "
              "once per copy the site keeps")
    assert main(["export", str(tmp_path / "coordinator"), "--out", str(tmp_path / "release")]) == 0
    report = json.loads((tmp_path / "release" / "privacy_report.json").read_text())
    assert report["sites"][0]["input_privacy"]["epsilon_per_original_pixel"] == 8.0
    assert f"- site-1: {stated}" in (tmp_path / "release" / "MODEL_CARD.md").read_text()
    assert f"  inputs locally privatized: {stated}" in (tmp_path / "release" / "PRIVACY.txt").read_text()
    capsys.readouterr()
    assert main(["ledger", "show", "--db", str(tmp_path / "coordinator" / "ledger.sqlite")]) == 0
    assert f"  site-1's inputs: {stated}" in capsys.readouterr().out


def test_basis_source_sites_ships_no_basis(tmp_path: Path) -> None:
    """basis.source = "sites": the coordinator keeps its public data for the warm start but serves no
    basis; every request says so (version -1), and projecting sites compute V from their own S_pub copy."""
    from fedpose.data.synthetic import ensure_dataset
    from fedpose.federation.server.basis_service import NO_BASIS

    data = tmp_path / "data"
    ensure_dataset(data, sites=1, per_site=4, public=8, test=4, size=(64, 64), seed=0, progress=False)
    run = _run(tmp_path, 2, public_data=str(data / "public"), basis={"source": "sites", "k": 2, "public_samples": 4})
    runner = RoundRunner(run, echo=lambda *_: None)
    trainable = list(runner.global_model().trainable_parameters())
    transport = ScriptedTransport([11, 12], lambda request: ok_reply(request, trainable, 1.0 * request.instruction.round))
    runner.run_rounds(transport)
    assert len(transport.sent) == 4
    assert all(r.basis is None and r.instruction.basis_version == NO_BASIS for r in transport.sent)


def test_the_server_step_follows_its_cosine_schedule_over_the_rounds(tmp_path: Path) -> None:
    """aggregation.lr_schedule = "cosine" over coordinator.rounds = 3 (final 0.1×): every site sends
    the same update u, so the global weights move by η_t·u with η = 1, 0.55, 0.1."""
    run = _run(tmp_path, 3, aggregation={"strategy": "fedavg", "lr_schedule": "cosine", "final_lr_fraction": 0.1})
    runner = RoundRunner(run, echo=lambda *_: None)
    trainable = list(runner.global_model().trainable_parameters())
    name = trainable[0]
    starts: dict[int, float] = {}

    def answer(request: TrainRequest) -> NodeReply:
        starts[request.instruction.round] = float(request.global_arrays[name].flat[0])
        reply = ok_reply(request, trainable, 1.0 * request.instruction.round)
        return NodeReply(reply.node, reply.reply, update=lambda: {k: np.full_like(request.global_arrays[k], 1e-2) for k in trainable})

    runner.run_rounds(ScriptedTransport([11, 12], answer))
    ends = [starts[2], starts[3], float(runner.global_state[name].flat[0])]
    moves = np.diff([starts[1], *ends])
    np.testing.assert_allclose(moves, [1e-2, 0.55e-2, 0.1e-2], rtol=1e-3)


class LateNodesTransport(ScriptedTransport):
    """site-2's node connects only at the third look: a machine slower to start than site-1's."""

    def __init__(self, answer: Callable[[TrainRequest], NodeReply]):
        super().__init__([11, 12], answer)
        self.looks = 0

    def node_ids(self) -> list[int]:
        self.looks += 1
        return [11] if self.looks < 3 else [11, 12]


@pytest.mark.parametrize("expected_sites", [None, 2, 3])
def test_a_fresh_run_waits_for_its_expected_sites_before_round_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   expected_sites: int | None) -> None:
    """Without ``expected_sites`` round 1 starts once the node count is stable (settle time 0
    here), so a late site misses it; with it, round 1 waits until that many sites are connected —
    and never past the round timeout for one that does not come."""
    monkeypatch.setattr(rounds_module, "NODE_WAIT_POLL_S", 0.01)
    runner = RoundRunner(_run(tmp_path, 1, expected_sites=expected_sites, round_timeout_s=1.0), echo=lambda _: None)
    trainable = list(runner.global_model().trainable_parameters())
    transport = LateNodesTransport(lambda r: ok_reply(r, trainable, 1.0))
    runner.run_rounds(transport)

    asked = sorted(r.node for r in transport.sent)
    assert asked == ([11] if expected_sites is None else [11, 12])


def test_the_expected_sites_setting_states_the_settle_time_the_runner_uses() -> None:
    """The config's description names the fresh-run settle time; it lives in the round runner."""
    from fedpose.federation.config import CoordinatorConfig

    description = CoordinatorConfig.model_fields["expected_sites"].description
    assert f"stable for {SHIPPED_SETTLE_S:g} s" in description, description


def test_a_public_set_smaller_than_the_basis_sample_count_is_named_when_the_coordinator_starts(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from fedpose.data.synthetic import ensure_dataset

    data = tmp_path / "data"
    ensure_dataset(data, sites=1, per_site=4, public=8, test=4, size=(64, 64), seed=0, progress=False)
    with caplog.at_level("WARNING", logger="fedpose.coordinator"):
        RoundRunner(_run(tmp_path, 1, public_data=str(data / "public"), basis={"k": 2, "public_samples": 16}), echo=lambda *_: None)
    assert [r.getMessage() for r in caplog.records if "public set" in r.getMessage()] == [
        "coordinator basis: the public set holds 8 images, fewer than basis.public_samples = 16: every basis is computed "
        "from those 8; add public images or lower public_samples"]
