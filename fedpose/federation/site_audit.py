"""The site's audit log for its privacy officer: every reply to a training instruction and every
secure-aggregation stage answer, hash-chained.

``<state_dir>/audit.jsonl`` holds one line per reply, written by the site at the moment it replies
(:func:`record_reply`, called from :func:`~fedpose.federation.local_training.train_site_round` and,
for an error reply, :func:`~fedpose.federation.local_training.run_site_round`) and before the
reply is handed to Flower: an update that could not be logged is not sent. The egress guard
(``sites/egress.py``) checks the reply after that; one it blocks gets a second line
(:func:`record_blocked`, ``blocked_seq``) saying that the guard's error left instead. Each line
(:class:`AuditEntry`) says what was asked (the instruction's public fields), what the site answered
(status, reason code), its cumulative ε after the round with guarantee, unit, δ and accountant, the
(σ, q, steps) it spent for the round, and the size and SHA-256 of the update it released — public
values only. The site-local diagnostics in ``rounds.jsonl`` (loss, timings, notes: statistics of
the private data) are never read here.

Why a file of its own and not the spend journal (``spends.jsonl``): the journal is written *before*
training, one line per spend, and is what the budget may never be below; this log is written
*after* it, one line per reply (refusals, errors and re-sent releases included), and records what
left. Both name a spend; :func:`verify` checks that they agree.

Tamper evidence: each entry carries ``prev``, the ``hash`` of the entry before it (the first
carries :data:`GENESIS`), and its own ``hash``: the SHA-256 of its canonical JSON without the hash.
An entry edited, deleted or moved breaks the chain at that entry; :func:`verify` also checks the
log against the budget and the journal (a logged spend the budget or journal lacks: they were rolled
back). What the chain cannot show: someone who can write the state dir can rewrite the whole chain
(and the budget and journal) consistently, or cut entries off its end. The witnesses against that
are outside the state dir: the coordinator's ledger and a copy of the log kept where the site's
operators cannot write (docs/site-state.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from fedpose.config import ModelSpec
from fedpose.io import append_lines
from fedpose.federation.protocol import ReasonCode, ReplyStatus, SiteReply, SpendEvent, SpendRecord

log = logging.getLogger(__name__)

AUDIT_FILE = "audit.jsonl"
#: ``error_class`` of the entry that records a reply the egress guard blocked
BLOCKED_ERROR_CLASS = "EgressGuardBlocked"
AUDIT_FORMAT = "fedpose.site-audit/1"
#: ``prev`` of the first entry
GENESIS = "0" * 64


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AuditInstruction(_Entry):
    """What the coordinator asked, as far as the site can state it from the instruction's public fields."""

    local_steps: int  #: steps asked (the site runs at most its own configured cap)
    basis_version: int  #: projection-basis version the instruction named (-1: none)
    model: ModelSpec  #: the architecture of the global model
    global_sha256: str  #: :func:`arrays_sha256` of the global weights received
    ledger_record_rounds: list[int]  #: rounds of this site the coordinator's ledger record listed


class SecAggStageAnswer(_Entry):
    """A secure-aggregation stage answer the site sent (sites/egress.py checked it first): what was
    asked, what it answered, and for an unmask answer whose shares it gave — never both of one node."""

    request: str  #: "setup", "key-directory", "view", "unmask-request"
    answer: str  #: "public-keys", "encrypted-shares", "view-signature", "unmask-shares", "refusal"
    refusal: str | None = None  #: the refusal's fixed code
    seed_share_nodes: list[int] = Field(default_factory=list)  #: survivors whose self-mask seed shares it gave
    key_share_nodes: list[int] = Field(default_factory=list)  #: dropped nodes whose mask-key shares it gave
    answer_sha256: str  #: SHA-256 of the answer as encoded for the wire


