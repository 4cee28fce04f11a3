"""A federation starts from a public pre-training checkpoint (configs/pretrain-federation.toml):
the coordinator's initial global model is that checkpoint's weights, and a checkpoint built for
another architecture (input size, head) is refused instead of quietly getting a random head."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedpose.config import ModelConfig, load_config
from fedpose.data.synthetic import generate_dataset
from fedpose.federation.deployment import CoordinatorRunConfig
from fedpose.federation.server.rounds import RoundRunner
from fedpose.model import CheckpointError, build_model, load_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parents[3]
SIZE = (64, 64)


def _coordinator(tmp_path: Path, checkpoint: Path, input_size: tuple[int, int] = SIZE) -> CoordinatorRunConfig:
    return CoordinatorRunConfig.model_validate({"run_id": "r", "coordinator": {
        "checkpoint_dir": str(tmp_path / "coordinator"), "data": {"input_size": list(input_size)},
        "model": {"backbone": "tiny_vit_test", "scenario": "finetune", "init_checkpoint": str(checkpoint)}}})


def test_the_documented_pretraining_config_builds_the_checkpoint_a_federation_starts_from(tmp_path: Path) -> None:
    """The documented pre-training config, shrunk (test backbone, 64×64, 6 steps), trains on public
    synthetic data only; a finetune coordinator's round-0 model is exactly its last.pt."""
    from fedpose.train.central import run_training

    data = tmp_path / "data"
    generate_dataset(data, sites=2, per_site=0, public=12, test=4, size=SIZE, seed=1, workers=1, progress=False)
    cfg = load_config(ROOT / "configs" / "pretrain-federation.toml", [
        f"data.train='{data / 'public'}'", f"data.val='{data / 'test'}'", "data.input_size=[64, 64]",
        "model.backbone='tiny_vit_test'", "train.steps=6", "train.batch_size=4", "train.eval_every=6",
        "train.checkpoint_every=6", "train.eval_samples=4", f"train.out_dir='{tmp_path / 'pretrain'}'",
        "optim.warmup_steps=1", "train.threads=1"])
    assert cfg.model.scenario == "scratch" and cfg.privacy.mechanism == "none"
    run_training(cfg, progress=False, log=lambda _: None)
    last = tmp_path / "pretrain" / "checkpoints" / "last.pt"
    saved = load_checkpoint(last)

    runner = RoundRunner(_coordinator(tmp_path, last), echo=lambda _: None)
    runner.ledger.close()
    assert runner.state.model_spec.scenario == "finetune"
    assert set(runner.global_state) == set(saved["model"])
    for name, value in saved["model"].items():
        np.testing.assert_array_equal(runner.global_state[name], value.numpy(), err_msg=name)


@pytest.mark.parametrize("other", [{"input_size": (64, 32)}, {"head_hidden": 0}])
def test_a_checkpoint_for_another_architecture_is_refused(tmp_path: Path, other: dict) -> None:
    torch.manual_seed(0)
    spec = {"backbone": "tiny_vit_test", "scenario": "scratch"} | {k: v for k, v in other.items() if k != "input_size"}
    model = build_model(ModelConfig(**spec), other.get("input_size", SIZE))
    path = save_checkpoint(tmp_path / "other.pt", model)
    with pytest.raises(CheckpointError, match=rf"coordinator.model.init_checkpoint .*{next(iter(other))}"):
        RoundRunner(_coordinator(tmp_path, path), echo=lambda _: None)
    assert not (tmp_path / "coordinator" / "global.npz").exists()


def test_a_timm_state_dict_still_starts_the_backbone(tmp_path: Path) -> None:
    """ImageNet-style weights (a timm state dict, no model spec) are not a fedpose checkpoint: the
    backbone loads, the SimCC head is the coordinator's own."""
    torch.manual_seed(0)
    source = build_model(ModelConfig(backbone="tiny_vit_test", scenario="scratch"), SIZE)
    path = tmp_path / "timm.pth"
    torch.save(source.backbone.state_dict(), path)
    runner = RoundRunner(_coordinator(tmp_path, path), echo=lambda _: None)
    runner.ledger.close()
    name = next(k for k in runner.global_state if k.startswith("backbone.") and k.endswith("weight"))
    np.testing.assert_array_equal(runner.global_state[name], source.state_dict()[name].numpy())
