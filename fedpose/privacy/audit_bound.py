"""The one-run lower bound on ε of Steinke, Nasr & Jagielski (2023, "Privacy auditing with one (1)
training run", NeurIPS; arXiv:2305.08846), from canary guesses.

m canaries are each included independently with probability ½. After one training run the auditor
guesses inclusion for r of them (abstaining on the rest) and gets v right. If the algorithm is
(ε, δ)-DP with respect to each canary, the number of correct guesses is dominated — up to a δ
term — by Binomial(r, e^ε/(1+e^ε)) (the paper's Theorem 3.1), so

    p(ε) = P[Binomial(r, p_ε) ≥ v] + 2·m·δ·max_{1≤i≤v} P[v > Binomial(r, p_ε) ≥ v − i] / i

(their Algorithm 2 / Proposition 5.7) bounds the probability of ≥ v correct guesses. The audit
rejects every ε with p(ε) < β = 1 − confidence: :func:`epsilon_lower_bound` is the largest such
ε (root of p(ε) = β, monotone increasing in ε). The auditor may try several guess counts r; it
then pays a Bonferroni factor (``:func:`best_lower_bound```), so the reported bound keeps its
confidence.

The f-DP variant of Mahloujifar, Melis & Chaudhuri (2024, "Auditing f-differential privacy in one
run", ICML 2025; arXiv:2410.22235) tests the same guesses against a whole tradeoff curve instead of
one (ε, δ) point: :func:`fdp_epsilon_lower_bound` rejects μ-Gaussian DP (the curve
G_μ(α) = Φ(Φ⁻¹(1 − α) − μ)) and reports the ε of the largest rejected μ at the audit's δ. A bound
on the per-canary (TPR, FPR) pair at every level, not only at e^ε, is what makes it tighter when
there are many guesses. It is a lower bound on the ε of the mechanism's Gaussian curve: exact for
the Gaussian mechanism, and for DP-SGD (a composition of subsampled Gaussians, whose curve is close
to Gaussian) a check of the claim, not a proof against an arbitrary (ε, δ)-DP mechanism.

jax-privacy's ``auditing`` module implements both bounds, but needs JAX (a second ML framework);
this module implements them on numpy/scipy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence

import numpy as np
from scipy import optimize, special, stats

from fedpose.privacy.accountants.pld import gaussian_delta


def p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """Upper bound on P[≥ ``correct`` right out of ``guesses``] for an (ε, δ)-DP algorithm (Algorithm 2)."""
    _check_counts(canaries, guesses, correct)
    p = float(special.expit(epsilon))  # accuracy of ε-DP randomized response: e^ε / (1 + e^ε)
    tail = float(stats.binom.sf(correct - 1, guesses, p))  # P[Binomial(r, p) ≥ v]
    if delta == 0 or correct == 0:
        return min(tail, 1.0)
    shifts = np.arange(1, correct + 1)
    # P[v > Binomial(r, p) ≥ v − i] for i = 1..v
    window = stats.binom.sf(correct - shifts - 1, guesses, p) - tail
    alpha = float(np.max(window / shifts))
    return min(tail + 2.0 * canaries * delta * alpha, 1.0)


def epsilon_lower_bound(canaries: int, guesses: int, correct: int, delta: float, confidence: float) -> float:
    """The largest ε rejected at ``confidence``: the algorithm is not (ε, δ)-DP for any smaller ε
    (with probability ≥ ``confidence`` over the canaries' coins). 0 when nothing is rejected."""
    _check_counts(canaries, guesses, correct)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1), got {delta}")
    significance = 1.0 - confidence
    if p_value(canaries, guesses, correct, 0.0, delta) >= significance:
        return 0.0

    def excess(epsilon: float) -> float:
        return p_value(canaries, guesses, correct, epsilon, delta) - significance

    high = 1.0
    while excess(high) < 0:
        high *= 2
        if high > 1e3:  # v = r = m with δ = 0 can reject every ε: report the cap, never ∞
            return math.inf
    low = high / 2 if high > 1.0 else 0.0
    # The lower end of the bracket: the reported bound never exceeds what the data rejects.
    return float(optimize.brentq(excess, low, high, xtol=1e-9)) * (1 - 1e-9)


_STANDARD_NORMAL = NormalDist()


def gaussian_epsilon(mu: float, delta: float) -> float:
    """ε at ``delta`` of μ-Gaussian DP: the root of δ_G(ε; μ) = δ (0 when δ_G(0; μ) ≤ δ already)."""
    if not 0 < delta < 1:
        raise ValueError(f"a Gaussian curve's ε needs δ in (0, 1) (δ = 0 gives ε = ∞), got {delta}")

    def excess(epsilon: float) -> float:
        return float(gaussian_delta(epsilon, np.array([mu]))[0]) - delta

    if mu <= 0 or excess(0.0) <= 0:
        return 0.0
    high = 1.0
    while excess(high) > 0:  # δ_G(ε; μ) falls to 0 as ε grows
        high *= 2
    return float(optimize.brentq(excess, high / 2 if high > 1 else 0.0, high, xtol=1e-10))


