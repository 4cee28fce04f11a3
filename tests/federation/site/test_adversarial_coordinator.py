"""A malicious coordinator against the real site code (no Flower in between: the coordinator
controls every field of the instruction anyway).

Each test plays one attack and asserts the two properties a site must keep whatever it is sent:
no two releases let their difference cancel the noise (the residual keeps the noise's size), and
the site never spends beyond its own ε_max.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from fedpose.federation.local_training import run_site_round
from fedpose.federation.site_budget import SiteBudget
from site_round_helpers import BATCH_SIZE, flat, global_model, make_site_data, site_config

LR, NOISE, CLIP, STEPS = 0.05, 1.0, 1.0, 2
#: std per coordinate of the noise one round adds to Δ (plain SGD: lr · σC/B per step, STEPS steps)
ROUND_NOISE_STD = LR * NOISE * CLIP / BATCH_SIZE * math.sqrt(STEPS)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return make_site_data(tmp_path_factory.mktemp("site-data"))


@pytest.fixture(scope="module")
def weights() -> tuple[dict, dict]:
    return global_model()


def _spent(state_dir: Path) -> float:
    return SiteBudget(state_dir, "site-1", 50.0, 1e-5, "DP").epsilon


def _assert_noise_survives(first: dict[str, np.ndarray], second: dict[str, np.ndarray]) -> None:
    """Δ_a − Δ_b of two independent releases holds two independent noise draws: its per-coordinate
    std is at least that of one (a shared noise stream would leave only the data signal)."""
    residual = flat(first) - flat(second)
    assert residual.std() >= 0.9 * ROUND_NOISE_STD, (residual.std(), ROUND_NOISE_STD)


def test_replaying_a_round_gets_the_same_release_never_a_fresh_one(data_root, weights, tmp_path) -> None:
    state, (global_state, spec) = tmp_path / "state", weights
    site = site_config(data_root, state)
    first = run_site_round(site, "run", 1, global_state, spec, STEPS)
    spent = _spent(state)
    for _ in range(2):
        again = run_site_round(site, "run", 1, global_state, spec, STEPS)
        assert again.reply.reason == "resent-earlier-release"
        assert all(np.array_equal(again.update[k], first.update[k]) for k in first.update)  # nothing new to average
    assert _spent(state) == spent
    # asked again for another trainable set: no re-send of an update of other parameters, no fresh release
    other = run_site_round(site, "run", 1, global_state, spec.model_copy(update={"scenario": "biases_norms"}), STEPS)
    assert (other.reply.status, other.reply.reason, other.update) == ("replayed", "no-earlier-release", {})
    assert _spent(state) == spent
    # the same round with other parameters is refused outright, nothing released or spent
    conflict = run_site_round(site_config(data_root, state, local_steps=1), "run", 1, global_state, spec, 1)
    assert conflict.reply.status == "error" and not conflict.update
    assert _spent(state) == spent


def test_the_same_round_id_in_another_run_draws_fresh_noise(data_root, weights, tmp_path) -> None:
    """Round 1 of run B after round 1 of run A, with the same seed in the site config: under
    seeded noise the two releases shared their noise and Δ_A − Δ_B cancelled it."""
    global_state, spec = weights
    site = site_config(data_root, tmp_path / "state")
    release_a = run_site_round(site, "run-a", 1, global_state, spec, STEPS)
    release_b = run_site_round(site, "run-b", 1, global_state, spec, STEPS)
    assert release_a.reply.status == release_b.reply.status == "ok"
    _assert_noise_survives(release_a.update, release_b.update)
    assert release_b.reply.privacy.rounds_spent == 2  # both releases are paid for


def test_two_sites_with_the_same_seed_do_not_share_noise(data_root, weights, tmp_path) -> None:
    """Round ids chosen so that (seed, round) collide across two sites: nothing is seeded any more."""
    global_state, spec = weights
    one = run_site_round(site_config(data_root, tmp_path / "one"), "run", 7, global_state, spec, STEPS)
    two = run_site_round(site_config(data_root, tmp_path / "two"), "run", 7, global_state, spec, STEPS)
    _assert_noise_survives(one.update, two.update)


def test_the_residual_check_would_catch_shared_noise() -> None:
    """The check above is not vacuous: two releases with one seeded noise stream cancel."""
    from fedpose.config import PrivacyConfig
    from fedpose.privacy.engine import build_engine
    from test_dp_engine import TensorPoseSet, make_model

    privacy = PrivacyConfig(mechanism="dpsgd", noise_multiplier=NOISE, sample_rate=0.25, max_grad_norm=CLIP,
                            insecure_seeded_noise=True)
    releases = []
    for _ in range(2):
        model = make_model()
        engine = build_engine(privacy, model, dataset_size=16, batch_size=BATCH_SIZE, planned_steps=1, seed=3)
        engine.step(model, next(engine.batches(TensorPoseSet(16))))
        releases.append({k: (LR * p.grad).numpy() for k, p in model.trainable_parameters().items()})
    residual = flat(releases[0]) - flat(releases[1])
    assert residual.std() < 1e-6 * ROUND_NOISE_STD


def test_weights_that_overflow_the_gradients_cannot_flip_the_status(data_root, weights, tmp_path) -> None:
    """Weights chosen to make per-sample gradients overflow: those samples are zeroed, the site
    still releases a finite, noisy update — the outcome does not depend on which records were hit."""
    global_state, spec = weights
    hostile = {k: (v * np.float32(1e30) if k.startswith("head.") and v.dtype.kind == "f" else v) for k, v in global_state.items()}
    result = run_site_round(site_config(data_root, tmp_path / "state"), "run", 1, hostile, spec, STEPS)
    assert result.reply.status in ("ok", "failed")  # decided by the noisy update, never by one record
    if result.reply.status == "ok":
        assert all(np.isfinite(a).all() for a in result.update.values())
    assert result.reply.privacy is not None and result.reply.privacy.epsilon > 0


def test_asking_for_more_steps_than_the_site_allows(data_root, weights, tmp_path) -> None:
    global_state, spec = weights
    state = tmp_path / "state"
    result = run_site_round(site_config(data_root, state), "run", 1, global_state, spec, 10_000)
    assert result.reply.local_steps == STEPS and result.reply.privacy.steps == STEPS
    assert SiteBudget(state, "site-1", 50.0, 1e-5, "DP").steps == STEPS


def test_fresh_run_ids_never_reset_the_budget(data_root, weights, tmp_path) -> None:
    """A coordinator that starts a new run (or resumes under new ids) to make the site forget."""
    global_state, spec = weights
    state = tmp_path / "state"
    site = site_config(data_root, state, eps_max=6.0)  # rounds reach ε 3.87, 4.87, 5.62, then 6.25 > 6
    statuses, epsilons = [], []
    for attempt in range(6):
        result = run_site_round(site, f"run-{attempt}", 1, global_state, spec, STEPS)
        statuses.append(result.reply.status)
        epsilons.append(result.reply.privacy.epsilon)
    assert "refused" in statuses and statuses.index("refused") > 0
    assert all(s == "refused" for s in statuses[statuses.index("refused"):])  # never un-exhausted
    assert statuses[:3] == ["ok"] * 3 and max(epsilons) <= 6.0 and epsilons == sorted(epsilons)
    assert SiteBudget(state, "site-1", 6.0, 1e-5, "DP").epsilon <= 6.0
