"""The coordinator's ledger as a witness of a site's spends: a site never spends from a state that
is behind what the federation has on record for it.

A site's budget state lives on its own disk; a restored backup, an older ``budget.json`` copied
over the current one, or a deleted ``state_dir`` would let it count from an earlier (or zero)
spend. The coordinator's ledger keeps every spend the site reported (its accountant events — σ, q,
steps per (run, round) — not just ε, so they can be compared round by round), and every train
instruction carries the ledger's record of that site (:class:`~fedpose.federation.protocol.SpendRecord`).

Site side (:func:`check_record`): before any data work, every event on record must be a spent
round of the site's budget with the same (σ, q, steps). If one is missing (its state is behind the
record, or new while the ledger knows it) or differs, the site refuses: locally with a message
naming its files and the rounds, on the wire with the fixed code ``behind-federation-record``; it
never trains to find out. Its report then composes its own events with the ones on record it
lacks, so the ε it states is the larger of the two books. The record it received is kept in
``<state_dir>/federation_record.json`` for the operator, whose explicit, recorded way forward after
a restore from backup is ``fedpose privacy adopt STATE_DIR``
(:func:`~fedpose.federation.site_budget.adopt_spends`): the spends on record are added to the
budget, never lowering anything.

Which direction is safe: the site takes the maximum. A record *behind* the site's state (fewer
rounds — a coordinator that lost or hides rows) changes nothing; a record *ahead* of it, or
different, makes the site refuse. So a coordinator can only inflate the record — denial of service,
never a lower ε. What the ledger cannot do: witness spends it never heard of (a round whose reply
was lost, until the site's next reply lists it; rounds of other runs or other coordinators), or
protect a site whose operator rewrites the whole state dir consistently and sends nothing — only a
backup or an append-only store of the state protects against that (docs/site-state.md).

Coordinator side (:func:`records_for_node`): which records a node's instruction carries.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedpose.federation.protocol import SpendEvent, SpendRecord
from fedpose.federation.site_budget import STATE_FILE, JOURNAL_FILE, JournaledSpend, RoundEntry, SiteBudget
from fedpose.io import atomic_write_text

#: the last record a refusing site received, kept for ``fedpose privacy adopt`` (site-local, never sent)
RECORD_FILE = "federation_record.json"
RECORD_FORMAT = "fedpose.federation-record/1"


# -- site side -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RecordShortfall:
    """Spends the federation has on record for a site that its own budget does not hold (or holds differently)."""

    site_id: str
    state_dir: Path
    run_id: str
    round: int
    missing: tuple[SpendEvent, ...]  #: on record, not spent in the site's budget
    differing: tuple[tuple[SpendEvent, RoundEntry], ...]  #: on record with other (σ, q, steps) than the budget's
    held_rounds: int  #: spent rounds of this run the site's budget holds

    @property
    def events(self) -> list[SpendEvent]:
        """The record's events the site's own budget does not account for (composed into its report)."""
        return [*self.missing, *(event for event, _ in self.differing)]

    @property
    def message(self) -> str:
        """The site-local explanation: files, rounds, and what the operator can do."""
        parts = []
        if self.missing:
            parts.append(f"spent round(s) {_rounds(self.missing)} of run '{self.run_id}' are on the coordinator's record "
                         f"but not in {self.state_dir / STATE_FILE} (it holds {self.held_rounds} spent round(s) of this run)")
        if self.differing:
            parts.append("; ".join(f"round {e.round} is on record with σ={e.noise_multiplier}, q={e.sample_rate}, steps={e.steps} "
                                   f"but spent in the budget with σ={held.noise_multiplier}, q={held.sample_rate}, steps={held.steps}"
                                   for e, held in self.differing))
        return (
            f"site '{self.site_id}' refuses round {self.round} of run '{self.run_id}' before any data work: its budget state "
            f"is behind the federation's record of its spends — {'; '.join(parts)}. Its state was restored from an older copy, "
            f"rolled back, lost or edited; training now would understate the ε it has spent. Nothing was trained or released. "
            f"The record is saved in {self.state_dir / RECORD_FILE}. Restore the newest copy of {self.state_dir} — or, if this "
            f"older state is all there is, `fedpose privacy adopt {self.state_dir}` adds the spends on record to its budget "
            f"(recorded in {STATE_FILE} and {JOURNAL_FILE}; never lowers anything) — and the site trains again next round."
        )


def own_record(records: Sequence[SpendRecord], site_id: str) -> SpendRecord | None:
    """This site's record among those an instruction carries (None: nothing on record for it)."""
    mine = [r for r in records if r.site_id == site_id]
    if len(mine) > 1:  # two records for one site: take every event of both (the larger claim)
        return SpendRecord(site_id=site_id, events=[e for r in mine for e in r.events])
    return mine[0] if mine else None


