"""Grey copies: the grey (infrared) images' own biases and LayerNorm affines.

Hospitals' night-time cameras record infrared images: one grey channel, stored with R = G = B.
Public photo collections are in colour, and a public base reads grey images far worse than colour
ones. That is most of what the sites teach it: on the main job's tuning data the shipped recipe's
published models gained +16.7 to +21.0 PCKh@0.5 on the grey test images and lost 0.8 to 1.7 on the
colour ones (benchmarks/federated_utility/gain_by_kind/). Every coordinate of a shared trainable set
carries DP noise that the colour images pay for and learn nothing from.

Scenario ``grey_biases_norms`` gives every tensor of ``biases_norms`` (every bias and LayerNorm
affine) a grey copy (``grey_early_biases_norms``: those of the patch embedding and the first two
stages only, :data:`fedpose.model.pose_model.GREY_EARLY_UNITS`), registered on its module as
``grey_bias`` / ``grey_weight`` and starting as the module's own tensor. A grey image runs with
the copies, a colour image with the module's tensors, which stay frozen: the copies are the only
trainable tensors. So

* a fresh model computes exactly its base model, and a colour image's output stays the base's
  whatever the copies become: its gradient is exactly zero;
* a grey image's gradient falls in the copies; a unit's clipped gradient still moves the noisy sum
  by at most C, so σ, q and ε are those of any other trainable set;
* the number of trainable parameters is ``biases_norms``' (30 912 for tiny_vit_5m_224; 5 216 of
  them early);
* a DP step fills a sampled unit's rows from its grey records only (:func:`records_with_gradient`):
  a colour row would cost a row's work and add exactly zero.

Which images are grey is a function of the image alone (:func:`grey_flags`, a public rule): the
mean over its pixels of |R − G| + |G − B|, intensities in [0, 1], under :data:`GREY_TOLERANCE`.
The augmentation's black fill, rotation and mirroring keep a grey image grey. The flags are
computed wherever the model runs and are never part of a message.

Each copy acts through a forward hook that adds g·(copy − own) to its module's output (for a
LayerNorm's scale, g·(γ_grey − γ) ⊙ x̂), with g the image's flag repeated over its rows: TinyViT's
window folding keeps a sample's rows together (batch-major), which the hook checks. The hooks read
the flags from their own module, where :meth:`PoseModel.forward_suffix` puts them for one forward
pass, so a copied model (``copy.deepcopy``) never reads another model's flags. Per-sample gradients
take the ``vmap`` path over the whole network: the batched affine path
(:mod:`fedpose.privacy.per_sample`) does not know the copies.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from timm.layers import LayerNorm2d
from torch import Tensor, nn

from fedpose.data.dataset import IMAGENET_MEAN, IMAGENET_STD

#: an image is grey when the mean over its pixels of |R − G| + |G − B| (intensities in [0, 1]) is
#: under this: one grey level of 255 per channel pair, so that a grey image stored as JPEG (whose
#: chroma rounding leaves ±1 levels here and there) still counts as grey, and a colour photo does not
GREY_TOLERANCE = 2.0 / 255
#: the attribute name prefix of a grey copy on its module ("grey_bias", "grey_weight")
GREY_PREFIX = "grey_"
#: the attribute a module's hook reads the current pass's flags from
_FLAGS = "_fedpose_grey_flags"
#: crops flagged per batch by :func:`records_with_gradient` (bounds its memory only)
_FLAG_CHUNK = 256


def is_grey_copy_key(name: str) -> bool:
    """Whether a parameter / state-dict key is a grey copy."""
    return name.rsplit(".", 1)[-1].startswith(GREY_PREFIX)


def own_key(grey_key: str) -> str:
    """The key of the tensor a grey copy copies ("a.grey_bias" → "a.bias")."""
    prefix, last = grey_key.rsplit(".", 1)
    return f"{prefix}.{last.removeprefix(GREY_PREFIX)}"


def grey_flags(images: Tensor) -> Tensor:
    """(B,) 1.0 for each ImageNet-normalised image (B, 3, H, W) without colour, 0.0 otherwise (in
    the images' dtype, so that the hooks' arithmetic works under ``vmap``)."""
    mean = torch.tensor(IMAGENET_MEAN, dtype=images.dtype, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=images.dtype, device=images.device).view(1, 3, 1, 1)
    intensity = images * std + mean
    chroma = (intensity[:, 0] - intensity[:, 1]).abs() + (intensity[:, 1] - intensity[:, 2]).abs()
    return (chroma.flatten(1).mean(1) < GREY_TOLERANCE).to(images.dtype)


def add_grey_copies(model: nn.Module, targets: set[str]) -> list[nn.Module]:
    """Give every parameter named in ``targets`` (biases and LayerNorm affines) a grey copy on its
    module, and the module the hook that uses it; returns the modules, in ``named_modules`` order."""
    modules = []
    for name, module in list(model.named_modules()):
        own = [p for p, _ in module.named_parameters(recurse=False) if (f"{name}.{p}" if name else p) in targets]
        if not own:
            continue
        if any(p != "bias" for p in own) and type(module) not in (nn.LayerNorm, LayerNorm2d):
            raise TypeError(f"{name}: a grey copy of a {type(module).__name__}'s {own} (biases and LayerNorm affines only)")
        for p in own:
            module.register_parameter(f"{GREY_PREFIX}{p}", nn.Parameter(getattr(module, p).detach().clone()))
        module.register_forward_hook(_grey_hook(name, own))
        modules.append(module)
    return modules


@contextmanager
def grey_pass(modules: list[nn.Module], images: Tensor) -> Iterator[None]:
    """One forward pass of ``images`` (B, 3, H, W): the hooks of ``modules`` read the images' flags
    during it and none after it. Nothing to do for a model without grey copies (no modules)."""
    if not modules:
        yield
        return
    flags = grey_flags(images)
    for module in modules:
        setattr(module, _FLAGS, flags)
    try:
        yield
    finally:
        for module in modules:
            setattr(module, _FLAGS, None)

#: modules whose output is (rows, …, C); the others' is (rows, C, H, W)
_CHANNELS_LAST = (nn.Linear, nn.LayerNorm)


def _grey_hook(name: str, own: list[str]) -> Callable[[nn.Module, tuple, Tensor], Tensor]:
    def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        flags = getattr(module, _FLAGS, None)
        if flags is None:  # a pass outside forward_suffix (BatchNorm calibration): the module's own tensors
            return output
        rows, images = output.shape[0], flags.shape[0]
        if rows % images:
            raise RuntimeError(f"{name}: {rows} rows for {images} images; grey copies need a sample's rows together")
        channels_last = type(module) in _CHANNELS_LAST
        correction = torch.zeros((), dtype=output.dtype, device=output.device)
        for p in own:
            delta = getattr(module, f"{GREY_PREFIX}{p}") - getattr(module, p)
            if not channels_last:  # (C,) over (rows, C, H, W)
                delta = delta.view(1, -1, *([1] * (output.dim() - 2)))
            if p == "weight":  # a LayerNorm's scale: (γ_grey − γ) ⊙ x̂
                delta = delta * _normalized(module, args[0], channels_last)
            correction = correction + delta
        per_row = flags.repeat_interleave(rows // images).view(rows, *([1] * (output.dim() - 1)))
        return output + per_row * correction

    return hook


def _normalized(module: nn.Module, inputs: Tensor, channels_last: bool) -> Tensor:
    """x̂ of a LayerNorm (over the channels), in its output's layout."""
    if channels_last:
        return F.layer_norm(inputs, module.normalized_shape, None, None, module.eps)
    return F.layer_norm(inputs.permute(0, 2, 3, 1), module.normalized_shape, None, None, module.eps).permute(0, 3, 1, 2)


