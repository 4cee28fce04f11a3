"""Checkpoints: one ``torch.save`` file written atomically, loadable with ``weights_only=True``.

A fedpose checkpoint is a dict::

    {"format": "fedpose-checkpoint", "version": 1,
     "model_spec": {backbone, scenario, input_size, split_factor, label_sigma, head_hidden,
                    lora_rank, lora_alpha (scenario "lora" only)},
     "model": state_dict, "optimizer": state_dict | None, "scheduler": state_dict | None,
     "config": the run's config as plain data | None, "metrics": list/dict | None, "step": int,
     "rng": {"torch": ByteTensor, "python": tuple, "numpy": tuple}, "extra": dict}

The publishable form of a model (``fedpose export``) is a safetensors file instead
(:func:`save_safetensors`): tensors and a string metadata map, no pickle, so a model shared
between hospitals can be opened without running anything it holds. Its metadata carries
``fedpose.format`` and the model spec (JSON), so ``fedpose eval`` / ``predict`` rebuild the
architecture from the file alone; ``.pt`` checkpoints stay readable.

``load_init_weights`` starts a model from either a fedpose checkpoint or a timm TinyViT state
dict (e.g. ImageNet weights someone copied onto the machine); nothing is ever downloaded.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fedpose.config import ModelSpec
from fedpose.io import atomic_write

CHECKPOINT_FORMAT = "fedpose-checkpoint"
CHECKPOINT_VERSION = 1
SAFETENSORS_SUFFIX = ".safetensors"
#: metadata keys of a fedpose safetensors file (safetensors metadata is a str → str map)
SAFETENSORS_FORMAT = "fedpose-safetensors/1"
SAFETENSORS_FORMAT_KEY = "fedpose.format"
SAFETENSORS_SPEC_KEY = "fedpose.model_spec"


class CheckpointError(ValueError):
    """A checkpoint or weights file is missing, unreadable or does not fit the model."""


def model_spec(model: nn.Module) -> ModelSpec:
    """What :func:`fedpose.model.build_model_from_spec` needs to rebuild ``model``'s architecture."""
    return ModelSpec(
        backbone=model.backbone_name,
        scenario=model.scenario,
        input_size=tuple(model.input_size),
        split_factor=model.split_factor,
        label_sigma=model.codec.sigma,
        head_hidden=model.head.cls_x.in_features if not isinstance(model.head.mlp, nn.Identity) else 0,
        lora_rank=getattr(model, "lora_rank", None),
        lora_alpha=getattr(model, "lora_alpha", None),
    )


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, keys, *rest = state["python"]
    random.setstate((version, tuple(keys), *rest))
    name, np_keys, *np_rest = state["numpy"]
    np.random.set_state((name, np_keys.numpy().astype(np.uint32), *np_rest))


