"""PoseModel: SimCC codec, scenarios, frozen BatchNorm, frozen/trainable split, per-sample grads, checkpoints."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch.func import functional_call, grad, vmap

from fedpose.config import ModelConfig
from fedpose.model import (
    CheckpointError,
    build_model,
    load_checkpoint,
    load_init_weights,
    model_from_checkpoint,
    save_checkpoint,
)
from fedpose.model.backbones import create_backbone
from fedpose.model.simcc import SimCCCodec

SIZE = (64, 64)


def make(scenario: str = "finetune", size: tuple[int, int] = SIZE, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_model(ModelConfig(backbone="tiny_vit_test", scenario=scenario, **kwargs), size)


def batch(n: int = 3, size: tuple[int, int] = SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    images = torch.randn(n, 3, *size, generator=g)
    joints = torch.rand(n, 16, 2, generator=g) * torch.tensor([size[1] - 1, size[0] - 1])
    weight = torch.ones(n, 16)
    weight[0, 3] = 0
    return images, joints, weight


# ------------------------------------------------------------------ SimCC codec
@pytest.mark.parametrize("split_factor", [1, 2, 3])
@pytest.mark.parametrize("refine", [False, True])
def test_simcc_encode_decode_round_trip_within_one_bin(split_factor: int, refine: bool) -> None:
    codec = SimCCCodec((128, 96), split_factor=split_factor, sigma=2.0)
    g = torch.Generator().manual_seed(0)
    joints = torch.rand(4, 16, 2, generator=g) * torch.tensor([95.0, 127.0])
    target_x, target_y = codec.targets(joints)
    assert target_x.shape == (4, 16, 96 * split_factor) and target_y.shape == (4, 16, 128 * split_factor)
    torch.testing.assert_close(target_x.sum(-1), torch.ones(4, 16))
    decoded, confidence = codec.decode(target_x.log(), target_y.log(), refine=refine)
    assert (decoded - joints).abs().max() <= 1.0 / split_factor
    if not refine:  # argmax decoding: error at most half a bin
        assert (decoded - joints).abs().max() <= 0.5 / split_factor + 1e-5
    assert ((confidence > 0) & (confidence <= 1)).all()


def test_simcc_loss_is_minimal_at_target_and_ignores_zero_weight_joints() -> None:
    codec = SimCCCodec((64, 64), split_factor=2, sigma=3.0)
    joints = torch.tensor([[[10.0, 20.0]] * 16])
    bins_y, bins_x = codec.bins
    log_tx, log_ty = codec.log_targets(joints[..., 0], bins_x), codec.log_targets(joints[..., 1], bins_y)
    weight = torch.ones(1, 16)
    assert codec.loss(log_tx, log_ty, joints, weight).item() == pytest.approx(0.0, abs=1e-5)
    off = codec.loss(torch.zeros_like(log_tx), torch.zeros_like(log_ty), joints, weight)
    assert off.item() > 1.0
    # a far-away, unweighted joint contributes nothing and produces no NaN
    joints_far = joints.clone()
    joints_far[0, 5] = torch.tensor([1e5, -1e5])
    weight_far = weight.clone()
    weight_far[0, 5] = 0
    loss_far = codec.loss(log_tx, log_ty, joints_far, weight_far)
    assert torch.isfinite(loss_far).all() and loss_far.item() == pytest.approx(0.0, abs=1e-5)


# ------------------------------------------------------------------ scenarios
def test_finetune_trainable_set_is_stage3_layernorms_and_head() -> None:
    model = make("finetune")
    layer_norm_params = {
        f"{name}.{p}" for name, mod in model.named_modules() if isinstance(mod, torch.nn.LayerNorm)
        for p, _ in mod.named_parameters(recurse=False)
    }
    expected = {
        name for name, _ in model.named_parameters()
        if name.startswith("backbone.stages.3.") or name.startswith("head.") or name in layer_norm_params
    }
    assert set(model.trainable_parameters()) == expected
    # LayerNorms of the frozen stages 1-2 are trainable, their other weights are not
    assert "backbone.stages.1.blocks.0.attn.norm.weight" in expected
    assert "backbone.stages.1.blocks.0.attn.qkv.weight" not in expected
    assert not any(n.startswith(("backbone.patch_embed", "backbone.stages.0")) for n in expected)
    assert model.frozen_prefix == ["backbone.patch_embed", "backbone.stages.0", "backbone.stages.1.downsample"]
    # stages 1-2 train only LayerNorms: the affine-tuned part, whose per-sample gradients the
    # engine takes from one batched backward
    assert model.affine_tuned_part == ["backbone.stages.1.blocks", "backbone.stages.2.downsample", "backbone.stages.2.blocks"]
    affine_tuned = {
        f"{name}.{p}" for name, module in model.affine_tuned_modules().items() for p, _ in module.named_parameters(recurse=False)
    }
    assert affine_tuned == {n for n in expected if n.startswith(("backbone.stages.1.", "backbone.stages.2."))}


@pytest.mark.parametrize("scenario", ["full", "scratch"])
def test_full_and_scratch_train_everything(scenario: str) -> None:
    model = make(scenario)
    assert set(model.trainable_parameters()) == {n for n, _ in model.named_parameters()}
    assert model.frozen_prefix == []
    assert model.affine_tuned_part == [] and model.affine_tuned_modules() == {}


def test_scratch_rejects_init_checkpoint(tmp_path) -> None:
    with pytest.raises(ValueError, match="model.init_checkpoint"):
        build_model(ModelConfig(backbone="tiny_vit_test", scenario="scratch", init_checkpoint=tmp_path / "w.pt"), SIZE)


def test_a_missing_init_checkpoint_names_the_key(tmp_path) -> None:
    from fedpose.model import CheckpointError

    with pytest.raises(CheckpointError, match=r"model.init_checkpoint = .*w.pt: checkpoint not found \(train the run"):
        build_model(ModelConfig(backbone="tiny_vit_test", scenario="finetune", init_checkpoint=tmp_path / "w.pt"), SIZE)


def test_unknown_backbone_is_named() -> None:
    with pytest.raises(ValueError, match="model.backbone: unknown backbone 'resnet50'"):
        create_backbone("resnet50")


# ------------------------------------------------------------------ BatchNorm / forward split
@pytest.mark.parametrize("scenario", ["finetune", "full"])
def test_batchnorm_frozen_during_training_step(scenario: str) -> None:
    model = make(scenario)
    model.train()  # even a plain .train() keeps BatchNorm in eval mode
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns and all(not bn.training for bn in bns)
    assert all(m.training for m in model.modules() if not isinstance(m, torch.nn.BatchNorm2d))
    before = {k: v.clone() for k, v in model.state_dict().items() if "running_" in k or "num_batches" in k}
    images, joints, weight = batch()
    optimizer = torch.optim.SGD(model.trainable_parameters().values(), lr=0.1)
    for _ in range(2):  # the second backward would fail if attention biases were cached
        optimizer.zero_grad()
        model.loss(*model(images), joints, weight).mean().backward()
        optimizer.step()
    after = model.state_dict()
    for key, value in before.items():
        assert torch.equal(value, after[key]), key


@pytest.mark.parametrize("scenario", ["finetune", "full", "biases_norms"])
def test_forward_equals_trainable_of_frozen(scenario: str) -> None:
    model = make(scenario)
    images, _, _ = batch()
    with torch.no_grad():
        full = model(images)
        split = model.forward_trainable(model.forward_frozen(images))
        features = model.forward_frozen(images)
        functional = functional_call(model, dict(model.named_parameters()), (features,), {"start": "features"})
        suffix = functional_call(model, dict(model.named_parameters()), (model.forward_affine_tuned(features),), {"start": "hidden"})
    for a, b, c, d in zip(full, split, functional, suffix):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    with pytest.raises(ValueError, match="start"):
        model(images, start="pixels")
    assert full[0].shape == (3, 16, SIZE[1] * 2) and full[1].shape == (3, 16, SIZE[0] * 2)


@pytest.mark.slow
@pytest.mark.parametrize("scenario,size", [("finetune", (64, 64)), ("full", (96, 64))])
def test_vmap_per_sample_gradients_equal_per_sample_loop(scenario: str, size: tuple[int, int]) -> None:
    """The DP engine's path (functional_call + vmap + grad on forward_trainable) is exact."""
    model = make(scenario, size)
    images, joints, weight = batch(3, size)
    params = {k: v.detach() for k, v in model.trainable_parameters().items()}
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        features = model.forward_frozen(images)

    def sample_loss(p, feature, joint, w):
        logits = functional_call(model, (p, buffers), (feature.unsqueeze(0),), {"start": "features"})
        return model.loss(*logits, joint.unsqueeze(0), w.unsqueeze(0)).sum()

    for _ in range(2):  # twice: caching must not zero any gradient on the second call
        per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0, 0))(params, features, joints, weight)
    for i in range(3):
        model.zero_grad()
        model.loss(*model(images[i : i + 1]), joints[i : i + 1], weight[i : i + 1]).sum().backward()
        for name, param in model.trainable_parameters().items():
            error = (per_sample[name][i] - param.grad).norm() / param.grad.norm().clamp_min(1e-8)
            assert error < 1e-4, (name, error.item())


