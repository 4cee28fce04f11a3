"""What per-sample gradients of every bias and LayerNorm affine (scenario ``biases_norms``) cost:
from one batched backward, as fedpose takes them since 2026-12-05, or under ``vmap``.

    python benchmarks/step_cost/affine_probe.py [--sizes 128x96 256x192] [--repeats 7] [--device cuda] [--rows N]

Under ``biases_norms`` nothing is frozen (the patch embedding's BatchNorm biases train) and every
backbone unit trains only per-channel shifts and scales, whose per-sample gradients are sums over
a sample's rows of the module's output gradient (⊙ x̂ for a LayerNorm's scale), so fedpose runs
the whole backbone batched and only the head under ``vmap`` (fedpose/privacy/per_sample.py). This
script times, round-robin on one fixed chunk (``--rows``, default the CPU chunk size, 16),
process-CPU seconds, one torch thread (on ``--device cuda``: wall seconds, each way ending with
``torch.cuda.synchronize``, TF32 matmuls on as in training):

* ``vmap_all``: the whole network under ``vmap`` (what fedpose did under ``biases_norms`` until
  2026-12-05);
* ``fedpose``: fedpose's ``per_sample_gradients`` as it is now;
* ``batched``: one batched forward with every affine owner's output recorded (the head's too),
  one ``autograd.grad`` to those outputs, sums per sample (:func:`batched_affine_gradients`);
* ``non_private``: a plain batched forward and ``loss.sum().backward()``;

checks that ``fedpose`` and ``batched`` equal ``vmap_all`` (largest relative difference over
parameters), and writes history/<date>_affine_probe[_cuda].json. Random weights: speed does not
depend on them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from timm.layers import LayerNorm2d
from torch import Tensor, nn

from fedpose.config import ModelConfig
from fedpose.model import PoseModel, build_model
from torch.func import grad_and_value, vmap

from fedpose.privacy import per_sample
from fedpose.privacy.per_sample import DEFAULT_CHUNK_SIZE, frozen_features, per_sample_gradients
from fedpose.runtime import configure_device, synchronize

HERE = Path(__file__).resolve().parent


def _rows_by_sample(grad: Tensor, batch: int, channels_last: bool) -> Tensor:
    """(batch, rows·positions, C) from a batch-major output gradient."""
    if channels_last:
        return grad.reshape(batch, -1, grad.shape[-1])
    return grad.reshape(batch, -1, grad.shape[1], grad.shape[2] * grad.shape[3]).transpose(2, 3).reshape(batch, -1, grad.shape[1])


def batched_affine_gradients(model: PoseModel, features: Tensor, joints: Tensor, weight: Tensor) -> dict[str, Tensor]:
    """Per-sample gradients of a model whose trainable parameters are all biases (Linear, Conv2d,
    BatchNorm2d) and LayerNorm affines, from one batched backward."""
    batch, records = features.shape[0], []
    owners = {name: module for name, module in model.named_modules()
              if any(p.requires_grad for p in module.parameters(recurse=False))}
    handles = [module.register_forward_hook(lambda m, args, out, name=name: records.append((name, m, args[0], out)))
               for name, module in owners.items()]
    try:
        with torch.enable_grad():
            losses = model.loss(*model(features, start="features"), joints, weight)
    finally:
        for handle in handles:
            handle.remove()
    output_grads = torch.autograd.grad(losses.sum(), [out for *_, out in records], allow_unused=True)
    grads: dict[str, Tensor] = {}
    for (name, module, inputs, output), grad in zip(records, output_grads):
        grad = torch.zeros_like(output) if grad is None else grad
        channels_last = isinstance(module, nn.Linear) or type(module) is nn.LayerNorm
        by_sample = _rows_by_sample(grad, batch, channels_last)
        found = {"bias": by_sample.sum(1)}
        if isinstance(module, nn.LayerNorm):  # LayerNorm (last dim) or timm's LayerNorm2d (channels)
            cl_inputs = inputs if type(module) is nn.LayerNorm else inputs.permute(0, 2, 3, 1)
            normalized = F.layer_norm(cl_inputs, module.normalized_shape, None, None, module.eps).detach()
            found["weight"] = (by_sample * normalized.reshape(batch, -1, by_sample.shape[-1])).sum(1)
        elif not isinstance(module, (nn.Linear, nn.Conv2d, nn.BatchNorm2d)):
            raise TypeError(f"{name}: {type(module).__name__} is not a bias or norm owner")
        for key, value in found.items():
            if getattr(module, key, None) is not None and getattr(module, key).requires_grad:
                full = f"{name}.{key}"
                grads[full] = grads[full] + value if full in grads else value
    return {name: grads[name] for name in model.trainable_parameters()}


def probe(size: tuple[int, int], repeats: int, device: torch.device, rows: int = DEFAULT_CHUNK_SIZE) -> dict[str, object]:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # biases_norms without init_checkpoint: random frozen weights
        model = build_model(ModelConfig(backbone="tiny_vit_5m_224", scenario="biases_norms"), size).to(device)
    model.train_mode()
    with torch.no_grad():  # non-zero affines, so a gradient that ignored them would show
        for param in model.trainable_parameters().values():
            param.add_(0.05 * torch.randn_like(param))
    images = torch.randn(rows, 3, *size, device=device)
    joints = torch.rand(rows, 16, 2, device=device) * torch.tensor([size[1], size[0]], dtype=torch.float32, device=device)
    weight = torch.ones(rows, 16, device=device)
    features = frozen_features(model, images)

    def non_private() -> None:
        model.zero_grad(set_to_none=True)
        model.loss(*model(features, start="features"), joints, weight).sum().backward()

    def vmap_all() -> dict[str, Tensor]:
        params = {name: p.detach() for name, p in model.trainable_parameters().items()}
        with per_sample._vmap_safe_attention(model, device):  # CUDA's fused attention rejects vmap
            grads, _ = vmap(grad_and_value(per_sample._sample_loss_fn(model, "features")), in_dims=(None, 0, 0, 0))(
                params, features, joints, weight)
        return grads

    ways = {"vmap_all": vmap_all,
            "fedpose": lambda: per_sample_gradients(model, features, joints, weight)[0],
            "batched": lambda: batched_affine_gradients(model, features, joints, weight),
            "non_private": non_private}
    reference = vmap_all()

    def largest_relative_difference(grads: dict[str, Tensor]) -> float:
        return max(float((grads[n] - reference[n]).abs().max() / reference[n].abs().max().clamp(min=1e-12)) for n in reference)
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    for name, way in ways.items():  # warm-up
        way()
    for _ in range(repeats):
        for name, way in ways.items():
            started = clock()
            way()
            synchronize(device)
            seconds[name].append(round(clock() - started, 4))
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    return {"input_size": list(size), "rows": rows, "trainable_parameters": model.num_trainable(),
            "largest_relative_difference_to_vmap_all": {name: largest_relative_difference(ways[name]())
                                                         for name in ("fedpose", "batched")},
            "median_cpu_seconds": medians, "all_cpu_seconds": seconds,
            "over_non_private": {name: round(medians[name] / medians["non_private"], 3) for name in ways}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["128x96", "256x192"], help="H×W, e.g. 128x96")
    parser.add_argument("--repeats", type=int, default=7, help="timed chunks per way (after one warm-up)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument("--rows", type=int, default=DEFAULT_CHUNK_SIZE, help="rows of the chunk (default: the CPU chunk)")
    parser.add_argument("--out", type=Path, default=None, help="default: history/<date>_affine_probe[_cuda].json")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        configure_device(device)
        device_name = f"{torch.cuda.get_device_name(device)}"
    else:
        torch.set_num_threads(1)
        device_name = "cpu"
    load_start = os.getloadavg()
    results = [probe(tuple(int(v) for v in size.split("x")), args.repeats, device, args.rows)  # type: ignore[arg-type]
               for size in args.sizes]
    suffix = "_cuda" if device.type == "cuda" else ""
    out = args.out or HERE / "history" / f"{datetime.date.today().isoformat()}_affine_probe{suffix}.json"
    out.write_text(json.dumps({
        "what": __doc__.split("\n\n")[0].strip(),
        "conditions": {"backbone": "tiny_vit_5m_224", "scenario": "biases_norms", "device": device_name,
                       "torch_threads": torch.get_num_threads(),
                       "machine": platform.machine(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
                       "python": platform.python_version(), "load_average_start": load_start,
                       "load_average_end": os.getloadavg(),
                       "method": ("wall seconds (synchronized)" if device.type == "cuda" else "process-CPU seconds")
                       + f" of one {args.rows}-row chunk, ways timed round-robin, medians"},
        "results": results}, indent=1) + "\n")
    for result in results:
        print(f"{result['input_size']}: {result['median_cpu_seconds']}  over non-private {result['over_non_private']}  "
              f"max rel diff {result['largest_relative_difference_to_vmap_all']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
