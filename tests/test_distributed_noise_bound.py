"""The Skellam accounting of ``benchmarks/distributed_noise`` is a true upper bound.

The benchmark prices distributed noise with it, so a bound that were too small would make the
lever look better than it is. Checked against quantities computed independently: the exact
subsampled-Gaussian RDP of dp-accounting (for the subsampling bound) and the Rényi divergence of
two shifted one-dimensional Skellam distributions summed over their support (for the one-step bound).
"""

from __future__ import annotations


import numpy as np
import pytest
from scipy.special import ive, logsumexp

from benchmark_modules import BENCHMARKS, load_benchmark_module
from fedpose.privacy.accountants.rdp import add_remove_rdp

SKELLAM = BENCHMARKS / "distributed_noise" / "skellam.py"


@pytest.fixture(scope="module")
def skellam():
    return load_benchmark_module(SKELLAM, "distributed_noise_skellam")


@pytest.mark.parametrize("sigma", [0.8, 1.5, 3.0])
@pytest.mark.parametrize("sample_rate", [0.01, 16 / 120, 0.5])
def test_subsampling_bound_is_never_below_the_exact_subsampled_gaussian(skellam, sigma, sample_rate):
    """Fed the Gaussian's RDP, Zhu & Wang's general bound must cover dp-accounting's exact curve."""
    orders = list(range(2, 41))
    exact = add_remove_rdp(sample_rate, sigma, 1, orders)
    bound = np.array([skellam.poisson_subsampled_rdp(a, sample_rate, lambda l: l / (2 * sigma**2)) for a in orders])
    assert np.all(bound >= exact * (1 - 1e-9))
    assert np.all(bound <= np.array(orders) / (2 * sigma**2) + 1e-12)  # never above the unsampled mechanism


def test_subsampling_bound_at_rate_one_is_the_mechanism(skellam):
    assert skellam.poisson_subsampled_rdp(7, 1.0, lambda l: l / 2.0) == pytest.approx(3.5)
    assert skellam.poisson_subsampled_rdp(7, 0.0, lambda l: l / 2.0) == 0.0
    with pytest.raises(ValueError, match="integer order"):
        skellam.poisson_subsampled_rdp(2.5, 0.1, lambda l: l / 2.0)


def _skellam_logpmf(x: np.ndarray, variance: float) -> np.ndarray:
    """log P(Sk = x) for Sk = Pois(μ/2) − Pois(μ/2): e^{−μ}·I_|x|(μ) = ive(|x|, μ)."""
    with np.errstate(divide="ignore"):
        return np.log(ive(np.abs(x), variance))


@pytest.mark.parametrize("variance", [1.0, 5.0, 20.0, 200.0])
@pytest.mark.parametrize("shift", [1, 3])
def test_one_step_bound_covers_the_exact_one_dimensional_divergence(skellam, variance, shift):
    """d = 1, sensitivity k: Δ₁ = Δ₂ = k; D_α(Sk + k ‖ Sk) summed over the support (the tails
    beyond float range carry nothing) stays below Agarwal et al.'s bound at every order."""
    x = np.arange(-3000, 3001)
    log_p, log_q = _skellam_logpmf(x, variance), _skellam_logpmf(x - shift, variance)
    finite = np.isfinite(log_p) & np.isfinite(log_q)
    assert np.exp(logsumexp(log_p[finite])) == pytest.approx(1.0, abs=1e-9)
    for order in (2, 3, 5, 10, 30):
        divergence = logsumexp(order * log_q[finite] + (1 - order) * log_p[finite]) / (order - 1)
        assert divergence <= skellam.skellam_rdp(order, variance, shift, shift) + 1e-9


def test_calibrated_noise_meets_its_target_and_no_less_would(skellam):
    kwargs = dict(max_grad_norm=1.0, scale=4096.0, dimension=6576, sample_rate=16 / 120, steps=80)
    sigma = skellam.noise_multiplier_for(8.0, 1e-5, **kwargs, rel_tolerance=1e-3)

    def eps(s: float) -> float:
        event = skellam.SkellamEvent.rounded(s, kwargs["max_grad_norm"], kwargs["scale"], kwargs["dimension"],
                                             kwargs["sample_rate"], kwargs["steps"])
        return skellam.epsilon([event], 1e-5)

    assert eps(sigma) <= 8.0 < eps(sigma - 2e-3)
    # the rounding's sensitivities are deterministic triangle-inequality bounds
    event = skellam.SkellamEvent.rounded(sigma, 1.0, 4096.0, 6576, 0.1, 1)
    assert event.l2_sensitivity == pytest.approx(4096.0 + 6576**0.5)
    assert event.l1_sensitivity == pytest.approx(6576**0.5 * event.l2_sensitivity)
