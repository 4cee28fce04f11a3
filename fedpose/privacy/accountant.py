"""The privacy ledger: the events a guarantee rests on, and the ε any accountant makes of them.

A :class:`PrivacyLedger` records the accountant's *input* — ``(noise_multiplier, sample_rate,
steps)`` segments of the Poisson-subsampled Gaussian mechanism, under one neighbouring relation —
and names the accountant (:mod:`fedpose.privacy.accountants`: ``rdp``, ``pld``, ``prv``) whose ε it
reports. Because the events are kept, not just a curve, a site can recompute its spend with any
accountant (``fedpose privacy budget``). The ledger is JSON-serialisable (``to_dict`` /
``from_dict``); states written before accountants were selectable carry ``"accountant": "rdp"``
and keep saying RDP.

Neighbouring relations (:data:`RELATIONS`, see DESIGN.md):

* ``add_remove`` (DP-SGD, PDP-SGD): neighbours differ by one record, membership hidden by the
  Poisson sampling;
* ``replace_one`` (FDP, FP-DP, MaskDP): neighbours replace the private part of one record while
  its public part ψ(x) and label stay (sensitivity 2C); the noise-free public gradient comes from a
  sample drawn independently of the private one, so the Poisson sampling still hides membership.
  Never the add/remove analysis.
* ``replace_public_membership``: the same neighbours with membership visible — FDP budgets written
  while the public gradient came from the private sample keep it (sampling only as a visible mixture).

The RDP curve (:meth:`PrivacyLedger.rdp`) is available whatever the accountant: sites send it to
the coordinator as a function of public parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from fedpose.privacy.accountants import ACCOUNTANTS, default_accountant, get_accountant
from fedpose.privacy.accountants.base import (
    ADD_REMOVE,
    REPLACE_ONE,
    REPLACE_PUBLIC_MEMBERSHIP,
    RELATIONS,
    Event,
    check_delta,
    check_event,
    check_relation,
)
from fedpose.privacy.accountants.rdp import (
    CURVES,
    DEFAULT_ORDERS,
    RdpAccountant,
    add_remove_rdp,
    rdp_curve,
    rdp_to_epsilon,
    replace_public_membership_rdp,
)
from fedpose.privacy.accountants.sampler_cut import accountable_delta

__all__ = [
    "ADD_REMOVE", "REPLACE_ONE", "REPLACE_PUBLIC_MEMBERSHIP", "RELATIONS", "DEFAULT_ORDERS", "MAX_NOISE_MULTIPLIER", "PrivacyLedger",
    "RDPAccountant", "add_remove_rdp", "replace_public_membership_rdp", "rdp_to_epsilon", "epsilon_for",
    "noise_multiplier_for", "smallest_noise_multiplier", "default_accountant",
]

#: σ above which calibration gives up (ε would need an absurd amount of noise).
MAX_NOISE_MULTIPLIER = 1e4


@dataclass
class PrivacyLedger:
    """Subsampled-Gaussian steps under one relation, and the accountant that turns them into ε.

    ``history`` holds ``(noise_multiplier, sample_rate, steps)`` segments; consecutive steps with
    identical parameters are merged into one segment. ``accountant`` names the registry entry
    used by :meth:`get_epsilon` (callers pass the configured or default one; the dataclass default
    stays "rdp" so ledgers built before accountants were selectable mean what they meant).
    """

    history: list[tuple[float, float, int]] = field(default_factory=list)
    orders: tuple[float, ...] = DEFAULT_ORDERS  #: RDP orders of :meth:`rdp` (and of the rdp accountant)
    relation: str = ADD_REMOVE  #: neighbouring relation of the guarantee (see RELATIONS)
    accountant: str = "rdp"

    def __post_init__(self) -> None:
        check_relation(self.relation)
        if not get_accountant(self.accountant).supports(self.relation):
            raise ValueError(f"the {self.accountant} accountant does not handle the {self.relation!r} relation")

    # -- recording -------------------------------------------------------------------------
    def step(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Record ``steps`` applications of the Poisson-subsampled Gaussian mechanism."""
        check_event(noise_multiplier, sample_rate, steps)
        if steps == 0:
            return
        if self.history and self.history[-1][:2] == (float(noise_multiplier), float(sample_rate)):
            sigma, q, done = self.history[-1]
            self.history[-1] = (sigma, q, done + steps)
        else:
            self.history.append((float(noise_multiplier), float(sample_rate), int(steps)))

    def merge(self, other: "PrivacyLedger") -> None:
        """Append another ledger's history (e.g. a site's round): events compose by concatenation."""
        if other.relation != self.relation:
            raise ValueError(f"cannot compose a '{other.relation}' ledger into a '{self.relation}' ledger")
        for sigma, q, steps in other.history:
            self.step(sigma, q, steps)

    @property
    def steps(self) -> int:
        return sum(steps for _, _, steps in self.history)

    @property
    def events(self) -> list[Event]:
        return [Event(sigma, q, steps) for sigma, q, steps in self.history]

    def with_accountant(self, accountant: str) -> "PrivacyLedger":
        """The same events, accounted by ``accountant`` (a copy)."""
        return PrivacyLedger(list(self.history), self.orders, self.relation, accountant)

    # -- accounting ------------------------------------------------------------------------
    def rdp(self) -> np.ndarray:
        """Total RDP at each order in ``self.orders`` (composition = sum over segments)."""
        return rdp_curve(self.events, self.relation, self.orders)

    def get_epsilon(self, delta: float) -> tuple[float, float]:
        """(ε, optimal RDP order α) at ``delta`` by this ledger's accountant; α is NaN for pld/prv.
        ε = 0 for an empty ledger. The ε of SecureNoise's real, tail-cut Gaussians: the accountant is
        asked at the δ their cut leaves (:mod:`~fedpose.privacy.accountants.sampler_cut`); ∞ when none is left."""
        check_delta(delta)
        if self.steps == 0:
            return 0.0, float("nan")
        delta_gaussian = accountable_delta(self.events, self.relation, delta)
        if delta_gaussian <= 0:
            return math.inf, float("nan")
        if self.accountant == "rdp":
            return RdpAccountant(self.orders).epsilon_and_order(self.events, self.relation, delta_gaussian)
        return get_accountant(self.accountant).epsilon(self.events, self.relation, delta_gaussian), float("nan")

    def epsilon_by(self, delta: float) -> dict[str, float]:
        """ε of these events under every accountant that handles the relation (name → ε)."""
        return {name: self.with_accountant(name).get_epsilon(delta)[0]
                for name, acc in ACCOUNTANTS.items() if acc.supports(self.relation)}

    def epsilon_if(self, noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
        """ε after hypothetically recording one more segment (for budget checks before a round)."""
        trial = PrivacyLedger(list(self.history), self.orders, self.relation, self.accountant)
        trial.step(noise_multiplier, sample_rate, steps)
        return trial.get_epsilon(delta)[0]

    # -- persistence -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "accountant": self.accountant,
            "relation": self.relation,
            "history": [
                {"noise_multiplier": sigma, "sample_rate": q, "steps": steps} for sigma, q, steps in self.history
            ],
            "orders": list(self.orders),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PrivacyLedger":
        if not isinstance(data, dict):
            raise ValueError(f"not a privacy ledger state: {data!r:.200}")
        name = data.get("accountant", "rdp")  # states from before accountants were selectable are RDP
        if name not in ACCOUNTANTS:
            raise ValueError(f"privacy ledger state: unknown accountant {name!r}")
        history = data.get("history")
        if not isinstance(history, list):
            raise ValueError("privacy ledger state: 'history' must be a list")
        orders = tuple(float(a) for a in data.get("orders", DEFAULT_ORDERS))
        if not orders or any(a <= 1 for a in orders):
            raise ValueError("privacy ledger state: orders must all be > 1")
        relation = data.get("relation", ADD_REMOVE)
        if relation not in RELATIONS:
            raise ValueError(f"privacy ledger state: unknown relation {relation!r}")
        ledger = cls(orders=orders, relation=relation, accountant=name)
        for i, seg in enumerate(history):
            try:
                ledger.step(float(seg["noise_multiplier"]), float(seg["sample_rate"]), int(seg["steps"]))
            except (KeyError, TypeError) as exc:
                raise ValueError(f"privacy ledger state: history[{i}] is malformed: {seg!r}") from exc
        return ledger


#: the name this class had while RDP was the only accountant (imports elsewhere still use it)
RDPAccountant = PrivacyLedger


def epsilon_for(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    orders: Iterable[float] = DEFAULT_ORDERS,
    relation: str = ADD_REMOVE,
    accountant: str = "rdp",
) -> tuple[float, float]:
    """(ε, optimal RDP order or NaN) of ``steps`` Poisson-subsampled Gaussian steps under ``relation``."""
    ledger = PrivacyLedger(orders=tuple(orders), relation=relation, accountant=accountant)
    ledger.step(noise_multiplier, sample_rate, steps)
    check_delta(delta)
    return ledger.get_epsilon(delta)


def noise_multiplier_for(
    target_epsilon: float,
    sample_rate: float,
    steps: int,
    delta: float,
    rel_tolerance: float = 0.005,
    orders: Iterable[float] = DEFAULT_ORDERS,
    max_noise_multiplier: float = MAX_NOISE_MULTIPLIER,
    relation: str = ADD_REMOVE,
    accountant: str = "rdp",
) -> float:
    """Smallest σ (to ``rel_tolerance``) whose ε after ``steps`` steps does not exceed ``target_epsilon``.

    Bisection on σ (ε is monotone decreasing in σ); the returned σ always satisfies
    ε(σ) ≤ target_epsilon, and σ·(1 − rel_tolerance) would not (or is below the bracket). For
    a tight accountant the bracket starts at the RDP σ, which always suffices (RDP bounds every
    other accountant's ε from above), so only a few slow evaluations are needed.
    """
    if not (isinstance(target_epsilon, (int, float)) and target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    check_event(1.0, sample_rate, steps)
    check_delta(delta)
    largest = get_accountant(accountant).largest_epsilon
    if target_epsilon > largest:  # PLD: dp-accounting's ε overflows to ∞ above about 709 (accountants/pld.py)
        raise ValueError(f"target ε = {target_epsilon:g} is beyond what the {accountant.upper()} accountant evaluates "
                         f"(at most {largest:g}: a site's guard would refuse the steps); ask for a smaller ε, or use "
                         f"accountant 'rdp'")
    orders = tuple(orders)
    if steps == 0 or sample_rate == 0:
        return 0.0

    def eps(sigma: float) -> float:
        return epsilon_for(sigma, sample_rate, steps, delta, orders, relation, accountant)[0]

    low, high = 0.0, 1.0
    if accountant != "rdp":
        high = noise_multiplier_for(target_epsilon, sample_rate, steps, delta, rel_tolerance / 4, orders,
                                    max_noise_multiplier, relation, "rdp")
        low = 0.8 * high
        while eps(low) <= target_epsilon:  # tight accountants save ~4–15 % of σ in practice
            high, low = low, 0.8 * low
    return smallest_noise_multiplier(eps, target_epsilon, low, high, rel_tolerance, max_noise_multiplier,
                                     f" at sample rate {sample_rate}, {steps} steps, δ = {delta}")


def smallest_noise_multiplier(
    eps: Callable[[float], float],
    target_epsilon: float,
    low: float = 0.0,
    high: float = 1.0,
    rel_tolerance: float = 0.005,
    max_noise_multiplier: float = MAX_NOISE_MULTIPLIER,
    where: str = "",
) -> float:
    """Smallest σ (to ``rel_tolerance``) with ``eps(σ) ≤ target_epsilon``, for any ε decreasing in σ:
    ``high`` doubles until it suffices, then bisection from [``low``, ``high``]. ``where`` ends the
    "unreachable" message (the setting that could not reach the target)."""
    while eps(high) > target_epsilon:
        low, high = high, high * 2
        if high > max_noise_multiplier:
            raise ValueError(
                f"target ε = {target_epsilon} is unreachable{where}: it would need a noise multiplier above "
                f"{max_noise_multiplier:g}"
            )
    # Invariant: eps(high) <= target; eps(low) > target (or low == 0, which has ε = ∞).
    while high - low > rel_tolerance * high:
        mid = (low + high) / 2
        if eps(mid) <= target_epsilon:
            high = mid
        else:
            low = mid
    return high
