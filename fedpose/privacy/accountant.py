"""RDP accounting for the Poisson-subsampled Gaussian mechanism (DP-SGD and its relatives).

The computation is Opacus' RDP analysis (``opacus.accountants.analysis.rdp``: Mironov et al.
2019 for the subsampled Gaussian, Balle et al. 2020 Thm. 21 for RDP → (ε, δ)); this module
only adds what fedpose needs around it:

* a **ledger** — the history of ``(noise_multiplier, sample_rate, steps)`` segments — that is
  JSON-serialisable (``to_dict`` / ``from_dict``) so a site can persist its spent budget and a
  coordinator can mirror it;
* a wider order grid than Opacus' default (up to α = 1024, as Google's dp-accounting uses):
  small budgets such as ε = 0.2 at δ = 4e-5 are optimised at orders well above 63, and a
  grid that stops early gives a looser ε than necessary;
* ``epsilon_for`` / ``noise_multiplier_for`` helpers used by the CLI and by ``build_engine``;
* the **neighbouring relation** of the guarantee being accounted (:data:`RELATIONS`):

  - ``add_remove`` (DP-SGD, PDP-SGD): neighbours differ by one record; Opacus' analysis of the
    Poisson-subsampled Gaussian mechanism (sensitivity C, membership hidden by the sampling);
  - ``replace_public_membership`` (FDP, FP-DP, MaskDP): neighbours replace the private part of
    one record while its public part ψ(x) and label stay; the public gradient is released
    without noise, so whether a record was sampled may be visible and the usual amplification
    argument does not apply. fedpose uses the bound of :func:`replace_public_membership_rdp`
    (sensitivity 2C, sampling only through a convex mixture), never the add/remove curve.

RDP composes by addition per order, so a federation's rounds simply append segments.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable

import numpy as np


def _opacus_rdp_analysis() -> ModuleType:
    """``opacus.accountants.analysis.rdp``, loaded from its file without running ``opacus/__init__``.

    The package init imports Opacus' PrivacyEngine, optimizers and ``torch.distributed`` (~2 s
    measured); a deployed site pays every import once per round, because Flower starts a new
    ClientApp process per message. The analysis module itself needs only numpy and scipy.
    """
    name = "opacus.accountants.analysis.rdp"
    if name in sys.modules:
        return sys.modules[name]
    package = importlib.util.find_spec("opacus")  # locates the package without importing it
    if package is None or package.origin is None:
        raise ImportError("opacus is not installed (fedpose uses its RDP analysis)")
    path = Path(package.origin).parent / "accountants" / "analysis" / "rdp.py"
    spec = importlib.util.spec_from_file_location("fedpose._opacus_rdp_analysis", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load Opacus' RDP analysis from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rdp_analysis = _opacus_rdp_analysis()

#: RDP orders α. Opacus' default grid plus large orders for small-ε regimes.
DEFAULT_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [128, 256, 512, 1024]
)

ADD_REMOVE = "add_remove"
REPLACE_PUBLIC_MEMBERSHIP = "replace_public_membership"


def add_remove_rdp(sample_rate: float, noise_multiplier: float, steps: int, orders: Iterable[float]) -> np.ndarray:
    """Opacus' RDP of the Poisson-subsampled Gaussian mechanism (add/remove-one adjacency)."""
    return np.asarray(
        rdp_analysis.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=steps, orders=list(orders)),
        dtype=float,
    )


def replace_public_membership_rdp(
    sample_rate: float, noise_multiplier: float, steps: int, orders: Iterable[float]
) -> np.ndarray:
    """RDP bound for replace-one adjacency when batch membership may be public (FDP family).

    One step releases (public gradient of the batch) + (Σ clipped private gradients + N(0, σ²C²)).
    Neighbours replace one record's private gradient u by u' (‖u − u'‖ ≤ 2C); everything else,
    including whether the record is sampled, is identical. For α > 1, exp((α−1)·D_α(P‖Q)) is
    jointly convex in (P, Q), so mixing over the Poisson sample gives, per step,

        ρ(α) ≤ log(1 − q + q·exp((α−1)·α·(2C)²/(2σ²C²))) / (α − 1)
             = log(1 − q + q·exp(2α(α−1)/σ²)) / (α − 1),

    whatever the public gradient reveals about the sample. q = 1 gives the Gaussian mechanism
    with sensitivity 2C (2α/σ²). Steps compose additively.
    """
    alphas = np.asarray(list(orders), dtype=float)
    if steps == 0 or sample_rate == 0:
        return np.zeros(len(alphas))
    if noise_multiplier == 0:
        return np.full(len(alphas), np.inf)
    exponent = 2.0 * alphas * (alphas - 1.0) / noise_multiplier**2
    if sample_rate == 1:
        per_step = exponent / (alphas - 1.0)
    else:
        per_step = np.logaddexp(math.log1p(-sample_rate), math.log(sample_rate) + exponent) / (alphas - 1.0)
    return steps * per_step


