"""Trainable-parameter sets (issue 26): norms_head, norms, biases_norms and lora next to finetune.

What each scenario trains, that the DP engine noises exactly that set and nothing else moves,
that per-sample gradients stay exact through the adapters, that a fresh lora model computes its
base model, and that adapters survive checkpoints, export and a federated round.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from fedpose.config import MAX_LORA_RANK, ModelConfig, ModelSpec, OptimConfig, PrivacyConfig
from fedpose.model import (
    CheckpointError,
    build_model,
    build_model_from_spec,
    load_init_weights,
    model_from_checkpoint,
    save_checkpoint,
)
from fedpose.model.checkpoint import load_checkpoint, model_spec, save_safetensors
from fedpose.model.pose_model import LORA_TARGETS, LoRALinear, is_adapter_key
from fedpose.privacy import engine as engine_module
from fedpose.privacy.engine import build_engine
from fedpose.privacy.per_sample import AFFINE_MODULES, flatten, frozen_features, per_sample_gradients
from fedpose.train.optim import build_optimizer

SIZE = (64, 64)
NEW_SCENARIOS = ("norms_head", "norms", "biases_norms", "lora")


def make(scenario: str, seed: int = 0, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # partial scenarios without init_checkpoint
        return build_model(ModelConfig(backbone="tiny_vit_test", scenario=scenario, **kwargs), SIZE)


def with_trained_adapters(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """B ≠ 0 (as after training): at B = 0 the adapters' A gets no gradient, which would hide errors."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".lora_b"):
                param.copy_(0.05 * torch.randn(param.shape, generator=g))
    return model


