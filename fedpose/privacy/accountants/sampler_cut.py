"""What the noise sampler's cut costs: the δ that a Gaussian with a bounded tail adds to the ideal one.

The accountants compose ideal Gaussians. :class:`~fedpose.privacy.noise.SecureNoise` draws Box–Muller
pairs whose radius stops at T = √(106 ln 2) ≈ 8.57σ (a 53-bit uniform; ``noise.py``): the real
output is the ideal one conditioned on every pair lying inside that radius. That changes the
guarantee in two ways, both counted here and by :meth:`PrivacyLedger.get_epsilon
<fedpose.privacy.accountant.PrivacyLedger.get_epsilon>`:

1. **Outputs only one neighbour can produce.** Moving the noise's centre by s (in σ, the step's
   sensitivity over its noise std) puts some outputs of one neighbour outside the other's support.
   Pair i, moved by sᵢ (Σ sᵢ² ≤ s²), leaves the support only if its radius R lies in (T − sᵢ, T], and
   P(R > r) = exp(−r²/2) for a pair of standard normals, so the escape probability is at most
   Σᵢ exp(−T²/2)·u(sᵢ), u(x) = exp(Tx − x²/2) − 1. Its maximum over the shifts is bounded in two
   parts (:func:`tail_cut_delta`): pairs moved by x ≥ x_lo, where x(T − x) ≥ 2 makes u(x)/x²
   non-decreasing, add at most u(s) together; pairs moved by less, where u is convex with u(0) = 0,
   add at most u(x_lo)/x_lo · Σ sᵢ ≤ u(x_lo)/x_lo · s·√pairs (Cauchy–Schwarz). (The cruder
   pairs·exp(−(T − s)²/2), every pair moved by the whole s, holds for every s < T.)
2. **Densities scaled by 1/Z**, Z = (1 − 2⁻⁵³)^pairs the probability that a draw is not cut: on
   the outputs both neighbours can produce the likelihood ratio is the ideal one and each step's
   density at most the ideal one over Z.

So after steps t = 1..n, for every ε: δ_real(ε) ≤ δ_ideal(ε)/Zⁿ + Σₜ ηₜ/Z, where ηₜ bounds the
probability that the output leaves the region where both neighbours' densities are the ideal ones
over Z. For ``add_remove`` that region is the record-free centre's support (the output with the
record is a mixture, so the record-free side can land outside the sampled component's support):
ηₜ = escape(1/σ). For ``replace_one`` both sides are mixtures of the shared record-free component
and the replaced one: ηₜ = escape(1/σ) + q·escape(2/σ); ``replace_public_membership`` is bounded
by the same. The ledger accounts the ideal Gaussian at δ' = (δ − Σ ηₜ/Z)·Zⁿ, so its (ε, δ) is the
real sampler's.

The bound depends on the number of noise coordinates a step draws, which the ledger does not
record: it assumes :data:`MAX_NOISE_COORDINATES`, and :class:`~fedpose.privacy.noise.SecureNoise`
refuses larger draws. Measured cost (σ = 1, per step): ηₜ ≈ 1.3e-11, 1.3e-7 over 10⁴ steps, which
moves ε at δ = 1e-5 by about 1e-4; at σ = 0.5 it is 3.9e-10 per step.
"""

from __future__ import annotations

import math
from typing import Sequence

from fedpose.privacy.accountants.base import ADD_REMOVE, Event, check_relation

#: the largest |z|/σ SecureNoise can produce: √(−2 ln 2⁻⁵³), a Box–Muller radius from a 53-bit uniform
SECURE_TAIL_BOUND_SIGMAS = math.sqrt(2 * 53 * math.log(2))
#: the most noise coordinates one release may draw (the accounting's bound assumes it; 2²⁵ ≈ 33.6 M,
#: above tiny_vit_21m's 21 M parameters); SecureNoise refuses more
MAX_NOISE_COORDINATES = 1 << 25
#: P(a pair's radius is cut) = exp(−T²/2) = 2⁻⁵³
_PAIR_CUT_PROBABILITY = 2.0**-53


def _pairs(coordinates: int) -> int:
    return (int(coordinates) + 1) // 2


def tail_cut_delta(coordinates: int, shift_sigmas: float, tail_sigmas: float = SECURE_TAIL_BOUND_SIGMAS) -> float:
    """Upper bound on the probability that ``coordinates`` Gaussian coordinates, drawn in Box–Muller pairs
    whose radius stops at ``tail_sigmas``, leave the support of the same draw moved by ``shift_sigmas``
    standard deviations in ℓ2 (module docstring, 1.); 1 once the shift reaches the cut."""
    cut, shift = float(tail_sigmas), float(shift_sigmas)
    if shift <= 0:
        return 0.0
    if shift >= cut:
        return 1.0
    pairs = _pairs(coordinates)
    base = math.exp(-cut * cut / 2)
    crude = pairs * (math.exp(-(cut - shift) ** 2 / 2) - base)
    if cut * cut <= 8:
        return min(1.0, crude)
    root = math.sqrt(cut * cut - 8)
    low, high = (cut - root) / 2, (cut + root) / 2  # x(T − x) ≥ 2 between them

    def u(x: float) -> float:
        return math.expm1(cut * x - x * x / 2)

    slope = u(low) / low  # u(x) ≤ slope·x for x ≤ low (u convex there, u(0) = 0)
    if shift <= low:
        refined = base * slope * shift * math.sqrt(pairs)
    elif shift <= high:
        refined = base * (u(shift) + slope * shift * math.sqrt(pairs))
    else:
        refined = math.inf
    return min(1.0, crude, refined)


def _step_escape(event: Event, relation: str) -> float:
    """ηₜ of one step of ``event`` (module docstring)."""
    if event.noise_multiplier == 0:
        return 1.0
    one = tail_cut_delta(MAX_NOISE_COORDINATES, 1.0 / event.noise_multiplier)
    if relation == ADD_REMOVE:
        return one
    return min(1.0, one + event.sample_rate * tail_cut_delta(MAX_NOISE_COORDINATES, 2.0 / event.noise_multiplier))


def accountable_delta(events: Sequence[Event], relation: str, delta: float) -> float:
    """The δ' at which the ideal-Gaussian accountants must be asked for ε so that the real sampler's
    guarantee holds at ``delta`` (module docstring); ≤ 0 when the cut alone spends ``delta``."""
    check_relation(relation)
    released = [e for e in events if e.steps > 0 and e.sample_rate > 0]
    if not released:
        return float(delta)
    pair_cut = _PAIR_CUT_PROBABILITY * _pairs(MAX_NOISE_COORDINATES)  # 1 − Z ≤ this, per step
    escape = sum(e.steps * _step_escape(e, relation) for e in released) / (1 - pair_cut)
    density = 1 - sum(e.steps for e in released) * pair_cut  # Zⁿ ≥ 1 − n·(1 − Z)
    if density <= 0:
        return 0.0
    return (float(delta) - escape) * density