def _plain(config: Any) -> Any:
    if config is None:
        return None
    if hasattr(config, "model_dump"):
        return config.model_dump(mode="json")
    return config


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    config: Any = None,
    metrics: Any = None,
    step: int = 0,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint atomically (a crash leaves the previous file intact)."""
    payload = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "model_spec": model_spec(model).model_dump(mode="json"),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "config": _plain(config),
        "metrics": metrics,
        "step": int(step),
        "rng": rng_state(),
        "extra": extra or {},
    }
    path = Path(path)
    atomic_write(path, lambda fh: torch.save(payload, fh))
    return path


def _torch_load(path: Path) -> Any:
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.is_dir():
        raise CheckpointError(f"{path}: a directory, not a checkpoint file")
    try:
        with warnings.catch_warnings():  # torch warns about a foreign file's pickle protocol before refusing it
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for corrupt / foreign files
        # Not torch's text: it advises weights_only=False, i.e. running whatever code the file holds.
        raise CheckpointError(
            f"{path}: not a readable torch checkpoint (damaged, truncated, or not written by fedpose; it is only ever "
            f"read as weights, never unpickled as arbitrary objects; {type(exc).__name__})"
        ) from exc


def save_weights_only(path: str | Path, model: nn.Module, extra: dict[str, Any] | None = None) -> Path:
    """A checkpoint that ``fedpose eval`` / ``predict`` read, holding the architecture and weights
    only: no optimizer or scheduler state, config, metrics, step or RNG state (those carry
    statistics of the training data or the run's seed). What ``fedpose export`` publishes."""
    payload = {
        "format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "model_spec": model_spec(model).model_dump(mode="json"),
        "model": model.state_dict(), "optimizer": None, "scheduler": None, "config": None, "metrics": None,
        "step": 0, "rng": None, "extra": extra or {},
    }
    path = Path(path)
    atomic_write(path, lambda fh: torch.save(payload, fh))
    return path


#: the largest magnitude float16 holds; a weight beyond it would be stored as ±inf
FLOAT16_MAX = float(torch.finfo(torch.float16).max)


def half_precision_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state with every floating tensor rounded to float16 (integer buffers as they are).
    Refuses, naming the tensor, a model with a finite value beyond float16's range (it would become ±inf)."""
    state = {}
    for key, value in model.state_dict().items():
        if value.is_floating_point():
            beyond = value.isfinite() & (value.abs() > FLOAT16_MAX)
            if bool(beyond.any()):
                raise ValueError(f"{key}: {int(beyond.sum())} value(s) beyond float16's range (±{FLOAT16_MAX:g}, largest "
                                 f"{float(value[beyond].abs().max()):.6g}); keep float32")
            value = value.to(torch.float16)
        state[key] = value
    return state


def save_safetensors(path: str | Path, model: nn.Module, metadata: dict[str, str] | None = None, half: bool = False) -> Path:
    """The architecture (model spec, in the metadata) and weights of ``model`` as safetensors,
    written atomically: no optimizer, config, metrics, step or RNG state (they carry statistics of
    the training data or the run's seed), and no pickle. ``metadata``: further public strings.
    ``half``: floating tensors stored as float16 (:func:`half_precision_state`; half the size; read
    back into a float32 model)."""
    import json

    from safetensors.torch import save

    state = half_precision_state(model) if half else model.state_dict()
    # safetensors refuses views and shared storage: every tensor is written as its own contiguous copy
    tensors = {key: value.detach().cpu().contiguous().clone() for key, value in state.items()}
    header = {**(metadata or {}), SAFETENSORS_FORMAT_KEY: SAFETENSORS_FORMAT,
              SAFETENSORS_SPEC_KEY: json.dumps(model_spec(model).model_dump(mode="json"), sort_keys=True)}
    data = save(tensors, metadata=header)
    path = Path(path)
    atomic_write(path, lambda fh: fh.write(data))
    return path


def load_safetensors(path: str | Path) -> dict[str, Any]:
    """A fedpose safetensors file as a checkpoint dict (``model_spec``, ``model``, ``extra``: the
    other metadata strings); :class:`CheckpointError` naming the file for anything else."""
    import json

    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"model file not found: {path}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            metadata = dict(fh.metadata() or {})
            tensors = {key: fh.get_tensor(key) for key in fh.keys()}
    except Exception as exc:  # safetensors raises its own error types for a damaged header or data
        raise CheckpointError(f"{path}: not a readable safetensors file (damaged or truncated; {type(exc).__name__})") from exc
    if metadata.get(SAFETENSORS_FORMAT_KEY) != SAFETENSORS_FORMAT:
        raise CheckpointError(f"{path}: a safetensors file, but not a fedpose model (metadata {SAFETENSORS_FORMAT_KEY} = "
                              f"{metadata.get(SAFETENSORS_FORMAT_KEY)!r}, expected {SAFETENSORS_FORMAT!r})")
    try:
        spec = ModelSpec.model_validate(json.loads(metadata.pop(SAFETENSORS_SPEC_KEY)))
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"{path}: its model spec ({SAFETENSORS_SPEC_KEY}) is missing or malformed ({exc})") from None
    metadata.pop(SAFETENSORS_FORMAT_KEY)
    return {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "model_spec": spec.model_dump(mode="json"),
            "model": tensors, "step": 0, "extra": metadata}