def test_overfits_tiny_batch() -> None:
    model = make("scratch", label_sigma=2.0)
    images, joints, weight = batch(2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = model.loss(*model(images), joints, weight).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


# ------------------------------------------------------------------ checkpoints
def test_checkpoint_round_trip_and_init_weights(tmp_path) -> None:
    model = make("full")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = save_checkpoint(tmp_path / "c.pt", model, optimizer, config={"a": 1}, metrics=[{"step": 1}], step=7)
    checkpoint = load_checkpoint(path)
    assert checkpoint["step"] == 7 and checkpoint["config"] == {"a": 1}
    restored, _ = model_from_checkpoint(path)
    images, _, _ = batch()
    with torch.no_grad():
        assert torch.equal(model(images)[0], restored(images)[0])
    # a fedpose checkpoint initialises a fresh model (e.g. for fine-tuning at the same size)
    fresh = make("finetune")
    report = load_init_weights(fresh, path)
    assert report["skipped"] == []
    torch.testing.assert_close(fresh.state_dict()["head.cls_x.weight"], model.state_dict()["head.cls_x.weight"])


def test_init_from_timm_state_dict_skips_classifier(tmp_path) -> None:
    import timm.models.tiny_vit as tv

    from fedpose.model.backbones import CUSTOM_CONFIGS

    timm_model = tv.TinyVit(num_classes=10, **CUSTOM_CONFIGS["tiny_vit_test"])
    torch.save(timm_model.state_dict(), tmp_path / "timm.pth")
    model = make("finetune")
    report = load_init_weights(model, tmp_path / "timm.pth")
    assert all(k.startswith("head.") for k in report["skipped"])
    key = "stages.3.blocks.0.attn.qkv.weight"
    assert torch.equal(model.state_dict()[f"backbone.{key}"], timm_model.state_dict()[key])


def test_init_weights_rejects_wrong_file(tmp_path) -> None:
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable torch checkpoint"):
        load_init_weights(make(), tmp_path / "junk.pt")
    torch.save({"foo.weight": torch.zeros(3)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="does not fit backbone"):
        load_init_weights(make(), tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a fedpose checkpoint"):
        load_checkpoint(tmp_path / "other.pt")


@pytest.mark.slow  # ~40 s on a loaded 2-core machine
def test_the_mid_backbone_gives_the_engine_exact_per_sample_gradients() -> None:
    """tiny_vit_mid (the sweep-base candidate; depths 1, 2, 3, 1): the engine's per-sample gradients
    (norm-tuned LayerNorms included) equal a per-sample loop; the finetune set is stage 3 + every
    LayerNorm + the head, as for the product's model."""
    scenario = "finetune"
    from fedpose.privacy.per_sample import frozen_features, per_sample_gradients

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model(ModelConfig(backbone="tiny_vit_mid", scenario=scenario), SIZE)
    trainable = model.trainable_parameters()
    assert all(k.startswith(("backbone.stages.3.", "head.")) or ".norm" in k for k in trainable)
    assert any(k.startswith("backbone.stages.1.") for k in trainable)  # a LayerNorm before stage 3
    images, joints, weight = batch(2)
    grads, _ = per_sample_gradients(model, frozen_features(model, images), joints, weight)
    for i in range(2):
        model.zero_grad()
        model.loss(*model(images[i : i + 1]), joints[i : i + 1], weight[i : i + 1]).sum().backward()
        for name, param in trainable.items():
            error = (grads[name][i] - param.grad).norm() / param.grad.norm().clamp_min(1e-8)
            assert error < 1e-4, (name, error.item())


def test_load_model_reads_every_kind_of_model_path(tmp_path) -> None:
    """fedpose.model.load_model, which `fedpose eval` / `predict` and the benchmarks use: a checkpoint
    file, a `fedpose train` run directory (its last checkpoint), a coordinator's directory (its
    global.npz), and a directory that is none of these refused with a message naming each kind."""
    from fedpose.federation.aggregation import save_array_checkpoint
    from fedpose.model import load_model
    from fedpose.model.checkpoint import model_spec

    model = make("full")
    images, _, _ = batch()
    with torch.no_grad():
        expected = model(images)[0]
    run_dir = tmp_path / "train-run"
    save_checkpoint(run_dir / "checkpoints" / "last.pt", model, torch.optim.SGD(model.parameters(), lr=0.1), config={}, metrics=[], step=1)
    coordinator = tmp_path / "coordinator"
    coordinator.mkdir()
    arrays = {name: value.detach().numpy() for name, value in model.state_dict().items()}
    save_array_checkpoint(coordinator / "global.npz", arrays, meta={"state": {"model_spec": model_spec(model).model_dump(mode="json")}})
    for path in (run_dir / "checkpoints" / "last.pt", run_dir, coordinator, coordinator / "global.npz"):
        with torch.no_grad():
            assert torch.equal(load_model(path)(images)[0], expected), path
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty: a directory that is none of a `fedpose train` run directory .*global\.npz"):
        load_model(tmp_path / "empty")


def test_a_model_file_whose_spec_or_weights_do_not_build_is_named_not_a_traceback(tmp_path) -> None:
    """A checkpoint or coordinator model from another version, or damaged: an invalid model spec, an
    unknown backbone, weights that do not fit the spec, no weights at all — each a CheckpointError
    (GlobalModelError for a coordinator's model) naming the file, which `fedpose eval` / `predict` /
    `export` print as a one-line error."""
    from fedpose.federation.aggregation import save_array_checkpoint
    from fedpose.federation.global_model import GlobalModelError
    from fedpose.model import load_model
    from fedpose.model.checkpoint import model_spec

    model = make("full")
    spec = model_spec(model).model_dump(mode="json")
    path = tmp_path / "model.pt"
    save_checkpoint(path, model, torch.optim.SGD(model.parameters(), lr=0.1), config={}, metrics=[], step=1)
    good = torch.load(path, weights_only=False)
    cases = {
        "spec": ({**good, "model_spec": {**spec, "scenario": "everything"}}, r"its model spec is not one this fedpose builds \(scenario: "),
        "backbone": ({**good, "model_spec": {**spec, "backbone": "resnet"}}, r"its model spec is not one .*unknown backbone 'resnet'"),
        "weights": ({**good, "model": {k: v for k, v in good["model"].items() if "head" not in k}},
                    r"its weights do not fit its model spec \(Missing key"),
        "none": ({**good, "model": None}, r"holds no weights"),
    }
    for name, (checkpoint, message) in cases.items():
        torch.save(checkpoint, tmp_path / f"{name}.pt")
        with pytest.raises(CheckpointError, match=rf"^{re.escape(str(tmp_path / name))}\.pt: {message}"):
            load_model(tmp_path / f"{name}.pt")
    arrays = {name: value.detach().numpy() for name, value in model.state_dict().items()}
    save_array_checkpoint(tmp_path / "global.npz", arrays, meta={"state": {"model_spec": {**spec, "input_size": [64]}}})
    with pytest.raises(GlobalModelError, match=r"global\.npz: its model spec is not one this fedpose builds \(input_size\.1: Field required\)$"):
        load_model(tmp_path / "global.npz")