def samples(n: int, seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    joints = torch.rand(n, 16, 2, generator=g) * torch.tensor([SIZE[1] - 1, SIZE[0] - 1])
    weight = (torch.rand(n, 16, generator=g) > 0.2).float()
    return {"image": torch.randn(n, 3, *SIZE, generator=g), "joints": joints, "weight": weight,
            "index": torch.arange(n)}


class TensorSet(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.data = samples(n)

    def __len__(self) -> int:
        return len(self.data["index"])

    def __getitem__(self, i: int) -> dict:
        return {key: value[i] for key, value in self.data.items()}


def layer_norm_parameters(model: torch.nn.Module) -> set[str]:
    return {f"{name}.{p}" for name, module in model.named_modules() if isinstance(module, torch.nn.LayerNorm)
            for p, _ in module.named_parameters(recurse=False)}


# -- what each set is -------------------------------------------------------------------------------
def test_each_new_scenario_trains_the_documented_set() -> None:
    for scenario in NEW_SCENARIOS:
        model = make(scenario)
        names = {n for n, _ in model.named_parameters()}
        norms, head = layer_norm_parameters(model), {n for n in names if n.startswith("head.")}
        adapters = {n for n in names if is_adapter_key(n)}
        expected = {
            "norms_head": norms | head,
            "norms": norms | {n for n in head if not n.startswith("head.joint_conv.")},
            "biases_norms": norms | {n for n in names if n.endswith(".bias")},
            "lora": norms | head | adapters,
        }[scenario]
        assert set(model.trainable_parameters()) == expected, scenario
        assert bool(adapters) == (scenario == "lora")
        if scenario == "biases_norms":  # biases from the first convolution on: nothing is frozen in front
            assert model.frozen_prefix == []
            # ... and every backbone unit trains affines only: one batched backward, vmap runs the head only
            stages = len(model.backbone.stages)
            assert model.affine_tuned_part == ["backbone.patch_embed", "backbone.stages.0"] + [
                f"backbone.stages.{i}.{unit}" for i in range(1, stages) for unit in ("downsample", "blocks")]
            assert {type(m) for m in model.affine_tuned_modules().values()} <= set(AFFINE_MODULES)
            assert not any(n.endswith(".weight") and n not in norms for n in model.trainable_parameters())
            continue
        # the frozen prefix is what it is for finetune: nothing before stage 1's blocks trains
        assert model.frozen_prefix == ["backbone.patch_embed", "backbone.stages.0", "backbone.stages.1.downsample"]
    lora = make("lora")
    wrapped = {n for n, m in lora.named_modules() if isinstance(m, LoRALinear)}
    last = len(lora.backbone.stages) - 1
    assert wrapped == {f"backbone.stages.{last}.blocks.{b}.{t}" for b in range(len(lora.backbone.stages[last].blocks))
                       for t in LORA_TARGETS}
    assert not any(p.requires_grad for m in lora.modules() if isinstance(m, LoRALinear) for p in (m.weight, m.bias))
    # stages 1-2 and stage 3's downsample train LayerNorms only: they keep the batched fast path
    assert lora.affine_tuned_part[-1] == f"backbone.stages.{last}.downsample"
    assert make("norms").affine_tuned_part[-1] == f"backbone.stages.{last}.blocks"  # vmap runs the head only


def test_smaller_sets_are_smaller() -> None:
    counts = {s: make(s).num_trainable() for s in ("full", "finetune", "lora", "norms_head", "norms", "biases_norms")}
    assert counts["full"] > counts["finetune"] > counts["lora"] > counts["norms_head"] > counts["norms"] > counts["biases_norms"]
    assert counts["biases_norms"] < 0.01 * counts["full"]
    lora = make("lora", lora_rank=2)
    adapters = sum(p.numel() for n, p in lora.named_parameters() if is_adapter_key(n))
    assert lora.num_trainable() == counts["norms_head"] + adapters
    assert adapters == sum(2 * (m.in_features + m.out_features) for m in lora.modules() if isinstance(m, LoRALinear))


def test_a_fresh_lora_model_computes_its_base_model_exactly(tmp_path: Path) -> None:
    base = make("finetune", seed=5)
    path = save_checkpoint(tmp_path / "base.pt", base)
    torch.manual_seed(9)  # the adapters' A is drawn afresh: B = 0 must make it irrelevant
    lora = build_model(ModelConfig(backbone="tiny_vit_test", scenario="lora", init_checkpoint=path), SIZE)
    images = samples(2)["image"]
    with torch.no_grad():
        for ours, theirs in zip(lora(images), base(images)):
            assert torch.equal(ours, theirs)
        with_trained_adapters(lora)
        assert not torch.equal(lora(images)[0], base(images)[0])  # the adapters do act once B moves
    # built from the same seed, a lora model's base weights are the finetune model's (adapters are drawn last)
    same_seed = make("lora", seed=5).state_dict()
    assert all(torch.equal(value, same_seed[key]) for key, value in base.state_dict().items())


def test_model_specs_with_and_without_adapters_are_validated() -> None:
    spec = model_spec(make("lora", lora_rank=4, lora_alpha=16.0))
    assert (spec.scenario, spec.lora_rank, spec.lora_alpha) == ("lora", 4, 16.0)
    assert model_spec(make("norms")).lora_rank is None
    fields = spec.model_dump(exclude={"lora_rank", "lora_alpha"})
    before_adapters = ModelSpec.model_validate({**fields, "scenario": "finetune"})  # a spec written before adapters existed
    # ... and without adapters a spec is written as it was then (readable by earlier versions)
    assert before_adapters.model_dump(mode="json") == {**fields, "scenario": "finetune", "input_size": list(SIZE)}
    assert "lora" not in before_adapters.model_dump_json()
    assert ModelSpec.model_validate_json(spec.model_dump_json()) == spec
    with pytest.raises(ValidationError, match="both are required for 'lora'"):
        ModelSpec.model_validate({**fields, "scenario": "lora"})
    with pytest.raises(ValidationError, match="absent otherwise"):
        ModelSpec.model_validate({**fields, "scenario": "norms_head", "lora_rank": 8, "lora_alpha": 8.0})
    with pytest.raises(ValidationError, match="lora_rank"):
        ModelSpec.model_validate({**fields, "lora_rank": MAX_LORA_RANK + 1, "lora_alpha": 8.0})
    with pytest.raises(ValidationError, match="scenario"):
        ModelSpec.model_validate({**fields, "scenario": "adapters"})
    assert build_model_from_spec({**fields, "lora_rank": MAX_LORA_RANK, "lora_alpha": 8.0}).lora_rank == MAX_LORA_RANK
    with pytest.raises(ValueError, match="LoRA rank 8 must be in 1..4 for a 16 → 4 linear"):  # wider than the layer
        LoRALinear(torch.nn.Linear(16, 4), 8, 8.0)


# -- the engine noises exactly the set --------------------------------------------------------------
@pytest.mark.parametrize("scenario", NEW_SCENARIOS)
def test_the_engine_noises_exactly_the_trainable_set_and_nothing_else_moves(scenario: str) -> None:
    model = make(scenario)
    trainable = model.trainable_parameters()
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if n not in trainable}
    buffers_before = {n: b.clone() for n, b in model.named_buffers()}
    trainable_before = {n: p.detach().clone() for n, p in trainable.items()}
    dataset = TensorSet(8)
    privacy = PrivacyConfig(mechanism="dpsgd", noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)
    engine = build_engine(privacy, model, len(dataset), 4, 2, seed=0)
    optimizer = build_optimizer(model, OptimConfig(name="adamw", lr=1e-3, weight_decay=0.1))
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        engine.step(model, engine_module.collate([dataset[i] for i in range(4)]))
        for name, param in model.named_parameters():
            if name in trainable:  # Gaussian noise on every coordinate: none is exactly zero
                assert param.grad is not None and param.grad.shape == param.shape and bool((param.grad != 0).all()), name
            else:
                assert param.grad is None, name
        optimizer.step()
    for name, param in model.named_parameters():
        if name in trainable:
            assert bool((param.detach() != trainable_before[name]).any()), name
        else:
            assert torch.equal(param.detach(), frozen_before[name]), name
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers_before[name]), name