def trains_only_grey_copies(trainable_names: Iterable[str]) -> bool:
    """Whether a model whose trainable tensors are these trains nothing but grey copies (scenario
    ``grey_biases_norms``, ``grey_early_biases_norms``): then a colour image's gradient is exactly zero."""
    names = list(trainable_names)
    return bool(names) and all(is_grey_copy_key(name) for name in names)


def records_with_gradient(trainable_names: Iterable[str], dataset: Any) -> list[bool] | None:
    """Which of ``dataset``'s records can move the trainable tensors: None (every one) unless they
    are grey copies only; then the records whose un-augmented crop is grey (:func:`grey_flags`).

    A DP step fills a sampled unit's fixed row slots (``privacy.max_records_per_unit``) from these
    records only (:class:`fedpose.privacy.engine.GradientEngine`): a colour row would cost a row's
    work and add exactly zero. Its private sample only: the flag is of the private crop, so a public
    view's noise-free sample (fdp, maskdp) takes a unit's rows from all of its records. The flag is a function of the record alone, computed for every
    record with the same work whatever it is, so it changes neither the sensitivity (a unit's sum
    is still clipped to C once), nor q, nor what a round costs. The augmentation keeps a grey crop
    grey (black fill, rotation, mirroring); a colour record whose crop would only turn grey under
    some augmentation is left out: utility, never privacy."""
    if not trains_only_grey_copies(trainable_names):
        return None
    flags: list[bool] = []
    for start in range(0, len(dataset), _FLAG_CHUNK):
        images = torch.stack([dataset.load(i, plain=True)["image"] for i in range(start, min(start + _FLAG_CHUNK, len(dataset)))])
        flags.extend(bool(flag) for flag in grey_flags(images).tolist())
    if flags and not any(flags):
        # said on this machine only (stderr / the local log): in a reply, one record could flip it
        warnings.warn(f"the model trains only grey copies (model.scenario grey_*) but none of the {len(flags)} "
                      "training images is grey: every step's rows are padding, so training moves the model by DP noise "
                      "alone; train another scenario on colour-only data", RuntimeWarning, stacklevel=2)
    return flags