class AuditEntry(_Entry):
    """One reply of the site, as its audit log holds it (every field is public: from the instruction,
    the reply, or a digest of what was released)."""

    format: str = AUDIT_FORMAT
    seq: int = Field(ge=1)  #: 1, 2, … in the order the site replied
    prev: str  #: ``hash`` of the entry before (GENESIS for the first)
    at: float  #: unix time of the reply
    site_id: str
    run_id: str
    round: int
    asked: AuditInstruction | None  #: None: the instruction could not be read (error reply)
    status: ReplyStatus
    reason: ReasonCode | None
    error_class: str | None = None
    local_steps: int  #: steps the round ran
    guarantee: str | None  #: the site's guarantee ("DP", "FDP", "MaskDP", "none"); None: state unreadable
    protection_unit: str | None
    delta: float | None
    accountant: str | None
    epsilon: float | None  #: cumulative ε after the round (None: no guarantee, or state unreadable)
    #: the neighbouring relation the ε is under (None: an entry written before this field, or no ε;
    #: its guarantee's default relation then — the same words for every guarantee kept today)
    adjacency: str | None = None
    eps_max: float | None
    rounds_spent: int | None
    spend: SpendEvent | None  #: this round's (σ, q, steps) when the site's budget holds it as spent
    update_bytes: int  #: bytes of the released update's arrays (0: nothing released)
    update_sha256: str | None  #: :func:`arrays_sha256` of the released update (None: nothing released)
    #: set on the entry that records that the egress guard blocked the reply logged at this seq
    #: (:func:`record_blocked`): that reply did not leave, the guard's error did
    blocked_seq: int | None = None
    #: set on the first entry of a log begun again because the site's log was lost (its state marker
    #: says a log was kept: :func:`log_record`): the replies before it are not on record here
    restarted_after_loss: bool | None = None
    #: set on the entry of a secure-aggregation stage answer (status "ok", or "refused" with reason
    #: "secure-aggregation-refused"; no spend, no update, no ε: :func:`record_secagg_stage`)
    secagg_stage: SecAggStageAnswer | None = None
    hash: str = ""  #: SHA-256 of the canonical JSON of every other field