@pytest.mark.parametrize("scenario", NEW_SCENARIOS)
def test_per_sample_gradients_equal_a_per_sample_loop(scenario: str) -> None:
    model = make(scenario)
    if scenario == "lora":
        with_trained_adapters(model)
    batch = samples(3)
    params = list(model.trainable_parameters().values())
    features = frozen_features(model, batch["image"])
    for _ in range(2):  # twice: nothing cached may change the second call (shared/FACTS.md)
        grads, _ = per_sample_gradients(model, features, batch["joints"], batch["weight"])
    for i in range(3):
        logits = model.forward_trainable(features[i: i + 1])
        loss = model.loss(*logits, batch["joints"][i: i + 1], batch["weight"][i: i + 1]).sum()
        reference = flatten(list(torch.autograd.grad(loss, params)))
        ours = flatten([g[i] for g in grads.values()])
        assert (ours - reference).norm() / reference.norm() <= 1e-4, (scenario, i)
        if scenario == "lora":  # the adapters themselves, not just the head that dominates the norm
            for name, g in grads.items():
                if is_adapter_key(name):
                    ref = torch.autograd.grad(model.loss(*model.forward_trainable(features[i: i + 1]), batch["joints"][i: i + 1],
                                                         batch["weight"][i: i + 1]).sum(), [model.get_parameter(name)])[0]
                    assert ref.norm() > 0 and (g[i] - ref).norm() / ref.norm() <= 1e-4, name


# -- checkpoints and export ----------------------------------------------------------------------------
def test_lora_checkpoints_round_trip_and_merge_into_other_sets(tmp_path: Path) -> None:
    lora = with_trained_adapters(make("lora", lora_rank=4, lora_alpha=8.0))
    images = samples(2)["image"]
    with torch.no_grad():
        expected = lora(images)
    path = save_checkpoint(tmp_path / "lora.pt", lora)
    assert any(is_adapter_key(k) for k in load_checkpoint(path)["model"])
    restored, checkpoint = model_from_checkpoint(path)  # built from its spec: adapters included
    assert checkpoint["model_spec"]["lora_rank"] == 4 and restored.scenario == "lora"
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(restored(images), expected))
    # into a model without adapters, or with other ones: merged into the base weights, nothing lost
    for scenario, rank in (("finetune", 8), ("lora", 2)):
        torch.manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            other = build_model(ModelConfig(backbone="tiny_vit_test", scenario=scenario, lora_rank=rank,
                                            init_checkpoint=path), SIZE)
        with torch.no_grad():
            for ours, theirs in zip(other(images), expected):
                torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    # adapters never stand in for a base weight the file lacks
    checkpoint = load_checkpoint(path)
    del checkpoint["model"]["backbone.stages.1.blocks.0.attn.qkv.weight"]
    torch.save(checkpoint, tmp_path / "holed.pt")
    with pytest.raises(CheckpointError, match=r"1 of \d+ backbone tensors missing.*stages\.1\.blocks\.0\.attn\.qkv\.weight"):
        load_init_weights(make("lora", lora_rank=4, lora_alpha=8.0), tmp_path / "holed.pt")


def test_a_lora_model_exports_to_safetensors_and_back(tmp_path: Path) -> None:
    lora = with_trained_adapters(make("lora"))
    path = save_safetensors(tmp_path / "model.safetensors", lora)
    loaded, _ = model_from_checkpoint(path)
    images = samples(2)["image"]
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(loaded(images), lora(images)))
    assert set(loaded.trainable_parameters()) == set(lora.trainable_parameters())


# -- the federation ---------------------------------------------------------------------------------
def lora_global(seed: int = 0) -> tuple[dict[str, np.ndarray], ModelSpec]:
    model = make("lora", seed=seed)
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}, model_spec(model)


