"""The pricing of correlated noise in ``benchmarks/correlated_noise`` is right.

The benchmark decides whether banded matrix-factorization noise is worth building, so each of its
three parts is checked against something independent: the workload against the site's real
optimizer fed unit impulses, the factorization against its constraints and a second start (the
problem is convex in CᵀC, so every start must reach the same minimum), and the noise multiplier
against the accountant it claims to reduce to.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from benchmark_modules import BENCHMARKS, load_benchmark_module
from fedpose.federation.config import SiteOptimConfig
from fedpose.privacy.accountant import epsilon_for, noise_multiplier_for
from fedpose.train.optim import build_optimizer

BANDED = BENCHMARKS / "correlated_noise" / "banded.py"


@pytest.fixture(scope="module")
def banded():
    return load_benchmark_module(BANDED, "correlated_noise_banded")


class _Weights(torch.nn.Module):
    """One coordinate per step: coordinate s receives the gradient of step s only."""

    def __init__(self, steps: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(steps))

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {"weight": self.weight}


def test_workload_is_what_the_site_optimizer_does_to_a_gradient(banded):
    """Impulses through the sites' real optimizer (built fresh each round, as local_training does),
    the round's Δ added to the global model (FedAvg of one site, server step 1): the model after
    step t moves by −lr·A[t, s] along the gradient of step s."""
    rounds, local_steps, lr, momentum = 3, 4, 0.1, 0.9
    steps = rounds * local_steps
    model = _Weights(steps)
    config = SiteOptimConfig(name="sgd", lr=lr, momentum=momentum, weight_decay=0.0)
    trajectory = []
    for round_id in range(rounds):
        optimizer = build_optimizer(model, config)
        for step in range(round_id * local_steps, (round_id + 1) * local_steps):
            optimizer.zero_grad()
            model.weight.grad = torch.nn.functional.one_hot(torch.tensor(step), steps).float()
            optimizer.step()
            trajectory.append(model.weight.detach().clone().numpy())
    expected = banded.iterate_workload(rounds, local_steps, momentum)
    np.testing.assert_allclose(-np.array(trajectory) / lr, expected, rtol=1e-5, atol=1e-6)


def test_banded_factor_keeps_its_constraints_and_never_beats_a_wider_band(banded):
    workload = banded.iterate_workload(2, 4, 0.9)
    steps = workload.shape[1]
    identity_error = math.sqrt((workload ** 2).sum())
    errors, previous = [], None
    for bands in (1, 2, 3, 8):
        factor, error = banded.best_banded_factor(workload, bands, start=previous)
        assert np.all(factor[~banded.banded_mask(steps, bands)] == 0), "outside the band or above the diagonal"
        np.testing.assert_allclose(np.linalg.norm(factor, axis=0), 1.0, rtol=1e-12)  # sensitivity 1
        np.testing.assert_allclose(np.linalg.norm(workload @ np.linalg.inv(factor)), error, rtol=1e-9)
        errors.append(error)
        previous = factor
    assert errors[0] == pytest.approx(identity_error, rel=1e-12)  # one band: DP-SGD's independent noise
    assert all(wider <= narrower * (1 + 1e-9) for narrower, wider in zip(errors, errors[1:]))
    assert errors[-1] < 0.8 * identity_error  # correlation does cancel noise when nothing else is paid


def test_banded_factor_is_the_global_optimum(banded):
    """Convex in CᵀC: a random banded start reaches the same minimum as the identity."""
    workload = banded.iterate_workload(2, 5, 0.9)
    steps, bands = workload.shape[1], 3
    mask = banded.banded_mask(steps, bands)
    random_start = np.where(mask, np.random.default_rng(0).uniform(0.2, 1.0, (steps, steps)), 0.0)
    _, from_identity = banded.best_banded_factor(workload, bands)
    _, from_random = banded.best_banded_factor(workload, bands, start=random_start)
    assert from_random == pytest.approx(from_identity, rel=1e-6)


def test_cyclic_poisson_noise_is_dpsgd_accounting_of_fewer_denser_steps(banded):
    target, rate, steps, delta = 4.0, 0.1, 12, 1e-5
    one_band = banded.cyclic_poisson_noise_multiplier(target, rate, steps, 1, delta)
    assert one_band == pytest.approx(noise_multiplier_for(target, rate, steps, delta, rel_tolerance=1e-4,
                                                          accountant="pld"), rel=1e-12)
    three_bands = banded.cyclic_poisson_noise_multiplier(target, rate, steps, 3, delta)
    assert epsilon_for(three_bands, 3 * rate, 4, delta, accountant="pld")[0] <= target
    assert epsilon_for(three_bands * 0.99, 3 * rate, 4, delta, accountant="pld")[0] > target
    assert three_bands > one_band  # less amplification: the price of the band
    with pytest.raises(ValueError, match="would exceed 1"):
        banded.cyclic_poisson_noise_multiplier(target, rate, steps, 11, delta)


def test_the_script_prices_the_main_job_read_from_its_config():
    """run.py reads the main job from configs/demo.toml and prices every band width against b = 1."""
    script = load_benchmark_module(BENCHMARKS / "correlated_noise" / "run.py", "correlated_noise_run")
    main_job = script.settings()[-1]
    assert (main_job["rounds"], main_job["local_steps"], main_job["momentum"], main_job["targets"]) == (2, 16, 0.9, [1.0])
    assert main_job["sample_rate"] == pytest.approx(32 / 480)
    priced = script.price({"setting": "small", "sample_rate": 0.5, "rounds": 2, "local_steps": 3, "momentum": 0.9,
                           "targets": [4.0]}, 4.0)
    assert [row["bands"] for row in priced["rows"]] == [1, 2]  # b·q ≤ 1
    first = priced["rows"][0]
    assert first["every_iterate"]["vs_dpsgd"] == first["final_model"]["vs_dpsgd"] == 1.0
    assert priced["best"]["every_iterate"]["vs_dpsgd"] <= 1.0
