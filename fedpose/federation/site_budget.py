"""The site's own privacy budget: persisted, crash-safe, and the authority on whether a round runs.

A site composes RDP over every local step of every round it joins (DESIGN.md, "Federation").
Before it trains, :meth:`SiteBudget.authorize_round` computes the ε the planned steps would reach;
past ``eps_max`` it refuses (:class:`BudgetExhausted`) and spends nothing. Otherwise it records the
spend **durably before training starts** — a crash during training then counts the round as spent
(conservative), never as free. Whatever the coordinator asks, a restart reloads the spent budget
from disk; a missing-but-expected or corrupt state file is an error, never a silent reset to zero.

State file ``<state_dir>/budget.json`` (written with :func:`fedpose.io.atomic_write`, so a reader
sees the old or the new file, never half of one)::

    {"payload": {"format": ..., "site_id": ..., "guarantee": ..., "delta": ...,
                 "accountant": RDPAccountant.to_dict(), "entries": [RoundEntry, ...]},
     "sha256": <digest of the canonical JSON of payload>}

Rounds are keyed by ``(run_id, round)``: authorizing the same key again (a replayed or duplicated
Flower message) spends nothing and returns the original entry with ``replayed=True``. The caller
must then not release a *freshly noised* update for that round (that would be a second release):
send the cached update or nothing.

Budgets are keyed by the site's stable id (config), never by Flower's node id, which changes when
an unauthenticated SuperNode restarts.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fedpose.io import atomic_write_text
from fedpose.privacy.accountant import RDPAccountant
from fedpose.privacy.report import relation_of

STATE_FILE = "budget.json"
LOCK_FILE = "budget.lock"
STATE_FORMAT = "fedpose.site-budget/1"

EntryStatus = Literal["spent", "refused"]


class BudgetError(Exception):
    """Base class of site-budget errors."""


class BudgetExhausted(BudgetError):
    """The planned round would take the site past ``eps_max``: refused, nothing spent."""

    def __init__(self, site_id: str, run_id: str, round_id: int, spent: float, planned: float, eps_max: float, delta: float, guarantee: str):
        self.site_id, self.run_id, self.round_id = site_id, run_id, round_id
        self.spent, self.planned, self.eps_max = spent, planned, eps_max
        self.delta, self.guarantee = delta, guarantee
        super().__init__(self.reason)

    @property
    def reason(self) -> str:
        return (
            f"site '{self.site_id}' refuses round {self.round_id} of run '{self.run_id}': its planned steps would "
            f"reach ε = {self.planned:.4g} > ε_max = {self.eps_max:.4g} ({self.guarantee}, δ = {self.delta:.3g}, RDP); "
            f"spent so far ε = {self.spent:.4g}"
        )


class BudgetStateError(BudgetError):
    """The persisted budget state is unreadable, corrupt, or belongs to another site/guarantee."""


class RoundConflict(BudgetError):
    """The same (run id, round) was authorized before with different parameters."""


@dataclass(frozen=True)
class RoundEntry:
    """One round the site was asked to train, as persisted in its budget state."""

    run_id: str
    round: int
    status: EntryStatus
    steps: int
    noise_multiplier: float
    sample_rate: float
    epsilon_after: float  #: ε spent after this round ("refused": unchanged spend)
    delta: float
    recorded_at: float  #: unix time
    reason: str = ""

    @property
    def key(self) -> tuple[str, int]:
        return (self.run_id, self.round)

    def same_request(self, noise_multiplier: float, sample_rate: float, steps: int) -> bool:
        return (self.noise_multiplier, self.sample_rate, self.steps) == (float(noise_multiplier), float(sample_rate), int(steps))


@dataclass(frozen=True)
class RoundAuthorization:
    """Permission to train one round. ``replayed``: this round was already spent earlier."""

    entry: RoundEntry
    replayed: bool


@dataclass
class _State:
    site_id: str
    guarantee: str
    delta: float
    accountant: RDPAccountant | None = None  #: None → a fresh ledger with the guarantee's relation
    entries: list[RoundEntry] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.accountant is None:
            self.accountant = RDPAccountant(relation=relation_of(self.guarantee))

    def to_payload(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "site_id": self.site_id,
            "guarantee": self.guarantee,
            "delta": self.delta,
            "accountant": self.accountant.to_dict(),
            "entries": [asdict(e) for e in self.entries],
        }

    def copy(self) -> "_State":
        return _State(self.site_id, self.guarantee, self.delta, RDPAccountant.from_dict(self.accountant.to_dict()), list(self.entries))


def _digest(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class SiteBudget:
    """A site's persisted RDP budget for one guarantee (e.g. "DP", "FDP", "MaskDP").

    >>> budget = SiteBudget("state/site-a", "site-a", eps_max=3.0, delta=1e-5, guarantee="DP")
    >>> auth = budget.authorize_round("run1", 1, noise_multiplier=1.0, sample_rate=0.01, steps=100)
    >>> # ... train, release the update; raises BudgetExhausted instead when ε_max would be passed.
    """

    def __init__(self, state_dir: str | Path, site_id: str, eps_max: float, delta: float, guarantee: str = "DP"):
        if not (eps_max > 0 and math.isfinite(eps_max)):
            raise ValueError(f"eps_max must be a finite number > 0, got {eps_max!r}")
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        self.state_dir = Path(state_dir)
        self.site_id = site_id
        self.eps_max = float(eps_max)
        self.delta = float(delta)
        self.guarantee = guarantee
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._state = self._load()

    # -- queries ---------------------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self.state_dir / STATE_FILE

    @property
    def epsilon(self) -> float:
        """ε spent so far (this budget's guarantee, at ``delta``, RDP)."""
        return self._state.accountant.get_epsilon(self.delta)[0]

    @property
    def entries(self) -> list[RoundEntry]:
        return list(self._state.entries)

    @property
    def steps(self) -> int:
        return self._state.accountant.steps

    def accountant(self) -> RDPAccountant:
        """A copy of the persisted accountant (mutating it changes nothing on disk)."""
        return RDPAccountant.from_dict(self._state.accountant.to_dict())

    def planned_epsilon(self, noise_multiplier: float, sample_rate: float, steps: int) -> float:
        """ε the site would have spent after ``steps`` more steps at (σ, q)."""
        return self._state.accountant.epsilon_if(noise_multiplier, sample_rate, steps, self.delta)

    def entry(self, run_id: str, round_id: int) -> RoundEntry | None:
        for e in self._state.entries:
            if e.key == (run_id, int(round_id)):
                return e
        return None

    def report(self) -> dict[str, Any]:
        """What the site tells the coordinator (cumulative): ε, δ, guarantee, steps, RDP per order."""
        acc = self._state.accountant
        return {
            "site_id": self.site_id,
            "guarantee": self.guarantee,
            "accountant": "rdp",
            "epsilon": self.epsilon,
            "delta": self.delta,
            "eps_max": self.eps_max,
            "steps": acc.steps,
            "rounds_spent": sum(e.status == "spent" for e in self._state.entries),
            "orders": list(acc.orders),
            "rdp": [float(x) for x in acc.rdp()],
        }

    # -- the guard -------------------------------------------------------------------------------
    def authorize_round(
        self, run_id: str, round_id: int, noise_multiplier: float, sample_rate: float, steps: int
    ) -> RoundAuthorization:
        """Spend the budget for one round, durably, or refuse it.

        Raises :class:`BudgetExhausted` (nothing spent; the refusal is recorded for audit) when the
        planned steps would pass ``eps_max``; :class:`RoundConflict` when this (run, round) was
        already spent with other parameters. A replay of a spent round spends nothing.
        The spend is on disk before this returns: train only after it returns.
        """
        round_id = int(round_id)
        with self._locked():
            self._state = self._load()  # another process (a new ClientApp per message) may have spent
            previous = self.entry(run_id, round_id)
            if previous is not None and previous.status == "spent":
                if not previous.same_request(noise_multiplier, sample_rate, steps):
                    raise RoundConflict(
                        f"site '{self.site_id}': round {round_id} of run '{run_id}' was already spent with "
                        f"σ={previous.noise_multiplier}, q={previous.sample_rate}, steps={previous.steps}; "
                        f"now asked for σ={noise_multiplier}, q={sample_rate}, steps={steps}"
                    )
                return RoundAuthorization(previous, replayed=True)

            spent = self.epsilon
            planned = self.planned_epsilon(noise_multiplier, sample_rate, steps)
            new_state = self._state.copy()
            new_state.entries = [e for e in new_state.entries if e.key != (run_id, round_id)]  # drop an old refusal
            if not planned <= self.eps_max:  # also refuses NaN / ∞ (e.g. σ = 0)
                refusal = BudgetExhausted(self.site_id, run_id, round_id, spent, planned, self.eps_max, self.delta, self.guarantee)
                new_state.entries.append(
                    RoundEntry(run_id, round_id, "refused", int(steps), float(noise_multiplier), float(sample_rate),
                               spent, self.delta, time.time(), refusal.reason)
                )
                self._persist(new_state)
                raise refusal

            new_state.accountant.step(noise_multiplier, sample_rate, steps)
            entry = RoundEntry(run_id, round_id, "spent", int(steps), float(noise_multiplier), float(sample_rate),
                               planned, self.delta, time.time())
            new_state.entries.append(entry)
            self._persist(new_state)
            return RoundAuthorization(entry, replayed=False)

    # -- persistence -----------------------------------------------------------------------------
    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.state_dir / LOCK_FILE, "a+b") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _persist(self, state: _State) -> None:
        payload = state.to_payload()
        atomic_write_text(self.path, json.dumps({"payload": payload, "sha256": _digest(payload)}, indent=1))
        self._state = state  # only after the write succeeded: a failed write leaves memory == disk

    def _load(self) -> _State:
        if not self.path.exists():
            return _State(self.site_id, self.guarantee, self.delta)
        where = f"site budget state {self.path}"
        try:
            doc = json.loads(self.path.read_text())
            payload, digest = doc["payload"], doc["sha256"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise BudgetStateError(
                f"{where} is unreadable or corrupt ({exc}); refusing to continue rather than resetting the "
                "budget to zero. Restore it from a backup, or investigate before deleting it."
            ) from None
        if _digest(payload) != digest:
            raise BudgetStateError(f"{where} is corrupt (checksum mismatch); refusing to reset the budget to zero")
        if payload.get("format") != STATE_FORMAT:
            raise BudgetStateError(f"{where}: unknown format {payload.get('format')!r} (expected {STATE_FORMAT})")
        if payload["site_id"] != self.site_id:
            raise BudgetStateError(f"{where} belongs to site '{payload['site_id']}', not '{self.site_id}'")
        if payload["guarantee"] != self.guarantee:
            raise BudgetStateError(
                f"{where} accounts a '{payload['guarantee']}' guarantee; this site now trains under '{self.guarantee}' "
                "— budgets of different guarantees do not compose; use a new state_dir"
            )
        if payload["delta"] != self.delta:
            raise BudgetStateError(f"{where} was kept at δ = {payload['delta']}, config says δ = {self.delta}")
        try:
            accountant = RDPAccountant.from_dict(payload["accountant"])
            entries = [RoundEntry(**e) for e in payload["entries"]]
        except (ValueError, TypeError, KeyError) as exc:
            raise BudgetStateError(f"{where}: malformed content ({exc})") from None
        if accountant.relation != relation_of(self.guarantee):
            raise BudgetStateError(
                f"{where}: accounted under the '{accountant.relation}' relation, but {self.guarantee} needs "
                f"'{relation_of(self.guarantee)}'"
            )
        # The accountant must be exactly the composition of the spent rounds.
        replay = RDPAccountant(orders=accountant.orders, relation=accountant.relation)
        for e in entries:
            if e.status == "spent":
                replay.step(e.noise_multiplier, e.sample_rate, e.steps)
        if replay.steps != accountant.steps or not np.allclose(replay.rdp(), accountant.rdp(), rtol=1e-12, atol=0):
            raise BudgetStateError(f"{where}: accountant history does not match the recorded rounds")
        return _State(self.site_id, self.guarantee, self.delta, accountant, entries)
