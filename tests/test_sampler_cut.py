"""The noise sampler stops at 8.57σ; the reported δ counts what that cut costs (accountants/sampler_cut.py).

The bound is checked where it can be measured: with a cut at a few σ (the same bound, ``tail_sigmas``
smaller), the escape probability is sampled and the exact hockey-stick divergence of the truncated
Gaussians is integrated on a grid. The ledger is checked to ask its accountant at the δ the cut leaves.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedpose.privacy.accountant import PrivacyLedger
from fedpose.privacy.accountants import get_accountant
from fedpose.privacy.accountants.base import ADD_REMOVE, REPLACE_ONE, Event
from fedpose.privacy.accountants.pld import gaussian_delta
from fedpose.privacy.accountants.sampler_cut import (
    MAX_NOISE_COORDINATES,
    SECURE_TAIL_BOUND_SIGMAS,
    accountable_delta,
    tail_cut_delta,
)
from fedpose.privacy.noise import SecureNoise

CUT = 3.5  # a cut low enough to sample: escape probabilities ~1e-3


def _truncated_pairs(rng: np.random.Generator, draws: int, pairs: int, cut: float) -> np.ndarray:
    """``draws`` × ``pairs`` × 2 standard normals, each pair conditioned on radius ≤ ``cut`` (Box–Muller
    with the radius uniform's range ending where SecureNoise's does, scaled to this cut)."""
    floor = math.exp(-cut * cut / 2)  # u ≥ this ⇔ radius ≤ cut
    u = rng.uniform(floor, 1.0, (draws, pairs))
    radius, angle = np.sqrt(-2 * np.log(u)), rng.uniform(-math.pi, math.pi, (draws, pairs))
    return np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=-1)


@pytest.mark.parametrize("pairs,spread", [(1, "one pair"), (40, "one pair"), (40, "even"), (40, "random")])
@pytest.mark.parametrize("shift", [0.3, 1.0, 2.0])
def test_escape_probability_is_bounded_however_the_shift_is_spread(pairs: int, spread: str, shift: float) -> None:
    rng = np.random.default_rng(0)
    if spread == "one pair":
        move = np.zeros((pairs, 2))
        move[0, 0] = shift
    elif spread == "even":
        move = np.full((pairs, 2), shift / math.sqrt(2 * pairs))
    else:
        move = rng.standard_normal((pairs, 2))
        move *= shift / np.linalg.norm(move)
    noise = _truncated_pairs(rng, 200_000, pairs, CUT)
    escaped = (np.linalg.norm(noise + move, axis=-1) > CUT).any(axis=1).mean()
    bound = tail_cut_delta(2 * pairs, shift, tail_sigmas=CUT)
    assert escaped <= bound * 1.05 + 3e-4  # sampling error: ≤ 200k draws
    if spread == "one pair" and pairs == 1:
        assert bound <= 5 * escaped  # and not vacuous where the whole shift sits in one pair


def test_exact_hockey_stick_of_truncated_gaussians_is_within_the_bound() -> None:
    """One pair cut at 3σ, neighbours one σ apart: the real δ(ε), integrated on a grid, exceeds the
    ideal Gaussian's (the cut is real) and stays below δ_G(ε)/Z + escape/Z (the ledger's rule)."""
    cut, shift, h = 3.0, 1.0, 0.004
    x, y = np.meshgrid(np.arange(-cut - 0.01, cut + shift + 0.01, h), np.arange(-cut - 0.01, cut + 0.01, h), indexing="ij")
    z = 1 - math.exp(-cut * cut / 2)
    phi = np.exp(-(x * x + y * y) / 2) / (2 * math.pi)
    phi_moved = np.exp(-((x - shift) ** 2 + y * y) / 2) / (2 * math.pi)
    p = phi * (np.hypot(x, y) <= cut) / z
    q = phi_moved * (np.hypot(x - shift, y) <= cut) / z
    for epsilon in (0.0, 0.5, 1.0, 2.0):
        real = float(np.maximum(q - math.exp(epsilon) * p, 0).sum() * h * h)
        ideal = float(gaussian_delta(epsilon, np.array([shift]))[0])
        bound = ideal / z + tail_cut_delta(2, shift, tail_sigmas=cut) / z
        assert real <= bound + 2e-4
        if epsilon == 2.0:
            assert real > ideal + 1e-3  # at ε = 2 the outputs only one side can produce dominate


def test_the_bound_holds_for_every_shift_below_the_cut_and_grows_with_it() -> None:
    shifts = np.linspace(0.0, SECURE_TAIL_BOUND_SIGMAS, 200)
    values = [tail_cut_delta(MAX_NOISE_COORDINATES, s) for s in shifts]
    assert values == sorted(values) and values[0] == 0.0 and values[-1] == 1.0
    # per DP-SGD step at σ = 1 and 0.5, for the largest draw the accounting allows
    assert 1e-11 < tail_cut_delta(MAX_NOISE_COORDINATES, 1.0) < 2e-11
    assert 3e-10 < tail_cut_delta(MAX_NOISE_COORDINATES, 2.0) < 5e-10


def test_the_ledger_asks_its_accountant_at_the_delta_the_cut_leaves() -> None:
    events = [Event(0.9, 0.05, 4000)]
    for relation in (ADD_REMOVE, REPLACE_ONE):
        left = accountable_delta(events, relation, 1e-5)
        assert 1e-5 - 1e-6 < left < 1e-5 - 4000 * tail_cut_delta(MAX_NOISE_COORDINATES, 1 / 0.9)
        ledger = PrivacyLedger(relation=relation, accountant="pld")
        ledger.step(0.9, 0.05, 4000)
        epsilon = ledger.get_epsilon(1e-5)[0]
        assert epsilon == get_accountant("pld").epsilon(events, relation, left)
        assert epsilon > get_accountant("pld").epsilon(events, relation, 1e-5)  # never the ideal Gaussian's


def test_noise_so_small_that_the_cut_spends_delta_gives_infinite_epsilon() -> None:
    """σ = 0.1: a record moves the noise by 10σ, past the 8.57σ cut; outputs of one neighbour are impossible
    under the other with probability ~q per step, so no finite ε holds at δ = 1e-5."""
    ledger = PrivacyLedger(accountant="pld")
    ledger.step(0.1, 0.01, 10)
    assert accountable_delta(ledger.events, ADD_REMOVE, 1e-5) <= 0
    assert ledger.get_epsilon(1e-5)[0] == math.inf
    rdp_ledger = ledger.with_accountant("rdp")
    assert rdp_ledger.get_epsilon(1e-5)[0] == math.inf


def test_secure_noise_refuses_draws_the_bound_does_not_cover() -> None:
    with pytest.raises(ValueError, match="33,554,432"):
        SecureNoise().normal(MAX_NOISE_COORDINATES + 1, 1.0)
