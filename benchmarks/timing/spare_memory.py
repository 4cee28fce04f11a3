"""Peak memory of a site round whose last step runs a large spare (fedpose.privacy.fixed_shape).

A federation site's round does fixed work: its last step also computes the rows its earlier steps
left of the round's budget, all padding. Until 0007721 that spare was collated into the last step's
batch; now it is loaded and run one chunk at a time (``fedpose.privacy.engine.SpareRows``). This
script runs one round of real DP-SGD steps both ways, each in a fresh process, and records the
peak resident memory and the round's wall time. "one batch" re-creates the old path faithfully:
the engine's layout is unchanged and every row, spare included, is loaded into the step's batch
(the same rows, the same release).

    python benchmarks/timing/spare_memory.py --out benchmarks/timing/spare_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

MODES = ("chunked", "one batch")


def one_round(mode: str, args: argparse.Namespace) -> dict:
    import torch

    from fedpose.config import ModelConfig, PrivacyConfig
    from fedpose.data.units import UnitIndex
    from fedpose.model import build_model
    from fedpose.privacy.engine import SPARE_ROWS_KEY, build_engine

    torch.set_num_threads(args.threads)
    height, width = args.size

    class RandomImages(torch.utils.data.Dataset):
        """Records with the keys the engine reads: a fresh random image each (nothing cached)."""

        def __len__(self) -> int:
            return args.patients * args.records

        def __getitem__(self, i: int) -> dict:
            g = torch.Generator().manual_seed(i)
            return {"image": torch.randn(3, height, width, generator=g), "joints": torch.rand(16, 2, generator=g) * torch.tensor([width, height]),
                    "weight": torch.ones(16), "index": i}

    model = build_model(ModelConfig(backbone=args.backbone, scenario="biases_norms"), (height, width))
    model.train_mode()
    units = UnitIndex("patient", tuple(tuple(range(p * args.records, (p + 1) * args.records)) for p in range(args.patients)))
    privacy = PrivacyConfig(mechanism="dpsgd", noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=args.batch / args.patients,
                            max_records_per_unit=args.records)
    engine = build_engine(privacy, model, len(units.members) * args.records, args.batch, args.steps, units=units,
                          chunk_size=args.chunk, round_steps=args.steps)
    if mode == "one batch":  # the path until 0007721: the spare collated into the last step's batch
        laid_out = engine._laid_out_sample

        def all_rows(draw: int, sample: int):
            records, slots, real, _ = laid_out(draw, sample)
            return records, slots, real, len(records)

        engine._laid_out_sample = all_rows
    optimizer = torch.optim.SGD(model.trainable_parameters().values(), lr=0.0)
    batches = engine.batches(RandomImages())
    started, rows, spare = time.perf_counter(), 0, 0
    for _ in range(args.steps):
        batch = next(batches)
        optimizer.zero_grad(set_to_none=True)
        engine.step(model, batch)
        optimizer.step()
        rows += int(batch["image"].shape[0])
        spare += len(batch.get(SPARE_ROWS_KEY, ()))
    seconds = time.perf_counter() - started
    return {"mode": mode, "round_seconds": round(seconds, 2), "rows_in_batches": rows, "rows_run_as_spare_chunks": spare,
            "rows_per_round": engine.round.chunks * engine.round.chunk_rows,
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", default="tiny_vit_test")
    parser.add_argument("--size", type=int, nargs=2, default=[256, 192], metavar=("H", "W"))
    parser.add_argument("--patients", type=int, default=480)
    parser.add_argument("--records", type=int, default=4, help="records per patient (all in a sampled patient's slot)")
    parser.add_argument("--batch", type=int, default=16, help="expected patients per step")
    parser.add_argument("--steps", type=int, default=30, help="steps per round")
    parser.add_argument("--chunk", type=int, default=16, help="rows per per-sample chunk")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one measurement, in a child process
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(one_round(args.mode, args)))
        return
    results = []
    for mode in MODES:  # each in a fresh process: peak RSS is per process
        child = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
        if args.out:
            at = child.index("--out")
            del child[at: at + 2]
        out = subprocess.run(child, check=True, capture_output=True, text=True, env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(results[-1], flush=True)
    report = {
        "conditions": {key: value for key, value in vars(args).items() if key not in ("mode", "out")}
        | {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
           "load_average_start": os.getloadavg(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "what": "one site round of DP-SGD steps (dpsgd, biases_norms, per patient), fixed work per round; each mode in its own process"},
        "results": results,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
