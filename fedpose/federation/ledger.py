"""The coordinator's budget ledger: a persisted SQLite mirror of what each site reported.

The site is the authority on its own budget (:mod:`fedpose.federation.site_budget`); this ledger
records what each site *reported* per round — its cumulative ε, its own ε_max and whether one more
round would still fit — so the coordinator can stop selecting exhausted sites (judged by the
site's own numbers, never a second copy of its budget), survive its own restart, and export an
audit trail. One row per (site id, round); writing
the same (site, round) again replaces the row, so a resumed coordinator that re-records a round
never double-counts it. ε values are the site's cumulative spend after that round (guarantee, δ and
the accountant that computed it stored alongside: FDP's ε is not comparable with DP's, and a PLD ε
is lower than an RDP ε of the same steps). A site's summary ε is the largest reported by the
accountant of its latest report: a site that deliberately switched to a tighter accountant is shown
(and judged) by that accountant's ε, labelled with its name, never mixed with the older numbers.

Status per (site, round):
  ``ok``        the site trained and its update was aggregated;
  ``rejected``  the site trained (budget spent!) but the update failed validation;
  ``refused``   the site refused the round (its budget guard said no), nothing spent;
  ``missing``   no update: no reply before the round timeout or a Flower error reply (unknown
                whether the site spent), a site reporting that its training failed (its
                reported spend is recorded; the round history says "failed"), or a site that
                refused because its state is behind this ledger's record of it (nothing spent;
                it is asked again next round: its operator may have restored it meanwhile).

The ledger is also the federation's **witness of each site's spends**: table ``site_spends`` keeps
the accountant events (σ, q, steps per (run, round)) every site reported it spent, first report
wins (a later lower report never erases one). The coordinator sends a site its record with every
train instruction (:mod:`fedpose.federation.witness`) and the site refuses to train while its own
state is behind it. A SuperNode killed after its site spent leaves a round ``missing`` without any
report: :attr:`SiteSummary.epsilon_possible` counts each such round after the site's last report as
possibly spent at its last reported per-round cost (shown by ``fedpose ledger show``, never used to
select), and the site's next reply reconciles (its spends list names the rounds it did spend).
"""

from __future__ import annotations

import csv
import io
import json
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from fedpose.federation.protocol import SiteReply

