"""Statistical checks on fresh (CSPRNG) randomness, with a false-failure rate that is negligible.

Noise and Poisson coins are drawn from OS entropy, so a goodness-of-fit test on them fails by
chance with probability α on every run — and with a dozen such tests, one CI run in a few thousand
goes red for nothing (a KS test at α = 1e-4 did, with p = 5e-5, on a sampler that passes at 2·10⁷
samples). :func:`pvalue_of_two_draws` tests a second, independent draw only when the first is
rejected: a correct sampler then fails with probability α², while a wrong one fails both draws
(the test's power on one draw, squared, is still ≈ 1 for any defect the check is sized for).
"""

from __future__ import annotations

from collections.abc import Callable


def pvalue_of_two_draws(pvalue_of_a_fresh_draw: Callable[[], float], alpha: float = 1e-4) -> float:
    """The p-value of a fresh draw, or — when it is at most ``alpha`` — of a second, independent one."""
    pvalue = pvalue_of_a_fresh_draw()
    return pvalue if pvalue > alpha else pvalue_of_a_fresh_draw()
