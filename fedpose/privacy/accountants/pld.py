"""PLD accountant: privacy-loss distributions, composed exactly (up to a pessimistic discretization).

* ``add_remove`` (DP-SGD, PDP-SGD): Google's dp-accounting ``PLDAccountant`` on
  ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))`` (Koskela et al. 2020, Doroshenko et al. 2022),
  with its pessimistic discretization, so the ε is an upper bound that is tight to ~1e-3.
* ``replace_one`` (FDP, FP-DP, MaskDP): dp-accounting's PLD of the Poisson-subsampled Gaussian
  under substitution (``from_gaussian_mechanism(..., neighboring_relation=REPLACE_ONE)``): one
  step is the pair (1 − q)·N(0, σ²) + q·N(−1, σ²) against (1 − q)·N(0, σ²) + q·N(1, σ²) — the
  replaced record's clipped gradient, in units of C, is −1 in one world and +1 in the other, and
  whether it was sampled is hidden. That this 1-D pair bounds every pair of clipped gradients u, u'
  (‖u‖, ‖u'‖ ≤ C, any angle) is dp-accounting's analysis, checked numerically in the plane of u and
  u' by ``tests/test_accountant_relations.py``. Pessimistic discretization: an upper bound.
* ``replace_public_membership`` (budgets written before FDP's public sample became independent):
  derived here in closed form. Membership of
  the replaced record in a step's batch is visible (the noise-free public gradient may show it) and
  identically distributed in both worlds, so the hockey-stick divergence is the membership-weighted
  average of the conditional ones. Not sampled: the two outputs are identical. Sampled: a Gaussian
  with sensitivity 2C and std σC, i.e. a Gaussian mechanism with μ = 2/σ. Over several steps
  the conditional outputs compose to a Gaussian mechanism with μ² = Σ_steps sampled 4/σ², so with
  k_j ~ Binomial(T_j, q_j) sampled steps in event j,

      δ(ε) = E_k[ δ_G(ε; μ_k) ],   μ_k² = Σ_j 4 k_j / σ_j²,
      δ_G(ε; μ) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ)          (Balle & Wang 2018).

  This is the exact privacy profile of that mechanism — not a bound on it — and is inverted for ε by
  root finding. Binomial tails below 1e-18 are dropped and their whole mass is added to δ.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from typing import Sequence

import numpy as np

from fedpose.privacy.accountants.base import ADD_REMOVE, REPLACE_ONE, REPLACE_PUBLIC_MEMBERSHIP, Event, check_delta, check_relation, effective

#: dp-accounting's PLD grid step in privacy-loss units (its default) at ε ≤ 1; scaled by ε above
VALUE_DISCRETIZATION = 1e-4
#: the largest ε a σ is calibrated to with this accountant. dp-accounting inverts δ(ε) through
#: exp(ε)-sized ratios, which overflow a double past ε ≈ 709.8 (= log of the largest double): it then
#: reports ε = ∞ for some step counts but not others (σ 0.0598, q 1/15, δ 1e-5: 8 steps ∞, 16 steps
#: 996). ∞ is safe — a guard refuses, nothing is spent — but a σ calibrated to such an ε would be
#: refused by the guard that accounts its first round, so calibration stops here.
LARGEST_EPSILON = 700.0
#: binomial probabilities below this are dropped (and their mass added to δ)
_TAIL_MASS = 1e-18


def gaussian_delta(epsilon: float, mu: np.ndarray) -> np.ndarray:
    """δ_G(ε; μ) of the Gaussian mechanism with sensitivity/std ratio μ (0 where μ = 0), stably in logs."""
    from scipy import special  # here, not at import: a site's SecAgg stage process loads this module, never calls it

    mu = np.asarray(mu, dtype=float)
    out = np.zeros_like(mu)
    positive = mu > 0
    m = mu[positive]
    log_a = special.log_ndtr(m / 2 - epsilon / m)
    log_b = epsilon + special.log_ndtr(-m / 2 - epsilon / m)
    out[positive] = np.exp(log_a) * -np.expm1(np.minimum(log_b - log_a, 0.0))
    return out


def _sampled_steps_distribution(events: Sequence[Event]) -> tuple[np.ndarray, np.ndarray, float]:
    """(μ² values, probabilities, dropped mass) of μ² = Σ_j 4 k_j/σ_j², k_j ~ Binomial(T_j, q_j)."""
    from scipy import stats

    by_sigma: dict[float, list[Event]] = defaultdict(list)
    for event in events:
        by_sigma[event.noise_multiplier].append(event)
    values, probs, dropped = np.zeros(1), np.ones(1), 0.0
    for sigma, group in by_sigma.items():
        # number of sampled steps among all events with this σ: a convolution of binomials
        count = np.ones(1)
        for event in group:
            pmf = stats.binom.pmf(np.arange(event.steps + 1), event.steps, event.sample_rate)
            count = np.convolve(count, pmf)
        keep = count >= _TAIL_MASS
        dropped += float(count[~keep].sum())
        k = np.nonzero(keep)[0]
        values = (values[:, None] + 4.0 * k[None, :] / sigma**2).ravel()
        probs = (probs[:, None] * count[keep][None, :]).ravel()
        keep = probs >= _TAIL_MASS
        dropped += float(probs[~keep].sum())
        values, probs = values[keep], probs[keep]
    return values, probs, dropped


def replace_public_membership_delta(events: Sequence[Event], epsilon: float) -> float:
    """Exact δ(ε) of the FDP-family relation (module docstring), plus the dropped tail mass."""
    mu_squared, probs, dropped = _sampled_steps_distribution(effective(events))
    return float(np.dot(probs, gaussian_delta(epsilon, np.sqrt(mu_squared)))) + dropped


def replace_public_membership_epsilon(events: Sequence[Event], delta: float) -> float:
    from scipy import optimize

    events = effective(events)
    mu_squared, probs, dropped = _sampled_steps_distribution(events)
    mu = np.sqrt(mu_squared)
    if dropped >= delta:
        raise ValueError(f"δ = {delta:g} is below the accountant's numerical floor {dropped:.1e}")

    def excess(epsilon: float) -> float:
        return float(np.dot(probs, gaussian_delta(epsilon, mu))) + dropped - delta

    if excess(0.0) <= 0:
        return 0.0
    high = 1.0
    while excess(high) > 0:  # δ(ε) decreases to `dropped` < δ, so this ends
        high *= 2
    # Return the upper end of the bracket: the ε reported is never below the exact one.
    root = optimize.brentq(excess, 0.0 if high == 1.0 else high / 2, high, xtol=1e-10, rtol=1e-10)
    return float(root) * (1 + 1e-9)


def replace_one_epsilon(events: Sequence[Event], delta: float) -> float:
    import dp_accounting
    from dp_accounting.pld import privacy_loss_distribution

    from fedpose.privacy.accountants.rdp import RdpAccountant

    # Grid scaled as in add_remove_epsilon; the RDP bound of this relation is the visible-membership
    # curve (several times the ε computed here), so the grid is coarser than it needs to be, never finer.
    scale = max(1.0, RdpAccountant().epsilon(events, REPLACE_ONE, delta))
    total = None
    for event in effective(events):
        one_step = privacy_loss_distribution.from_gaussian_mechanism(
            event.noise_multiplier, sensitivity=1.0, sampling_prob=event.sample_rate,
            value_discretization_interval=VALUE_DISCRETIZATION * scale,
            neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE,
        )
        composed = one_step.self_compose(event.steps)
        total = composed if total is None else total.compose(composed)
    assert total is not None  # PldAccountant.epsilon returns 0 before calling with no events
    return float(total.get_epsilon_for_delta(delta))


def add_remove_epsilon(events: Sequence[Event], delta: float) -> float:
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    from fedpose.privacy.accountants.rdp import RdpAccountant

    # The grid scales with the ε being computed: PLD arrays grow as (loss range)/(grid step), and the
    # loss range grows fast at small σ (ε ≈ 8: minutes at a fixed 1e-4). The RDP ε (fast, an upper
    # bound) sets the scale; the discretization stays pessimistic, so ε is still an upper bound, with a
    # relative error of order 1e-4.
    scale = max(1.0, RdpAccountant().epsilon(events, ADD_REMOVE, delta))
    accountant = pld_privacy_accountant.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=VALUE_DISCRETIZATION * scale
    )
    for event in effective(events):
        gaussian = dp_accounting.GaussianDpEvent(event.noise_multiplier)
        one_step = gaussian if event.sample_rate == 1 else dp_accounting.PoissonSampledDpEvent(event.sample_rate, gaussian)
        accountant.compose(one_step, event.steps)
    return float(accountant.get_epsilon(delta))


_EPSILON = {ADD_REMOVE: add_remove_epsilon, REPLACE_ONE: replace_one_epsilon,
            REPLACE_PUBLIC_MEMBERSHIP: replace_public_membership_epsilon}


class PldAccountant:
    name = "pld"
    title = ("privacy-loss distribution (dp-accounting for add/remove and replace-one; closed form for replace-one "
             "with visible membership)")
    exact_for: frozenset[str] = frozenset(_EPSILON)
    largest_epsilon = LARGEST_EPSILON

    def supports(self, relation: str) -> bool:
        return relation in _EPSILON

    def epsilon(self, events: Sequence[Event], relation: str, delta: float) -> float:
        check_delta(delta)
        check_relation(relation)
        return _epsilon(tuple(effective(events)), relation, delta)


@functools.lru_cache(maxsize=256)
def _epsilon(events: tuple[Event, ...], relation: str, delta: float) -> float:
    """ε of merged events, remembered: a pure function of public values, which one site round asks
    for several times (the guard's spent and planned ε, the reply's report, the round's log)."""
    if not events:
        return 0.0
    if any(e.noise_multiplier == 0 for e in events):
        return math.inf
    return _EPSILON[relation](events, delta)
