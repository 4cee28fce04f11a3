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


def test_the_monitor_flags_a_blow_up_once_and_re_arms_after_recovery() -> None:
    from fedpose.train import DivergenceMonitor

    monitor = DivergenceMonitor(window=4, factor=10.0)
    steady = [3.2, 3.1, 3.0, 2.9, 3.0, 2.8, 3.1, 2.9]
    assert [monitor.update(i + 1, loss) for i, loss in enumerate(steady)] == [None] * len(steady)
    # 3.19 → 3718 (the run): the window mean passes 10× its lowest within a few steps, flagged once
    events = [monitor.update(9 + i, loss) for i, loss in enumerate([40.0, 300.0, 3718.0, 3500.0, 3600.0])]
    flagged = [e for e in events if e is not None]
    assert len(flagged) == 1 and flagged[0]["step"] == 10
    assert flagged[0]["ratio"] > 10 and flagged[0]["lowest_window_mean"] == pytest.approx(
        min(sum(steady[i:i + 4]) / 4 for i in range(len(steady) - 3)))
    # back to normal, then a second blow-up is a second event
    assert [monitor.update(20 + i, 3.0) for i in range(4)] == [None] * 4 and not monitor.diverged
    assert sum(monitor.update(30 + i, 1e4) is not None for i in range(4)) == 1


def test_a_noisy_but_stable_loss_is_not_divergence() -> None:
    import numpy as np

    from fedpose.train import DivergenceMonitor

    rng = np.random.default_rng(0)
    monitor = DivergenceMonitor()
    # a private run's per-step loss: heavy-tailed noise around a slowly falling mean (5× spikes included)
    losses = 3.0 * np.exp(-np.arange(500) / 300) * rng.lognormal(0.0, 0.6, 500)
    assert all(monitor.update(i + 1, float(x)) is None for i, x in enumerate(losses))


def test_a_non_finite_loss_is_flagged_at_once() -> None:
    from fedpose.train import DivergenceMonitor

    monitor = DivergenceMonitor()
    assert monitor.update(1, 3.2) is None
    assert monitor.update(2, float("nan")) == {"step": 2, "reason": "non-finite loss", "loss": None}
    assert monitor.update(3, float("inf")) is None  # still the same divergence
