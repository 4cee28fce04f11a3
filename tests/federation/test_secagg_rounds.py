"""Secure aggregation driven by the real round runner, with real cryptography: the aggregate equals
plain FedAvg of the same updates within the stated quantization bound, dropouts are recovered up to
the threshold, a round below it is abandoned (nothing aggregated, spends recorded), and a site that
requires secure aggregation refuses a plain round spending nothing.

Most tests script the sites' updates (fixed Δ, so the expected aggregate is known exactly) but run
each site's real :class:`SiteSecAggSession`; one runs real site rounds (training, budget, masking)
through :class:`InProcessTransport`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

import fedpose.federation.server.rounds as rounds_module
from fedpose.federation import protocol
from fedpose.federation.deployment import CoordinatorRunConfig
from fedpose.federation.ledger import BudgetLedger
from fedpose.federation.report import load_history, round_line
from fedpose.federation.secagg import site as secagg_site
from fedpose.federation.server.rounds import NodeReply, RoundRunner, TrainRequest
from file_trees import tree_bytes

SITE_OF = {1: "site-1", 2: "site-2", 3: "site-3", 4: "site-4", 5: "site-5"}
WEIGHT_OF = {1: 1.0, 2: 2.0, 3: 1.0, 4: 1.0, 5: 0.5}
CLIP, BITS = 0.05, 12


@pytest.fixture(autouse=True)
def no_settle_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rounds_module, "NODE_SETTLE_S", 0.0)


def _run(tmp_path: Path, secure: bool, **coordinator: object) -> CoordinatorRunConfig:
    return CoordinatorRunConfig.model_validate({"run_id": "r", "coordinator": {
        "checkpoint_dir": str(tmp_path / "coordinator"), "data": {"input_size": [64, 64]}, "rounds": 1, "min_sites": 1,
        "model": {"backbone": "tiny_vit_test", "scenario": "scratch"}, "update_norm_bound": 100.0,
        "secure_aggregation": {"enabled": secure, "clip_range": CLIP, "max_weight": 2.0, "bits": BITS, "modulus_bits": 24,
                               "max_sites": 8}, **coordinator}})


def _privacy(rounds_spent: int = 1) -> protocol.PrivacyReport:
    return protocol.PrivacyReport(guarantee="DP", unit="record", adjacency="add_remove", accountant="rdp", epsilon=1.0,
                                  delta=1e-5, eps_max=10.0, steps=2, rounds_spent=rounds_spent, orders=[2.0], rdp=[0.5],
                                  next_round_affordable=True)


def fixed_update(node: int, like: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Site ``node``'s Δ: reproducible, mostly inside [−r, r] (a few coordinates beyond it, clipped)."""
    rng = np.random.default_rng(node)
    return {k: rng.uniform(-1.2 * CLIP, 1.2 * CLIP, like[k].shape).astype(np.float32) for k in like}


class ScriptedSites:
    """Sites that answer with fixed updates, through their real secure-aggregation sessions.

    ``lost[stage]``: nodes whose answer at that stage never arrives ("setup", "share-keys",
    "masked-vector" — they trained and spent, the reply was lost — "view" or "unmask")."""

    def __init__(self, nodes: list[int], trainable: list[str], lost: dict[str, set[int]] | None = None):
        self.nodes, self.trainable, self.lost = nodes, trainable, lost or {}
        self.sessions: dict[int, secagg_site.SiteSecAggSession] = {}
        self.trained: list[int] = []
        self.addressed: set[int] = set()  # every node any secure-aggregation stage sent a message to

    def node_ids(self) -> list[int]:
        return list(self.nodes)

    def send_and_receive(self, requests: list[TrainRequest], timeout: float) -> list[NodeReply]:
        replies = []
        for request in requests:
            node = request.node
            update = fixed_update(node, {k: request.global_arrays[k] for k in self.trainable})
            reply = protocol.SiteReply(site_id=SITE_OF[node], run_id="r", round=request.instruction.round, status="ok",
                                       privacy=_privacy(), local_steps=2, aggregation_weight=WEIGHT_OF[node])
            self.trained.append(node)
            if node in self.lost.get("masked-vector", set()):
                continue
            if request.secagg_inbox is None:
                replies.append(NodeReply(node, reply, update=lambda u=update: u))
                continue
            session = self.sessions[node]
            session.receive_shares(request.secagg_inbox)
            flat = np.concatenate([update[k].reshape(-1).astype(np.float64) for k in self.trainable])
            masked = session.mask(flat, WEIGHT_OF[node])
            replies.append(NodeReply(node, reply, masked=lambda m=masked: m))
        return replies

    def secagg_exchange(self, messages: Mapping[int, protocol.SecAggRequest], timeout: float) -> dict[int, protocol.SecAggSiteMessage]:
        answers: dict[int, protocol.SecAggSiteMessage] = {}
        self.addressed.update(messages)
        for node, message in messages.items():
            if isinstance(message, protocol.SecAggSetup):
                session, answer = secagg_site.start(SITE_OF[node], message)
                stage = "setup"
                if session is not None:
                    self.sessions[node] = session
            else:
                answer = secagg_site.answer(self.sessions.get(node), SITE_OF[node], message)
                stage = ("share-keys" if isinstance(message, protocol.SecAggKeyDirectory)
                         else "view" if isinstance(message, protocol.SecAggViewRequest) else "unmask")
            if node not in self.lost.get(stage, set()):
                answers[node] = answer
        return answers


