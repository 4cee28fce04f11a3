"""A step that leaves non-finite weights stops training with an error naming the step and the
keys to change; the failing step never reaches on_step (so no checkpoint holds its weights)."""

from __future__ import annotations

import pytest
import torch

from fedpose.config import ConfigError, PrivacyConfig
from fedpose.privacy.engine import build_engine
from fedpose.privacy.projection import basis_from_gradients
from fedpose.train import TrainingDiverged, train_steps

from test_dp_engine import TensorPoseSet, make_model


@pytest.mark.parametrize("privacy", [PrivacyConfig(), PrivacyConfig(mechanism="dpsgd", noise_multiplier=1e30, max_grad_norm=1.0)])
def test_divergence_stops_training_before_the_step_is_reported(privacy: PrivacyConfig) -> None:
    model = make_model()
    data = TensorPoseSet(8)
    engine = build_engine(privacy, model, len(data), 4, 10, seed=0)
    optimizer = torch.optim.SGD(model.trainable_parameters().values(), lr=1e30)
    reported: list[int] = []
    with pytest.raises(TrainingDiverged, match=r"optim\.lr: training diverged at step (\d+)") as caught:
        train_steps(model, engine, data, optimizer, 10, on_step=lambda step, _: reported.append(step), progress=False)
    failed_step = int(caught.value.args[0].split("step ")[1].split(":")[0])
    assert reported == list(range(1, failed_step))
    assert isinstance(caught.value, ConfigError)  # the CLI prints it as a user error, no traceback


def test_basis_from_non_finite_gradients_is_refused_with_a_reason() -> None:
    gradients = torch.randn(4, 30)
    gradients[1, 3] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        basis_from_gradients(gradients, k=2)
