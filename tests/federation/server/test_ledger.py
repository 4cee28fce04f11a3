"""Coordinator budget ledger: idempotent per (site, round), survives restart, exports, CLI."""

from __future__ import annotations

import csv
import io
import json
import sqlite3
import subprocess
import sys

import pytest

from fedpose.cli import main as cli_main
from fedpose.federation.ledger import BudgetLedger, LedgerEntry, LedgerError


def _ok(site: str, rnd: int, eps: float, steps: int = 10) -> LedgerEntry:
    return LedgerEntry(site, rnd, "ok", epsilon=eps, delta=1e-5, guarantee="DP", steps=steps,
                       rdp=(0.1 * rnd, 0.2 * rnd), orders=(2.0, 4.0))


def _fill(path) -> None:
    with BudgetLedger(path) as ledger:
        ledger.record_many([_ok("a", 1, 0.5), _ok("b", 1, 0.7)])
        ledger.record_many([_ok("a", 2, 0.9), LedgerEntry("b", 2, "missing", reason="timeout")])
        ledger.record_many([
            LedgerEntry("a", 3, "rejected", epsilon=1.2, delta=1e-5, guarantee="DP", steps=10, reason="norm 9.1 > 5"),
            LedgerEntry("b", 3, "refused", epsilon=0.7, delta=1e-5, guarantee="DP", reason="budget"),
        ])


def test_summaries_and_exhausted_sites(tmp_path):
    db = tmp_path / "ledger.sqlite"
    _fill(db)
    with BudgetLedger(db) as ledger:
        s = {x.site_id: x for x in ledger.site_summaries()}
        assert s["a"].epsilon == pytest.approx(1.2) and s["a"].rounds_joined == 3 and s["a"].last_status == "rejected"
        assert s["b"].epsilon == pytest.approx(0.7) and s["b"].rounds_joined == 1
        assert s["b"].rounds_missing == 1 and s["b"].rounds_refused == 1
        # b refused its last round: exhausted whatever the bound; a only once its ε reaches the bound.
        assert ledger.exhausted_sites(None) == {"b"}
        assert ledger.exhausted_sites(2.0) == {"b"}
        assert ledger.exhausted_sites(1.2) == {"a", "b"}
        assert ledger.exhausted_sites({"a": 1.0}) == {"a", "b"}
        assert ledger.last_round() == 3
        entry = ledger.entries("a")[0]
        assert entry.rdp == (0.1, 0.2) and entry.orders == (2.0, 4.0)


def test_resume_rerecording_a_round_does_not_double_count(tmp_path):
    db = tmp_path / "ledger.sqlite"
    _fill(db)
    # A coordinator restarted mid-run replays rounds 2 and 3 and records them again.
    with BudgetLedger(db) as ledger:
        ledger.record_many([_ok("a", 2, 0.9), LedgerEntry("b", 2, "missing", reason="timeout")])
        ledger.record(_ok("a", 3, 1.2))  # this time the update passed validation
    with BudgetLedger(db) as ledger:
        a = {x.site_id: x for x in ledger.site_summaries()}["a"]
        assert a.rounds_joined == 3 and a.last_status == "ok"
        assert len(ledger.entries()) == 6


def test_failed_transaction_records_nothing(tmp_path):
    db = tmp_path / "ledger.sqlite"
    with BudgetLedger(db) as ledger:
        ledger.record(_ok("a", 1, 0.5))
        bad = LedgerEntry("c", 2, "ok")
        object.__setattr__(bad, "status", "bogus")  # slips past validation; the SQL CHECK constraint fails
        with pytest.raises(sqlite3.IntegrityError):
            ledger.record_many([_ok("a", 2, 0.9), _ok("b", 2, 0.4), bad])
        assert [e.round for e in ledger.entries()] == [1]


def test_bad_status_and_mismatched_rdp_are_rejected():
    with pytest.raises(ValueError, match="status"):
        LedgerEntry("a", 1, "fine")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rdp and orders"):
        LedgerEntry("a", 1, "ok", rdp=(1.0,), orders=(2.0, 3.0))


