"""Per-sample gradients of the trainable part of a :class:`~fedpose.model.PoseModel`.

Why ``torch.func`` and not Opacus' hooks (measured, see shared/FACTS.md):

* Opacus rejects stock timm TinyViT in every grad-sample mode: trainable ``Attention`` modules
  own a buffer, and TinyViT folds attention windows into the batch dimension, so hook-based
  "per-sample" gradients are per *window*. Patched to run, the clipping would silently be per
  window — a privacy bug, not just a crash.
* ``functional_call`` + ``vmap`` + ``grad`` differentiates the model as one function of its
  parameters for one sample at a time, whatever the model does with its batch dimension inside
  (window folding included). It matches a per-sample loop to float precision.

Where the trainable part starts with units whose only trainable parameters are affines (the
model's *affine-tuned* part: LayerNorm affines and the biases of linear, convolution and BatchNorm
layers — stages 1–2 under ``finetune``, the whole backbone under ``biases_norms``), running them
under ``vmap`` too is slow: vmap backpropagates through their convolutions and attention sample by
sample (at 256×192, batch 16, finetune, timm's attention blocks: a dpsgd step took 1.90 s that
way against 1.75 s as below, with 1.54 s for a non-private step; benchmarks/step_cost). Their
per-sample gradients need far less. A bias b of a layer with output y = … + b has sample i's
gradient Σ_t ∂l_i/∂y_t over that sample's rows t (and, for a convolution or BatchNorm, its
positions); a LayerNorm y = γ ⊙ x̂ + β has Σ_t ∂l_i/∂y_t ⊙ x̂_t for γ and Σ_t ∂l_i/∂y_t for β. So
:func:`per_sample_gradients`

1. runs the affine-tuned part once, batched, with autograd, recording each trainable module's
   output (and a LayerNorm's x̂) (:class:`_AffineRecord`);
2. takes per-sample gradients of the suffix *and of its input* with ``vmap`` (as above);
3. backpropagates those input gradients through the affine-tuned part in one batched backward,
   which yields ∂l/∂y for every recorded output: the gradient of Σ_i l_i at sample i's rows
   is ∂l_i/∂y, because samples do not interact (BatchNorm runs on frozen statistics, and
   nothing else mixes the batch);
4. sums ∂l/∂y (⊙ x̂ for a LayerNorm's γ) over each sample's rows and positions.

Rows belong to samples in batch-major order: an output of shape (B·w, …) holds sample i's rows at
[i·w, (i+1)·w) — true of TinyViT's window folding ((B, windows, …) reshaped to (B·windows, …)),
the trap that breaks Opacus. tests/test_dp_engine.py checks the result against a per-sample loop
on the real TinyViT at a size with several padded windows per sample, for the affines of stages
1–2 (``finetune``) and of the whole backbone (``biases_norms``).

Contract with the model: ``forward_frozen(images)`` (run here under ``no_grad``),
``forward_affine_tuned(features)``, ``affine_tuned_modules()``, and
``model(x, start="features" | "hidden")``, a pure function of the parameters and buffers
(BatchNorm in eval mode — the batched path refuses one in training mode — no stochastic
layers); ``loss(...)`` is per-sample; ``named_modules()`` as in ``nn.Module``. Gradients are taken
w.r.t. ``model.trainable_parameters()``, in that order; a "flat" gradient is their concatenation
(``flatten`` / ``unflatten``).

The vmap runs in chunks of ``chunk_size`` samples to bound memory (per-sample gradients of a
chunk are ``chunk_size × p`` floats, ~18 MiB per sample at p = 4.74 M, plus the activations each
sample keeps for its backward pass, which dominate when p is small). On the CPU the chunk is
:data:`DEFAULT_CHUNK_SIZE`; on CUDA :func:`measured_chunk_size` measures what a chunk costs on the
model itself and sizes it from free device memory (:func:`auto_chunk_size`, by the gradients
alone, where no model is at hand).

Device: everything here runs on the device of ``features`` (the model's device); sums, norms and
clipping factors are float32 there, and the clipped sums' products never use TF32 (:func:`no_tf32`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

from fedpose.joints import NUM_JOINTS


class TrainableModel(Protocol):
    """What the privacy engine needs from a pose model (the contract in the module docstring)."""

    input_size: tuple[int, int]  # (H, W) of its images: what measured_chunk_size probes with

    def forward_frozen(self, images: Tensor) -> Tensor: ...
    def forward_affine_tuned(self, features: Tensor) -> Tensor: ...
    def forward_trainable(self, features: Tensor) -> tuple[Tensor, Tensor]: ...
    def affine_tuned_modules(self) -> dict[str, nn.Module]: ...
    def loss(self, logits_x: Tensor, logits_y: Tensor, joints: Tensor, weight: Tensor) -> Tensor: ...
    def trainable_parameters(self) -> dict[str, nn.Parameter]: ...
    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...


DEFAULT_CHUNK_SIZE = 16
#: device memory one sample of a chunk needs, in units of its float32 gradient (4·p bytes): the
#: per-sample gradient, the per-unit sum or flat copy it is folded into, and the chunk's
#: activations kept for the batched backward (comparable at 256×192). An estimate to be checked
#: against the peak GPU memory that benchmarks/step_cost records on CUDA.
_GRADIENT_COPIES_PER_SAMPLE = 4
#: share of the available device memory the per-sample gradients of one chunk may take
_DEVICE_MEMORY_SHARE = 0.5
_MAX_AUTO_CHUNK = 1024


def chunk_size_for(available_bytes: int, num_params: int, rows: int | None = None) -> int:
    """Samples per chunk that fit ``available_bytes`` of device memory: half of it over ~4 float32
    gradient copies per sample (p = 4.7 M: 19 MB a copy), at most ``rows`` (a step's fixed row
    count: a larger chunk would never be filled) and :data:`_MAX_AUTO_CHUNK`."""
    per_sample = _GRADIENT_COPIES_PER_SAMPLE * 4 * max(1, num_params)
    cap = _MAX_AUTO_CHUNK if rows is None else max(1, min(_MAX_AUTO_CHUNK, int(rows)))
    return max(1, min(cap, int(_DEVICE_MEMORY_SHARE * available_bytes // per_sample)))


def available_device_memory(device: torch.device) -> int:
    """Bytes a step may use on a CUDA ``device`` now: free in the driver plus what torch's allocator
    holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def auto_chunk_size(device: torch.device, num_params: int, rows: int | None = None) -> int:
    """Samples per chunk for per-sample gradients of ``num_params`` parameters on ``device``:
    :data:`DEFAULT_CHUNK_SIZE` on the CPU; on CUDA sized from the memory available now by the
    gradients alone (:func:`chunk_size_for`; with a model at hand, :func:`measured_chunk_size`
    counts the activations too). Callers decide it once, from a step's fixed shape, before training
    (:class:`~fedpose.privacy.engine.GradientEngine`): per step, it would depend on what the
    allocator happens to hold."""
    if device.type != "cuda":
        return DEFAULT_CHUNK_SIZE if rows is None else max(1, min(DEFAULT_CHUNK_SIZE, int(rows)))
    return chunk_size_for(available_device_memory(device), num_params, rows)