LedgerStatus = Literal["ok", "rejected", "refused", "missing"]
STATUSES: tuple[str, ...] = ("ok", "rejected", "refused", "missing")
#: statuses in which the site ran local training (and so spent budget)
TRAINED_STATUSES: tuple[str, ...] = ("ok", "rejected")
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS site_rounds (
    site_id     TEXT    NOT NULL,
    round       INTEGER NOT NULL,
    status      TEXT    NOT NULL CHECK (status IN ('ok', 'rejected', 'refused', 'missing')),
    epsilon     REAL,
    delta       REAL,
    guarantee   TEXT,
    unit        TEXT,
    accountant  TEXT,
    eps_max     REAL,
    next_round_affordable INTEGER,
    steps       INTEGER NOT NULL DEFAULT 0,
    rdp_json    TEXT,
    orders_json TEXT,
    reason      TEXT    NOT NULL DEFAULT '',
    recorded_at REAL    NOT NULL,
    PRIMARY KEY (site_id, round)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS site_spends (
    site_id          TEXT    NOT NULL,
    run_id           TEXT    NOT NULL,
    round            INTEGER NOT NULL,
    noise_multiplier REAL    NOT NULL,
    sample_rate      REAL    NOT NULL,
    steps            INTEGER NOT NULL,
    reported_at      REAL    NOT NULL,
    PRIMARY KEY (site_id, run_id, round)
);
"""
#: columns added after schema version 1 shipped (added in place to older ledgers, NULL in old rows)
_ADDED_COLUMNS = (("unit", "TEXT"), ("eps_max", "REAL"), ("next_round_affordable", "INTEGER"), ("update_sha256", "TEXT"),
                  ("input_ldp_epsilon", "REAL"), ("input_ldp_ll_prune", "INTEGER"), ("adjacency", "TEXT"))


class LedgerError(Exception):
    """The ledger database is missing, unreadable, or of an unknown schema."""


@dataclass(frozen=True)
class LedgerEntry:
    """What one site reported for one round."""

    site_id: str
    round: int
    status: LedgerStatus
    epsilon: float | None = None  #: cumulative ε after this round, as reported by the site
    delta: float | None = None
    guarantee: str | None = None  #: "DP", "FDP", "MaskDP", ...
    accountant: str | None = "rdp"  #: the accountant that computed epsilon ("rdp", "pld", "prv")
    steps: int = 0  #: local steps in this round
    rdp: tuple[float, ...] | None = None  #: cumulative RDP per order
    orders: tuple[float, ...] | None = None
    reason: str = ""
    recorded_at: float = 0.0  #: unix time; 0 = now
    #: protection unit the ε is about ("record", "image", "patient"); None: not reported (or a row
    #: written before units existed — those sites were record-level)
    unit: str | None = None
    eps_max: float | None = None  #: the site's own budget, as it reported it (None: no report)
    #: the site's answer to "would one more identical round fit ε_max" (None: no report)
    next_round_affordable: bool | None = None
    #: SHA-256 of what the coordinator received from the site this round (its Δ, or under secure
    #: aggregation its masked vector; :func:`fedpose.federation.site_audit.arrays_sha256`): the
    #: site's audit log holds the same digest of what it sent. None: nothing received
    update_sha256: str | None = None
    #: the site's LDP-Slicing ε_total per privatized pixel on its inputs, as it reported it (None: its
    #: images are not locally privatized, or no report), and whether LL pruning makes it per 2×2 block
    input_ldp_epsilon: float | None = None
    input_ldp_ll_prune: bool | None = None
    #: the neighbouring relation the site's ε is under, as it reported it (None: no report, or a row
    #: from before this column — the guarantee's own relation then)
    adjacency: str | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"ledger status must be one of {STATUSES}, got {self.status!r}")
        if not isinstance(self.site_id, str) or not self.site_id:
            raise ValueError(f"ledger entry: site_id must be a non-empty string, got {self.site_id!r}")
        if (self.rdp is None) != (self.orders is None) or (self.rdp is not None and len(self.rdp) != len(self.orders or ())):
            raise ValueError(f"ledger entry {self.site_id}/{self.round}: rdp and orders must be given together, same length")


    @classmethod
    def from_reply(cls, round_id: int, reply: "SiteReply", status: LedgerStatus, reason: str = "") -> "LedgerEntry":
        """Entry from a site's typed reply: its cumulative privacy report (if it sent one) and the
        local steps it ran. Steps count only where the site trained on this round's request."""
        privacy = reply.privacy
        trained = status in TRAINED_STATUSES or reply.status in ("failed", "error")
        # a round the site's budget holds as spent (its reply lists it) cost its steps, even when the
        # round then failed and released nothing (an error reply says local_steps 0)
        spent = next((e.steps for e in reply.spends if e.round == int(round_id)), None)
        return cls(
            site_id=reply.site_id, round=int(round_id), status=status,
            epsilon=privacy.epsilon if privacy is not None else None,
            delta=privacy.delta if privacy is not None and privacy.accountant != "none" else None,
            guarantee=privacy.guarantee if privacy is not None else None,
            unit=privacy.protection_unit if privacy is not None and privacy.accountant != "none" else None,
            adjacency=privacy.adjacency if privacy is not None and privacy.accountant != "none" else None,
            accountant=privacy.accountant if privacy is not None else None,
            eps_max=privacy.eps_max if privacy is not None else None,
            next_round_affordable=privacy.next_round_affordable if privacy is not None else None,
            input_ldp_epsilon=privacy.input_privacy.epsilon_total if privacy is not None and privacy.input_privacy else None,
            input_ldp_ll_prune=privacy.input_privacy.ll_prune if privacy is not None and privacy.input_privacy else None,
            steps=int(spent if spent is not None and status != "refused" else reply.local_steps if trained else 0),
            rdp=tuple(privacy.rdp) if privacy is not None and privacy.rdp else None,
            orders=tuple(privacy.orders) if privacy is not None and privacy.rdp else None,
            reason=reason,
        )


@dataclass(frozen=True)
class SiteSummary:
    site_id: str
    epsilon: float | None  #: latest (= largest) reported cumulative ε
    delta: float | None
    guarantee: str | None
    accountant: str | None  #: the accountant that computed epsilon ("rdp", "pld", "prv")
    rounds_joined: int  #: rounds in which the site trained (ok or rejected)
    rounds_refused: int
    rounds_missing: int  #: rounds with no update from the site (some of them spent: below)
    last_round: int
    last_status: str
    unit: str | None = None  #: protection unit of the latest reported ε
    eps_max: float | None = None  #: the site's own ε_max from its latest report
    next_round_affordable: bool | None = None  #: from its latest report (None: no report)
    #: rounds after the site's last report that it was sent and never answered: it may have spent
    unconfirmed_rounds: int = 0
    #: ε if each unconfirmed round was spent at the site's last reported per-round cost (None: no
    #: unconfirmed round or no report); display only — the site's next reply reconciles it
    epsilon_possible: float | None = None
    #: rounds the site spent on (its reply lists the spend) that released no update: it failed after
    #: the spend; its reported ε covers them, rounds_joined does not count them
    rounds_spent_unreleased: int = 0
    #: the site's LDP-Slicing settings on its inputs from its latest report (None: not privatized / no report)
    input_ldp_epsilon: float | None = None
    input_ldp_ll_prune: bool | None = None
    adjacency: str | None = None  #: neighbouring relation of the latest reported ε (None: the guarantee's)

    @property
    def exhausted(self) -> bool:
        """The site's guard said no (a refusal), or its reported ε has reached its own ε_max.

        A report that only says the *next* round would not fit does not exclude the site: it is asked
        again and refuses visibly (nothing spent) — the operator sees the guard act in a round line."""
        if self.last_status == "refused":
            return True
        return self.eps_max is not None and self.epsilon is not None and self.epsilon >= self.eps_max


class BudgetLedger:
    """SQLite ledger at ``path`` (created if absent). Use as a context manager or call ``close()``."""

    def __init__(self, path: str | Path, read_only: bool = False):
        self.path = Path(path)
        if read_only:
            if not self.path.exists():
                raise LedgerError(f"ledger database not found: {self.path}")
            self._db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path)
        try:
            if not read_only:
                with self._db:
                    self._db.executescript(_SCHEMA)
                    self._db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            row = self._db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise LedgerError(f"{self.path} is not a fedpose ledger database ({exc})") from None
        if row is None or int(row[0]) != SCHEMA_VERSION:
            self._db.close()
            raise LedgerError(f"{self.path}: unknown ledger schema version {row[0] if row else None!r}")
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(site_rounds)").fetchall()}
        missing = [(name, kind) for name, kind in _ADDED_COLUMNS if name not in columns]
        if missing and not read_only:
            # ledgers from before these columns: add them; their rows stay NULL (unit NULL = record-level)
            with self._db:
                for name, kind in missing:
                    self._db.execute(f"ALTER TABLE site_rounds ADD COLUMN {name} {kind}")
            columns.update(name for name, _ in missing)
        self._select = ", ".join(name if name in columns else "NULL" for name, _ in _ADDED_COLUMNS)
        #: a read-only open of a ledger from before the witness table has no spends to show
        self._has_spends = self._db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'site_spends'").fetchone() is not None

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "BudgetLedger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing ---------------------------------------------------------------------------------
    def record(self, entry: LedgerEntry) -> None:
        self.record_many([entry])

    def record_many(self, entries: Iterable[LedgerEntry]) -> None:
        """Record a round's entries in one transaction (all or nothing). Same (site, round) replaces."""
        now = time.time()
        rows = [
            (
                e.site_id, int(e.round), e.status, e.epsilon, e.delta, e.guarantee, e.unit, e.accountant, int(e.steps),
                json.dumps(list(e.rdp)) if e.rdp is not None else None,
                json.dumps(list(e.orders)) if e.orders is not None else None,
                e.reason, e.recorded_at or now, e.eps_max,
                None if e.next_round_affordable is None else int(e.next_round_affordable), e.update_sha256,
                e.input_ldp_epsilon, None if e.input_ldp_ll_prune is None else int(e.input_ldp_ll_prune), e.adjacency,
            )
            for e in entries
        ]
        with self._db:
            self._db.executemany(
                "INSERT OR REPLACE INTO site_rounds (site_id, round, status, epsilon, delta, guarantee, unit, accountant, "
                "steps, rdp_json, orders_json, reason, recorded_at, eps_max, next_round_affordable, update_sha256, "
                "input_ldp_epsilon, input_ldp_ll_prune, adjacency) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )

    # -- reading ---------------------------------------------------------------------------------
    def entries(self, site_id: str | None = None) -> list[LedgerEntry]:
        query = ("SELECT site_id, round, status, epsilon, delta, guarantee, accountant, steps, rdp_json, orders_json, reason, "
                 f"recorded_at, {self._select} FROM site_rounds")
        args: tuple = ()
        if site_id is not None:
            query += " WHERE site_id = ?"
            args = (site_id,)
        rows = self._db.execute(query + " ORDER BY site_id, round", args).fetchall()
        return [
            LedgerEntry(
                site_id=r[0], round=r[1], status=r[2], epsilon=r[3], delta=r[4], guarantee=r[5], accountant=r[6],
                steps=r[7], rdp=tuple(json.loads(r[8])) if r[8] else None, orders=tuple(json.loads(r[9])) if r[9] else None,
                reason=r[10], recorded_at=r[11], unit=r[12], eps_max=r[13],
                next_round_affordable=None if r[14] is None else bool(r[14]), update_sha256=r[15],
                input_ldp_epsilon=r[16], input_ldp_ll_prune=None if r[17] is None else bool(r[17]), adjacency=r[18],
            )
            for r in rows
        ]

    def site_summaries(self) -> list[SiteSummary]:
        by_site: dict[str, list[LedgerEntry]] = {}
        for e in self.entries():
            by_site.setdefault(e.site_id, []).append(e)
        summaries = []
        for site_id, rows in by_site.items():
            reported = [e for e in rows if e.epsilon is not None]
            if reported:  # only numbers from the accountant the site reports with now (see the module docstring)
                current = max(reported, key=lambda e: e.round).accountant
                reported = [e for e in reported if e.accountant == current]
            latest = max(reported, key=lambda e: (e.epsilon, e.round)) if reported else None
            last = rows[-1]
            reporting = [e for e in rows if e.eps_max is not None]  # rows that carried the site's privacy report
            unconfirmed, possible = _unconfirmed(rows, reported)
            summaries.append(
                SiteSummary(
                    site_id=site_id,
                    epsilon=latest.epsilon if latest else None,
                    delta=latest.delta if latest else None,
                    # a non-private site reports no ε: its guarantee "none" says so (not "not reported")
                    guarantee=latest.guarantee if latest else ("none" if any(e.guarantee == "none" for e in rows) else None),
                    accountant=latest.accountant if latest else None,
                    rounds_joined=sum(e.status in TRAINED_STATUSES for e in rows),
                    rounds_refused=sum(e.status == "refused" for e in rows),
                    rounds_missing=sum(e.status == "missing" for e in rows),
                    last_round=last.round,
                    last_status=last.status,
                    unit=(latest.unit or "record") if latest else None,  # NULL: a row from before units
                    adjacency=latest.adjacency if latest else None,
                    eps_max=reporting[-1].eps_max if reporting else None,
                    next_round_affordable=reporting[-1].next_round_affordable if reporting else None,
                    unconfirmed_rounds=unconfirmed, epsilon_possible=possible,
                    rounds_spent_unreleased=sum(e.status == "missing" and e.steps > 0 for e in rows),
                    input_ldp_epsilon=reporting[-1].input_ldp_epsilon if reporting else None,
                    input_ldp_ll_prune=reporting[-1].input_ldp_ll_prune if reporting else None,
                )
            )
        return summaries

    def record_spends(self, site_id: str, run_id: str, events: Iterable[tuple[int, float, float, int]]) -> None:
        """Keep the (round, σ, q, steps) events a site reported it spent in ``run_id``. A (site, run,
        round) already recorded keeps its first report: the witness never goes down."""
        now = time.time()
        with self._db:
            self._db.executemany(
                "INSERT OR IGNORE INTO site_spends (site_id, run_id, round, noise_multiplier, sample_rate, steps, reported_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(site_id, run_id, int(r), float(sigma), float(q), int(steps), now) for r, sigma, q, steps in events])

    def spend_events(self, run_id: str) -> dict[str, list[tuple[int, float, float, int]]]:
        """site id → the (round, σ, q, steps) events it reported spent in ``run_id``, by round."""
        events: dict[str, list[tuple[int, float, float, int]]] = {}
        for site_id, run, round_id, sigma, q, steps in self._spend_rows():
            if run == run_id:
                events.setdefault(site_id, []).append((int(round_id), float(sigma), float(q), int(steps)))
        return events

    def _spend_rows(self) -> list[tuple[str, str, int, float, float, int]]:
        """Every row of the witness table: (site, run, round, σ, q, steps), by site, run and round."""
        if not self._has_spends:
            return []
        return self._db.execute("SELECT site_id, run_id, round, noise_multiplier, sample_rate, steps FROM site_spends "
                                "ORDER BY site_id, run_id, round").fetchall()

    def recorded_epsilon(self, site_id: str, guarantee: str | None, accountant: str | None) -> float | None:
        """The largest cumulative ε this ledger holds for ``site_id`` under ``guarantee`` as
        ``accountant`` computed it (None: none yet). One accountant's ε is never compared with
        another's: a site that switches to a tighter one (``fedpose privacy budget --accountant
        pld --apply``) states a lower ε for the same spends."""
        row = self._db.execute("SELECT MAX(epsilon) FROM site_rounds WHERE site_id = ? AND guarantee IS ? AND accountant IS ? "
                               "AND epsilon IS NOT NULL", (site_id, guarantee, accountant)).fetchone()
        return None if row[0] is None else float(row[0])

    def exhausted_sites(self, eps_max: float | Mapping[str, float] | None = None) -> set[str]:
        """Sites the coordinator should stop selecting, judged by what each site reported (the site's
        own guard is the authority): a refusal, or a reported ε at its reported ε_max. ``eps_max`` (one bound, or per site id) adds an
        operator's own bound, e.g. ``fedpose ledger show --eps-max``."""
        exhausted = set()
        for s in self.site_summaries():
            bound = eps_max.get(s.site_id) if isinstance(eps_max, Mapping) else eps_max
            if s.exhausted or (bound is not None and s.epsilon is not None and s.epsilon >= bound):
                exhausted.add(s.site_id)
        return exhausted

    def last_round(self) -> int:
        """Highest round recorded (0 if none) — where a resumed coordinator continues."""
        row = self._db.execute("SELECT MAX(round) FROM site_rounds").fetchone()
        return int(row[0] or 0)

    # -- export ----------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(
            {
                "sites": [asdict(s) for s in self.site_summaries()],
                "entries": [asdict(e) for e in self.entries()],
                # the witness table: each site's reported spends per (run, round) — declared σ, q and
                # steps, the accountant's whole input, so an officer can recompute ε
                "spends": [{"site_id": site, "run_id": run, "round": r, "noise_multiplier": sigma, "sample_rate": q,
                            "steps": steps} for site, run, r, sigma, q, steps in self._spend_rows()],
            },
            indent=2,
        )

    def to_csv(self) -> str:
        """One row per (site, round); rdp and orders as JSON lists."""
        out = io.StringIO()
        names = [f.name for f in fields(LedgerEntry)]
        writer = csv.DictWriter(out, fieldnames=names, lineterminator="\n")
        writer.writeheader()
        for e in self.entries():
            row = asdict(e)
            row["rdp"] = json.dumps(list(e.rdp)) if e.rdp is not None else ""
            row["orders"] = json.dumps(list(e.orders)) if e.orders is not None else ""
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
        return out.getvalue()

    EXPORTERS = {"json": to_json, "csv": to_csv}

    def export(self, fmt: str) -> str:
        try:
            return self.EXPORTERS[fmt](self)
        except KeyError:
            raise ValueError(f"unknown ledger export format {fmt!r}; choose from {sorted(self.EXPORTERS)}") from None


def _unconfirmed(rows: list[LedgerEntry], reported: list[LedgerEntry]) -> tuple[int, float | None]:
    """(rounds sent after the site's last report and never answered, ε if each was spent at the last
    reported per-round cost). A round without any reply may have been spent (a SuperNode killed after
    its site recorded the spend): the books show it as possible until the site reports again."""
    last_report = max((e.round for e in rows if e.epsilon is not None), default=0)
    unanswered = [e for e in rows if e.round > last_report and e.status == "missing" and e.epsilon is None]
    if not unanswered or not reported:
        return len(unanswered), None
    by_round = sorted(reported, key=lambda e: e.round)
    latest = max(e.epsilon for e in by_round if e.epsilon is not None)
    earlier = [e.epsilon for e in by_round if e.epsilon is not None and e.epsilon < latest]
    per_round = latest - (max(earlier) if earlier else 0.0)
    return len(unanswered), latest + len(unanswered) * per_round


@contextmanager
def open_ledger(path: str | Path, read_only: bool = False) -> Iterator[BudgetLedger]:
    ledger = BudgetLedger(path, read_only=read_only)
    try:
        yield ledger
    finally:
        ledger.close()
