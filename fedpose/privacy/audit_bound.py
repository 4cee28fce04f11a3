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

jax-privacy's ``auditing`` module implements the same bound, but needs JAX (a second ML framework);
this module is the paper's Algorithm 2 on numpy/scipy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import optimize, special, stats


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


@dataclass(frozen=True)
class GuessResult:
    """The best bound over the tried guess counts, and the guesses that gave it."""

    epsilon_lower: float
    guesses: int  #: r
    correct: int  #: v
    guesses_in: int  #: how many of the r were "included" guesses (the top scores)
    tried: int  #: guess counts tried (the Bonferroni factor)


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
    — and keep the best bound, each computed at significance (1 − confidence)/(number of tries)
    (Bonferroni), so the result holds at ``confidence``.

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
    per_test_confidence = 1.0 - (1.0 - confidence) / len(splits)
    best = GuessResult(0.0, 0, 0, 0, len(splits))
    for r, top in splits:
        bottom = r - top
        correct = int(included[order[:top]].sum()) + (int((~included[order[m - bottom:]]).sum()) if bottom else 0)
        bound = epsilon_lower_bound(m, r, correct, delta, per_test_confidence)
        if bound > best.epsilon_lower:
            best = GuessResult(bound, r, correct, top, len(splits))
    return best


def _check_counts(canaries: int, guesses: int, correct: int) -> None:
    if not (0 <= correct <= guesses <= canaries):
        raise ValueError(f"need 0 ≤ correct ≤ guesses ≤ canaries, got {correct}, {guesses}, {canaries}")
