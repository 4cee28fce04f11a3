"""RDP accountant (Mironov 2017; subsampled Gaussian: Mironov et al. 2019, via Google's dp-accounting).

Composition is additive per order α, and ε comes from Balle et al. 2020 Thm. 21
(``dp_accounting.rdp.compute_epsilon``). Public dp-accounting API only: the curve of the
add/remove relation is ``RdpAccountant.rdp`` after composing ``PoissonSampledDpEvent`` s. (The
previous implementation loaded Opacus' ``analysis/rdp.py`` by file path to skip Opacus' package
init; dp-accounting's RDP needs numpy and scipy only, never torch, and its curve is never below
Opacus' — equal at integer orders, up to 13 % higher at fractional orders near 1 — so no recorded
ε goes down by the switch.)

RDP is an upper bound for every relation but not a tight one: 5–15 % looser in ε than the PLD
accountant at DP-SGD settings (FACTS.md); for ``replace_one`` it is the visible-membership curve,
far looser (:data:`CURVES`).
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Iterable, Sequence

import numpy as np

from fedpose.privacy.accountants.base import ADD_REMOVE, REPLACE_ONE, REPLACE_PUBLIC_MEMBERSHIP, Event, check_delta, check_relation, effective

#: RDP orders α: Opacus' default grid plus large orders (as dp-accounting's) for small-ε regimes:
#: ε = 0.2 at δ = 4e-5 is optimised at orders well above 63.
DEFAULT_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [128, 256, 512, 1024]
)


def add_remove_rdp(sample_rate: float, noise_multiplier: float, steps: int, orders: Iterable[float]) -> np.ndarray:
    """RDP of ``steps`` Poisson-subsampled Gaussian steps, add/remove-one adjacency (dp-accounting)."""
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    orders = [float(a) for a in orders]
    if steps == 0 or sample_rate == 0:
        return np.zeros(len(orders))
    if noise_multiplier == 0:
        return np.full(len(orders), np.inf)
    accountant = rdp_privacy_accountant.RdpAccountant(orders)
    absl = logging.getLogger("absl")
    level = absl.level
    # dp-accounting logs a warning per fractional order near 1 whose series does not converge; it
    # then sets that order to ∞ (excluded from the conversion), which is the conservative answer.
    absl.setLevel(logging.ERROR)
    try:
        accountant.compose(dp_accounting.PoissonSampledDpEvent(sample_rate, dp_accounting.GaussianDpEvent(noise_multiplier)), steps)
    finally:
        absl.setLevel(level)
    return np.asarray(accountant.rdp, dtype=float)


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


#: neighbouring relation → RDP curve of one event (q, σ, steps, orders). ``replace_one`` takes the
#: visible-membership bound: its derivation holds whatever the public gradient shows about the sample,
#: so it bounds hidden membership too — loosely (at ε 8, q 16/120, 80 steps: σ 4.50 instead of the PLD's 1.43).
CURVES = {ADD_REMOVE: add_remove_rdp, REPLACE_ONE: replace_public_membership_rdp,
          REPLACE_PUBLIC_MEMBERSHIP: replace_public_membership_rdp}


def rdp_curve(events: Sequence[Event], relation: str, orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """Total RDP at each order (composition = sum over events)."""
    check_relation(relation)
    total = np.zeros(len(orders))
    for event in events:
        total += CURVES[relation](event.sample_rate, event.noise_multiplier, event.steps, orders)
    return total


def rdp_to_epsilon(rdp: Iterable[float], delta: float, orders: Iterable[float] = DEFAULT_ORDERS) -> tuple[float, float]:
    """(ε, optimal order) of an RDP curve at ``delta`` (Balle et al. 2020, dp-accounting)."""
    from dp_accounting.rdp import rdp_privacy_accountant

    check_delta(delta)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optimum at the grid's edge: the grid already reaches α = 1024
        epsilon, order = rdp_privacy_accountant.compute_epsilon(list(orders), list(rdp), delta)
    return float(epsilon), float(order)


class RdpAccountant:
    name = "rdp"
    title = "Rényi DP (Mironov 2017/2019, Balle et al. 2020 conversion; dp-accounting)"
    exact_for: frozenset[str] = frozenset()  # an upper bound for every relation, never the tight one
    largest_epsilon = math.inf

    def __init__(self, orders: Sequence[float] = DEFAULT_ORDERS) -> None:
        self.orders = tuple(float(a) for a in orders)

    def supports(self, relation: str) -> bool:
        return relation in CURVES

    def epsilon_and_order(self, events: Sequence[Event], relation: str, delta: float) -> tuple[float, float]:
        check_delta(delta)
        check_relation(relation)
        events = effective(events)
        if not events:
            return 0.0, float("nan")
        if any(e.noise_multiplier == 0 for e in events):
            return math.inf, float("nan")
        return rdp_to_epsilon(rdp_curve(events, relation, self.orders), delta, self.orders)

    def epsilon(self, events: Sequence[Event], relation: str, delta: float) -> float:
        return self.epsilon_and_order(events, relation, delta)[0]