def test_exports(tmp_path):
    db = tmp_path / "ledger.sqlite"
    _fill(db)
    with BudgetLedger(db, read_only=True) as ledger:
        doc = json.loads(ledger.export("json"))
        rows = list(csv.DictReader(io.StringIO(ledger.export("csv"))))
        with pytest.raises(ValueError, match="format"):
            ledger.export("xml")
    assert len(doc["entries"]) == 6 and {s["site_id"] for s in doc["sites"]} == {"a", "b"}
    assert len(rows) == 6
    assert rows[0]["site_id"] == "a" and json.loads(rows[0]["rdp"]) == [0.1, 0.2]
    assert rows[4]["site_id"] == "b" and rows[4]["status"] == "missing" and rows[4]["epsilon"] == ""


def test_read_only_open_of_missing_or_foreign_file(tmp_path):
    with pytest.raises(LedgerError, match="not found"):
        BudgetLedger(tmp_path / "nope.sqlite", read_only=True)
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(LedgerError, match="not a fedpose ledger"):
        BudgetLedger(junk)


def test_cli_show_and_export(tmp_path, capsys):
    db = tmp_path / "ledger.sqlite"
    _fill(db)
    assert cli_main(["ledger", "show", "--db", str(db), "--eps-max", "1.0"]) == 0
    out = capsys.readouterr().out
    assert "a: ε = 1.2 (DP, δ = 1e-05, RDP)" in out and "EXHAUSTED" in out
    assert cli_main(["ledger", "export", "--db", str(db), "--format", "csv", "--out", str(tmp_path / "l.csv")]) == 0
    assert (tmp_path / "l.csv").read_text().startswith("site_id,round,status")
    assert cli_main(["ledger", "export", "--db", str(tmp_path / "missing.sqlite")]) == 2
    assert "ledger database not found" in capsys.readouterr().err


def test_cli_entry_point_exports_json(tmp_path):
    db = tmp_path / "ledger.sqlite"
    _fill(db)
    proc = subprocess.run([sys.executable, "-m", "fedpose.cli", "ledger", "export", "--db", str(db), "--format", "json"],
                          capture_output=True, text=True, check=True)
    assert len(json.loads(proc.stdout)["entries"]) == 6


_SCHEMA_BEFORE_UNITS = """
CREATE TABLE site_rounds (
    site_id TEXT NOT NULL, round INTEGER NOT NULL, status TEXT NOT NULL, epsilon REAL, delta REAL, guarantee TEXT,
    accountant TEXT, steps INTEGER NOT NULL DEFAULT 0, rdp_json TEXT, orders_json TEXT, reason TEXT NOT NULL DEFAULT '',
    recorded_at REAL NOT NULL, PRIMARY KEY (site_id, round));
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '1');
INSERT INTO site_rounds VALUES ('a', 1, 'ok', 0.5, 1e-5, 'DP', 'rdp', 10, NULL, NULL, '', 1.0);
"""