#: samples of the two probe chunks :func:`measured_chunk_size` runs (two sizes: a fixed part and a slope)
_PROBE_SAMPLES = (2, 4)


def measured_chunk_size(model: TrainableModel, device: torch.device, rows: int, input_rows: int | None = None) -> int:
    """Samples per chunk of per-sample gradients on a CUDA ``device``, from what a chunk costs there:
    the per-unit path (:func:`clipped_unit_gradient_sum`, every row its own unit: the larger of the
    two paths) runs on 2 and on 4 zero images of ``model.input_size`` — no record of any dataset —
    and the allocator's peak above what was allocated before gives a fixed part and a cost per
    sample (its gradient, its unit's sum *and* the activations it keeps for the backward pass,
    which :func:`chunk_size_for` does not count and which dominate when p is small). The chunk is
    then as many samples as fit half the memory available now, after the step's own inputs
    (``input_rows`` images and their frozen features; default ``rows``), at most ``rows``.

    Resets the device's peak-memory statistics (``torch.cuda.reset_peak_memory_stats``); model
    weights, buffers and gradients are untouched."""
    probes = [chunk_peak_bytes(model, device, samples) for samples in _PROBE_SAMPLES]
    peaks, row_bytes = [peak for peak, _ in probes], probes[-1][1]
    num_params = sum(p.numel() for p in model.trainable_parameters().values())
    return chunk_size_from_probe(available_device_memory(device), peaks, num_params, rows,
                                 row_bytes * (rows if input_rows is None else input_rows))