def is_fedpose_checkpoint(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("format") == CHECKPOINT_FORMAT


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a fedpose checkpoint (CPU tensors) — a ``.pt`` file or an exported ``.safetensors``
    one; raises CheckpointError for anything else."""
    path = Path(path)
    if path.suffix == SAFETENSORS_SUFFIX:
        return load_safetensors(path)
    obj = _torch_load(path)
    if not is_fedpose_checkpoint(obj):
        raise CheckpointError(f"{path}: not a fedpose checkpoint (use model.init_checkpoint for timm weights)")
    if obj.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path}: checkpoint version {obj.get('version')} not supported")
    return obj


#: the spec fields that say which parameters train, not what the base network computes: a
#: checkpoint of any scenario starts a model of any other (adapters are merged or start at zero)
TRAINABLE_SET_FIELDS = frozenset({"scenario", "lora_rank", "lora_alpha"})


def check_start_checkpoint(path: str | Path, spec: ModelSpec, where: str = "model.init_checkpoint") -> None:
    """Refuse a fedpose checkpoint whose architecture differs from ``spec`` in anything but the
    trainable set (:data:`TRAINABLE_SET_FIELDS`: a public pre-training run's ``scratch``/``full``
    checkpoint is what a ``finetune`` or ``lora`` federation starts from). :func:`load_init_weights`
    alone would quietly keep a random SimCC head for another input size or split factor: a
    federation must start from the model it was given. A timm state dict (no spec: ImageNet
    weights for the backbone) is accepted as it is."""
    raw = _torch_load(Path(path))
    if not is_fedpose_checkpoint(raw):
        return
    theirs = ModelSpec.model_validate(raw.get("model_spec") or {}).model_dump(mode="json", exclude=TRAINABLE_SET_FIELDS)
    ours = spec.model_dump(mode="json", exclude=TRAINABLE_SET_FIELDS)
    differ = [f"{key} {theirs[key]!r} (the model: {ours[key]!r})" for key in ours if theirs[key] != ours[key]]
    if differ:
        raise CheckpointError(f"{where} {path}: built for another model: {'; '.join(differ)} — pre-train at the "
                              "federation's backbone and input size (configs/pretrain-federation.toml)")


def _timm_backbone_state(raw: dict[str, Any], model: nn.Module) -> dict[str, torch.Tensor]:
    """timm TinyViT state dict → our ``backbone.*`` keys; drops the ImageNet classifier and the
    derived ``attention_bias_idxs``; resizes bias tables whose window differs (timm's filter)."""
    from timm.models.tiny_vit import checkpoint_filter_fn

    for wrapper in ("model", "state_dict"):
        if wrapper in raw and isinstance(raw[wrapper], dict):
            raw = raw[wrapper]
    backbone_only = {k: v for k, v in raw.items() if not k.startswith("head.")}
    filtered = checkpoint_filter_fn(backbone_only, model.backbone)
    return {f"backbone.{k}": v for k, v in filtered.items()}


def load_init_weights(model: nn.Module, path: str | Path) -> dict[str, list[str]]:
    """Initialise ``model`` from a fedpose checkpoint or a timm TinyViT state dict.

    Tensors whose shapes fit are copied; the SimCC head is skipped when it was built for a
    different input size. Low-rank adapters (scenario "lora"): a checkpoint's adapters load as they
    are into a model with the same rank and α, and are otherwise merged into their base weights
    (what they learned is kept); a model's adapters that the file lacks keep their initialisation
    (B = 0: the model computes the checkpoint's function). Grey copies (scenario
    "grey_biases_norms") the file lacks start as the tensors they copy. Returns {"loaded": [...], "skipped":
    [...]} (key names). Raises CheckpointError when the backbone does not match (wrong file or
    wrong backbone).
    """
    from fedpose.model.pose_model import is_adapter_key, merged_adapter_weights
    from fedpose.model.grey_copies import is_grey_copy_key, own_key

    path = Path(path)
    raw = _torch_load(path)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a state dict or a fedpose checkpoint, got {type(raw).__name__}")
    source = raw["model"] if is_fedpose_checkpoint(raw) else _timm_backbone_state(raw, model)
    if any(is_adapter_key(key) for key in source):
        theirs = ModelSpec.model_validate(raw["model_spec"])
        if (theirs.lora_rank, theirs.lora_alpha) != (getattr(model, "lora_rank", None), getattr(model, "lora_alpha", None)):
            source = merged_adapter_weights(source, float(theirs.lora_alpha or 0.0))
    target = model.state_dict()
    loaded, skipped = [], []
    for key, value in source.items():
        if key.endswith("attention_bias_idxs"):
            continue  # derived from the window size, rebuilt by the model
        if key in target and target[key].shape == value.shape:
            target[key] = value
            loaded.append(key)
        else:
            skipped.append(key)
    backbone_keys = [k for k in target if k.startswith("backbone.") and not k.endswith("attention_bias_idxs")
                     and not is_adapter_key(k)  # adapters the file lacks start at their zero update
                     and not is_grey_copy_key(k)]  # grey copies the file lacks start as their own tensor (below)
    missing = [k for k in backbone_keys if k not in set(loaded)]
    if missing:
        raise CheckpointError(
            f"{path}: does not fit backbone '{model.backbone_name}' "
            f"({len(missing)} of {len(backbone_keys)} backbone tensors missing or mis-shaped, e.g. {missing[:3]})"
        )
    for key in set(target) - set(loaded):
        if is_grey_copy_key(key):  # a base without grey copies: the grey images start where the colour ones are
            target[key] = target[own_key(key)].clone()
    model.load_state_dict(target)
    return {"loaded": loaded, "skipped": skipped}