def check_record(budget: SiteBudget, run_id: str, round_id: int, records: Sequence[SpendRecord]) -> RecordShortfall | None:
    """None when the site's budget holds every spend on record for it (same σ, q, steps); otherwise
    the shortfall, after saving the record beside the state for the operator. Reads nothing but the
    budget: call it before any data work."""
    record = own_record(records, budget.site_id)
    if record is None or not record.events:
        return None
    held = {e.round: e for e in budget.entries if e.run_id == run_id and e.status == "spent"}
    missing, differing = [], []
    for event in sorted(record.events, key=lambda e: e.round):
        entry = held.get(event.round)
        if entry is None:
            missing.append(event)
        elif not entry.same_request(event.noise_multiplier, event.sample_rate, event.steps):
            differing.append((event, entry))
    if not missing and not differing:
        return None
    save_record(budget.state_dir, budget.site_id, run_id, round_id, record)
    return RecordShortfall(budget.site_id, budget.state_dir, run_id, int(round_id), tuple(missing), tuple(differing), len(held))


def spends_of_run(budget: SiteBudget | None, run_id: str) -> list[SpendEvent]:
    """The spent rounds of ``run_id`` in the site's budget, as the reply lists them."""
    if budget is None:
        return []
    return [SpendEvent(round=e.round, noise_multiplier=e.noise_multiplier, sample_rate=e.sample_rate, steps=e.steps)
            for e in sorted(budget.entries, key=lambda e: e.round) if e.run_id == run_id and e.status == "spent"]


def save_record(state_dir: Path, site_id: str, run_id: str, round_id: int, record: SpendRecord) -> None:
    atomic_write_text(Path(state_dir) / RECORD_FILE, json.dumps({
        "format": RECORD_FORMAT, "site_id": site_id, "run_id": run_id, "received_for_round": int(round_id),
        "received_at": time.time(), "events": [e.model_dump() for e in record.events]}, indent=1))


def load_saved_record(state_dir: str | Path) -> tuple[list[JournaledSpend], str] | None:
    """The spends of the record a refusing site saved, and a description of where they come from
    (None: no record saved). For ``fedpose privacy adopt``."""
    from fedpose.federation.site_budget import BudgetStateError

    path = Path(state_dir) / RECORD_FILE
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != RECORD_FORMAT:
            raise ValueError(f"unknown format {doc.get('format')!r}")
        run_id = str(doc["run_id"])
        events = [SpendEvent.model_validate(e) for e in doc["events"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BudgetStateError(f"federation record {path} is unreadable ({exc})") from None
    spends = [JournaledSpend(run_id, e.round, e.noise_multiplier, e.sample_rate, e.steps) for e in events]
    return spends, f"coordinator's record received for round {doc['received_for_round']} of run '{run_id}' ({path})"


# -- coordinator side ------------------------------------------------------------------------------------
def records_for_node(events: Mapping[str, Sequence[tuple[int, float, float, int]]], site_id: str | None,
                     attributed: set[str]) -> list[SpendRecord]:
    """The ledger records a node's instruction carries: its site's, when the coordinator knows which
    site the node is; otherwise every recorded site that no node of this round is known to be (a
    restarted SuperLink or simulation hands out new node ids, and a site must never miss its record
    because of that). ``events``: :meth:`BudgetLedger.spend_events` of the run."""
    def record(site: str) -> SpendRecord:
        return SpendRecord(site_id=site, events=[SpendEvent(round=r, noise_multiplier=s, sample_rate=q, steps=n)
                                                 for r, s, q, n in events[site]])

    if site_id is not None:
        return [record(site_id)] if events.get(site_id) else []
    return [record(site) for site in sorted(events) if events[site] and site not in attributed]


def spend_tuples(events: Sequence[SpendEvent]) -> list[tuple[int, float, float, int]]:
    """A reply's spends as the ledger stores them."""
    return [(e.round, e.noise_multiplier, e.sample_rate, e.steps) for e in events]


def _rounds(events: Sequence[SpendEvent]) -> str:
    return ", ".join(str(e.round) for e in events)