def test_a_site_trains_and_releases_the_adapters(tmp_path: Path) -> None:
    """The real site round: a lora spec's arrays (adapters included) are accepted, Δ holds exactly
    the trainable set (adapters, LayerNorms, head), and a spec whose arrays lack the adapters is
    refused before anything is spent."""
    from fedpose.federation.local_training import run_site_round
    from fedpose.federation.site_pins import GlobalModelRejected
    from fedpose.federation.local_training import train_site_round
    from site_round_helpers import make_site_data, site_config

    data = make_site_data(tmp_path / "data")
    site = site_config(data, tmp_path / "state", local_steps=1)
    global_state, spec = lora_global()
    without_adapters = {k: v for k, v in global_state.items() if not is_adapter_key(k)}
    with pytest.raises(GlobalModelRejected, match="missing"):
        train_site_round(site, "run", 1, without_adapters, spec, 1)
    budget = (tmp_path / "state" / "budget.json").read_text()
    assert '"spent"' not in budget  # refused before the spend
    result = run_site_round(site, "run", 1, global_state, spec, 1)
    assert result.reply.status == "ok"
    assert set(result.update) == set(make("lora").trainable_parameters())
    assert {k for k in result.update if is_adapter_key(k)} == {k for k in global_state if is_adapter_key(k)}
    assert all(np.any(result.update[k] != 0) for k in result.update)


def test_a_lora_federation_round_moves_the_adapters_and_only_the_trainable_set(tmp_path: Path) -> None:
    """The coordinator's RoundRunner over the in-process transport: the adapters travel, are
    aggregated into the global model, and the frozen base weights stay what they were."""
    from fedpose.federation.deployment import CoordinatorRunConfig
    from fedpose.federation.server.in_process import InProcessTransport
    from fedpose.federation.server.rounds import RoundRunner
    from site_round_helpers import make_site_data, site_config

    data = make_site_data(tmp_path / "data")
    site = site_config(data, tmp_path / "site-1", local_steps=1)
    run = CoordinatorRunConfig.model_validate({"run_id": "r", "coordinator": {
        "checkpoint_dir": str(tmp_path / "coordinator"), "data": {"input_size": list(SIZE)}, "rounds": 1, "min_sites": 1,
        "local_steps": 1, "model": {"backbone": "tiny_vit_test", "scenario": "lora", "lora_rank": 2}}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = RoundRunner(run, echo=lambda *_: None)
    start = {k: np.array(v, copy=True) for k, v in runner.global_state.items()}
    assert runner.state.model_spec.lora_rank == 2
    runner.run_rounds(InProcessTransport([site]))
    trainable = set(runner.global_model().trainable_parameters())
    adapters = {k for k in start if is_adapter_key(k)}
    assert adapters and adapters <= trainable
    for name, value in runner.global_state.items():
        moved = not np.array_equal(np.asarray(value), start[name])
        assert moved == (name in trainable), name


def test_fedpose_export_publishes_a_federated_lora_model(tmp_path: Path) -> None:
    """`fedpose export` of a coordinator's lora global model: the safetensors file holds the adapters
    and its spec, and rebuilds the same function; the model card names the adapters."""
    import json

    from fedpose.cli import main
    from fedpose.federation.aggregation import save_array_checkpoint

    model = with_trained_adapters(make("lora"))
    spec = model_spec(model)
    coordinator = tmp_path / "coordinator"
    save_array_checkpoint(coordinator / "global.npz", {k: v.detach().numpy().copy() for k, v in model.state_dict().items()},
                          {"run_id": "demo", "state": {"model_spec": spec.model_dump(mode="json")}})
    (coordinator / "report.json").write_text(json.dumps({"run_id": "demo", "sites": [
        {"site_id": "site-1", "epsilon": 2.5, "delta": 1e-5, "guarantee": "DP", "rounds_joined": 3}]}))
    assert main(["export", str(coordinator), "--out", str(tmp_path / "release")]) == 0
    exported, checkpoint = model_from_checkpoint(tmp_path / "release" / "model.safetensors")
    assert ModelSpec.model_validate(checkpoint["model_spec"]) == spec
    assert any(is_adapter_key(k) for k in checkpoint["model"])
    images = samples(2)["image"]
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(exported(images), model(images)))
    assert "(lora: rank-8 adapters, α 8" in (tmp_path / "release" / "MODEL_CARD.md").read_text()


def test_a_biases_norms_site_round_releases_exactly_the_biases_and_layer_norms(tmp_path: Path) -> None:
    """The real site round on a biases_norms spec: Δ holds every bias and LayerNorm affine (each
    moved: noise on every coordinate) and nothing else — what the coordinator aggregates."""
    from fedpose.federation.local_training import run_site_round
    from site_round_helpers import make_site_data, site_config

    data = make_site_data(tmp_path / "data")
    site = site_config(data, tmp_path / "state", local_steps=1)
    model = make("biases_norms")
    global_state = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    result = run_site_round(site, "run", 1, global_state, model_spec(model), 1)
    assert result.reply.status == "ok"
    assert set(result.update) == set(model.trainable_parameters())
    assert all(k.endswith(".bias") or k in layer_norm_parameters(model) for k in result.update)
    assert all(np.any(result.update[k] != 0) for k in result.update)
