"""What skipping TinyViT's window padding saves (fedpose.model.window_attention): a DP step's
per-sample gradients and a non-private step, with timm's blocks (attention over the padding) and
with fedpose's (the padding's share in closed form, the same function).

    python benchmarks/step_cost/window_attention.py [--sizes 128x96 256x192] [--repeats 5] [--rows 16]

For each input size and scenario (``biases_norms``: the main job's, the whole backbone on the
batched path; ``finetune``: stage 3 and the head under ``vmap``) it times, round-robin on one fixed
chunk of ``--rows`` rows (default: the CPU chunk), process-CPU seconds on one torch thread:

* ``dp_timm`` / ``dp_fedpose``: ``per_sample_gradients`` (what a DP step spends per chunk, less
  the clipping and noise, which do not depend on the blocks);
* ``nonprivate_timm`` / ``nonprivate_fedpose``: a batched forward and ``loss.sum().backward()``;

checks that the two ways' per-sample gradients agree (largest relative difference over
parameters) and writes window_attention.json. Random weights with non-zero attention biases:
speed does not depend on the weights.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch

from fedpose.config import ModelConfig
from fedpose.model import build_model
from fedpose.model.window_attention import run_window_padding
from fedpose.privacy.per_sample import DEFAULT_CHUNK_SIZE, frozen_features, per_sample_gradients

HERE = Path(__file__).resolve().parent


def probe(size: tuple[int, int], scenario: str, repeats: int, rows: int) -> dict[str, object]:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no init_checkpoint: random frozen weights
        fedpose_model = build_model(ModelConfig(backbone="tiny_vit_5m_224", scenario=scenario), size).train_mode()
    with torch.no_grad():
        for name, param in fedpose_model.named_parameters():
            if "attention_biases" in name:
                param.normal_(0.0, 1.0)
    timm_model = run_window_padding(copy.deepcopy(fedpose_model))
    images = torch.randn(rows, 3, *size)
    joints = torch.rand(rows, 16, 2) * torch.tensor([size[1], size[0]], dtype=torch.float32)
    weight = torch.ones(rows, 16)
    features = frozen_features(fedpose_model, images)

    def dp(model):
        return lambda: per_sample_gradients(model, features, joints, weight)[0]

    def non_private(model):
        def step() -> None:
            model.zero_grad(set_to_none=True)
            model.loss(*model(features, start="features"), joints, weight).sum().backward()
        return step

    ways = {"dp_timm": dp(timm_model), "dp_fedpose": dp(fedpose_model),
            "nonprivate_timm": non_private(timm_model), "nonprivate_fedpose": non_private(fedpose_model)}
    reference, ours = ways["dp_timm"](), ways["dp_fedpose"]()
    largest_relative_difference = max(
        float((ours[n] - reference[n]).abs().max() / reference[n].abs().max().clamp(min=1e-12)) for n in reference)
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for way in ways.values():  # warm-up
        way()
    for _ in range(repeats):
        for name, way in ways.items():
            started = time.process_time()
            way()
            seconds[name].append(round(time.process_time() - started, 4))
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    return {"input_size": list(size), "scenario": scenario, "rows": rows,
            "largest_relative_difference_per_sample_gradients": largest_relative_difference,
            "median_seconds": medians, "all_seconds": seconds,
            "speedup": {"dp": round(medians["dp_timm"] / medians["dp_fedpose"], 3),
                        "nonprivate": round(medians["nonprivate_timm"] / medians["nonprivate_fedpose"], 3)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["128x96", "256x192"], help="H×W, e.g. 128x96")
    parser.add_argument("--scenarios", nargs="+", default=["biases_norms", "finetune"])
    parser.add_argument("--repeats", type=int, default=5, help="timed chunks per way (after one warm-up)")
    parser.add_argument("--rows", type=int, default=DEFAULT_CHUNK_SIZE, help="rows of the chunk (default: the CPU chunk)")
    parser.add_argument("--out", type=Path, default=HERE / "window_attention.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    results = []
    for size in args.sizes:
        for scenario in args.scenarios:
            result = probe(tuple(int(v) for v in size.split("x")), scenario, args.repeats, args.rows)  # type: ignore[arg-type]
            print(f"{size} {scenario}: {result['median_seconds']}  speed-up {result['speedup']}  "
                  f"max rel diff {result['largest_relative_difference_per_sample_gradients']:.1e}", flush=True)
            results.append(result)
    args.out.write_text(json.dumps({
        "what": __doc__.split("\n\n")[0].strip(),
        "conditions": {"backbone": "tiny_vit_5m_224", "device": "cpu", "cpu": platform.processor() or platform.machine(),
                       "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                       "torch": torch.__version__, "python": platform.python_version(),
                       "date": datetime.date.today().isoformat(),
                       "load_average_start": load_start, "load_average_end": os.getloadavg(),
                       "method": f"process-CPU seconds of one {args.rows}-row chunk, ways timed round-robin, medians"},
        "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
