"""Noise sources: the default CSPRNG Gaussian/uniform draws are statistically right and never
reproducible; the seeded source is reproducible and says it is not private."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
from scipy import stats

from fedpose.config import RunConfig
from fedpose.privacy.csprng import AesCtrBytes
from fedpose.privacy.noise import (
    SECURE_TAIL_BOUND_SIGMAS,
    InsecureSeededNoise,
    SecureNoise,
    make_noise,
)
from fresh_draws import pvalue_of_two_draws

#: enough samples for 4σ tails (expected ≈ 127 beyond 4σ) while keeping the test ~1 s
SAMPLES = 2_000_001  # odd: the Box–Muller pair split must handle it


def _standard_sample() -> np.ndarray:
    return SecureNoise().normal(SAMPLES, 3.0).double().numpy() / 3.0


@pytest.fixture(scope="module")
def secure_sample() -> np.ndarray:
    return _standard_sample()


def test_secure_gaussian_mean_std_and_shape(secure_sample: np.ndarray) -> None:
    n = secure_sample.size
    assert n == SAMPLES
    assert abs(secure_sample.mean()) < 5 / math.sqrt(n)
    # chi-square of n·s² against χ²(n), central 1 − 1e-6 (fresh noise: a wider band would fail by
    # chance; a σ off by 1 % still moves the statistic by 20 of its standard deviations)
    statistic = float((secure_sample**2).sum())
    assert stats.chi2.ppf(5e-7, n) < statistic < stats.chi2.ppf(1 - 5e-7, n)
    assert pvalue_of_two_draws(lambda: stats.kstest(_standard_sample(), "norm").pvalue) > 1e-4
    # the cos and sin halves are independent standard normals too
    half = SAMPLES // 2
    assert abs(np.corrcoef(secure_sample[:half], secure_sample[half: 2 * half])[0, 1]) < 5 / math.sqrt(half)


def test_secure_gaussian_has_its_tails(secure_sample: np.ndarray) -> None:
    n = secure_sample.size
    for threshold in (3.0, 4.0):
        expected = n * 2 * stats.norm.sf(threshold)
        beyond = int((np.abs(secure_sample) > threshold).sum())
        assert abs(beyond - expected) < 5 * math.sqrt(expected), (threshold, beyond, expected)
    assert np.abs(secure_sample).max() <= SECURE_TAIL_BOUND_SIGMAS


class _ConstantKeystream(AesCtrBytes):
    """Keystream of one repeated byte: drives the transform to its extremes."""

    def __init__(self, byte: int) -> None:
        self.byte = byte

    def fill(self, out: np.ndarray, count: int) -> np.ndarray:
        out[:count] = self.byte
        return out[:count]


def test_tail_bound_is_the_53_bit_uniform_not_float32() -> None:
    source = SecureNoise()
    source._keystream = _ConstantKeystream(0)  # m = 0 → u = 2⁻⁵³ (the smallest), angle 0
    z = source.normal(4, 2.0)
    assert torch.allclose(z[:2], torch.full((2,), 2.0 * SECURE_TAIL_BOUND_SIGMAS))  # cos 0 = 1
    assert SECURE_TAIL_BOUND_SIGMAS == pytest.approx(8.572, abs=1e-3)
    assert torch.allclose(z[2:], torch.zeros(2), atol=1e-6)  # sin 0 = 0
    source._keystream = _ConstantKeystream(0xFF)  # m = 2⁵³ − 1 → u = 1 → radius 0
    assert torch.equal(source.normal(3, 2.0), torch.zeros(3))


def test_secure_float64_normals_for_numpy_users() -> None:
    z = SecureNoise().normal(100_001, 0.5, torch.float64)
    assert z.dtype == torch.float64 and z.shape == (100_001,)
    assert pvalue_of_two_draws(
        lambda: stats.kstest(SecureNoise().normal(100_001, 0.5, torch.float64).numpy() / 0.5, "norm").pvalue) > 1e-4


@pytest.mark.parametrize("size", [0, 1, 2, 3, 65_536 * 2 + 1])
def test_secure_sizes_across_chunk_boundaries(size: int) -> None:
    z = SecureNoise().normal(size, 1.0)
    assert z.shape == (size,) and z.dtype == torch.float32 and bool(torch.isfinite(z).all())


def test_secure_uniforms_are_53_bit_in_unit_interval() -> None:
    u = SecureNoise().uniform(500_000)
    assert u.dtype == torch.float64 and u.shape == (500_000,)
    values = u.numpy()
    assert values.min() >= 0.0 and values.max() < 1.0
    assert pvalue_of_two_draws(lambda: stats.kstest(SecureNoise().uniform(500_000).numpy(), "uniform").pvalue) > 1e-4
    scaled = values * 2.0**53
    assert np.array_equal(scaled, np.floor(scaled))  # on the 2⁻⁵³ grid
    assert (scaled % 2**21 != 0).mean() > 0.99  # and the low bits are used


def test_secure_streams_differ_between_instances_and_draws() -> None:
    a, b = SecureNoise(), SecureNoise()
    first = a.normal(1000, 1.0)
    assert not torch.equal(first, b.normal(1000, 1.0))
    assert not torch.equal(first, a.normal(1000, 1.0))
    assert not torch.equal(a.uniform(1000), b.uniform(1000))


def test_no_config_value_or_global_seed_influences_secure_noise() -> None:
    assert list(inspect.signature(SecureNoise).parameters) == []  # nothing to pass a seed through
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        np.random.seed(0)
        source = make_noise(None)  # what the engine builds unless insecure_seeded_noise is set
        assert isinstance(source, SecureNoise) and source.secure
        source.reseed(1, 0)  # the engine's (purpose, step) keys are ignored
        draws.append(source.normal(1000, 1.0))
    assert not torch.equal(draws[0], draws[1])
    assert "os.urandom" in SecureNoise.description
    assert RunConfig().privacy.insecure_seeded_noise is False  # the default config is private


def test_insecure_seeded_noise_is_reproducible_and_labelled() -> None:
    a, b = make_noise(4), InsecureSeededNoise(4)
    assert isinstance(a, InsecureSeededNoise) and not a.secure
    assert a.description == "seeded torch.Generator (seed 4): NOT PRIVATE, tests only"
    a.reseed(2, 7)
    b.reseed(2, 7)
    assert torch.equal(a.normal(100, 1.0), b.normal(100, 1.0))
    assert torch.equal(a.uniform(10), b.uniform(10))
    b.reseed(2, 8)
    a.reseed(2, 7)
    assert not torch.equal(a.normal(100, 1.0), b.normal(100, 1.0))
    assert a.normal(5, 1.0, torch.float64).dtype == torch.float64