def test_rows_name_the_unit_and_ledgers_from_before_units_are_record_level(tmp_path, capsys):
    db = tmp_path / "old.sqlite"
    with sqlite3.connect(db) as con:
        con.executescript(_SCHEMA_BEFORE_UNITS)
    with BudgetLedger(db, read_only=True) as ledger:  # read-only: no migration, unit unknown = record
        assert ledger.entries()[0].unit is None and ledger.site_summaries()[0].unit == "record"
    with BudgetLedger(db) as ledger:  # writable: the column is added, old rows keep NULL
        ledger.record(LedgerEntry("b", 1, "ok", epsilon=0.4, delta=1e-5, guarantee="DP", steps=10, unit="patient"))
        units = {s.site_id: s.unit for s in ledger.site_summaries()}
    assert units == {"a": "record", "b": "patient"}
    assert cli_main(["ledger", "show", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "a: ε = 0.5 (DP, δ = 1e-05, RDP) per record" in out and "b: ε = 0.4 (DP, δ = 1e-05, RDP) per patient" in out


def test_an_entry_from_a_reply_carries_the_sites_unit():
    from fedpose.federation.protocol import PrivacyReport, SiteReply

    privacy = PrivacyReport(guarantee="DP", unit="one patient", protection_unit="patient", adjacency="add_remove",
                            accountant="rdp", epsilon=0.3, delta=1e-5, eps_max=1.0, steps=5, rounds_spent=1,
                            orders=[2.0], rdp=[0.1], next_round_affordable=True)
    reply = SiteReply(site_id="s", run_id="r", round=1, status="ok", privacy=privacy, local_steps=5)
    assert LedgerEntry.from_reply(1, reply, "ok").unit == "patient"


def test_rows_and_summaries_carry_the_adjacency_the_site_reported(tmp_path):
    """Every ε the ledger keeps names its neighbouring relation as the site reported it (an FDP budget
    kept under the older replace_public_membership relation is not restated under replace_one), in
    the rows, the summaries and the JSON / CSV exports; rows from before the column say none."""
    from fedpose.federation.protocol import PrivacyReport, SiteReply

    privacy = PrivacyReport(guarantee="FDP", unit="one patient", protection_unit="patient",
                            adjacency="replace_public_membership", accountant="rdp", epsilon=0.3, delta=1e-5, eps_max=1.0,
                            steps=5, rounds_spent=1, orders=[2.0], rdp=[0.1], next_round_affordable=True)
    reply = SiteReply(site_id="s", run_id="r", round=1, status="ok", privacy=privacy, local_steps=5)
    with BudgetLedger(tmp_path / "ledger.sqlite") as ledger:
        ledger.record_many([LedgerEntry.from_reply(1, reply, "ok"), _ok("old", 1, 0.5)])
        (row,) = ledger.entries("s")
        summaries = {s.site_id: s for s in ledger.site_summaries()}
        exported = json.loads(ledger.export("json"))
        table = ledger.export("csv")
    assert row.adjacency == "replace_public_membership" and summaries["s"].adjacency == "replace_public_membership"
    assert summaries["old"].adjacency is None
    assert {e["site_id"]: e["adjacency"] for e in exported["entries"]} == {"old": None, "s": "replace_public_membership"}
    assert "adjacency" in table.splitlines()[0].split(",")


def test_exhaustion_is_judged_by_the_sites_own_report(tmp_path):
    """The ledger keeps each site's reported ε_max and next-round answer; a site is exhausted when
    its reported ε reaches its own ε_max or it refused — a "next round would not fit" answer alone
    leaves it selectable, so its own guard refuses visibly in the next round."""
    from fedpose.federation.protocol import PrivacyReport, SiteReply

    def reply(site: str, epsilon: float, eps_max: float, affordable: bool) -> LedgerEntry:
        privacy = PrivacyReport(guarantee="DP", unit="one record", adjacency="add_remove", accountant="pld",
                                epsilon=epsilon, delta=1e-5, eps_max=eps_max, steps=5, rounds_spent=1, orders=[],
                                rdp=[], next_round_affordable=affordable)
        return LedgerEntry.from_reply(1, SiteReply(site_id=site, run_id="r", round=1, status="ok", privacy=privacy,
                                                   local_steps=5), "ok")

    db = tmp_path / "ledger.sqlite"
    with BudgetLedger(db) as ledger:
        ledger.record_many([reply("full", 4.0, 4.0, False), reply("tight", 3.0, 4.0, False), reply("roomy", 1.0, 8.0, True)])
    with BudgetLedger(db, read_only=True) as ledger:
        summaries = {s.site_id: s for s in ledger.site_summaries()}
        assert summaries["tight"].eps_max == 4.0 and summaries["tight"].next_round_affordable is False
        assert ledger.exhausted_sites() == {"full"}
        assert ledger.exhausted_sites(0.5) == {"full", "tight", "roomy"}  # an operator's own, stricter bound
        assert ledger.entries("roomy")[0].eps_max == 8.0


def test_ledgers_from_before_the_reported_budget_columns_still_open(tmp_path):
    db = tmp_path / "old.sqlite"
    with sqlite3.connect(db) as con:
        con.executescript(_SCHEMA_BEFORE_UNITS)
    with BudgetLedger(db) as ledger:
        (entry,) = ledger.entries()
        assert entry.eps_max is None and entry.next_round_affordable is None and ledger.exhausted_sites() == set()
        ledger.record(LedgerEntry("b", 1, "ok", epsilon=0.4, delta=1e-5, guarantee="DP", steps=10, eps_max=2.0,
                                  next_round_affordable=True))
        assert {s.site_id: s.eps_max for s in ledger.site_summaries()} == {"a": None, "b": 2.0}


def test_a_round_spent_then_failed_counts_its_steps_and_shows_as_spent(tmp_path, capsys):
    """A site that spent a round and then failed (an error reply: local_steps 0, no update) lists the
    spend in its reply: the ledger row keeps its steps, `ledger show` says the missing round was spent,
    and the JSON export carries every site's spends per round (σ, q, steps) to recompute ε from."""
    from fedpose.federation import protocol

    privacy = protocol.PrivacyReport(guarantee="DP", unit="record", adjacency="add_remove", accountant="pld", epsilon=1.5,
                                     delta=1e-5, eps_max=8.0, steps=4, rounds_spent=2, orders=[], rdp=[],
                                     next_round_affordable=True)
    spends = [protocol.SpendEvent(round=r, noise_multiplier=1.1, sample_rate=0.25, steps=2) for r in (1, 2)]
    error = protocol.SiteReply(site_id="a", run_id="r", round=2, status="error", reason="site-error",
                               error_class="IsADirectoryError", privacy=privacy, local_steps=0, spends=spends)
    db = tmp_path / "ledger.sqlite"
    with BudgetLedger(db) as ledger:
        ledger.record(_ok("a", 1, 1.0, steps=2))
        ledger.record(LedgerEntry.from_reply(2, error, status="missing", reason="error"))
        ledger.record_spends("a", "r", [(e.round, e.noise_multiplier, e.sample_rate, e.steps) for e in spends])
        (summary,) = ledger.site_summaries()
        assert ledger.entries("a")[1].steps == 2
        assert (summary.rounds_joined, summary.rounds_missing, summary.rounds_spent_unreleased) == (1, 1, 1)
        exported = json.loads(ledger.export("json"))
    assert exported["spends"] == [{"site_id": "a", "run_id": "r", "round": r, "noise_multiplier": 1.1, "sample_rate": 0.25,
                                   "steps": 2} for r in (1, 2)]
    assert cli_main(["ledger", "show", "--db", str(db)]) == 0
    assert "missing 1 (1 of them spent, then failed: no update)" in capsys.readouterr().out


def test_a_non_private_site_is_shown_as_non_private_not_as_unreported(tmp_path, capsys):
    """A site training without privacy reports no ε: its summary says guarantee "none", and
    `ledger show` prints ε = ∞ with that statement (an auditing helper found it shown as "ε not reported")."""
    db = tmp_path / "ledger.sqlite"
    with BudgetLedger(db) as ledger:
        ledger.record_many([_ok("a", 1, 0.5), LedgerEntry("b", 1, "ok", guarantee="none", steps=10)])
        summaries = {s.site_id: s for s in ledger.site_summaries()}
    assert summaries["b"].guarantee == "none" and summaries["b"].epsilon is None and summaries["a"].guarantee == "DP"
    assert cli_main(["ledger", "show", "--db", str(db)]) == 0
    (line,) = [l for l in capsys.readouterr().out.splitlines() if l.startswith("b:")]
    assert line.startswith("b: ε = ∞ (no privacy") and "not reported" not in line
