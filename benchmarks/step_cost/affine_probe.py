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
* ``non_private``: a plain batched forward and ``loss.sum().backward()``;

checks that ``fedpose`` equals ``vmap_all`` (largest relative difference over parameters), and
writes history/<date>_affine_probe[_cuda].json. Random weights: speed does not depend on them.
The 2026-12-05 run (history/2026-12-05_affine_probe.json) also timed the head on the batched path
(an own copy of the record arithmetic, since removed): 1.03 and 1.11 times non-private, against
fedpose's 1.04 and 1.04, so the head stays under ``vmap``.
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
from torch import Tensor
from torch.func import grad_and_value, vmap

from fedpose.config import ModelConfig
from fedpose.model import build_model
from fedpose.privacy import per_sample
from fedpose.privacy.per_sample import DEFAULT_CHUNK_SIZE, frozen_features, per_sample_gradients
from fedpose.runtime import configure_device, synchronize

HERE = Path(__file__).resolve().parent


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
            "non_private": non_private}
    reference, ours = vmap_all(), ways["fedpose"]()
    largest_relative_difference = max(
        float((ours[n] - reference[n]).abs().max() / reference[n].abs().max().clamp(min=1e-12)) for n in reference)
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
            "largest_relative_difference_fedpose_to_vmap_all": largest_relative_difference,
            "median_seconds": medians, "all_seconds": seconds,
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
        print(f"{result['input_size']}: {result['median_seconds']}  over non-private {result['over_non_private']}  "
              f"max rel diff {result['largest_relative_difference_fedpose_to_vmap_all']:.1e}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
