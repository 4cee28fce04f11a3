"""Distributed discrete noise: the Poisson-subsampled Skellam mechanism, add/remove one unit (RDP).

Why Skellam. Under secure aggregation the coordinator sees only the sum of the sites' vectors, so the
noise that protects a patient may be split: each of h sites adds a share and the sum carries the
whole. Secure aggregation adds integers modulo M, so the shares must be integers; a symmetric Skellam
variable Sk(μ) = Pois(μ/2) − Pois(μ/2) (variance μ) is integer, and a sum of independent Skellams is
again Skellam with the variances added — exactly, not approximately as for discrete Gaussians
(Agarwal, Kairouz & Liu, NeurIPS 2021). Continuous Gaussian shares rounded one by one would not do:
the sum of rounded values is not a post-processing of (signal + total noise).

One step (the mechanism this module accounts for). Each sampled unit's clipped gradient g
(‖g‖₂ ≤ C) is scaled by γ and rounded to integers at random, r = round(γ·g); the r of all sampled
units are summed and Skellam noise of variance μ per coordinate is added. Add/remove-one neighbours
differ by one unit's r. Rounding moves each of the d coordinates by less than 1, so, deterministically
(no conditional rounding needed),

    Δ₂ = ‖r‖₂ ≤ γC + √d,        Δ₁ = ‖r‖₁ ≤ √d·γC + d.

RDP of one step without sampling (Agarwal et al. 2021, Thm. 3.5), integer α ≥ 2:

    ε(α) ≤ α·Δ₂²/(2μ) + min{ ((2α − 1)·Δ₂² + 6·Δ₁) / (4μ²),  3·Δ₁/(2μ) }.

The first term is the Gaussian mechanism's with σ = √μ/Δ₂ (the noise multiplier); the min is the
price of being discrete, negligible once μ is large (μ ≈ 10⁷ at γC = 4096).

Poisson subsampling with rate q (Zhu & Wang, ICML 2019, Thm. 6: the general upper bound, valid for
any mechanism with RDP ε(·) at integer orders; add/remove-one):

    e^{(α−1)·ε_q(α)} ≤ (1−q)^{α−1}(αq − q + 1) + C(α,2)·q²(1−q)^{α−2}·e^{ε(2)}
                       + 3·Σ_{l=3..α} C(α,l)·q^l(1−q)^{α−l}·e^{(l−1)·ε(l)},

and ε_q(α) ≤ ε(α) (joint convexity). Steps compose additively; ε at δ by Balle et al. 2020
(:func:`~fedpose.privacy.accountants.rdp.rdp_to_epsilon`). Only integer orders are valid here.

This is an upper bound, not the tight ε: fed the Gaussian's RDP, the subsampling bound is up to
3.5× the exact subsampled-Gaussian RDP at some orders (σ 2.63, q 16/120), and RDP itself is 5–15 %
looser than PLD at DP-SGD settings (FACTS.md). Every ε of this module is therefore labelled "RDP
(Skellam)".

It lives with the benchmark that uses it (``run.py`` here), not in ``fedpose/``: no site adds
Skellam noise today, and the benchmark measures what doing so would buy (see ``results.md``). The
factor 3 is what makes this bound loose: without it the sum above is, for the Gaussian, exactly
the subsampled Gaussian's RDP at integer orders (checked here to 1e-12), and the Skellam σ would
fall to the Gaussian's under RDP (about 7 % above PLD's). Steinke (2022) states a Poisson-subsampling
bound of that form for any mechanism under add/remove; it is not used here because its statement
and conditions could not be checked against the paper from this machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from scipy.special import gammaln

from fedpose.privacy.accountant import smallest_noise_multiplier
from fedpose.privacy.accountants.base import check_delta
from fedpose.privacy.accountants.rdp import rdp_to_epsilon

#: integer RDP orders (the bounds hold only there); large orders for small ε, as in :mod:`.rdp`
ORDERS: tuple[int, ...] = tuple(range(2, 64)) + (80, 96, 128, 160, 192, 256, 384, 512, 768, 1024)


@dataclass(frozen=True)
class SkellamEvent:
    """``steps`` Poisson-subsampled Skellam steps: integer sensitivities Δ₂, Δ₁, noise variance μ
    per coordinate (the *total* the protected sum carries), each unit sampled with probability q."""

    variance: float
    l2_sensitivity: float
    l1_sensitivity: float
    sample_rate: float
    steps: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.variance) and self.variance > 0):
            raise ValueError(f"skellam: variance must be finite and > 0, got {self.variance!r}")
        if not (self.l2_sensitivity > 0 and self.l1_sensitivity >= self.l2_sensitivity):
            raise ValueError(f"skellam: need Δ₁ ≥ Δ₂ > 0, got Δ₂ {self.l2_sensitivity!r}, Δ₁ {self.l1_sensitivity!r}")
        if not 0 <= self.sample_rate <= 1:
            raise ValueError(f"skellam: sample_rate must be in [0, 1], got {self.sample_rate!r}")
        if not (isinstance(self.steps, int) and self.steps >= 0):
            raise ValueError(f"skellam: steps must be an integer ≥ 0, got {self.steps!r}")

    @classmethod
    def rounded(cls, noise_multiplier: float, max_grad_norm: float, scale: float, dimension: int,
                sample_rate: float, steps: int) -> "SkellamEvent":
        """The event of the mechanism in the module docstring: units clipped to C, scaled by γ,
        rounded at random in d coordinates; μ = (σ·Δ₂)², so σ is the Gaussian noise multiplier
        the leading RDP term has."""
        if not (noise_multiplier > 0 and max_grad_norm > 0 and scale > 0 and dimension >= 1):
            raise ValueError("skellam: noise_multiplier, max_grad_norm, scale and dimension must be > 0")
        l2 = scale * max_grad_norm + math.sqrt(dimension)
        l1 = math.sqrt(dimension) * scale * max_grad_norm + dimension
        return cls((noise_multiplier * l2) ** 2, l2, l1, sample_rate, steps)


def skellam_rdp(order: int | np.ndarray, variance: float, l2_sensitivity: float, l1_sensitivity: float) -> float | np.ndarray:
    """RDP at integer ``order`` (or an array of them) of one Skellam release without sampling (Thm. 3.5 above)."""
    alpha, mu, l2, l1 = order, variance, l2_sensitivity, l1_sensitivity
    return alpha * l2**2 / (2 * mu) + np.minimum(((2 * alpha - 1) * l2**2 + 6 * l1) / (4 * mu**2), 3 * l1 / (2 * mu))


def poisson_subsampled_rdp(order: int, sample_rate: float, rdp: Callable[[np.ndarray], np.ndarray]) -> float:
    """Zhu & Wang's general upper bound (module docstring) on the RDP at integer ``order`` ≥ 2 of a
    mechanism with RDP ``rdp(l)`` (evaluated on an array of integer orders) run on a Poisson sample
    of rate q; never above ``rdp(order)``."""
    alpha, q = int(order), float(sample_rate)
    if alpha != order or alpha < 2:
        raise ValueError(f"skellam: the subsampling bound needs an integer order ≥ 2, got {order!r}")
    if q == 0:
        return 0.0
    unsampled = float(rdp(np.array([alpha]))[0])
    if q == 1:
        return unsampled
    log_q, log_1q = math.log(q), math.log1p(-q)
    l = np.arange(2, alpha + 1)
    log_binom = gammaln(alpha + 1) - gammaln(l + 1) - gammaln(alpha - l + 1)
    log_terms = log_binom + l * log_q + (alpha - l) * log_1q + (l - 1) * rdp(l)
    log_terms[1:] += math.log(3)  # l ≥ 3 carry the factor 3; l = 2 has e^{ε(2)} = e^{(l−1)·ε(l)} and none
    first = (alpha - 1) * log_1q + math.log(alpha * q - q + 1)
    return min(float(np.logaddexp.reduce(np.append(log_terms, first))) / (alpha - 1), unsampled)


def rdp_curve(events: Sequence[SkellamEvent], orders: Sequence[int] = ORDERS) -> np.ndarray:
    """Total RDP at each order: the sum over events of steps × the subsampled one-step bound."""
    total = np.zeros(len(orders))
    for event in events:
        if event.steps == 0 or event.sample_rate == 0:
            continue
        def one_step(l: np.ndarray, e: SkellamEvent = event) -> np.ndarray:
            return skellam_rdp(l, e.variance, e.l2_sensitivity, e.l1_sensitivity)

        total += event.steps * np.array([poisson_subsampled_rdp(a, event.sample_rate, one_step) for a in orders])
    return total


def epsilon(events: Sequence[SkellamEvent], delta: float, orders: Sequence[int] = ORDERS) -> float:
    """ε at ``delta`` after all ``events`` (an upper bound: RDP, then Balle et al. 2020)."""
    check_delta(delta)
    if not any(e.steps and e.sample_rate for e in events):
        return 0.0
    return rdp_to_epsilon(rdp_curve(events, orders), delta, orders)[0]


def noise_multiplier_for(target_epsilon: float, delta: float, *, max_grad_norm: float, scale: float, dimension: int,
                         sample_rate: float, steps: int, rel_tolerance: float = 1e-4) -> float:
    """The smallest σ (to ``rel_tolerance``) whose :meth:`SkellamEvent.rounded` steps stay within
    ``target_epsilon`` at ``delta`` (the library's bisection, ε being decreasing in σ)."""
    if not target_epsilon > 0:
        raise ValueError(f"skellam: target ε must be > 0, got {target_epsilon!r}")

    def eps_at(sigma: float) -> float:
        return epsilon([SkellamEvent.rounded(sigma, max_grad_norm, scale, dimension, sample_rate, steps)], delta)

    return smallest_noise_multiplier(eps_at, target_epsilon, rel_tolerance=rel_tolerance,
                                     where=f" (Skellam) at sample rate {sample_rate}, {steps} steps, δ = {delta}")
