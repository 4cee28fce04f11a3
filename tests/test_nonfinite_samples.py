"""One record must not decide what a site releases: a sample whose gradient is NaN or Inf is
zeroed before clipping, so the noisy sum stays finite and the reply's status cannot flip."""

from __future__ import annotations

import pytest
import torch

from fedpose.config import PrivacyConfig
from fedpose.privacy import engine as engine_module
from fedpose.privacy.engine import build_engine
from fedpose.privacy.per_sample import clipped_gradient_sum, frozen_features
from test_dp_engine import TensorPoseSet, make_model


def _poisoned_batch(bad: float) -> dict:
    batch = engine_module.collate([TensorPoseSet(4)[i] for i in range(4)])
    batch["image"][2] = bad  # one record whose gradient is not finite
    return batch


# biases_norms: the whole backbone takes the batched path (one backward for every sample), where a
# non-finite sample must stay in its own rows as it does under vmap
@pytest.mark.parametrize("scenario", ["finetune", "biases_norms"])
def test_a_nan_or_inf_sample_contributes_nothing_to_the_clipped_sum(scenario: str) -> None:
    model = make_model(scenario=scenario)
    clean = engine_module.collate([TensorPoseSet(4)[i] for i in (0, 1, 3)])
    features = frozen_features(model, clean["image"])
    reference, _, _ = clipped_gradient_sum(model, features, clean["joints"], clean["weight"], 1.0)
    for bad in (float("nan"), float("inf")):
        batch = _poisoned_batch(bad)
        features = frozen_features(model, batch["image"])
        total, norms, _ = clipped_gradient_sum(model, features, batch["joints"], batch["weight"], 1.0)
        assert torch.isfinite(total).all()
        assert not torch.isfinite(norms[2]) and torch.isfinite(norms[[0, 1, 3]]).all()
        assert torch.allclose(total, reference, rtol=1e-5, atol=1e-6)  # exactly the sum without it


def test_the_engine_releases_a_finite_gradient_and_counts_the_zeroed_sample_locally() -> None:
    model = make_model()
    privacy = PrivacyConfig(mechanism="dpsgd", noise_multiplier=1.0, sample_rate=0.25, max_grad_norm=1.0)
    engine = build_engine(privacy, model, dataset_size=16, batch_size=4, planned_steps=1)
    metrics = engine.step(model, _poisoned_batch(float("nan")))
    grads = [p.grad for p in model.trainable_parameters().values()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert metrics["nonfinite_samples"] == 1.0
    assert engine.accountant is not None and engine.accountant.steps == 1


def test_a_row_with_a_non_finite_gradient_drops_out_of_the_public_view_gradient() -> None:
    """FDP / MaskDP add a noise-free gradient of a public sample: a row whose loss or gradient is not
    finite (an annotation whose finite but extreme joints overflow the targets, say) is dropped from it
    as a private row is zeroed — the sum is that of the other rows, never NaN (0·NaN is NaN, so masking
    its loss alone would not do)."""
    from fedpose.privacy.per_sample import mean_gradient

    model = make_model()
    batch = engine_module.collate([TensorPoseSet(4)[i] for i in range(4)])
    features = frozen_features(model, batch["image"])
    keep = torch.tensor([True, True, False, True])
    reference, _ = mean_gradient(model, features, batch["joints"], batch["weight"], row_mask=keep)
    joints = batch["joints"].clone()
    joints[2] = 1e30  # finite, passes the annotation checks; its targets are not
    for chunk_size in (None, 2):
        total, losses = mean_gradient(model, features, joints, batch["weight"], chunk_size=chunk_size, drop_nonfinite_rows=True)
        assert not torch.isfinite(losses[2]) and torch.isfinite(total).all()
        # the mean's denominator stays the real rows (4), as a zeroed private row stays in the batch
        assert torch.allclose(total * 4, reference * 3, rtol=1e-4, atol=1e-6), chunk_size
    # non-private training keeps the row: a gradient that overflows is divergence, reported as such
    kept, _ = mean_gradient(model, features, joints, batch["weight"])
    assert not torch.isfinite(kept).all()