def arrays_sha256(arrays: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over named arrays in name order (name, dtype, shape, bytes each): the coordinator can
    compute the same digest of what it received and compare it with the site's log."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(json.dumps([name, array.dtype.str, list(array.shape)]).encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def _entry_hash(fields: Mapping[str, Any]) -> str:
    body = {k: v for k, v in fields.items() if k != "hash"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()


def instruction_of(local_steps: int, basis_version: int, model_spec: ModelSpec, global_state: Mapping[str, np.ndarray],
                   ledger_records: Sequence[SpendRecord], site_id: str) -> AuditInstruction:
    from fedpose.federation.witness import own_record

    record = own_record(ledger_records, site_id)
    return AuditInstruction(local_steps=int(local_steps), basis_version=int(basis_version), model=model_spec,
                            global_sha256=arrays_sha256(global_state),
                            ledger_record_rounds=sorted(e.round for e in record.events) if record else [])


def record_reply(state_dir: str | Path, reply: SiteReply, update: Mapping[str, np.ndarray],
                 asked: AuditInstruction | None) -> AuditEntry:
    """Append the entry of ``reply`` (and the ``update`` it carries) to the site's audit log, chained
    to the last entry, fsynced, under the state lock. Raises OSError when it cannot be written: the
    caller then sends no update."""
    privacy = reply.privacy
    spend = next((e for e in reply.spends if e.round == reply.round), None)
    released = dict(update) if reply.carries_update else {}
    return _append(Path(state_dir), lambda entries: dict(
        site_id=reply.site_id, run_id=reply.run_id, round=reply.round, asked=asked, status=reply.status,
        reason=reply.reason, error_class=reply.error_class, local_steps=reply.local_steps,
        guarantee=privacy.guarantee if privacy else None, protection_unit=privacy.protection_unit if privacy else None,
        delta=privacy.delta if privacy else None, accountant=privacy.accountant if privacy else None,
        epsilon=privacy.epsilon if privacy else None, adjacency=privacy.adjacency if privacy else None,
        eps_max=privacy.eps_max if privacy else None,
        rounds_spent=privacy.rounds_spent if privacy else None, spend=spend,
        update_bytes=int(sum(np.asarray(a).nbytes for a in released.values())),
        update_sha256=arrays_sha256(released) if released else None,
    ))


def record_blocked(state_dir: str | Path, site_id: str, run_id: str, round_id: int) -> AuditEntry | None:
    """Append that the egress guard blocked the reply last logged for (site, run, round): the
    coordinator got the guard's error instead, and no update left. The blocked entry keeps its place
    in the chain (it was written before the guard looked); this one corrects it. Its spend, ε and
    instruction are the blocked entry's (the spend stands). None when no reply for that round was
    logged (a reply made outside the round, e.g. for a config that does not load: nothing to correct)."""

    def correction(entries: Sequence[AuditEntry]) -> dict[str, Any] | None:
        blocked = next((e for e in reversed(entries) if (e.site_id, e.run_id, e.round) == (site_id, run_id, round_id)
                        and e.blocked_seq is None), None)
        if blocked is None:
            return None
        kept = blocked.model_dump(include={"site_id", "run_id", "round", "asked", "local_steps", "guarantee",
                                           "protection_unit", "delta", "accountant", "epsilon", "adjacency",
                                           "eps_max", "rounds_spent", "spend", "secagg_stage"})
        return dict(kept, status="error", reason=None, error_class=BLOCKED_ERROR_CLASS, update_bytes=0,
                    update_sha256=None, blocked_seq=blocked.seq)

    return _append(Path(state_dir), correction)


def record_secagg_stage(state_dir: str | Path, request: Any, answer: Any, wire_sha256: str) -> AuditEntry | None:
    """Append a secure-aggregation stage answer (``request`` / ``answer``: the protocol's SecAgg
    messages). Logged only where the site's state exists: a new site's first setup comes before its
    first train message creates it (None then; its public keys are all that left)."""
    from fedpose.federation.site_budget import GENESIS_FILE

    state_dir = Path(state_dir)
    if not (state_dir / GENESIS_FILE).exists():
        return None
    refused = answer.kind == "refusal"
    stage = SecAggStageAnswer(
        request=request.kind, answer=answer.kind, refusal=answer.reason if refused else None,
        seed_share_nodes=sorted(share.node for share in getattr(answer, "seed_shares", [])),
        key_share_nodes=sorted(share.node for share in getattr(answer, "key_shares", [])), answer_sha256=wire_sha256)
    return _append(state_dir, lambda entries: dict(
        site_id=answer.site_id, run_id=answer.run_id, round=answer.round, asked=None, status="refused" if refused else "ok",
        reason="secure-aggregation-refused" if refused else None, local_steps=0, guarantee=None, protection_unit=None,
        delta=None, accountant=None, epsilon=None, eps_max=None, rounds_spent=None, spend=None, update_bytes=0,
        update_sha256=None, secagg_stage=stage))


def _append(state_dir: Path, fields_of: Callable[[Sequence[AuditEntry]], dict[str, Any] | None]) -> AuditEntry | None:
    """Append the entry ``fields_of(the entries so far)`` gives (None: append nothing), chained to the
    last entry, fsynced, under the state lock."""
    from fedpose.federation.site_budget import _state_lock

    with _state_lock(state_dir):
        path = state_dir / AUDIT_FILE
        parsed = [entry for _, entry in _read(path)]
        new_fields = fields_of(parsed)
        if new_fields is None:
            return None
        last = parsed[-1] if parsed else None
        started = log_record(state_dir)
        if last is None and started is not None:
            log.error("site %s: its audit log %s was lost (the state has kept one since %s UTC): a new log begins, its "
                      "first entry marked restarted_after_loss; restore the old log from its outside copy",
                      new_fields["site_id"], path, time.strftime("%Y-%m-%d %H:%M", time.gmtime(started["started_at"])))
            new_fields = {**new_fields, "restarted_after_loss": True}
        fields = AuditEntry(seq=(last.seq + 1) if last else 1, prev=last.hash if last else GENESIS, at=time.time(),
                            **new_fields).model_dump(mode="json", exclude_none=False)
        for added in ("adjacency", "blocked_seq", "restarted_after_loss", "secagg_stage"):
            if fields[added] is None:
                del fields[added]  # entries that need neither are written as before these fields existed
        fields["hash"] = _entry_hash(fields)
        # a torn last line (the site stopped mid-append) is cut off, as _read skips it
        append_lines(path, json.dumps(fields, ensure_ascii=False) + "\n", complete=_is_entry)
        if started is None:
            _record_log_start(state_dir, fields["at"], (fields["run_id"], fields["round"]))
    return AuditEntry.model_validate(fields)


#: key of the site's state marker (``site_state.json``) that says the state keeps an audit log
LOG_RECORD_KEY = "audit_log"


def log_record(state_dir: Path) -> dict[str, Any] | None:
    """What the site's state marker says of its audit log: ``started_at`` (when its first entry was
    written) and ``spent_before`` (the (run, round) spends the budget held then, which no entry can
    name); None: the marker says nothing (no log yet, or a state from before this record)."""
    from fedpose.federation.site_budget import GENESIS_FILE, _read_signed

    marker = state_dir / GENESIS_FILE
    if not marker.exists():
        return None
    record = _read_signed(marker, "site state marker").get(LOG_RECORD_KEY)
    return record if isinstance(record, dict) else None


def _record_log_start(state_dir: Path, started_at: float, first: tuple[str, int]) -> None:
    """Note in the state marker that this state keeps an audit log from now on (under the state lock),
    so a log lost later is told from one never written, with the spends the budget held before the
    log's ``first`` entry (run, round) — the ones no entry can name. A state without a marker (a site
    whose state is not created yet) has nothing to note it in."""
    from fedpose.federation.site_budget import GENESIS_FILE, STATE_FILE, _read_signed, _write_signed

    marker, budget = state_dir / GENESIS_FILE, state_dir / STATE_FILE
    if not marker.exists():
        return
    spent_before = []
    if budget.exists():
        payload = _read_signed(budget, "site budget state")
        spent_before = sorted([str(e["run_id"]), int(e["round"])] for e in payload.get("entries", [])
                              if e.get("status") == "spent" and (str(e["run_id"]), int(e["round"])) != first)
    genesis = _read_signed(marker, "site state marker")
    _write_signed(marker, {**genesis, LOG_RECORD_KEY: {"started_at": started_at, "spent_before": spent_before}})


def _is_entry(line: bytes) -> bool:
    try:
        AuditEntry.model_validate(json.loads(line))
        return True
    except ValueError:
        return False


class AuditLogError(ValueError):
    """The audit log, or its agreement with the budget, is broken: the message names the first bad entry."""


def _read(path: Path) -> list[tuple[dict[str, Any], AuditEntry]]:
    """Each entry as written and as parsed — unchecked. A last line without its newline that does not
    parse is a cut-short append, not an entry (the next append cuts it off)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    entries: list[tuple[dict[str, Any], AuditEntry]] = []
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, 1):
        if raw.strip():
            try:
                doc = json.loads(raw)
                entries.append((doc, AuditEntry.model_validate(doc)))
            except ValueError as exc:
                if number == len(lines):
                    return entries
                raise AuditLogError(f"{path}, entry {len(entries) + 1}: malformed ({type(exc).__name__})") from None
    return entries


@dataclass(frozen=True)
class Verification:
    """What :func:`verify` checked."""

    entries: int
    spends_checked: int
    unlogged_spends: tuple[tuple[str, int], ...]  #: budget spends with no logged reply (see :func:`verify`)
    restarted_after_loss: bool = False  #: the log was lost once and begun again (its first entry says so)


def read_log(state_dir: str | Path) -> list[AuditEntry]:
    """The site's audit log as written (not verified; :func:`verify` checks it). Empty when there is none."""
    return [entry for _, entry in _read(Path(state_dir) / AUDIT_FILE)]


def verify(state_dir: str | Path) -> Verification:
    """Check the chain and the log's agreement with the budget and the spend journal; raise
    :class:`AuditLogError` naming the first bad entry.

    The chain: every line parses, ``seq`` counts 1, 2, …, ``prev`` is the hash of the entry before
    and ``hash`` is the entry's own. Agreement: every spend the log records is in the budget as spent
    with the same (σ, q, steps), and in the journal. A budget spend with no logged reply is listed,
    not refused: a site killed between its spend and its reply leaves exactly that (and so does a
    log whose tail was cut — which only an outside copy or the ledger can tell apart)."""
    from fedpose.federation.site_budget import (
        JOURNAL_FILE, STATE_FILE, BudgetStateError, _parse_state, _read_signed, check_journal, read_journal)

    state_dir = Path(state_dir)
    path = state_dir / AUDIT_FILE
    started = log_record(state_dir)
    if not path.exists():
        if started is not None:
            raise AuditLogError(f"no audit log at {path}, but the site's state has kept one since "
                                f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(started['started_at']))} UTC: it was lost or "
                                "removed — restore it from its outside copy")
        raise AuditLogError(f"no audit log at {path}")
    previous: AuditEntry | None = None
    entries: list[AuditEntry] = []
    for number, (doc, entry) in enumerate(_read(path), 1):
        where = f"{path}, entry {number}"
        if _entry_hash(doc) != entry.hash:
            raise AuditLogError(f"{where} (run '{entry.run_id}' round {entry.round}): its content does not match its hash "
                                "— the entry was edited after it was written")
        expected_prev, expected_seq = (previous.hash, previous.seq + 1) if previous else (GENESIS, 1)
        if entry.prev != expected_prev or entry.seq != expected_seq:
            raise AuditLogError(f"{where} (run '{entry.run_id}' round {entry.round}, seq {entry.seq}): does not follow the "
                                f"entry before it (expected seq {expected_seq} chained to {expected_prev[:12]}…) — an entry "
                                "before it was deleted, or entries were reordered or inserted")
        entries.append(entry)
        previous = entry
    budget_path = state_dir / STATE_FILE
    logged_spends = [(n, e) for n, e in enumerate(entries, 1) if e.spend is not None]
    if not budget_path.exists():
        if logged_spends:
            n, e = logged_spends[0]
            raise AuditLogError(f"{path}, entry {n} (run '{e.run_id}' round {e.round}): a logged spend, but there is no "
                                f"budget {budget_path}")
        return Verification(len(entries), 0, (), bool(entries and entries[0].restarted_after_loss))
    try:
        state = _parse_state(_read_signed(budget_path, "site budget state"), budget_path)
        check_journal(state_dir, state)
        journal = {s.key: s for s in read_journal(state_dir)}
    except BudgetStateError as exc:
        raise AuditLogError(str(exc)) from None
    spent = {e.key: e for e in state.entries if e.status == "spent"}
    for n, e in logged_spends:
        held = spent.get((e.run_id, e.round))
        where = f"{path}, entry {n} (run '{e.run_id}' round {e.round})"
        event = (e.spend.noise_multiplier, e.spend.sample_rate, e.spend.steps)  # type: ignore[union-attr]
        if held is None:
            raise AuditLogError(f"{where}: the site replied with this spend, but {budget_path} does not hold it — the budget "
                                "was rolled back or edited")
        if not held.same_request(*event):
            raise AuditLogError(f"{where}: logged with σ={event[0]}, q={event[1]}, steps={event[2]}, but {budget_path} "
                                f"holds σ={held.noise_multiplier}, q={held.sample_rate}, steps={held.steps}")
        if state.journaled and (e.run_id, e.round) not in journal:
            raise AuditLogError(f"{where}: the site replied with this spend, but {state_dir / JOURNAL_FILE} does not hold it")
    logged = {(e.run_id, e.round) for _, e in logged_spends}
    if started is not None:
        # every spend since the log began, by the budget's record of what it held then (not by clock time)
        before = {(str(run), int(r)) for run, r in started.get("spent_before", [])}
        unlogged = tuple(sorted(key for key, held in spent.items() if key not in logged and key not in before
                                and not held.reason.startswith("adopted")))
    else:  # a state from before that record: the spends since the log's first entry, by time
        since = entries[0].at if entries else float("inf")
        unlogged = tuple(sorted(key for key, held in spent.items() if key not in logged and held.recorded_at >= since
                                and not held.reason.startswith("adopted")))
    return Verification(len(entries), len(logged_spends), unlogged, bool(entries and entries[0].restarted_after_loss))
