"""Pose model: timm TinyViT backbone + SimCC head, training scenarios, checkpoints."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedpose.config import PARTIAL_SCENARIOS, ModelConfig, ModelSpec, validation_problems
from fedpose.model.backbones import available_backbones, create_backbone
from fedpose.model.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_init_weights,
    save_checkpoint,
)
from fedpose.model.pose_model import PoseModel
from fedpose.model.simcc import SimCCCodec, SimCCHead


def build_model(cfg: ModelConfig, input_size: tuple[int, int]) -> PoseModel:
    """Build the model for ``cfg`` at ``input_size`` (H, W); load ``cfg.init_checkpoint`` if set."""
    if cfg.scenario == "scratch" and cfg.init_checkpoint is not None:
        raise ValueError("model.init_checkpoint: scenario 'scratch' starts from random weights; unset it or use 'full'")
    model = PoseModel(
        create_backbone(cfg.backbone),
        tuple(input_size),  # type: ignore[arg-type]
        scenario=cfg.scenario,
        split_factor=cfg.split_factor,
        label_sigma=cfg.label_sigma,
        head_hidden=cfg.head_hidden,
        backbone_name=cfg.backbone,
        lora_rank=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
    )
    if cfg.init_checkpoint is not None:
        if not Path(cfg.init_checkpoint).exists():  # name the key: the file is often a run still to be made
            raise CheckpointError(f"model.init_checkpoint = {cfg.init_checkpoint}: checkpoint not found (train the run that "
                                  "writes it first, or point the key at an existing checkpoint)")
        load_init_weights(model, cfg.init_checkpoint)
    elif cfg.scenario in PARTIAL_SCENARIOS:
        warnings.warn(
            f"model.scenario '{cfg.scenario}' without model.init_checkpoint: the frozen weights stay random",
            stacklevel=2,
        )
    model.train_mode()
    return model


def build_model_from_spec(spec: ModelSpec | Mapping[str, Any]) -> PoseModel:
    """Rebuild the architecture of ``spec`` (weights not loaded); a checkpoint's plain ``model_spec``
    is validated here."""
    spec = ModelSpec.model_validate(spec)
    adapters = {"lora_rank": spec.lora_rank, "lora_alpha": spec.lora_alpha} if spec.scenario == "lora" else {}
    model = PoseModel(
        create_backbone(spec.backbone),
        spec.input_size,
        scenario=spec.scenario,
        split_factor=spec.split_factor,
        label_sigma=spec.label_sigma,
        head_hidden=spec.head_hidden,
        backbone_name=spec.backbone,
        **adapters,  # type: ignore[arg-type]
    )
    model.train_mode()
    _TRAINABLE_NAMES.setdefault(spec.model_dump_json(), frozenset(model.trainable_parameters()))
    return model


#: spec (JSON) → names of the parameters a freshly built model of it trains (for trainable_parameter_names)
_TRAINABLE_NAMES: dict[str, frozenset[str]] = {}


def trainable_parameter_names(spec: ModelSpec | Mapping[str, Any]) -> frozenset[str]:
    """Names of the parameters the model ``spec`` describes trains, as built (the ones a DP engine
    clips and noises). Remembered per spec from any build in this process: the site's egress guard
    asks after its round built the model, and rebuilding the product's backbone takes seconds."""
    key = ModelSpec.model_validate(spec).model_dump_json()
    if key not in _TRAINABLE_NAMES:
        build_model_from_spec(spec)
    return _TRAINABLE_NAMES[key]


def model_from_checkpoint(path: str | Path) -> tuple[PoseModel, dict[str, Any]]:
    """(model with the checkpoint's weights, the checkpoint dict)."""
    checkpoint = load_checkpoint(path)
    return model_with_weights(checkpoint.get("model_spec"), checkpoint.get("model"), path), checkpoint


def model_with_weights(spec: Any, weights: Any, where: str | Path, error: type[ValueError] = CheckpointError) -> PoseModel:
    """The model ``spec`` describes, with ``weights`` loaded — both read from the file ``where``.
    Raises ``error`` naming the file when the spec is not one this fedpose builds (a damaged file, or
    one from another version) or the weights do not fit it."""
    from pydantic import ValidationError

    try:
        model = build_model_from_spec(spec or {})
    except ValueError as exc:  # pydantic's ValidationError is one, and so is an unknown backbone
        problem = validation_problems(exc) if isinstance(exc, ValidationError) else str(exc)
        raise error(f"{where}: its model spec is not one this fedpose builds ({problem})") from None
    if not isinstance(weights, Mapping):
        raise error(f"{where}: holds no weights")
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:  # torch: "Error(s) in loading state_dict …:" then the missing / unexpected / mis-shaped tensors
        problem = " ".join(" ".join(str(exc).splitlines()[1:]).split())
        raise error(f"{where}: its weights do not fit its model spec ({problem[:300]})") from None
    return model


#: what a directory named as "the model" may be, and the model file inside it (a coordinator's
#: directory is recognised by its global.npz: :func:`load_model`)
MODEL_IN_DIRECTORY = (("a `fedpose train` run directory", "checkpoints/last.pt"),
                      ("a `fedpose export` directory", "model.safetensors"),
                      ("an export from before safetensors", "model.pt"))


def _model_file(path: str | Path) -> Path:
    """A checkpoint file as given; a run directory → its last checkpoint; an export directory →
    model.safetensors (model.pt for older exports)."""
    path = Path(path)
    if not path.is_dir():
        return path
    for _, name in MODEL_IN_DIRECTORY:
        if (path / name).is_file():
            return path / name
    kinds = ", ".join(f"{what} ({name})" for what, name in MODEL_IN_DIRECTORY)
    raise CheckpointError(f"{path}: a directory that is none of {kinds} or a coordinator directory (global.npz)")


def load_model(path: str | Path) -> PoseModel:
    """The model at ``path``, on the CPU: a checkpoint file, a directory of :data:`MODEL_IN_DIRECTORY`,
    or a federation's model — the coordinator's global.npz, or its checkpoint directory (the model it
    publishes: the moving average when the run keeps one). Raises CheckpointError or
    GlobalModelError (both ValueErrors) naming the file and what is wrong."""
    from fedpose.federation.global_model import global_checkpoint_path, load_global_model

    if global_checkpoint_path(path) is not None:
        return load_global_model(path).model
    return model_from_checkpoint(_model_file(path))[0]


__all__ = [
    "CheckpointError", "PoseModel", "SimCCCodec", "SimCCHead", "available_backbones", "build_model",
    "build_model_from_spec", "create_backbone", "load_checkpoint", "load_init_weights", "load_model",
    "model_from_checkpoint", "model_with_weights", "save_checkpoint",
]
