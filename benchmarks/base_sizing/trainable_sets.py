"""CPU seconds per DP step for each trainable-parameter set of the product's model (issue 26's
"which parameters are trainable" lever): how much a smaller set costs or saves per step.

    python benchmarks/base_sizing/trainable_sets.py            # tiny_vit_5m_224, 128×96, B = 16, 1 thread

Writes benchmarks/base_sizing/trainable_sets.json. Method: :func:`run.probe_model` (this folder's
run.py): a fixed batch of exactly B random images, one warm-up step, then ``--repeats``
round-robin steps of "none" (plain autograd) and "dpsgd" (per-sample gradients, clipping, secure
noise: the engine the sites run); medians of process-CPU and wall seconds, with the load average.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

import torch

from fedpose.config import ModelConfig
from fedpose.io import atomic_write_json
from fedpose.runtime import cpu_model

HERE = Path(__file__).resolve().parent
# this folder's run.py by path: it imports step_cost's run.py under the module name "run" itself
_spec = importlib.util.spec_from_file_location("base_sizing_run", HERE / "run.py")
base_sizing = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(base_sizing)  # type: ignore[union-attr]

SCENARIOS = ("finetune", "norms_head", "norms", "lora")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", default="tiny_vit_5m_224")
    parser.add_argument("--size", type=int, nargs=2, default=(128, 96), metavar=("H", "W"))
    parser.add_argument("--batch", type=int, default=16, help="rows per step (B)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS))
    parser.add_argument("--out", type=Path, default=HERE / "trainable_sets.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load_before = base_sizing.load_average()
    rows = [base_sizing.probe_model(args.backbone, scenario, tuple(args.size), args.batch, args.repeats) for scenario in args.scenarios]
    for row in rows:  # the raw lists stay in run.py's results; here the medians are the point
        row.pop("all_wall_seconds")
        row.pop("all_cpu_seconds")
    atomic_write_json(args.out, {
        "what": "seconds per step, non-private ('none') and DP-SGD ('dpsgd'), per trainable-parameter set",
        "backbone": args.backbone, "input_size_hw": list(args.size), "batch_rows": args.batch, "repeats": args.repeats,
        "torch_threads": args.threads, "lora_rank": ModelConfig().lora_rank,
        "machine": {"cpus": os.cpu_count(), "cpu_model": cpu_model(),
                    "load_average_before": load_before, "load_average_after": base_sizing.load_average()},
        "wall_seconds_total": round(time.perf_counter() - started, 1),
        "models": rows,
    })
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