def chunk_peak_bytes(model: TrainableModel, device: torch.device, samples: int) -> tuple[int, float]:
    """What one chunk of ``samples`` costs on a CUDA ``device``: the allocator's peak above what was
    allocated before, while the per-unit path (every row its own unit) runs on ``samples`` zero
    images of ``model.input_size`` (no record of any dataset); and the bytes of one row's image and
    frozen features, which the step holds outside the chunk. Resets the device's peak statistics."""
    height, width = model.input_size  # type: ignore[attr-defined]
    images = torch.zeros(samples, 3, height, width, device=device)
    features = frozen_features(model, images)
    row_bytes = (images.numel() * images.element_size() + features.numel() * features.element_size()) / samples
    joints = torch.zeros(samples, NUM_JOINTS, 2, device=device)
    weight = torch.ones(samples, NUM_JOINTS, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    clipped_unit_gradient_sum(model, features, joints, weight, torch.arange(samples, device=device), 1.0, samples)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before, row_bytes


def chunk_size_from_probe(available_bytes: int, peaks: list[int], num_params: int, rows: int, inputs_bytes: float) -> int:
    """Samples per chunk from the probe's peaks at :data:`_PROBE_SAMPLES` samples: fixed + n · per
    sample must fit half of ``available_bytes`` less the step's inputs (``inputs_bytes``); at most
    ``rows`` and :data:`_MAX_AUTO_CHUNK`, at least 1. The cost per sample is never taken below the
    two float32 copies of p it certainly holds (its gradient and its unit's sum): allocator rounding
    can make a small difference of peaks look free."""
    (small, large), (low, high) = _PROBE_SAMPLES, peaks
    per_sample = max((high - low) / (large - small), 2 * 4 * max(1, num_params))
    fixed = max(0.0, low - small * per_sample)
    budget = _DEVICE_MEMORY_SHARE * available_bytes - inputs_bytes - fixed
    cap = max(1, min(_MAX_AUTO_CHUNK, int(rows)))
    return max(1, min(cap, int(budget // per_sample)))


def frozen_features(model: TrainableModel, images: Tensor, chunk_size: int | None = None) -> Tensor:
    """The frozen prefix, outside any autograd graph: for the whole batch at once, or ``chunk_size``
    rows at a time (a DP step's rows: every forward then has the chunk's shape, whatever the step's size)."""
    with torch.no_grad():
        if chunk_size is None or images.shape[0] <= chunk_size:
            return model.forward_frozen(images)
        return torch.cat([model.forward_frozen(part) for part in images.split(chunk_size)])


def flatten(tensors: dict[str, Tensor] | list[Tensor]) -> Tensor:
    values = tensors.values() if isinstance(tensors, dict) else tensors
    return torch.cat([t.reshape(-1) for t in values])


def unflatten(flat: Tensor, like: dict[str, Tensor]) -> dict[str, Tensor]:
    """Split a flat vector into tensors shaped like ``like`` (views into ``flat``)."""
    out, offset = {}, 0
    for name, ref in like.items():
        out[name] = flat[offset: offset + ref.numel()].view_as(ref)
        offset += ref.numel()
    if offset != flat.numel():
        raise ValueError(f"flat gradient has {flat.numel()} entries, the parameters {offset}")
    return out


def _sample_loss_fn(model: TrainableModel, start: str):
    def sample_loss(params: dict[str, Tensor], inputs: Tensor, joints: Tensor, weight: Tensor) -> Tensor:
        logits_x, logits_y = functional_call(model, params, (inputs.unsqueeze(0),), {"start": start})
        return model.loss(logits_x, logits_y, joints.unsqueeze(0), weight.unsqueeze(0)).squeeze(0)

    return sample_loss


@dataclass(frozen=True)
class Affine:
    """What the batched path knows of a module type: which of its parameters are per-channel scales
    or shifts of its output, and whether that output is channels last (rows, …, C) or channels
    first (rows, C, H, W)."""

    parameters: tuple[str, ...]
    channels_last: bool


#: the module types whose :class:`Affine` parameters the batched path attributes to samples — the
#: one list: the model's affine-tuned part may hold trainable parameters of these only
#: (:func:`affine_of`). Exact types: a subclass may use its parameters differently (fedpose's
#: LoRALinear adds an adapter path, timm's LayerNorm2d normalises channels first).
AFFINE_MODULES: dict[type[nn.Module], Affine] = {
    nn.LayerNorm: Affine(("weight", "bias"), channels_last=True),
    nn.Linear: Affine(("bias",), channels_last=True),
    nn.Conv2d: Affine(("bias",), channels_last=False),
    nn.BatchNorm2d: Affine(("bias",), channels_last=False),
}


def affine_of(module: nn.Module) -> Affine | None:
    """``module``'s entry in :data:`AFFINE_MODULES`; None where the batched path cannot attribute its
    parameters (a type not listed, or a LayerNorm over more than its last dimension)."""
    if type(module) is nn.LayerNorm and len(module.normalized_shape) != 1:
        return None
    return AFFINE_MODULES.get(type(module))


class _AffineRecord:
    """One call of a module of the affine-tuned part: its output y (and, for a LayerNorm, its
    normalised input x̂), from which its bias's and LayerNorm affine's per-sample gradients follow
    (module docstring)."""

    def __init__(self, name: str, module: nn.Module, inputs: Tensor, output: Tensor) -> None:
        affine = affine_of(module)
        if affine is None:
            raise TypeError(f"{name}: per-sample gradients of a {type(module).__name__}'s parameters need the vmap path")
        self.name, self.module, self.output = name, module, output
        self.channels_last = affine.channels_last
        self.normalized: Tensor | None = None
        if isinstance(module, nn.LayerNorm):
            with torch.no_grad():
                self.normalized = F.layer_norm(inputs, module.normalized_shape, None, None, module.eps)

    def per_sample_gradients(self, output_grad: Tensor | None, batch: int) -> dict[str, Tensor]:
        """{parameter name: (batch, C)} from ∂(Σ_i l_i)/∂y, rows grouped batch-major (module docstring)."""
        rows = self.output.shape[0]
        if rows % batch:
            raise RuntimeError(
                f"{type(self.module).__name__} {self.name}: its input has {rows} rows for {batch} samples, so "
                "rows cannot be attributed to samples; per-sample gradients of this model need the vmap path"
            )
        if output_grad is None:  # y does not reach the loss
            output_grad = torch.zeros_like(self.output)
        if self.channels_last:  # (rows, …, C): sum a sample's rows and positions
            channels = self.output.shape[-1]
            by_sample = output_grad.reshape(batch, -1, channels)
            grads = {"bias": by_sample.sum(1)}
            if self.normalized is not None:
                grads["weight"] = (by_sample * self.normalized.reshape(batch, -1, channels)).sum(1)
        else:  # (rows, C, H, W)
            channels = self.output.shape[1]
            grads = {"bias": output_grad.reshape(batch, rows // batch, channels, -1).sum((1, 3))}
        return {
            f"{self.name}.{key}": grad
            for key, grad in grads.items()
            if getattr(self.module, key) is not None and getattr(self.module, key).requires_grad
        }


@contextmanager
def _record_affines(modules: dict[str, nn.Module]) -> Iterator[list[_AffineRecord]]:
    records: list[_AffineRecord] = []

    def hook_for(name: str):
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            records.append(_AffineRecord(name, module, args[0], output))

        return hook

    handles = [module.register_forward_hook(hook_for(name)) for name, module in modules.items()]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _vmap_safe_attention(model: nn.Module, device: torch.device) -> Iterator[None]:
    """On CUDA, timm's attention takes its explicit path (q·kᵀ·scale + bias, softmax, ·v — the
    same arithmetic) while per-sample gradients are computed: torch's fused attention kernels
    reject an attention bias without the vmapped batch dimension ("attn_bias: wrong shape (batch
    dimension)", seen on an H200 with torch 2.11), so every DP step failed on a GPU. The CPU
    keeps the fused path, which vmap handles there."""
    modules = [m for m in model.modules() if getattr(m, "fused_attn", False)] if device.type == "cuda" else []
    for module in modules:
        module.fused_attn = False
    try:
        yield
    finally:
        for module in modules:
            module.fused_attn = True


def per_sample_gradients(
    model: TrainableModel, features: Tensor, joints: Tensor, weight: Tensor
) -> tuple[dict[str, Tensor], Tensor]:
    """({name: (b, *param.shape)}, per-sample losses (b,)) for one chunk — no clipping.

    The affine-tuned part's gradients come from one batched backward, the rest from ``vmap``
    (module docstring).
    """
    with _vmap_safe_attention(model, features.device):  # type: ignore[arg-type]
        return _per_sample_gradients(model, features, joints, weight)


def _per_sample_gradients(
    model: TrainableModel, features: Tensor, joints: Tensor, weight: Tensor
) -> tuple[dict[str, Tensor], Tensor]:
    trainable = model.trainable_parameters()
    affine_modules = model.affine_tuned_modules()
    if not affine_modules:
        params = {name: p.detach() for name, p in trainable.items()}
        grads, losses = vmap(grad_and_value(_sample_loss_fn(model, "features")), in_dims=(None, 0, 0, 0))(
            params, features, joints, weight
        )
        return grads, losses.detach()

    _refuse_batch_statistics(model)
    with torch.enable_grad(), _record_affines(affine_modules) as records:
        hidden = model.forward_affine_tuned(features)
    affine_tuned = {
        f"{name}.{key}"
        for name, module in affine_modules.items()
        for key, param in module.named_parameters(recurse=False)
        if param.requires_grad
    }
    if not affine_tuned <= trainable.keys():
        raise RuntimeError(f"affine_tuned_modules() names parameters that are not trainable: {sorted(affine_tuned - trainable.keys())}")
    suffix_params = {name: p.detach() for name, p in trainable.items() if name not in affine_tuned}
    (grads, hidden_grads), losses = vmap(
        grad_and_value(_sample_loss_fn(model, "hidden"), argnums=(0, 1)), in_dims=(None, 0, 0, 0)
    )(suffix_params, hidden.detach(), joints, weight)
    output_grads = torch.autograd.grad(hidden, [r.output for r in records], hidden_grads, allow_unused=True)
    grads = dict(grads)
    for record, output_grad in zip(records, output_grads):
        for name, grad in record.per_sample_gradients(output_grad, features.shape[0]).items():
            # a module called more than once contributes once per call
            grads[name] = grads[name] + grad if name in grads else grad
    called = {record.name for record in records}
    for name in affine_tuned - grads.keys():
        if name.rsplit(".", 1)[0] in called:
            raise RuntimeError(f"{name}: the batched path has no per-sample gradient for this parameter")
        # a module the forward never called: its parameters get no gradient, as under vmap
        grads[name] = torch.zeros((features.shape[0], *trainable[name].shape), device=features.device)
    return {name: grads[name] for name in trainable}, losses.detach()


def _refuse_batch_statistics(model: TrainableModel) -> None:
    """The batched path is exact only while samples do not interact; a BatchNorm on batch statistics
    would mix them, and one sample could then move every other sample's "per-sample" gradient past
    the clipping bound. (:meth:`PoseModel.train` keeps BatchNorm in eval mode; this catches a model
    that was switched by hand.)"""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            raise RuntimeError(f"BatchNorm {name} is in training mode: its batch statistics would mix samples, so "
                               "per-sample gradients (and the clipping bound) would be wrong; use PoseModel.train()")


def per_sample_norms(grads: dict[str, Tensor]) -> Tensor:
    """Flat L2 norm over all trainable parameters, per sample (b,), accumulated in float64: a float32
    sum of p squares comes out low (by ~2e-5 relative at p ≈ 1 M, ~2e-3 at 2²⁵), and a norm
    computed low clips a gradient to more than C (a red-team measured it)."""
    per_tensor = [torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1, dtype=torch.float64) for g in grads.values()]
    return torch.linalg.vector_norm(torch.stack(per_tensor, 1), dim=1)


def row_norms(rows: Tensor) -> Tensor:
    """L2 norm of each row of a (n, p) float32 matrix, accumulated in float64 one row at a time (a
    float64 copy of the whole matrix would double the step's largest buffer)."""
    if rows.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float64, device=rows.device)
    return torch.stack([torch.linalg.vector_norm(row, dtype=torch.float64) for row in rows])


#: a clipping factor is rounded down by this much when it becomes float32, so factor · ‖g‖ ≤ C holds
#: after the rounding too (float32 keeps 24 bits: one rounding moves it by at most 2⁻²⁴ relative)
FACTOR_ROUNDED_DOWN = 1.0 - 2.0 ** -22


@contextmanager
def no_tf32() -> Iterator[None]:
    """CUDA matrix products in full float32 inside the block. The clipped sum multiplies each unit's
    gradient by its factor in a matrix product: with TF32 (which :func:`fedpose.runtime.configure_device`
    turns on for CUDA training) its entries would be rounded to 10 mantissa bits there, after the
    norm was taken, and a unit could move the sum by up to C · (1 + 2⁻¹¹)."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def clip_factors(norms: Tensor, max_grad_norm: float) -> Tensor:
    """min(1, C / ‖g_i‖), as float32 rounded down: scales each sample's gradient to norm ≤ C (Abadi
    et al.). ``norms`` in float64 (:func:`per_sample_norms`, :func:`row_norms`)."""
    return ((max_grad_norm / (norms.double() + 1e-12)).clamp(max=1.0) * FACTOR_ROUNDED_DOWN).float()


def clipped_gradient_sum(
    model: TrainableModel,
    features: Tensor,
    joints: Tensor,
    weight: Tensor,
    max_grad_norm: float,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    row_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Σ_i clip(∇ l(x_i), C) as a flat vector (p,), plus per-sample norms (B,) and losses (B,).

    Each sample's gradient is clipped to flat L2 norm ``max_grad_norm`` over *all* trainable
    parameters before summation, so one sample moves the sum by at most C.

    A sample whose gradient norm is not finite (NaN/Inf entries, or an overflowing norm) is
    zeroed: otherwise 0·Inf = NaN would poison the sum, and one record (or weights a malicious
    coordinator chose to overflow it) would decide whether the site can release anything. Zero
    is a valid clipped value, so the sensitivity stays C. Such samples show up as non-finite
    entries of the returned norms (the caller counts them locally; they never leave the site).

    ``row_mask`` (B,) bool: False marks a padding row of a fixed-shape step
    (:mod:`fedpose.privacy.fixed_shape`). It is computed like any other row (same work) and its
    gradient is set to exactly 0 before the sum, whatever its value.
    """
    if max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
    params = model.trainable_parameters()
    device = features.device
    total = torch.zeros(sum(p.numel() for p in params.values()), dtype=torch.float32, device=device)
    mask = _row_mask(row_mask, features.shape[0], device)
    norms, losses = [], []
    for start in range(0, features.shape[0], chunk_size):
        stop = start + chunk_size
        grads, chunk_losses = per_sample_gradients(model, features[start:stop], joints[start:stop], weight[start:stop])
        chunk_norms = per_sample_norms(grads)
        factors = clip_factors(chunk_norms, max_grad_norm)
        dropped = ~torch.isfinite(chunk_norms) | ~mask[start:stop]  # non-finite or padding: exactly zero
        factors = torch.where(dropped, torch.zeros_like(factors), factors)
        for g in grads.values():  # unconditionally: a data-dependent branch would be a data-dependent cost
            g[dropped] = 0.0
        # Σ_i factor_i · g_i per parameter, accumulated straight into the flat sum (one gemv each).
        offset = 0
        with no_tf32():
            for g in grads.values():
                size = g[0].numel()
                total[offset: offset + size].addmv_(g.reshape(g.shape[0], -1).float().T, factors)
                offset += size
        norms.append(chunk_norms)
        losses.append(chunk_losses)
    if not norms:
        return total, torch.zeros(0, device=device), torch.zeros(0, device=device)
    return total, torch.cat(norms), torch.cat(losses)


def clipped_unit_gradient_sum(
    model: TrainableModel,
    features: Tensor,
    joints: Tensor,
    weight: Tensor,
    unit_index: Tensor,
    max_grad_norm: float,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    row_mask: Tensor | None = None,
    augmentations: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Σ_u clip(Σ_{i ∈ u} ∇ l(x_i), C): per-sample gradients summed per protection unit, each
    unit's sum clipped to flat L2 norm C as one, so adding or removing a whole unit (a patient
    with any number of records) moves the sum by at most C.

    ``augmentations`` K (augmentation multiplicity, De et al. 2022): every record of the batch is
    in it K times, each row an independent augmentation. A unit's gradient is then the sum over
    its records of the mean over their K rows, i.e. its row sum ÷ K, and that is what is clipped
    (once, to C): the sensitivity stays C. The returned norms are of that averaged gradient.

    ``unit_index`` (B,) gives each row's unit (any integer labels; rows of a unit need not be
    adjacent). Returns the flat sum (p,), the units' pre-clip norms (U,) in ascending label order,
    per-sample losses (B,) and a (B,) mask of samples whose own gradient was non-finite.

    Conventions of :func:`clipped_gradient_sum`: a non-finite per-sample gradient is zeroed
    before it enters its unit's sum (one record cannot poison its unit or decide the release),
    and a unit whose summed norm is not finite (overflow) is zeroed too; zero is a valid clipped
    value, so the sensitivity stays C. Memory: rows are processed ``chunk_size`` at a time and
    the per-unit sums of one chunk take at most ``chunk_size × p`` floats, like the per-sample
    gradients themselves; a unit spanning chunks carries one partial sum (p,) forward.

    ``row_mask`` (B,) bool: False marks a padding row (see :func:`clipped_gradient_sum`); its
    gradient is set to exactly 0 before its unit's sum. A unit slot of padding rows only sums to 0
    and adds exactly 0. The returned non-finite mask is over real rows only.
    """
    if max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
    if augmentations < 1:
        raise ValueError(f"augmentations per record must be >= 1, got {augmentations}")
    rows = features.shape[0]
    if unit_index.shape != (rows,):
        raise ValueError(f"unit_index must have one entry per row ({rows}), got shape {tuple(unit_index.shape)}")
    params = model.trainable_parameters()
    num_params = sum(p.numel() for p in params.values())
    device = features.device
    total = torch.zeros(num_params, dtype=torch.float32, device=device)
    if rows == 0:
        return (total, torch.zeros(0, device=device), torch.zeros(0, device=device),
                torch.zeros(0, dtype=torch.bool, device=device))
    # Rows of one unit made adjacent, so each unit is finished after at most a few chunks.
    unit_index = unit_index.to(device)
    order = torch.argsort(unit_index.long(), stable=True)
    labels = unit_index.long()[order]
    features, joints, weight = features[order], joints[order], weight[order]
    mask = _row_mask(row_mask, rows, device)[order]
    unit_norms: list[Tensor] = []
    losses_sorted, nonfinite_sorted = [], []
    carry: Tensor | None = None  # partial sum of the unit whose rows continue into the next chunk
    for start in range(0, rows, chunk_size):
        stop = min(rows, start + chunk_size)
        grads, chunk_losses = per_sample_gradients(model, features[start:stop], joints[start:stop], weight[start:stop])
        nonfinite = ~torch.isfinite(per_sample_norms(grads)) & mask[start:stop]
        dropped = nonfinite | ~mask[start:stop]  # non-finite or padding: exactly zero
        for g in grads.values():  # unconditionally: a data-dependent branch would be a data-dependent cost
            g[dropped] = 0.0
        chunk_units, local = torch.unique_consecutive(labels[start:stop], return_inverse=True)
        sums = torch.zeros(len(chunk_units), num_params, dtype=torch.float32, device=device)
        offset = 0
        for g in grads.values():  # segment-sum per parameter, straight into the flat per-unit rows
            size = g[0].numel()
            sums.narrow(1, offset, size).index_add_(0, local, g.reshape(g.shape[0], -1).float())
            offset += size
        del grads
        if carry is not None:  # sorted labels: the carried unit is this chunk's first
            sums[0] += carry
            carry = None
        finished = len(chunk_units)
        if stop < rows and int(labels[stop]) == int(chunk_units[-1]):
            carry = sums[-1].clone()
            finished -= 1
        if finished:
            done = sums[:finished]
            norms = row_norms(done)
            if augmentations != 1:  # the unit's gradient is done / K: its norm, and the factor applied to done
                norms = norms / augmentations
            finite = torch.isfinite(norms)
            factors = clip_factors(norms, max_grad_norm)
            factors = torch.where(finite, factors, torch.zeros_like(factors))
            # 0 · Inf = NaN: zero the overflowing units' rows outright — always, so the step's work
            # does not depend on whether a private unit overflowed
            done = torch.where(finite[:, None], done, torch.zeros_like(done))
            with no_tf32():
                total.addmv_(done.T, factors if augmentations == 1 else factors / augmentations)
            unit_norms.append(norms)
        losses_sorted.append(chunk_losses)
        nonfinite_sorted.append(nonfinite)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(rows, device=order.device)
    return total, torch.cat(unit_norms), torch.cat(losses_sorted)[inverse], torch.cat(nonfinite_sorted)[inverse]


def _row_mask(row_mask: Tensor | None, rows: int, device: torch.device) -> Tensor:
    """(rows,) bool on ``device``: the given mask, or every row real."""
    if row_mask is None:
        return torch.ones(rows, dtype=torch.bool, device=device)
    if row_mask.shape != (rows,):
        raise ValueError(f"row_mask must have one entry per row ({rows}), got shape {tuple(row_mask.shape)}")
    return row_mask.to(device=device, dtype=torch.bool)


def buffer_view(buffer: Tensor, shape: tuple[int, int], what: str) -> Tensor:
    """The first rows·cols elements of a reused float32 ``buffer`` as a ``shape`` matrix."""
    size = shape[0] * shape[1]
    if buffer.dtype != torch.float32 or buffer.numel() < size:
        raise ValueError(f"{what} must be float32 with >= {size} elements, got {buffer.dtype} with {buffer.numel()}")
    return buffer.view(-1)[:size].view(shape)


def gradient_matrix(
    model: TrainableModel,
    features: Tensor,
    joints: Tensor,
    weight: Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    out: Tensor | None = None,
) -> Tensor:
    """Unclipped per-sample gradients as a (B, p) float32 matrix (for the public basis).

    ``out``: a float32 buffer of at least B × p elements to write into (its first B·p elements are
    returned as the matrix). Reusing one across basis refreshes saves mapping ~2 GB of fresh pages
    each time (m = 100, p = 4.7 M), which costs seconds of page faults on these VMs.
    """
    params = model.trainable_parameters()
    shape = (features.shape[0], sum(p.numel() for p in params.values()))
    matrix = torch.empty(shape, dtype=torch.float32, device=features.device) if out is None else buffer_view(out, shape, "gradient buffer")
    for start in range(0, features.shape[0], chunk_size):
        grads, _ = per_sample_gradients(
            model, features[start: start + chunk_size], joints[start: start + chunk_size], weight[start: start + chunk_size]
        )
        rows = next(iter(grads.values())).shape[0]
        offset = 0
        for g in grads.values():
            size = g[0].numel()
            matrix[start: start + rows, offset: offset + size] = g.reshape(rows, -1)
            offset += size
    return matrix


def mean_gradient(model: TrainableModel, features: Tensor, joints: Tensor, weight: Tensor,
                  row_mask: Tensor | None = None, chunk_size: int | None = None,
                  drop_nonfinite_rows: bool = False) -> tuple[Tensor, Tensor]:
    """Plain (unclipped, noise-free) gradient of the batch-mean loss, flat (p,), and losses (B,).
    With ``row_mask``, the mean over the real rows (padding rows computed, weighted 0; no real row:
    a zero gradient). With ``chunk_size``, ``chunk_size`` rows at a time, their gradients summed: the
    same gradient (up to float summation order) with the activations of one chunk held, not of the
    whole batch: a public-view sample as large as a step's U·R rows (640 at B = 160 patients of 4
    images, the tiny backbone at 128×96) peaked at 4.8 GiB in one pass, 1.0 GiB in chunks of 16.
    ``drop_nonfinite_rows``: a DP step's public-view gradient leaves out a row whose gradient is not
    finite (below); non-private training keeps it, so that a step size that overflows the weights is
    reported as divergence, not hidden."""
    params = model.trainable_parameters()
    rows = int(features.shape[0])
    mask = _row_mask(row_mask, rows, features.device)
    count = mask.sum().clamp(min=1)
    step = max(1, rows if chunk_size is None else int(chunk_size))
    total = torch.zeros(sum(p.numel() for p in params.values()), device=features.device)
    losses = [features.new_zeros(0)]
    for start in range(0, rows, step):
        part = slice(start, start + step)
        chunk, chunk_losses = _masked_mean_gradient(model, features[part], joints[part], weight[part], mask[part], count)
        if drop_nonfinite_rows and not bool(torch.isfinite(chunk).all()):
            # A row whose image or annotation makes its loss or gradient non-finite poisons the whole sum
            # (0·NaN is NaN, so masking its loss is not enough): take the chunk's real rows one by one and
            # drop such a row, as a private row's non-finite gradient is zeroed — one record must not make
            # a round fail after its spend (docs/privacy.md). Only such a chunk pays the row-wise passes: a
            # time that depends on the public sample's rows only (their public view and keypoints).
            chunk = torch.zeros_like(chunk)
            for row in torch.nonzero(mask[part]).flatten().tolist():
                one = slice(start + row, start + row + 1)
                row_gradient, _ = _masked_mean_gradient(model, features[one], joints[one], weight[one], mask[one], count)
                if bool(torch.isfinite(row_gradient).all()):
                    chunk += row_gradient
        total += chunk
        losses.append(chunk_losses)
    return total, torch.cat(losses)


def _masked_mean_gradient(model: TrainableModel, features: Tensor, joints: Tensor, weight: Tensor, mask: Tensor,
                          count: Tensor) -> tuple[Tensor, Tensor]:
    """Flat gradient of Σ_{masked rows} loss / count over these rows, and their losses (detached)."""
    params = model.trainable_parameters()
    logits_x, logits_y = model.forward_trainable(features)
    row_losses = model.loss(logits_x, logits_y, joints, weight)
    objective = torch.where(mask, row_losses, torch.zeros_like(row_losses)).sum() / count
    grads = torch.autograd.grad(objective, list(params.values()), allow_unused=True)
    return flatten([torch.zeros_like(p) if g is None else g for p, g in zip(params.values(), grads)]), row_losses.detach()