def _one_round(tmp_path: Path, secure: bool, nodes: list[int], lost: dict[str, set[int]] | None = None, **coordinator: object,
               ) -> tuple[RoundRunner, dict[str, np.ndarray], ScriptedSites, list[str]]:
    lines: list[str] = []
    runner = RoundRunner(_run(tmp_path / ("secure" if secure else "plain"), secure, **coordinator), echo=lines.append)
    # as after earlier rounds: the coordinator knows which site each node is (so a lost one is named)
    runner.state.node_sites = {str(node): SITE_OF[node] for node in nodes}
    before = {k: v.copy() for k, v in runner.global_state.items()}
    trainable = list(runner.global_model().trainable_parameters())
    sites = ScriptedSites(nodes, trainable, lost)
    runner.run_rounds(sites)
    return runner, before, sites, lines


def _fedavg(nodes: list[int], like: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Plain FedAvg (server lr 1) of the clipped fixed updates of ``nodes``."""
    total = sum(WEIGHT_OF[n] for n in nodes)
    return {k: sum(WEIGHT_OF[n] * np.clip(fixed_update(n, like)[k].astype(np.float64), -CLIP, CLIP) for n in nodes) / total
            for k in like}


def _bound(nodes: list[int]) -> float:
    """The stated bound: n · 2R/(2^bits − 1) on the weighted sum (R = W·r), divided by Σw; plus float32 rounding."""
    return len(nodes) * 2 * (2.0 * CLIP) / (2**BITS - 1) / sum(WEIGHT_OF[n] for n in nodes) + 1e-6


def _applied(runner: RoundRunner, before: Mapping[str, np.ndarray], trainable: list[str]) -> dict[str, np.ndarray]:
    return {k: runner.global_state[k].astype(np.float64) - before[k].astype(np.float64) for k in trainable}


def test_the_secure_aggregate_is_plain_fedavg_within_the_stated_bound(tmp_path: Path) -> None:
    nodes = [1, 2, 3]
    secure, before, sites, lines = _one_round(tmp_path, True, nodes)
    trainable = sites.trainable
    expected = _fedavg(nodes, {k: before[k] for k in trainable})
    applied = _applied(secure, before, trainable)
    worst = max(float(np.abs(applied[k] - expected[k]).max()) for k in trainable)
    assert 0 < worst < _bound(nodes)
    # the same updates sent in the clear (unclipped here: most coordinates are inside [−r, r])
    plain, plain_before, _, _ = _one_round(tmp_path, False, nodes)
    updates = [fixed_update(n, {k: before[k] for k in trainable}) for n in nodes]
    inside = {k: np.abs(np.stack([u[k] for u in updates])).max(axis=0) <= CLIP for k in trainable}
    plain_applied = _applied(plain, plain_before, trainable)
    assert max(float(np.abs(applied[k] - plain_applied[k])[inside[k]].max()) for k in trainable) < _bound(nodes)
    (entry,) = load_history(tmp_path / "secure" / "coordinator")
    assert entry.aggregated and entry.secure_aggregation is not None and entry.secure_aggregation.survivors == 3
    norm = np.sqrt(sum(float((expected[k] ** 2).sum()) for k in trainable))
    assert entry.secure_aggregation.mean_update_norm == pytest.approx(norm, rel=1e-3)
    assert "secure aggregation: sum of 3 of 3 sites (t = 2" in lines[-1] == round_line(entry)


def test_a_sampled_subset_of_the_sites_is_masked_among_itself_and_sums_to_its_fedavg(tmp_path: Path) -> None:
    """fraction_train 0.6 of five connected sites: only the three selected take part in any stage
    (the others get no setup, no key directory, no train request), and the aggregate is FedAvg of
    exactly those three."""
    runner, before, sites, lines = _one_round(tmp_path, True, [1, 2, 3, 4, 5], fraction_train=0.6)
    selected = sorted(sites.trained)
    assert len(selected) == 3 and selected == sorted(sites.sessions) == sorted(sites.addressed)  # no stage reached the rest
    trainable = sites.trainable
    expected = _fedavg(selected, {k: before[k] for k in trainable})
    applied = _applied(runner, before, trainable)
    assert max(float(np.abs(applied[k] - expected[k]).max()) for k in trainable) < _bound(selected)
    (entry,) = load_history(tmp_path / "secure" / "coordinator")
    assert sorted(entry.sites) == [SITE_OF[n] for n in selected] and entry.secure_aggregation.survivors == 3
    assert "secure aggregation: sum of 3 of 3 sites (t = 2" in lines[-1]


def test_a_site_dropping_after_masking_is_recovered(tmp_path: Path) -> None:
    """Site 3 trained (and spent) but its masked vector never arrived: its pairwise masks are removed
    with its secret key, rebuilt from the others' shares; the sum is that of sites 1 and 2."""
    runner, before, sites, lines = _one_round(tmp_path, True, [1, 2, 3], {"masked-vector": {3}})
    trainable = sites.trainable
    expected = _fedavg([1, 2], {k: before[k] for k in trainable})
    applied = _applied(runner, before, trainable)
    assert max(float(np.abs(applied[k] - expected[k]).max()) for k in trainable) < _bound([1, 2])
    (entry,) = load_history(tmp_path / "secure" / "coordinator")
    assert entry.sites["site-3"].status == "missing" and entry.secure_aggregation.survivors == 2  # type: ignore[union-attr]
    with BudgetLedger(tmp_path / "secure" / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        assert {e.site_id: e.status for e in ledger.entries()} == {"site-1": "ok", "site-2": "ok", "site-3": "missing"}


def test_sites_dropping_during_unmasking_are_recovered_up_to_the_threshold(tmp_path: Path) -> None:
    """5 sites, t = 3: two vanish after sending their vectors (their seeds come from the other three's
    shares), so all five vectors are in the sum."""
    nodes = [1, 2, 3, 4, 5]
    runner, before, sites, _ = _one_round(tmp_path, True, nodes, {"unmask": {2, 5}})
    expected = _fedavg(nodes, {k: before[k] for k in sites.trainable})
    applied = _applied(runner, before, sites.trainable)
    assert max(float(np.abs(applied[k] - expected[k]).max()) for k in sites.trainable) < _bound(nodes)


def test_too_many_dropouts_abandon_the_round_and_record_the_spends(tmp_path: Path) -> None:
    runner, before, sites, lines = _one_round(tmp_path, True, [1, 2, 3], {"masked-vector": {2, 3}})
    assert sorted(sites.trained) == [1, 2, 3]  # everyone trained: everyone spent
    assert all(np.array_equal(runner.global_state[k], before[k]) for k in before)  # nothing aggregated
    (entry,) = load_history(tmp_path / "secure" / "coordinator")
    assert not entry.aggregated and "after masking < threshold t = 2" in entry.secure_aggregation.abandoned  # type: ignore[union-attr]
    assert "secure aggregation: abandoned" in lines[-1]
    with BudgetLedger(tmp_path / "secure" / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        rows = {e.site_id: e for e in ledger.entries()}
    # the site whose vector arrived is recorded as spent, nothing aggregated; the lost ones as missing
    assert rows["site-1"].status == "rejected" and "abandoned" in rows["site-1"].reason and rows["site-1"].epsilon == 1.0
    assert rows["site-2"].status == rows["site-3"].status == "missing"


def test_too_few_unmask_answers_abandon_the_round_and_record_every_spend(tmp_path: Path) -> None:
    """All three vectors arrived, then two sites vanished before unmasking: 1 answer < t = 2, so no
    mask can be removed — abandoned, the global model unchanged, all three spends recorded."""
    runner, before, sites, lines = _one_round(tmp_path, True, [1, 2, 3], {"unmask": {2, 3}})
    assert sorted(sites.trained) == [1, 2, 3]
    assert all(np.array_equal(runner.global_state[k], before[k]) for k in before)
    (entry,) = load_history(tmp_path / "secure" / "coordinator")
    assert not entry.aggregated and entry.secure_aggregation.abandoned.startswith("1 of 3 sites after unmasking")  # type: ignore[union-attr]
    assert "secure aggregation: abandoned (1 of 3 sites after unmasking < threshold t = 2)" in lines[-1]
    with BudgetLedger(tmp_path / "secure" / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        rows = {e.site_id: e for e in ledger.entries()}
    assert all(rows[s].status == "rejected" and "secure aggregation abandoned" in rows[s].reason and rows[s].epsilon == 1.0
               for s in ("site-1", "site-2", "site-3")), rows


def test_too_few_keys_abandon_the_round_before_anyone_trains(tmp_path: Path) -> None:
    runner, before, sites, _ = _one_round(tmp_path, True, [1, 2, 3], {"setup": {2, 3}})
    assert sites.trained == []
    (entry,) = load_history(tmp_path / "secure" / "coordinator")
    assert "abandoned before training, nothing spent" in entry.secure_aggregation.abandoned  # type: ignore[union-attr]
    with BudgetLedger(tmp_path / "secure" / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        assert list(ledger.entries()) == []  # no site trained: nothing to mirror


def test_real_site_rounds_under_secure_aggregation(tmp_path: Path) -> None:
    """Three real sites (training, budget, masking) through InProcessTransport; a fourth that
    requires secure aggregation refuses a plain round without touching its state."""
    from fedpose.federation.local_training import train_site_round
    from fedpose.federation.server.in_process import InProcessTransport
    from site_round_helpers import global_model, make_site_data, site_config

    data = make_site_data(tmp_path / "data")
    sites = [site_config(data, tmp_path / f"site-{i}").model_copy(update={"site_id": f"site-{i}"}) for i in (1, 2, 3)]
    lines: list[str] = []
    runner = RoundRunner(_run(tmp_path, True, local_steps=2, secure_aggregation={
        "enabled": True, "clip_range": 0.05, "bits": 16, "modulus_bits": 32, "max_sites": 8}), echo=lines.append)
    before = {k: v.copy() for k, v in runner.global_state.items()}
    runner.run_rounds(InProcessTransport(sites))
    (entry,) = load_history(tmp_path / "coordinator")
    assert entry.aggregated and {s.status for s in entry.sites.values()} == {"ok"}
    assert "secure aggregation: sum of 3 of 3 sites" in lines[-1]
    assert any(not np.array_equal(runner.global_state[k], before[k]) for k in before)
    for site in sites:  # each site spent its round and kept no update for a re-send
        budget = json.loads((Path(site.state_dir) / "budget.json").read_text())["payload"]
        assert [e["round"] for e in budget["entries"] if e["status"] == "spent"] == [1]
        assert not (Path(site.state_dir) / "released_update.npz").exists()
        audit = [json.loads(line) for line in (Path(site.state_dir) / "audit.jsonl").read_text().splitlines()]
        assert audit[-1]["status"] == "ok" and audit[-1]["update_bytes"] > 0  # the masked vector's bytes are on record
        with BudgetLedger(tmp_path / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
            (row,) = ledger.entries(site.site_id)
        assert row.update_sha256 == audit[-1]["update_sha256"]  # what the coordinator received is what the site logged

    # a plain round to a site that requires secure aggregation: refused before anything, state unchanged
    strict = sites[0].model_copy(update={"require_secure_aggregation": True})
    state = {name: data for name, data in tree_bytes(Path(strict.state_dir)).items() if name not in ("audit.jsonl", "rounds.jsonl")}
    arrays, spec = global_model()
    result = train_site_round(strict, "r", 2, arrays, spec, 2)
    assert (result.reply.status, result.reply.reason, result.update, result.masked) == (
        "refused", "secure-aggregation-required", {}, None)
    assert {name: data for name, data in tree_bytes(Path(strict.state_dir)).items() if name in state} == state
