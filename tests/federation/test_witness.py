"""A spend is never understated: the coordinator's ledger as a witness of each site's spends.

Fault tests on the real code path without Flower's messaging: the real coordinator
(:class:`RoundRunner`: ledger, records, aggregation) drives the real site round
(:func:`run_site_round`: witness check, budget guard, private training) through the in-process
transport. The same faults on real processes are in ``test_federation_simulation.py``.

Each asserts what the site's books, the ledger and the truth say: the true spend is composed
from the rounds in which the site trained (its own ``rounds.jsonl`` outcomes "ok", kept outside
the state that is rolled back).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import fedpose.federation.server.rounds as rounds_module
from fedpose.federation import protocol
from fedpose.federation.deployment import CoordinatorRunConfig
from fedpose.federation.ledger import BudgetLedger
from fedpose.federation.local_training import run_site_round
from fedpose.federation.report import load_history
from fedpose.federation.server.in_process import InProcessTransport
from fedpose.federation.server.rounds import NodeReply, RoundRunner, TrainRequest
from fedpose.federation.site_budget import SiteBudget, read_journal
from fedpose.federation.witness import RECORD_FILE
from fedpose.privacy.accountant import epsilon_for
from fedpose.privacy.report import epsilon_digits
from site_round_helpers import BATCH_SIZE, PER_SITE, global_model, make_site_data, site_config

SIGMA, RATE, STEPS, DELTA = 1.0, BATCH_SIZE / PER_SITE, 2, 1e-5


@pytest.fixture(autouse=True)
def no_settle_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rounds_module, "NODE_SETTLE_S", 0.0)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_site_data(tmp_path_factory.mktemp("witness-data"))


def _run(tmp_path: Path, rounds: int) -> CoordinatorRunConfig:
    return CoordinatorRunConfig.model_validate({"run_id": "r", "coordinator": {
        "checkpoint_dir": str(tmp_path / "coordinator"), "data": {"input_size": [64, 64]}, "rounds": rounds, "min_sites": 1,
        "local_steps": STEPS, "model": {"backbone": "tiny_vit_test", "scenario": "scratch"}}})


def _rounds(tmp_path: Path, transport: object, upto: int) -> None:
    """Run (or resume) the coordinator until round ``upto``."""
    resume = (tmp_path / "coordinator" / "ledger.sqlite").exists()
    RoundRunner(_run(tmp_path, upto), resume=resume, echo=lambda _: None).run_rounds(transport)


def true_epsilon(trained_rounds: int) -> float:
    """ε of the rounds the site really trained (each: STEPS steps at σ, q; PLD, as a new budget enforces)."""
    return epsilon_for(SIGMA, RATE, trained_rounds * STEPS, DELTA, accountant="pld")[0] if trained_rounds else 0.0


class SiteLog:
    """The site's own log of what it did, kept across a rollback of its state dir (the truth)."""

    def __init__(self, state_dir: Path):
        self.state_dir, self.kept = state_dir, []

    def lines(self) -> list[dict]:
        path = self.state_dir / "rounds.jsonl"
        return self.kept + ([json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [])

    def set_aside(self) -> None:  # before the state dir is replaced or deleted
        self.kept = self.lines()

    def trained_rounds(self) -> list[int]:
        return [e["round"] for e in self.lines() if e["outcome"] == "ok"]


def _books(tmp_path: Path, state_dir: Path) -> tuple[float, float]:
    """(the site's budget ε, the ledger's ε for the site)."""
    budget = SiteBudget(state_dir, "site-1", eps_max=50.0, delta=DELTA)
    with BudgetLedger(tmp_path / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        (summary,) = ledger.site_summaries()
    return budget.epsilon, summary.epsilon


def _ledger_row(tmp_path: Path, round_id: int):
    with BudgetLedger(tmp_path / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        return {e.round: e for e in ledger.entries("site-1")}[round_id]


def _released_round(state_dir: Path) -> int | None:
    from fedpose.federation.aggregation import load_checkpoint_meta

    path = state_dir / "released_update.npz"
    return int(load_checkpoint_meta(path)["round"]) if path.exists() else None


class Renumbered(InProcessTransport):
    """The same sites under new node ids (a restarted SuperLink or simulation): the coordinator
    cannot attribute them until they reply."""

    def __init__(self, sites, offset: int):
        super().__init__(sites)
        self.sites = {node + offset: site for node, site in self.sites.items()}


def _cli(argv: list[str]) -> str:
    """stdout of a successful ``fedpose`` command, run in this process."""
    import contextlib
    import io

    from fedpose.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def _adopt(state_dir: Path) -> str:
    return _cli(["privacy", "adopt", str(state_dir)])


@pytest.mark.slow
def test_a_state_dir_restored_one_round_older_refuses_until_adopted(data_root: Path, tmp_path: Path) -> None:
    """A backup of the whole state dir from after round 1 put back after round 2: the site's budget,
    journal and marker agree with each other, only the ledger knows round 2. The site refuses round 3
    before any data work (under new node ids too: the record reaches unattributed nodes), releases
    nothing, and trains again once its operator adopts the record; budget = ledger = true spend."""
    state = tmp_path / "site-1"
    site = site_config(data_root, state, local_steps=STEPS)
    log = SiteLog(state)
    _rounds(tmp_path, InProcessTransport([site]), upto=1)
    backup = tmp_path / "backup"
    shutil.copytree(state, backup)
    _rounds(tmp_path, InProcessTransport([site]), upto=2)
    log.set_aside()
    shutil.rmtree(state)
    shutil.copytree(backup, state)
    (state / "rounds.jsonl").unlink()  # the truth is kept by SiteLog

    _rounds(tmp_path, Renumbered([site], offset=100), upto=3)
    round3 = load_history(tmp_path / "coordinator")[-1]
    assert round3.sites["site-1"].status == "refused" and not round3.aggregated
    assert round3.sites["site-1"].reason == protocol.REASON_TEXT["behind-federation-record"]
    assert _ledger_row(tmp_path, 3).status == "missing" and _ledger_row(tmp_path, 3).steps == 0  # not exhausted, not trained
    assert log.trained_rounds() == [1, 2] and log.lines()[-1]["outcome"] == "refused"
    assert "round(s) 2 of run 'r'" in log.lines()[-1]["note"] and str(state / "budget.json") in log.lines()[-1]["note"]
    assert _released_round(state) == 1  # released nothing for round 3
    assert (state / RECORD_FILE).exists()
    site_eps, ledger_eps = _books(tmp_path, state)
    assert site_eps == pytest.approx(true_epsilon(1), rel=1e-9)  # behind: why it refused
    assert ledger_eps == pytest.approx(true_epsilon(2), rel=1e-9)  # the witness

    # the site's own books name what they lack: `privacy budget` warns with the true spend (a dry run)
    shown = _cli(["privacy", "budget", str(state)])
    assert "WARNING: this budget lacks 1 spend(s) held elsewhere — run 'r' round 2" in shown, shown
    assert f"counting them, ε = {epsilon_digits(true_epsilon(2))} (DP, δ = 1e-05, PLD) per patient" in shown, shown
    assert "privacy adopt" in shown and not json.loads((state / "budget.json").read_text())["payload"].get("adoptions")
    out = _adopt(state)
    assert "adopted run 'r' round 2" in out and "(DP, δ = 1e-05, PLD) per patient" in out
    assert "WARNING" not in _cli(["privacy", "budget", str(state)])
    _rounds(tmp_path, Renumbered([site], offset=200), upto=4)
    assert load_history(tmp_path / "coordinator")[-1].sites["site-1"].status == "ok"
    assert log.trained_rounds() == [1, 2, 4] and _released_round(state) == 4
    site_eps, ledger_eps = _books(tmp_path, state)
    assert site_eps == pytest.approx(true_epsilon(3), rel=1e-9) and ledger_eps == pytest.approx(site_eps, rel=1e-9)
    adoption = json.loads((state / "budget.json").read_text())["payload"]["adoptions"]
    assert [tuple(r) for r in adoption[0]["rounds"]] == [("r", 2)]


@pytest.mark.slow
def test_an_older_budget_file_copied_over_the_current_one_is_caught_by_the_journal(data_root: Path, tmp_path: Path) -> None:
    """Only budget.json put back from after round 1 (journal and marker current): the site's own
    journal refuses it before any data work (an "error" reply naming only the class), nothing is
    released, and `fedpose privacy adopt` puts the journaled round back."""
    from fedpose.federation.site_budget import BudgetStateError

    state = tmp_path / "site-1"
    site = site_config(data_root, state, local_steps=STEPS)
    log = SiteLog(state)
    _rounds(tmp_path, InProcessTransport([site]), upto=1)
    older = (state / "budget.json").read_bytes()
    _rounds(tmp_path, InProcessTransport([site]), upto=2)
    (state / "budget.json").write_bytes(older)

    _rounds(tmp_path, InProcessTransport([site]), upto=3)
    round3 = load_history(tmp_path / "coordinator")[-1].sites["site-1"]
    assert round3.status == "error" and round3.reason.startswith("BudgetStateError")
    assert _ledger_row(tmp_path, 3).status == "missing" and _ledger_row(tmp_path, 3).steps == 0
    assert log.trained_rounds() == [1, 2] and _released_round(state) == 2
    assert "below its spend journal" in log.lines()[-1]["note"] and "round 2" in log.lines()[-1]["note"]
    with pytest.raises(BudgetStateError, match="below its spend journal"):
        SiteBudget(state, "site-1", eps_max=50.0, delta=DELTA)

    assert "adopted run 'r' round 2 (σ = 1, q = 0.25, 2 steps) from the journal" in _adopt(state)
    _rounds(tmp_path, InProcessTransport([site]), upto=4)
    assert log.trained_rounds() == [1, 2, 4]
    site_eps, ledger_eps = _books(tmp_path, state)
    assert site_eps == pytest.approx(true_epsilon(3), rel=1e-9) and ledger_eps == pytest.approx(site_eps, rel=1e-9)


@pytest.mark.slow
def test_a_deleted_state_dir_refuses_and_releases_nothing(data_root: Path, tmp_path: Path) -> None:
    """The whole state_dir deleted between rounds: the site starts a new state, sees the ledger
    knows it, and refuses every round (nothing trained, nothing released) until its operator acts."""
    state = tmp_path / "site-1"
    site = site_config(data_root, state, local_steps=STEPS)
    log = SiteLog(state)
    _rounds(tmp_path, InProcessTransport([site]), upto=1)
    log.set_aside()
    shutil.rmtree(state)

    _rounds(tmp_path, InProcessTransport([site]), upto=3)
    history = load_history(tmp_path / "coordinator")
    assert [r.sites["site-1"].status for r in history] == ["ok", "refused", "refused"]
    assert [r.aggregated for r in history] == [True, False, False]
    assert log.trained_rounds() == [1] and not (state / "released_update.npz").exists()
    assert [e["outcome"] for e in log.lines()[1:]] == ["refused", "refused"]
    site_eps, ledger_eps = _books(tmp_path, state)
    assert site_eps == 0.0 and ledger_eps == pytest.approx(true_epsilon(1), rel=1e-9)
    # the refusals stated the larger spend (the record's), never a regression of the books
    assert history[1].sites["site-1"].epsilon == pytest.approx(true_epsilon(1), rel=1e-9)

    _adopt(state)
    _rounds(tmp_path, InProcessTransport([site]), upto=4)
    assert log.trained_rounds() == [1, 4]
    site_eps, ledger_eps = _books(tmp_path, state)
    assert site_eps == pytest.approx(true_epsilon(2), rel=1e-9) and ledger_eps == pytest.approx(site_eps, rel=1e-9)


class LosesReplies(InProcessTransport):
    """Runs each site's real round, but the reply of the rounds in ``lost`` never arrives (the
    SuperNode was killed after its site recorded the spend and trained)."""

    def __init__(self, sites, lost: set[int]):
        super().__init__(sites)
        self.lost = lost

    def send_and_receive(self, requests: list[TrainRequest], timeout: float) -> list[NodeReply]:
        replies = super().send_and_receive(requests, timeout)
        return [] if requests and requests[0].instruction.round in self.lost else replies


@pytest.mark.slow
def test_a_spend_whose_reply_was_lost_is_shown_possible_then_reconciled(data_root: Path, tmp_path: Path) -> None:
    state = tmp_path / "site-1"
    site = site_config(data_root, state, local_steps=STEPS)
    transport = LosesReplies([site], lost={2})
    _rounds(tmp_path, transport, upto=2)
    with BudgetLedger(tmp_path / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        (summary,) = ledger.site_summaries()
        assert ledger.spend_events("r")["site-1"] == [(1, SIGMA, RATE, STEPS)]
    assert SiteLog(state).trained_rounds() == [1, 2]
    assert summary.epsilon == pytest.approx(true_epsilon(1), rel=1e-9)  # below the site: it never heard of round 2
    assert summary.unconfirmed_rounds == 1
    assert summary.epsilon_possible >= true_epsilon(2)  # what it displays is never below the truth
    shown = _cli(["ledger", "show", "--db", str(tmp_path / "coordinator" / "ledger.sqlite")])
    assert "1 round(s) sent since without a reply — possibly ε = " in shown and "(DP, δ = 1e-05, PLD) per patient" in shown

    _rounds(tmp_path, transport, upto=3)  # the next reply lists round 2 among its spends
    with BudgetLedger(tmp_path / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        (summary,) = ledger.site_summaries()
        assert [e[0] for e in ledger.spend_events("r")["site-1"]] == [1, 2, 3]
    site_eps, ledger_eps = _books(tmp_path, state)
    assert site_eps == pytest.approx(true_epsilon(3), rel=1e-9) and ledger_eps == pytest.approx(site_eps, rel=1e-9)
    assert summary.unconfirmed_rounds == 0 and summary.epsilon_possible is None


# -- a coordinator that lies about the record: only inflation is possible, and it only denies service ----------
def _record(*rounds: int, site_id: str = "site-1", sigma: float = SIGMA) -> list[protocol.SpendRecord]:
    return [protocol.SpendRecord(site_id=site_id, events=[protocol.SpendEvent(round=r, noise_multiplier=sigma, sample_rate=RATE,
                                                                               steps=STEPS) for r in rounds])]


def test_an_inflated_record_makes_the_site_refuse_and_never_lowers_its_epsilon(data_root: Path, tmp_path: Path) -> None:
    weights, spec = global_model()
    site = site_config(data_root, tmp_path / "state", local_steps=STEPS)
    first = run_site_round(site, "r", 1, weights, spec, STEPS)
    assert first.reply.status == "ok" and first.reply.spends == _record(1)[0].events
    spent = SiteBudget(tmp_path / "state", "site-1", 50.0, DELTA).epsilon

    for inflated in (_record(1, 2), _record(1, sigma=0.5), _record(1, 2, 3)):  # a round it never ran; other σ
        refused = run_site_round(site, "r", 4, weights, spec, STEPS, ledger_records=inflated)
        assert refused.reply.status == "refused" and refused.reply.reason == "behind-federation-record"
        assert refused.update == {} and refused.reply.privacy.epsilon >= spent  # the larger book, never lower
        assert SiteBudget(tmp_path / "state", "site-1", 50.0, DELTA).epsilon == spent  # nothing spent
        assert _released_round(tmp_path / "state") == 1
    assert [e["outcome"] for e in map(json.loads, (tmp_path / "state" / "rounds.jsonl").read_text().splitlines())] == \
        ["ok", "refused", "refused", "refused"]


@pytest.mark.slow
def test_a_lower_record_changes_nothing(data_root: Path, tmp_path: Path) -> None:
    """Fewer rounds on record than the site holds (a coordinator that lost or hides rows), or a
    record of another site: the site trains as it would without any record, at its own ε."""
    weights, spec = global_model()
    plain = site_config(data_root, tmp_path / "plain", local_steps=STEPS)
    witnessed = site_config(data_root, tmp_path / "witnessed", local_steps=STEPS)
    for round_id, record in ((1, []), (2, _record(1, 2, site_id="site-9")), (3, _record(1)), (4, _record())):
        a = run_site_round(plain, "r", round_id, weights, spec, STEPS)
        b = run_site_round(witnessed, "r", round_id, weights, spec, STEPS, ledger_records=record)
        assert a.reply.status == b.reply.status == "ok"
        assert a.reply.privacy.epsilon == pytest.approx(b.reply.privacy.epsilon, rel=1e-12)
    assert len(read_journal(tmp_path / "witnessed")) == 4


def test_a_refusal_does_no_data_work(data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The witness check comes before the dataset is opened: a refusal reads no image."""
    import fedpose.federation.local_training as local_training

    weights, spec = global_model()
    site = site_config(data_root, tmp_path / "state", local_steps=STEPS)

    def no_data(*args, **kwargs):
        raise AssertionError("the dataset was opened by a round that refuses")

    monkeypatch.setattr(local_training, "load_site_dataset", no_data)
    refused = run_site_round(site, "r", 2, weights, spec, STEPS, ledger_records=_record(1))
    assert refused.reply.status == "refused" and refused.reply.reason == "behind-federation-record"
    saved = json.loads((tmp_path / "state" / RECORD_FILE).read_text())
    assert saved["run_id"] == "r" and [e["round"] for e in saved["events"]] == [1]


def test_records_reach_the_right_nodes() -> None:
    from fedpose.federation.witness import records_for_node

    events = {"a": [(1, 1.0, 0.25, 2)], "b": [(1, 1.0, 0.25, 2), (2, 1.0, 0.25, 2)], "c": []}
    assert [r.site_id for r in records_for_node(events, "a", {"a"})] == ["a"]
    assert records_for_node(events, "c", {"c"}) == [] and records_for_node(events, "new", set()) == []
    # a node the coordinator cannot attribute gets every record no attributed node claims
    assert [r.site_id for r in records_for_node(events, None, {"a"})] == ["b"]
    assert [len(r.events) for r in records_for_node(events, None, set())] == [1, 2]


def test_the_spends_on_record_never_go_down(tmp_path: Path) -> None:
    with BudgetLedger(tmp_path / "ledger.sqlite") as ledger:
        ledger.record_spends("a", "r", [(1, 1.0, 0.25, 2), (2, 1.0, 0.25, 2)])
        ledger.record_spends("a", "r", [(1, 9.0, 0.25, 2)])  # a later, lower-cost report of round 1
        ledger.record_spends("a", "other-run", [(1, 1.0, 0.25, 2)])
        assert ledger.spend_events("r") == {"a": [(1, 1.0, 0.25, 2), (2, 1.0, 0.25, 2)]}


def test_a_ledger_from_before_the_witness_opens_read_only(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.sqlite"
    with BudgetLedger(path) as ledger:
        ledger.record_spends("a", "r", [(1, 1.0, 0.25, 2)])
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE site_spends")
    with BudgetLedger(path, read_only=True) as ledger:
        assert ledger.spend_events("r") == {}
    with BudgetLedger(path) as ledger:  # a writer adds the table
        assert ledger.spend_events("r") == {}
        ledger.record_spends("a", "r", [(1, 1.0, 0.25, 2)])
        assert ledger.spend_events("r") == {"a": [(1, 1.0, 0.25, 2)]}


def test_replies_list_their_spends_of_the_run_only(data_root: Path, tmp_path: Path) -> None:
    weights, spec = global_model()
    site = site_config(data_root, tmp_path / "state", local_steps=STEPS)
    run_site_round(site, "earlier-run", 1, weights, spec, STEPS)
    reply = run_site_round(site, "r", 1, weights, spec, STEPS).reply
    assert [(e.round, e.steps) for e in reply.spends] == [(1, STEPS)]
    assert np.isclose(reply.privacy.epsilon, true_epsilon(2), rtol=1e-9)  # both runs compose in ε
