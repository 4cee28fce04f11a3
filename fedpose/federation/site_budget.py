"""The site's own privacy budget: persisted, crash-safe, and the authority on whether a round runs.

A site composes every local step of every round it joins (DESIGN.md, "Federation"): it persists the
accountant's input — the (σ, q, steps) events under its guarantee's neighbouring relation — and the
name of the accountant (``rdp``, ``pld``, ``prv``; :mod:`fedpose.privacy.accountants`) whose ε it
enforces. A new budget takes ``privacy.accountant`` or, by default, the tightest accountant exact
for the relation (``pld``). An existing budget keeps the accountant it was written with — one
written before accountants were selectable says ``rdp`` — and a config asking for another is refused:
switching is a deliberate act (:func:`recompute_budget`, ``fedpose privacy budget --apply``) that
is recorded in the state (``recomputations``: from, to, ε before and after, when), and every round
entry names the accountant of its ``epsilon_after``. So a lower ε from a tighter accountant is never
silent.
Before it trains, :meth:`SiteBudget.authorize_round` computes the ε the planned steps would reach;
past ``eps_max`` it refuses (:class:`BudgetExhausted`) and spends nothing. Otherwise it records the
spend **durably before training starts** — a crash during training then counts the round as spent
(conservative), never as free. Whatever the coordinator asks, a restart reloads the spent budget
from disk; a missing-but-expected or corrupt state file is an error, never a silent reset to zero.

State file ``<state_dir>/budget.json`` (written with :func:`fedpose.io.atomic_write`, so a reader
sees the old or the new file, never half of one)::

    {"payload": {"format": ..., "site_id": ..., "guarantee": ..., "unit": ..., "delta": ...,
                 "accountant": PrivacyLedger.to_dict(), "entries": [RoundEntry, ...],
                 "recomputations": [...] (only after a deliberate accountant switch)},
     "sha256": <digest of the canonical JSON of payload>}

Rounds are keyed by ``(run_id, round)``: authorizing the same key again (a replayed or duplicated
Flower message) spends nothing and returns the original entry with ``replayed=True``. The caller
must then not release a *freshly noised* update for that round (that would be a second release):
send the cached update or nothing.

Budgets are keyed by the site's stable id (config), never by Flower's node id, which changes when
an unauthenticated SuperNode restarts.

A site's state is created once: :func:`ensure_site_state` writes the genesis marker
``<state_dir>/site_state.json`` (site id, guarantee, δ, creation time) beside an empty budget. From
then on a missing or unreadable budget file is an error that names it — the site never restarts
from zero — as is a missing marker beside a budget that has recorded rounds (the budget carries the
marker's creation time; a budget from before markers, or an empty one whose marker write was cut
short, is adopted: nothing is lost). Creation holds the state lock, so two processes starting one new
site never write an empty budget over the other's spend. The guarantee is fixed for the life of
the state: earlier releases still apply to the same patients, so a site cannot switch to a
guarantee its past releases void (after noise-free FDP public-view releases, or non-private
training, a record-level DP claim about the same records says nothing). Mechanisms that share a
guarantee (dpsgd/pdp, fdp/fpdp) share one budget.

Every spend is also appended to the site's own journal ``<state_dir>/spends.jsonl`` (one JSON line
per spent (run, round): σ, q, steps; fsynced) **before** the budget is written. The budget may
never be below its journal: a budget whose spent rounds miss a journaled one (an older copy put
back, an entry removed and the checksum recomputed) is refused, naming the rounds; a budget that
says it is journaled while the journal is gone is refused too. Old budgets (before the journal) load
as they are; their next spend starts the journal. The coordinator's ledger is a second witness
(:mod:`fedpose.federation.witness`). Neither protects against an operator who can write the whole
state dir consistently — only a backup or an append-only store does (docs/site-state.md).

A directory counts as a site's state as soon as it holds any file other than the lock and the
site's log (see :data:`NOT_STATE`): a state dir that lost its budget and marker but kept anything
else (a cache, a journal, a file fedpose does not know) is refused, never restarted from zero.

The protection unit (record / image / patient, :mod:`fedpose.data.units`) is part of the
guarantee's identity: ε per record and ε per patient are different statements, and a ledger
accounted per record cannot be continued per patient. A state created before units existed has
no ``unit`` field and was accounted per record. The unit is fixed with the state, like the
guarantee; a site whose config says ``privacy.unit = "auto"`` keeps the unit its state records.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fedpose.io import append_lines, atomic_write_text
from fedpose.privacy.accountant import PrivacyLedger, default_accountant
from fedpose.privacy.accountants import bounds, get_accountant
from fedpose.privacy.report import format_epsilon, relation_of

STATE_FILE = "budget.json"
LOCK_FILE = "budget.lock"
STATE_FORMAT = "fedpose.site-budget/1"
#: which rules a new state pins by (site_pins.py): 1 (``true`` in states written then) pinned settings
#: under FDP and MaskDP only, 2 also the input size under every guarantee (since 2026-12-06)
PINS_VERSION = 2
GENESIS_FILE = "site_state.json"
GENESIS_FORMAT = "fedpose.site-state/1"
JOURNAL_FILE = "spends.jsonl"
SITE_LOG_FILE = "site.log"  #: the ClientApp's local log (sites/client_app.py opens it before the state exists)
#: the only names a new site's state_dir may hold before its genesis marker: the lock taken to create
#: the state and the log opened for the message that creates it. Everything else — whatever it is —
#: means the directory already held a site's state (so no list of state files can go stale).
NOT_STATE = frozenset({LOCK_FILE, SITE_LOG_FILE})

EntryStatus = Literal["spent", "refused"]


class BudgetError(Exception):
    """Base class of site-budget errors."""


class BudgetExhausted(BudgetError):
    """The planned round would take the site past ``eps_max``: refused, nothing spent."""

    def __init__(self, site_id: str, run_id: str, round_id: int, spent: float, planned: float, eps_max: float, delta: float,
                 guarantee: str, accountant: str = "rdp", unit: str | None = None, relation: str | None = None):
        self.site_id, self.run_id, self.round_id = site_id, run_id, round_id
        self.spent, self.planned, self.eps_max = spent, planned, eps_max
        self.delta, self.guarantee, self.accountant = delta, guarantee, accountant
        self.unit, self.relation = unit, relation
        super().__init__(self.reason)

    @property
    def reason(self) -> str:
        from fedpose.privacy.report import format_epsilon

        return (
            f"site '{self.site_id}' refuses round {self.round_id} of run '{self.run_id}': its planned steps would "
            f"reach {format_epsilon(self.planned, self.delta, self.guarantee, self.accountant, self.unit, self.relation)} "
            f"> ε_max = {self.eps_max:.4g}; spent so far "
            f"{format_epsilon(self.spent, self.delta, self.guarantee, self.accountant, self.unit, self.relation)}"
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
    accountant: str = "rdp"  #: the accountant that computed epsilon_after (entries from before the field: RDP)

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


#: the unit of a state written before protection units existed (those sites clipped per record)
LEGACY_UNIT = "record"


@dataclass
class _State:
    site_id: str
    guarantee: str
    delta: float
    accountant: PrivacyLedger | None = None  #: None → a fresh ledger: the guarantee's relation, its default accountant
    entries: list[RoundEntry] = field(default_factory=list)
    #: creation time of the site's genesis marker; None only in budgets written before markers existed
    genesis_created_at: float | None = None
    #: deliberate accountant switches: {"from", "to", "epsilon_before", "epsilon_after", "steps", "at"}
    recomputations: list[dict[str, Any]] = field(default_factory=list)
    unit: str = LEGACY_UNIT  #: protection unit the ledger is accounted in
    #: spends are journaled in JOURNAL_FILE (False only for budgets from before the journal, until their next spend)
    journaled: bool = False
    #: deliberate adoptions of spends the budget lacked: {"source", "rounds", "epsilon_before", "epsilon_after", "at"}
    adoptions: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.accountant is None:
            relation = relation_of(self.guarantee)
            self.accountant = PrivacyLedger(relation=relation, accountant=default_accountant(relation))

    def to_payload(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "site_id": self.site_id,
            "guarantee": self.guarantee,
            "unit": self.unit,
            "delta": self.delta,
            "accountant": self.accountant.to_dict(),
            "entries": [asdict(e) for e in self.entries],
            # tells a lost marker apart from a budget that predates markers (only that one is adopted)
            **({"genesis_created_at": self.genesis_created_at} if self.genesis_created_at is not None else {}),
            **({"recomputations": list(self.recomputations)} if self.recomputations else {}),
            **({"journal": JOURNAL_FILE} if self.journaled else {}),
            **({"adoptions": list(self.adoptions)} if self.adoptions else {}),
        }

    def copy(self) -> "_State":
        return _State(self.site_id, self.guarantee, self.delta, PrivacyLedger.from_dict(self.accountant.to_dict()),
                      list(self.entries), self.genesis_created_at, list(self.recomputations), self.unit, self.journaled,
                      list(self.adoptions))


def _digest(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _write_signed(path: Path, payload: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps({"payload": payload, "sha256": _digest(payload)}, indent=1))


def _read_signed(path: Path, what: str) -> dict[str, Any]:
    """The checksummed payload of ``path``; :class:`BudgetStateError` naming the file otherwise."""
    try:
        doc = json.loads(path.read_text())
        payload, digest = doc["payload"], doc["sha256"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise BudgetStateError(
            f"{what} {path} is unreadable or corrupt ({exc}); refusing to continue rather than resetting the "
            "budget to zero. Restore it from a backup, or investigate before deleting it."
        ) from None
    if not isinstance(payload, dict) or _digest(payload) != digest:
        raise BudgetStateError(f"{what} {path} is corrupt (checksum mismatch); refusing to reset the budget to zero")
    return payload


def stored_unit(state_dir: str | Path) -> str | None:
    """The protection unit a site's existing state was created for ("record" for states from before
    units); None when the site has no state yet. Lets ``privacy.unit = "auto"`` keep the pinned unit."""
    marker = Path(state_dir) / GENESIS_FILE
    budget = Path(state_dir) / STATE_FILE
    for path, what in ((marker, "site state marker"), (budget, "site budget state")):
        if path.exists():
            return str(_read_signed(path, what).get("unit", LEGACY_UNIT))
    return None


def ensure_site_state(state_dir: str | Path, site_id: str, guarantee: str, delta: float | None,
                      accountant: str | None = None, unit: str = LEGACY_UNIT) -> bool:
    """Create a site's state once, or check it; returns True when it was created just now.

    Refuses (:class:`BudgetStateError`, naming the file) when the budget of an existing state is
    missing, when state files exist without a genesis marker, when the marker belongs to another
    site, or when the site now trains under another guarantee or protection unit than the one its
    state was created for. Nothing on disk changes when it refuses.
    """
    state_dir = Path(state_dir)
    marker, budget = state_dir / GENESIS_FILE, state_dir / STATE_FILE
    private = guarantee != "none"
    if marker.exists():
        genesis = _read_signed(marker, "site state marker")
        if genesis.get("format") != GENESIS_FORMAT:
            raise BudgetStateError(f"site state marker {marker}: unknown format {genesis.get('format')!r} (expected {GENESIS_FORMAT})")
        if genesis["site_id"] != site_id:
            raise BudgetStateError(f"site state {state_dir} belongs to site '{genesis['site_id']}', not '{site_id}'")
        if genesis["guarantee"] != guarantee:
            raise BudgetStateError(_guarantee_change_message(state_dir, site_id, genesis, guarantee))
        if private and genesis.get("unit", LEGACY_UNIT) != unit:
            raise BudgetStateError(_unit_change_message(marker, site_id, genesis.get("unit", LEGACY_UNIT), unit))
        if private and not budget.exists():
            raise BudgetStateError(
                f"site '{site_id}': budget file {budget} is missing, but this site's state was created on "
                f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(genesis['created_at']))} UTC ({marker}): refusing to "
                "restart its privacy budget from zero. Restore budget.json from a backup; the ε already spent still applies."
            )
        return False
    if budget.exists():
        payload = _read_signed(budget, "site budget state")
        created_at = payload.get("genesis_created_at")
        if created_at is not None and payload.get("entries"):  # created with a marker that was lost since
            raise BudgetStateError(
                f"site '{site_id}': site state marker {marker} is missing, but {budget} was created with it on "
                f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(created_at))} UTC and has recorded rounds since: "
                f"refusing to continue with state that was partly lost. Restore {GENESIS_FILE} from a backup of {state_dir}."
            )
        # A budget from before genesis markers, or one whose creation stopped before its marker was written
        # (nothing recorded yet): adopt it if the budget file itself is sound (nothing is lost).
        genesis = {"format": GENESIS_FORMAT, "site_id": payload.get("site_id"), "guarantee": payload.get("guarantee"),
                   "unit": payload.get("unit", LEGACY_UNIT),
                   "delta": payload.get("delta"), "created_at": created_at if created_at is not None else time.time(),
                   "adopted_from": STATE_FILE,
                   # a budget that recorded no round yet trains its first under this code, which pins its
                   # settings from then on: a pins file missing later was lost (a creation stopped before
                   # its marker must not leave the site without that guard)
                   **({"pins": PINS_VERSION} if not payload.get("entries") else {})}
        if genesis["site_id"] != site_id:
            raise BudgetStateError(f"site budget state {budget} belongs to site '{genesis['site_id']}', not '{site_id}'")
        if genesis["guarantee"] != guarantee:
            raise BudgetStateError(_guarantee_change_message(state_dir, site_id, genesis, guarantee))
        if private and genesis["unit"] != unit:
            raise BudgetStateError(_unit_change_message(budget, site_id, genesis["unit"], unit))
        with _state_lock(state_dir):
            if not marker.exists():  # another process may have adopted it meanwhile
                _write_signed(marker, genesis)
        return False
    leftovers = _leftover_state(state_dir)
    if leftovers:
        raise BudgetStateError(
            f"site '{site_id}': {state_dir} holds site state ({', '.join(leftovers)}) but neither {GENESIS_FILE} "
            f"nor {STATE_FILE}: its budget was lost. Refusing to restart from zero; restore both files from a backup."
        )
    state_dir.mkdir(parents=True, exist_ok=True)
    with _state_lock(state_dir):
        # Another process (the metrics exporter, a second ClientApp) may have created the state since the
        # checks above; writing a fresh empty budget over a spend it already recorded would reset ε.
        if marker.exists() or budget.exists() or _leftover_state(state_dir):
            return ensure_site_state(state_dir, site_id, guarantee, delta, accountant, unit)
        created_at = time.time()
        if private:  # the empty budget first: a crash before the marker leaves an empty budget, adopted above
            relation = relation_of(guarantee)
            ledger = PrivacyLedger(relation=relation, accountant=accountant or default_accountant(relation))
            fresh = _State(site_id, guarantee, float(delta) if delta is not None else 0.0, ledger, genesis_created_at=created_at,
                           unit=unit)
            _write_signed(budget, fresh.to_payload())
        # "pins": this state keeps its pinned settings (site_pins.py) from its first round on, so a pins
        # file missing after spends was lost, not never written
        _write_signed(marker, {"format": GENESIS_FORMAT, "site_id": site_id, "guarantee": guarantee, "delta": delta,
                               "created_at": created_at, "pins": PINS_VERSION, **({"unit": unit} if private else {})})
    return True


def _leftover_state(state_dir: Path) -> list[str]:
    """Names in ``state_dir`` that are site state (anything but :data:`NOT_STATE`), sorted."""
    if not state_dir.is_dir():
        return []
    return sorted(path.name for path in state_dir.iterdir() if path.name not in NOT_STATE)


@contextmanager
def _state_lock(state_dir: Path) -> Iterator[None]:
    """Exclusive lock on a site's state (creation and every budget write take it)."""
    with open(state_dir / LOCK_FILE, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _unit_change_message(path: Path, site_id: str, before: str, unit: str) -> str:
    return (
        f"site '{site_id}': its privacy budget ({path}) is accounted per {before}, and it now asks to train per {unit}. "
        f"The protection unit is part of the guarantee: ε per {before} already spent cannot be continued as ε per "
        f"{unit}. Set privacy.unit = \"{before}\" for this site (or \"auto\", which keeps the recorded unit), or "
        "start a new site state for the new guarantee."
    )


def _guarantee_change_message(state_dir: Path, site_id: str, genesis: dict[str, Any], guarantee: str) -> str:
    from fedpose.privacy.mechanisms import MECHANISMS

    before = genesis["guarantee"]
    same = sorted(name for name, m in MECHANISMS.items() if m.guarantee.name == before)
    spent = ""
    budget = state_dir / STATE_FILE
    if before != "none" and budget.exists():
        payload = _read_signed(budget, "site budget state")
        accountant = PrivacyLedger.from_dict(payload["accountant"])
        epsilon = accountant.get_epsilon(payload["delta"])[0]
        unit = str(payload.get("unit", LEGACY_UNIT))
        spent = f" It has spent {format_epsilon(epsilon, payload['delta'], before, accountant.accountant, unit, accountant.relation)}."
    released = "non-private updates" if before == "none" else f"releases under the {before} guarantee"
    return (
        f"site '{site_id}' was set up for the {before} guarantee ({state_dir / GENESIS_FILE}) and now asks for {guarantee}.{spent} "
        f"Its earlier {released} concern the same patients and still apply; a {guarantee} claim cannot be composed with them "
        f"(after noise-free public-view releases or non-private training, a record-level claim about the same records says "
        f"nothing). Keep a mechanism with the {before} guarantee ({', '.join(same)}), or retire this site's data."
    )


class SiteBudget:
    """A site's persisted privacy budget for one guarantee (e.g. "DP", "FDP", "MaskDP").

    ``accountant``: None keeps the budget's own accountant (a new budget gets the relation's
    default, ``pld``); a name that differs from an existing budget's is refused
    (:class:`BudgetStateError`): switch deliberately with :func:`recompute_budget`.

    >>> budget = SiteBudget("state/site-a", "site-a", eps_max=3.0, delta=1e-5, guarantee="DP")
    >>> auth = budget.authorize_round("run1", 1, noise_multiplier=1.0, sample_rate=0.01, steps=100)
    >>> # ... train, release the update; raises BudgetExhausted instead when ε_max would be passed.
    """

    def __init__(self, state_dir: str | Path, site_id: str, eps_max: float, delta: float, guarantee: str = "DP",
                 accountant: str | None = None, unit: str | None = None):
        """``accountant``: None keeps the state's own (a different one is refused: switches are deliberate).
        ``unit``: the protection unit the caller trains at (a change from the state's is refused);
        None keeps the state's own unit (readers such as the metrics exporter), "record" for a new state."""
        if not (eps_max > 0 and math.isfinite(eps_max)):
            raise ValueError(f"eps_max must be a finite number > 0, got {eps_max!r}")
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        self.state_dir = Path(state_dir)
        self.site_id = site_id
        self.eps_max = float(eps_max)
        self.delta = float(delta)
        self.guarantee = guarantee
        if accountant is not None:
            get_accountant(accountant)  # an unknown name fails here, naming the registry
        if unit is None:
            unit = stored_unit(self.state_dir) or LEGACY_UNIT
        self.unit = unit  #: protection unit (record / image / patient): part of the guarantee's identity
        ensure_site_state(self.state_dir, site_id, guarantee, self.delta, accountant, unit)
        self._state = self._load()
        kept = self._state.accountant.accountant
        if accountant is not None and accountant != kept:
            ledger = self._state.accountant
            raise BudgetStateError(
                f"site '{site_id}': budget {self.path} is accounted with {kept.upper()} ({self._epsilon_text(ledger, kept)}); "
                f"the config asks for {accountant.upper()} ({self._epsilon_text(ledger, accountant)} for the same events). A budget's "
                f"accountant changes only deliberately: `fedpose privacy budget {self.state_dir} --accountant {accountant} "
                f"--apply` records the switch; or remove privacy.accountant from the config to keep {kept.upper()}."
            )

    # -- queries ---------------------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self.state_dir / STATE_FILE

    def _epsilon_text(self, ledger: PrivacyLedger, accountant: str) -> str:
        """The ε of ``ledger``'s events under ``accountant``, with every qualifier (format_epsilon)."""
        epsilon = ledger.with_accountant(accountant).get_epsilon(self.delta)[0]
        return format_epsilon(epsilon, self.delta, self.guarantee, accountant, self._state.unit, ledger.relation)

    @property
    def epsilon(self) -> float:
        """ε spent so far (this budget's guarantee, at ``delta``, by :attr:`accountant_name`)."""
        return self._state.accountant.get_epsilon(self.delta)[0]

    @property
    def accountant_name(self) -> str:
        """The accountant whose ε this budget enforces ("rdp", "pld", "prv")."""
        return self._state.accountant.accountant

    @property
    def recomputations(self) -> list[dict[str, Any]]:
        return list(self._state.recomputations)

    @property
    def entries(self) -> list[RoundEntry]:
        return list(self._state.entries)

    @property
    def steps(self) -> int:
        return self._state.accountant.steps

    def accountant(self) -> PrivacyLedger:
        """A copy of the persisted ledger (mutating it changes nothing on disk)."""
        return PrivacyLedger.from_dict(self._state.accountant.to_dict())

    def planned_epsilon(self, noise_multiplier: float, sample_rate: float, steps: int) -> float:
        """ε the site would have spent after ``steps`` more steps at (σ, q)."""
        return self._state.accountant.epsilon_if(noise_multiplier, sample_rate, steps, self.delta)

    def entry(self, run_id: str, round_id: int) -> RoundEntry | None:
        for e in self._state.entries:
            if e.key == (run_id, int(round_id)):
                return e
        return None

    def report(self, extra_events: Sequence[tuple[float, float, int]] = ()) -> dict[str, Any]:
        """What the site tells the coordinator (cumulative): ε, δ, guarantee, accountant, steps, RDP per order.

        The RDP curve is sent at the orders where it is finite: dp-accounting excludes (as ∞) the
        fractional orders near 1 whose series does not converge, and JSON has no ∞.
        ``extra_events`` ((σ, q, steps) the budget does not hold, e.g. spends on the federation's
        record a restored state lacks) are composed in: the report then states the larger spend."""
        acc = self._state.accountant
        if extra_events:
            acc = PrivacyLedger.from_dict(acc.to_dict())
            for sigma, rate, steps in extra_events:
                acc.step(sigma, rate, steps)
        curve = acc.rdp()
        finite = np.isfinite(curve)
        return {
            "site_id": self.site_id,
            "guarantee": self.guarantee,
            "unit": self.unit,
            "accountant": acc.accountant,
            "relation": acc.relation,
            "epsilon": acc.get_epsilon(self.delta)[0],
            "delta": self.delta,
            "eps_max": self.eps_max,
            "steps": acc.steps,
            "rounds_spent": sum(e.status == "spent" for e in self._state.entries) + len(extra_events),
            "orders": [float(a) for a, ok in zip(acc.orders, finite) if ok],
            "rdp": [float(x) for x in curve[finite]],
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
                refusal = BudgetExhausted(self.site_id, run_id, round_id, spent, planned, self.eps_max, self.delta,
                                          self.guarantee, self.accountant_name, self.unit, self._state.accountant.relation)
                new_state.entries.append(
                    RoundEntry(run_id, round_id, "refused", int(steps), float(noise_multiplier), float(sample_rate),
                               spent, self.delta, time.time(), refusal.reason, self.accountant_name)
                )
                self._persist(new_state)
                raise refusal

            new_state.accountant.step(noise_multiplier, sample_rate, steps)
            entry = RoundEntry(run_id, round_id, "spent", int(steps), float(noise_multiplier), float(sample_rate),
                               planned, self.delta, time.time(), accountant=self.accountant_name)
            new_state.entries.append(entry)
            _journal_spends(self.state_dir, [entry])  # the journal first: the budget may never be below it
            new_state.journaled = True
            try:
                self._persist(new_state)
            except BaseException:
                # The write failed in this process, so the caller will not train: say so in the journal
                # (a kill between the two writes leaves the spend journaled — counted, never free).
                _journal_void(self.state_dir, entry)
                raise
            return RoundAuthorization(entry, replayed=False)

    # -- persistence -----------------------------------------------------------------------------
    def _locked(self) -> AbstractContextManager[None]:
        return _state_lock(self.state_dir)

    def _persist(self, state: _State) -> None:
        _write_signed(self.path, state.to_payload())
        self._state = state  # only after the write succeeded: a failed write leaves memory == disk

    def _load(self) -> _State:
        if not self.path.exists():  # ensure_site_state wrote it at genesis: it was lost since
            raise BudgetStateError(f"site '{self.site_id}': budget file {self.path} is missing; refusing to restart from zero")
        payload = _read_signed(self.path, "site budget state")
        where = f"site budget state {self.path}"
        if payload.get("site_id") != self.site_id:
            raise BudgetStateError(f"{where} belongs to site '{payload.get('site_id')}', not '{self.site_id}'")
        if payload.get("guarantee") != self.guarantee:
            raise BudgetStateError(_guarantee_change_message(self.state_dir, self.site_id, {"guarantee": payload["guarantee"]}, self.guarantee))
        if payload.get("unit", LEGACY_UNIT) != self.unit:
            raise BudgetStateError(_unit_change_message(self.path, self.site_id, payload.get("unit", LEGACY_UNIT), self.unit))
        if payload.get("delta") != self.delta:
            raise BudgetStateError(f"{where} was kept at δ = {payload.get('delta')}, config says δ = {self.delta}")
        state = _parse_state(payload, self.path)
        check_journal(self.state_dir, state)
        return state


def _parse_state(payload: dict[str, Any], path: Path) -> _State:
    """The verified state of a budget payload: format, relation, and ledger == composition of spent rounds."""
    where = f"site budget state {path}"
    if payload.get("format") != STATE_FORMAT:
        raise BudgetStateError(f"{where}: unknown format {payload.get('format')!r} (expected {STATE_FORMAT})")
    try:
        site_id, guarantee, delta = str(payload["site_id"]), str(payload["guarantee"]), float(payload["delta"])
        accountant = PrivacyLedger.from_dict(payload["accountant"])
        entries = [RoundEntry(**e) for e in payload["entries"]]
        recomputations = list(payload.get("recomputations", []))
    except (ValueError, TypeError, KeyError) as exc:
        raise BudgetStateError(f"{where}: malformed content ({exc})") from None
    # A budget keeps the relation it was written under where that bounds the mechanism's own (FDP's
    # visible-membership budgets from before its public sample was independent: looser, still true).
    if not bounds(accountant.relation, relation_of(guarantee)):
        raise BudgetStateError(
            f"{where}: accounted under the '{accountant.relation}' relation, but {guarantee} needs "
            f"'{relation_of(guarantee)}'"
        )
    # The ledger must be exactly the composition of the spent rounds (the events, not a derived curve).
    replay = PrivacyLedger(orders=accountant.orders, relation=accountant.relation, accountant=accountant.accountant)
    for e in entries:
        if e.status == "spent":
            replay.step(e.noise_multiplier, e.sample_rate, e.steps)
    if replay.history != accountant.history and (
        replay.steps != accountant.steps or not np.allclose(replay.rdp(), accountant.rdp(), rtol=1e-12, atol=0)
    ):
        raise BudgetStateError(f"{where}: accountant history does not match the recorded rounds")
    created_at = payload.get("genesis_created_at")
    if created_at is None:  # a budget that predates markers, adopted by ensure_site_state: stamp it from now on
        created_at = _read_signed(path.parent / GENESIS_FILE, "site state marker")["created_at"]
    return _State(site_id, guarantee, delta, accountant, entries, float(created_at), recomputations,
                  str(payload.get("unit", LEGACY_UNIT)), payload.get("journal") == JOURNAL_FILE,
                  list(payload.get("adoptions", [])))


# -- the journal of spends ------------------------------------------------------------------------------
@dataclass(frozen=True)
class JournaledSpend:
    """One line of ``spends.jsonl``: a spent (run, round) and its accountant event."""

    run_id: str
    round: int
    noise_multiplier: float
    sample_rate: float
    steps: int
    recorded_at: float = 0.0

    @property
    def key(self) -> tuple[str, int]:
        return (self.run_id, self.round)

    def event(self) -> tuple[float, float, int]:
        return (self.noise_multiplier, self.sample_rate, self.steps)


def _journal_spends(state_dir: Path, entries: list[RoundEntry]) -> None:
    """Append spent entries to the journal and fsync it (called under the state lock, before the budget write)."""
    _append_journal(state_dir, "".join(json.dumps({"run_id": e.run_id, "round": e.round, "noise_multiplier": e.noise_multiplier,
                                                   "sample_rate": e.sample_rate, "steps": e.steps,
                                                   "recorded_at": e.recorded_at}) + "\n" for e in entries))


def _journal_void(state_dir: Path, entry: RoundEntry) -> None:
    """Mark a journaled spend void: its budget write failed in-process and the round was not trained."""
    _append_journal(state_dir, json.dumps({"run_id": entry.run_id, "round": entry.round, "void": True,
                                           "reason": "the budget write failed; the round was not trained"}) + "\n")


def _append_journal(state_dir: Path, lines: str) -> None:
    # a torn last line is what read_journal skips (it does not parse) or counts (it does): the same here
    append_lines(state_dir / JOURNAL_FILE, lines, complete=_journal_line_parses)


_MALFORMED_LINE = (json.JSONDecodeError, UnicodeDecodeError, TypeError, ValueError, KeyError, AttributeError)


def _parse_journal_line(line: str | bytes) -> JournaledSpend | tuple[str, int]:
    """One journal line: a spend, or the (run, round) a "void" line cancels. Raises one of
    ``_MALFORMED_LINE`` when the line is not a journal line."""
    doc = json.loads(line)
    if doc.get("void") is True:
        return (str(doc["run_id"]), int(doc["round"]))
    return JournaledSpend(**doc)


def _journal_line_parses(line: bytes) -> bool:
    try:
        _parse_journal_line(line)
        return True
    except _MALFORMED_LINE:
        return False


def read_journal(state_dir: str | Path) -> list[JournaledSpend]:
    """The journaled spends of a site (empty when it has no journal). A torn last line (a crash in
    the middle of an append, before the budget was written) is ignored; any other bad line is an error.
    A "void" line cancels the spend journaled for its (run, round) just before (a failed budget write)."""
    path = Path(state_dir) / JOURNAL_FILE
    if not path.exists():
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BudgetStateError(f"spend journal {path} is unreadable ({exc}); restore it from a backup") from None
    lines = text.split("\n")
    spends: dict[tuple[str, int], JournaledSpend] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            parsed = _parse_journal_line(line)
        except _MALFORMED_LINE as exc:
            if number == len(lines):  # no newline after it: the append was cut short
                continue
            raise BudgetStateError(f"spend journal {path}, line {number}: malformed ({exc}); restore it from a backup") from None
        if isinstance(parsed, JournaledSpend):
            spends[parsed.key] = parsed
        else:  # void: cancels the spend journaled for its (run, round)
            spends.pop(parsed, None)
    return list(spends.values())


def check_journal(state_dir: Path, state: _State) -> None:
    """Refuse a budget that is below its journal (:class:`BudgetStateError` naming the rounds)."""
    path = state_dir / JOURNAL_FILE
    budget = state_dir / STATE_FILE
    if state.journaled and not path.exists():
        raise BudgetStateError(
            f"site '{state.site_id}': budget {budget} records its spends in the journal {path}, which is missing: "
            "refusing to trust a budget whose own witness is gone. Restore the journal from a backup of the state dir."
        )
    spent = {e.key: e for e in state.entries if e.status == "spent"}
    missing, differing = [], []
    for spend in read_journal(state_dir):
        held = spent.get(spend.key)
        if held is None:
            missing.append(spend)
        elif not held.same_request(*spend.event()):
            differing.append(spend)
    if missing or differing:
        raise BudgetStateError(
            f"site '{state.site_id}': budget {budget} is below its spend journal {path}: "
            + "; ".join(filter(None, [
                f"journaled spends absent from the budget: {_rounds_text(missing)}" if missing else "",
                f"spent with other (σ, q, steps) than journaled: {_rounds_text(differing)}" if differing else ""]))
            + ". The budget was rolled back, edited or its last write was cut short: the journaled ε still applies. "
            f"`fedpose privacy adopt {state_dir}` adds the journaled spends back into the budget (recorded, never lowering anything)."
        )


def _rounds_text(spends: list[Any]) -> str:
    return ", ".join(f"run '{s.run_id}' round {s.round}" for s in spends)


@contextmanager
def _existing_state(state_dir: Path) -> Iterator[tuple[Path, "_State"]]:
    """A site's existing budget state, read under the state lock, for a deliberate edit
    (:func:`adopt_spends`, :func:`recompute_budget`); no budget is an error, never a new one."""
    path = state_dir / STATE_FILE
    if not path.exists():
        raise BudgetStateError(f"no site budget at {path}")
    with _state_lock(state_dir):
        yield path, _parse_state(_read_signed(path, "site budget state"), path)


def adopt_spends(state_dir: str | Path, spends: list[JournaledSpend], source: str, dry_run: bool = False) -> dict[str, Any]:
    """Add spends the budget lacks — from its own journal and ``spends`` (e.g. the coordinator's
    record) — to a site's budget: the deliberate, recorded step after a restore from backup.

    Never lowers anything: spends the budget holds stay as they are; a spend recorded elsewhere
    with other parameters than the budget's for the same (run, round) is refused (which one is
    true needs investigating). Each adopted spend is journaled, then the budget is written with an
    ``adoptions`` record (source, rounds, ε before and after, time). Returns what was (or, with
    ``dry_run``, would be) adopted."""
    state_dir = Path(state_dir)
    with _existing_state(state_dir) as (path, state):
        spent = {e.key: e for e in state.entries if e.status == "spent"}
        journal = read_journal(state_dir)
        candidates: dict[tuple[str, int], tuple[JournaledSpend, str]] = {}
        for spend, where in [*((s, f"journal {state_dir / JOURNAL_FILE}") for s in journal), *((s, source) for s in spends)]:
            held = spent.get(spend.key)
            other = candidates.get(spend.key)
            if held is not None:
                if not held.same_request(*spend.event()):
                    raise BudgetStateError(
                        f"site '{state.site_id}': run '{spend.run_id}' round {spend.round} is spent in {path} with "
                        f"σ={held.noise_multiplier}, q={held.sample_rate}, steps={held.steps}, but the {where} says "
                        f"σ={spend.noise_multiplier}, q={spend.sample_rate}, steps={spend.steps}: investigate before adopting")
                continue
            if other is not None and other[0].event() != spend.event():
                raise BudgetStateError(
                    f"site '{state.site_id}': run '{spend.run_id}' round {spend.round} has other (σ, q, steps) in the "
                    f"{other[1]} than in the {where}: investigate before adopting")
            candidates.setdefault(spend.key, (spend, where))
        before = state.accountant.get_epsilon(state.delta)[0]
        new_state = state.copy()
        adopted: list[RoundEntry] = []
        for spend, _ in sorted(candidates.values(), key=lambda c: (c[0].run_id, c[0].round)):
            new_state.accountant.step(spend.noise_multiplier, spend.sample_rate, spend.steps)
            adopted.append(RoundEntry(spend.run_id, spend.round, "spent", spend.steps, spend.noise_multiplier,
                                      spend.sample_rate, new_state.accountant.get_epsilon(state.delta)[0], state.delta,
                                      time.time(), f"adopted from {candidates[spend.key][1]}", new_state.accountant.accountant))
        after = new_state.accountant.get_epsilon(state.delta)[0]
        result = {"site_id": state.site_id, "guarantee": state.guarantee, "delta": state.delta, "unit": state.unit,
                  "neighbouring_relation": state.accountant.relation,
                  "accountant": state.accountant.accountant, "epsilon_before": before, "epsilon_after": after,
                  "adopted": [{"run_id": e.run_id, "round": e.round, "noise_multiplier": e.noise_multiplier,
                               "sample_rate": e.sample_rate, "steps": e.steps, "from": candidates[e.key][1]} for e in adopted],
                  "applied": False}
        if dry_run or not adopted:
            return result
        new_state.entries = [e for e in new_state.entries if e.key not in candidates] + adopted  # drops old refusals only
        new_state.adoptions.append({"source": sorted({candidates[e.key][1] for e in adopted}),
                                    "rounds": [[e.run_id, e.round] for e in adopted],
                                    "epsilon_before": before, "epsilon_after": after, "at": time.time()})
        unjournaled = [e for e in adopted if e.key not in {s.key for s in journal}]
        if unjournaled:
            _journal_spends(state_dir, unjournaled)
        new_state.journaled = new_state.journaled or bool(unjournaled) or bool(journal)
        _write_signed(path, new_state.to_payload())
        result["applied"] = True
        return result


def recompute_budget(state_dir: str | Path, accountant: str | None = None, apply: bool = False) -> dict[str, Any]:
    """ε of a site's persisted events under ``accountant`` (and under every accountant that handles
    its relation); with ``apply``, switch the budget to ``accountant`` and record the switch.
    ``accountant`` None: the budget's own.

    The events are the accountant's whole input, so the switch is exact bookkeeping, not an
    estimate. It is recorded in ``recomputations`` (from, to, ε before and after, steps, time);
    earlier round entries keep the ε and accountant they were written with.
    """
    if accountant is not None:
        get_accountant(accountant)
    state_dir = Path(state_dir)
    with _existing_state(state_dir) as (path, state):
        ledger = state.accountant
        accountant = accountant or ledger.accountant
        if not get_accountant(accountant).supports(ledger.relation):
            raise BudgetStateError(f"the {accountant} accountant does not handle this budget's '{ledger.relation}' relation")
        before = ledger.get_epsilon(state.delta)[0]
        after = ledger.with_accountant(accountant).get_epsilon(state.delta)[0]
        result: dict[str, Any] = {
            "site_id": state.site_id, "guarantee": state.guarantee, "delta": state.delta, "unit": state.unit,
            "neighbouring_relation": ledger.relation, "steps": ledger.steps,
            "events": ledger.to_dict()["history"],
            "accountant": ledger.accountant, "epsilon": before,
            "requested_accountant": accountant, "requested_epsilon": after,
            "epsilon_by_accountant": ledger.epsilon_by(state.delta),
            "applied": False,
        }
        if apply and accountant != ledger.accountant:
            new_state = state.copy()
            new_state.accountant = ledger.with_accountant(accountant)
            new_state.recomputations.append({"from": ledger.accountant, "to": accountant, "epsilon_before": before,
                                             "epsilon_after": after, "steps": ledger.steps, "at": time.time()})
            _write_signed(path, new_state.to_payload())
            result.update(applied=True, accountant=accountant, epsilon=after)
        return result