def fdp_rejects(canaries: int, guesses: int, correct: int, mu: float, significance: float) -> bool:
    """Whether ≥ ``correct`` right out of ``guesses`` rejects μ-Gaussian DP at ``significance``
    (the recursion of Mahloujifar et al. 2024 for a tradeoff curve f, here f = G_μ).

    Suppose the mechanism were μ-GDP and the event "≥ v correct" had probability ≥ β. Per canary, a
    guess is a test between "in" and "out", so over the canaries the mass of right guesses r and of
    wrong ones h (expected counts / m) must satisfy h ≥ f̄⁻¹(r) = Φ(Φ⁻¹(r) − μ), the least
    false-positive rate G_μ allows next to true-positive rate r. The event alone forces
    r ≥ β·v/m and h ≥ β·(k − v)/m; each time the curve forces more wrong mass, the outcomes with
    i correct guesses (i = v − 1, …, 0, each adding i right per k − i wrong) force more right mass,
    and so on. If the forced total exceeds the k/m that k guesses can carry, no μ-GDP mechanism
    produces the observation with probability β: μ-GDP is rejected.
    """
    _check_counts(canaries, guesses, correct)
    right = significance * correct / canaries
    wrong = significance * (guesses - correct) / canaries
    for i in range(correct - 1, -1, -1):
        needed = 1.0 if right >= 1.0 else _STANDARD_NORMAL.cdf(_STANDARD_NORMAL.inv_cdf(right) - mu)
        if needed <= wrong:  # the curve forces nothing more, now or later
            break
        right = min(1.0, right + i / (guesses - i) * (needed - wrong))
        wrong = needed
    return right + wrong > guesses / canaries


def fdp_epsilon_lower_bound(canaries: int, guesses: int, correct: int, delta: float, confidence: float) -> float:
    """The ε at ``delta`` of the largest μ for which μ-Gaussian DP is rejected at ``confidence``
    (0 when nothing is rejected). Rejection is monotone in μ: a smaller μ is a stronger claim."""
    _check_counts(canaries, guesses, correct)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    significance = 1.0 - confidence

    def rejected(mu: float) -> bool:
        return fdp_rejects(canaries, guesses, correct, mu, significance)

    if not rejected(1e-9):
        return 0.0
    low, high = 1e-9, 1.0
    while rejected(high):  # G_μ → the no-privacy curve as μ → ∞, and that is never rejected
        low, high = high, high * 2
    while high - low > 1e-7 * high:
        middle = (low + high) / 2
        low, high = (middle, high) if rejected(middle) else (low, middle)
    return gaussian_epsilon(low, delta)  # the rejected end: the bound never exceeds what the data rejects


@dataclass(frozen=True)
class GuessResult:
    """The best bound over the tried guesses and both analyses, and the guesses that gave it."""

    epsilon_lower: float  #: max(epsilon_lower_steinke, epsilon_lower_fdp)
    guesses: int  #: r
    correct: int  #: v
    guesses_in: int  #: how many of the r were "included" guesses (the top scores)
    tried: int  #: tests tried (guess splits × analyses: the Bonferroni factor)
    epsilon_lower_steinke: float = 0.0  #: Steinke, Nasr & Jagielski 2023 ((ε, δ)-DP rejected)
    epsilon_lower_fdp: float = 0.0  #: Mahloujifar et al. 2024 (μ-Gaussian DP rejected, as ε at δ)


def guess_fractions_default() -> tuple[float, ...]:
    return (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def best_lower_bound(
    scores: Sequence[float],
    included: Sequence[bool],
    delta: float,
    confidence: float,
    fractions: Sequence[float] = guess_fractions_default(),
) -> GuessResult:
    """Guess from the scores — r = f·m guesses for each fraction f, either all "included" for the r
    highest scores, or split evenly between "included" for the highest and "excluded" for the lowest
    — and keep the best bound of both analyses (Steinke's (ε, δ) test and the f-DP test, the latter
    only for δ > 0), each test at significance (1 − confidence)/(number of tests) (Bonferroni), so
    the result, and both per-analysis values, hold at ``confidence``.

    Top-only guessing suits add/remove canaries (an excluded canary adds nothing, so low scores are
    ambiguous); the even split suits replace-one canaries (±C·d: both tails are informative)."""
    scores = np.asarray(scores, dtype=float)
    included = np.asarray(included, dtype=bool)
    if scores.shape != included.shape or scores.ndim != 1 or scores.size == 0:
        raise ValueError("scores and included must be equal-length, non-empty 1-D sequences")
    m = int(scores.size)
    order = np.argsort(-scores, kind="stable")  # highest first
    counts = sorted({max(1, min(m, int(round(f * m)))) for f in fractions})
    splits = sorted({(r, top) for r in counts for top in (r, (r + 1) // 2)})  # (guesses, of which "included")
    analyses = 2 if delta > 0 else 1  # a Gaussian curve has ε = ∞ at δ = 0: no f-DP ε to report
    tests = len(splits) * analyses
    per_test_confidence = 1.0 - (1.0 - confidence) / tests
    best = GuessResult(0.0, 0, 0, 0, tests)
    steinke = fdp = 0.0
    for r, top in splits:
        bottom = r - top
        correct = int(included[order[:top]].sum()) + (int((~included[order[m - bottom:]]).sum()) if bottom else 0)
        split_steinke = epsilon_lower_bound(m, r, correct, delta, per_test_confidence)
        split_fdp = fdp_epsilon_lower_bound(m, r, correct, delta, per_test_confidence) if analyses == 2 else 0.0
        steinke, fdp = max(steinke, split_steinke), max(fdp, split_fdp)
        if max(split_steinke, split_fdp) > best.epsilon_lower:
            best = GuessResult(max(split_steinke, split_fdp), r, correct, top, tests)
    return GuessResult(best.epsilon_lower, best.guesses, best.correct, best.guesses_in, tests, steinke, fdp)


def _check_counts(canaries: int, guesses: int, correct: int) -> None:
    if not (0 <= correct <= guesses <= canaries):
        raise ValueError(f"need 0 ≤ correct ≤ guesses ≤ canaries, got {correct}, {guesses}, {canaries}")
