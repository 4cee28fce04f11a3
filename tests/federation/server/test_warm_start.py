"""Coordinator warm start: public data only, BatchNorm statistics from public images, config checks."""

from __future__ import annotations

import math

import pytest
import torch

from fedpose.config import ConfigError, ModelConfig, OptimConfig, load_config
from fedpose.data.synthetic import generate_dataset
from fedpose.federation.config import CoordinatorConfig
from fedpose.federation.warm_start import warm_start
from fedpose.model import build_model

SIZE = (64, 64)


@pytest.fixture(scope="module")
def public_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("warm")
    generate_dataset(root, sites=1, per_site=2, public=12, test=2, size=SIZE, workers=1, progress=False)
    return root / "public"


def _batch_norm_means(model) -> list[torch.Tensor]:
    return [m.running_mean.clone() for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]


def test_calibration_only_sets_batch_norm_from_public_images_and_trains_nothing(public_dir) -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone="tiny_vit_test", scenario="scratch"), SIZE)
    weights = {k: v.clone() for k, v in model.state_dict().items() if "running" not in k and "num_batches" not in k}
    before = _batch_norm_means(model)
    result = warm_start(model, public_dir, steps=0, optim=OptimConfig(), batch_size=4, seed=0, calibrate=True, echo=lambda _: None)
    assert result["steps"] == 0 and math.isnan(result["final_loss"])
    assert any(not torch.allclose(a, b) for a, b in zip(before, _batch_norm_means(model)))
    after = model.state_dict()
    assert all(torch.equal(weights[k], after[k]) for k in weights)


def test_warm_start_trains_on_public_data_and_reports_progress(public_dir) -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone="tiny_vit_test", scenario="scratch"), SIZE)
    head_before = model.head.cls_x.weight.detach().clone()
    lines: list[str] = []
    result = warm_start(model, public_dir, steps=10, optim=OptimConfig(lr=1e-3), batch_size=4, seed=0,
                        calibrate=True, echo=lines.append)
    assert result["steps"] == 10 and math.isfinite(result["final_loss"])
    assert not torch.equal(head_before, model.head.cls_x.weight)
    assert lines and lines[-1].startswith("warm start on public data: step 10/10")


def test_warm_start_without_public_data_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="public_data"):
        CoordinatorConfig(warm_start={"steps": 5})
    path = tmp_path / "coordinator.toml"
    path.write_text("[warm_start]\nsteps = 5\n")
    with pytest.raises(ConfigError, match="public_data"):
        load_config(path, model=CoordinatorConfig)


def test_empty_public_set_is_rejected(tmp_path) -> None:
    empty = tmp_path / "public"
    empty.mkdir()
    (empty / "annotations.json").write_text("[]")
    model = build_model(ModelConfig(backbone="tiny_vit_test", scenario="scratch"), SIZE)
    with pytest.raises(ValueError, match="no records"):
        warm_start(model, empty, steps=1, optim=OptimConfig(), batch_size=2, seed=0, calibrate=True)
