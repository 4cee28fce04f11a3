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
* ``epsilon_for`` / ``noise_multiplier_for`` helpers used by the CLI and by ``build_engine``.

RDP composes by addition per order, so a federation's rounds simply append segments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
from opacus.accountants.analysis import rdp as rdp_analysis

#: RDP orders α. Opacus' default grid plus large orders for small-ε regimes.
DEFAULT_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [128, 256, 512, 1024]
)

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
        for sigma, q, steps in other.history:
            self.step(sigma, q, steps)

    @property
    def steps(self) -> int:
        return sum(steps for _, _, steps in self.history)

    # -- accounting ------------------------------------------------------------------------
    def rdp(self) -> np.ndarray:
        """Total RDP at each order in ``self.orders`` (composition = sum over segments)."""
        total = np.zeros(len(self.orders))
        for sigma, q, steps in self.history:
            total += np.asarray(
                rdp_analysis.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=list(self.orders)),
                dtype=float,
            )
        return total

    def get_epsilon(self, delta: float) -> tuple[float, float]:
        """(ε, optimal order α) for the recorded history at ``delta``. ε = 0 for an empty ledger."""
        _check_delta(delta)
        if self.steps == 0:
            return 0.0, float("nan")
        return rdp_to_epsilon(self.rdp(), delta, self.orders)

    def epsilon_if(self, noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
        """ε after hypothetically recording one more segment (for budget checks before a round)."""
        trial = RDPAccountant(list(self.history), self.orders)
        trial.step(noise_multiplier, sample_rate, steps)
        return trial.get_epsilon(delta)[0]

    # -- persistence -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "accountant": "rdp",
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
        accountant = cls(orders=orders)
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
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, orders: Iterable[float] = DEFAULT_ORDERS
) -> tuple[float, float]:
    """(ε, optimal order) of ``steps`` Poisson-subsampled Gaussian steps."""
    accountant = RDPAccountant(orders=tuple(orders))
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
        return epsilon_for(sigma, sample_rate, steps, delta, orders)[0]

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