#: Neighbouring relation → per-segment RDP function (q, σ, steps, orders) → RDP per order.
RELATIONS = {ADD_REMOVE: add_remove_rdp, REPLACE_PUBLIC_MEMBERSHIP: replace_public_membership_rdp}


def _check_relation(relation: str) -> None:
    if relation not in RELATIONS:
        raise ValueError(f"unknown neighbouring relation {relation!r}; known: {sorted(RELATIONS)}")


#: σ above which calibration gives up (ε would need an absurd amount of noise).
MAX_NOISE_MULTIPLIER = 1e4


def _check_segment(noise_multiplier: float, sample_rate: float, steps: int) -> None:
    if not (isinstance(noise_multiplier, (int, float)) and math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    if not (isinstance(sample_rate, (int, float)) and 0 <= sample_rate <= 1):
        raise ValueError(f"sample_rate must be in [0, 1], got {sample_rate!r}")
    if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0):
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")


def _check_delta(delta: float) -> None:
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")


@dataclass
class RDPAccountant:
    """Ledger of subsampled-Gaussian steps and the (ε, δ) they add up to.

    ``history`` holds ``(noise_multiplier, sample_rate, steps)`` segments; consecutive steps
    with identical parameters are merged into one segment.
    """

    history: list[tuple[float, float, int]] = field(default_factory=list)
    orders: tuple[float, ...] = DEFAULT_ORDERS
    relation: str = ADD_REMOVE  #: neighbouring relation of the guarantee (see RELATIONS)

    def __post_init__(self) -> None:
        _check_relation(self.relation)

    # -- recording -------------------------------------------------------------------------
    def step(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Record ``steps`` applications of the Poisson-subsampled Gaussian mechanism."""
        _check_segment(noise_multiplier, sample_rate, steps)
        if steps == 0:
            return
        if self.history and self.history[-1][:2] == (float(noise_multiplier), float(sample_rate)):
            sigma, q, done = self.history[-1]
            self.history[-1] = (sigma, q, done + steps)
        else:
            self.history.append((float(noise_multiplier), float(sample_rate), int(steps)))

    def merge(self, other: "RDPAccountant") -> None:
        """Append another ledger's history (e.g. a site's round) — RDP composes additively."""
        if other.relation != self.relation:
            raise ValueError(f"cannot compose a '{other.relation}' ledger into a '{self.relation}' ledger")
        for sigma, q, steps in other.history:
            self.step(sigma, q, steps)

    @property
    def steps(self) -> int:
        return sum(steps for _, _, steps in self.history)

    # -- accounting ------------------------------------------------------------------------
    def rdp(self) -> np.ndarray:
        """Total RDP at each order in ``self.orders`` (composition = sum over segments)."""
        total = np.zeros(len(self.orders))
        segment_rdp = RELATIONS[self.relation]
        for sigma, q, steps in self.history:
            total += segment_rdp(q, sigma, steps, self.orders)
        return total

    def get_epsilon(self, delta: float) -> tuple[float, float]:
        """(ε, optimal order α) for the recorded history at ``delta``. ε = 0 for an empty ledger."""
        _check_delta(delta)
        if self.steps == 0:
            return 0.0, float("nan")
        return rdp_to_epsilon(self.rdp(), delta, self.orders)

    def epsilon_if(self, noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
        """ε after hypothetically recording one more segment (for budget checks before a round)."""
        trial = RDPAccountant(list(self.history), self.orders, self.relation)
        trial.step(noise_multiplier, sample_rate, steps)
        return trial.get_epsilon(delta)[0]

    # -- persistence -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "accountant": "rdp",
            "relation": self.relation,
            "history": [
                {"noise_multiplier": sigma, "sample_rate": q, "steps": steps} for sigma, q, steps in self.history
            ],
            "orders": list(self.orders),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RDPAccountant":
        if not isinstance(data, dict) or data.get("accountant", "rdp") != "rdp":
            raise ValueError(f"not an RDP accountant state: {data!r:.200}")
        history = data.get("history")
        if not isinstance(history, list):
            raise ValueError("RDP accountant state: 'history' must be a list")
        orders = tuple(float(a) for a in data.get("orders", DEFAULT_ORDERS))
        if not orders or any(a <= 1 for a in orders):
            raise ValueError("RDP accountant state: orders must all be > 1")
        relation = data.get("relation", ADD_REMOVE)
        if relation not in RELATIONS:
            raise ValueError(f"RDP accountant state: unknown relation {relation!r}")
        accountant = cls(orders=orders, relation=relation)
        for i, seg in enumerate(history):
            try:
                accountant.step(float(seg["noise_multiplier"]), float(seg["sample_rate"]), int(seg["steps"]))
            except (KeyError, TypeError) as exc:
                raise ValueError(f"RDP accountant state: history[{i}] is malformed: {seg!r}") from exc
        return accountant


def rdp_to_epsilon(rdp: Iterable[float], delta: float, orders: Iterable[float] = DEFAULT_ORDERS) -> tuple[float, float]:
    """Convert an RDP curve to (ε, optimal order) at ``delta`` (Opacus' conversion)."""
    import warnings

    with warnings.catch_warnings():
        # Opacus warns when the optimum is at the grid's edge; the grid already reaches α = 1024.
        warnings.simplefilter("ignore", UserWarning)
        eps, order = rdp_analysis.get_privacy_spent(orders=list(orders), rdp=list(rdp), delta=delta)
    return float(eps), float(order)


def epsilon_for(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    orders: Iterable[float] = DEFAULT_ORDERS,
    relation: str = ADD_REMOVE,
) -> tuple[float, float]:
    """(ε, optimal order) of ``steps`` Poisson-subsampled Gaussian steps under ``relation``."""
    accountant = RDPAccountant(orders=tuple(orders), relation=relation)
    accountant.step(noise_multiplier, sample_rate, steps)
    _check_delta(delta)
    return accountant.get_epsilon(delta)


def noise_multiplier_for(
    target_epsilon: float,
    sample_rate: float,
    steps: int,
    delta: float,
    rel_tolerance: float = 0.005,
    orders: Iterable[float] = DEFAULT_ORDERS,
    max_noise_multiplier: float = MAX_NOISE_MULTIPLIER,
    relation: str = ADD_REMOVE,
) -> float:
    """Smallest σ (to ``rel_tolerance``) whose ε after ``steps`` steps does not exceed ``target_epsilon``.

    Bisection on σ (ε is monotone decreasing in σ); the returned σ always satisfies
    ε(σ) ≤ target_epsilon, and σ·(1 − rel_tolerance) would not (or is below the bracket).
    """
    if not (isinstance(target_epsilon, (int, float)) and target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    _check_segment(1.0, sample_rate, steps)
    _check_delta(delta)
    orders = tuple(orders)
    if steps == 0 or sample_rate == 0:
        return 0.0

    def eps(sigma: float) -> float:
        return epsilon_for(sigma, sample_rate, steps, delta, orders, relation)[0]

    low, high = 0.0, 1.0
    while eps(high) > target_epsilon:
        low, high = high, high * 2
        if high > max_noise_multiplier:
            raise ValueError(
                f"target ε = {target_epsilon} is unreachable at sample rate {sample_rate}, {steps} steps, "
                f"δ = {delta}: it would need a noise multiplier above {max_noise_multiplier:g}"
            )
    # Invariant: eps(high) <= target; eps(low) > target (or low == 0, which has ε = ∞).
    while high - low > rel_tolerance * high:
        mid = (low + high) / 2
        if eps(mid) <= target_epsilon:
            high = mid
        else:
            low = mid
    return high
