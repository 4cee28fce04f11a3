"""Probe: does augmentation multiplicity pay? (issue 26, lever 1; De et al. 2022)

    python benchmarks/federated_utility/augmult_probe.py                 # K ∈ {1, 4}, seeds 0 1 2
    python benchmarks/federated_utility/augmult_probe.py --steps 10 --seeds 0 --out /tmp/x.json   # a smoke run

Central DP fine-tuning per *patient* (the synthetic sites' unit) of the public warm start of
``run.py`` (same data generator, same ``warm_start_checkpoint``), through the product's own path
(``fedpose.train.central.run_training``: unit resolution, the engine, the accountant), on the three
sites' pooled training data, with ``run.py``'s mechanism (pdp, its basis); one run per (seed, K) at
the same ε, δ, q, C and steps, so σ is the same for every K (tested:
tests/test_augmentation_multiplicity.py). Scored on the held-out test split (the
mixture of the sites' distributions) with PCKh@0.5. Tuning status: nothing here was tuned on the
test split; the hyper-parameters are ``run.py``'s central arm (SGD, lr 0.1, momentum 0.9, C 1) with
a shorter run. The result says whether K helps at this scale, not how much it helps the product's
model.

Writes ``augmult_probe.json`` beside this file (conditions, every run, mean ± std per K). Each run
is saved under ``--work`` when it finishes, so an interrupted probe resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as sweep  # noqa: E402  (the sweep's data, warm start and evaluation: one way to do each)


def run_config(args: argparse.Namespace, data: Path, work: Path, init: Path, seed: int, copies: int) -> Any:
    from fedpose.config import RunConfig

    return RunConfig.model_validate({
        "data": {"train": str(work / "pooled"), "input_size": list(args.size)},
        "model": {"backbone": args.backbone, "scenario": "full", "init_checkpoint": str(init)},
        "optim": {"name": "sgd", "lr": args.lr, "momentum": 0.9, "weight_decay": 0.0, "cosine": True},
        "train": {"steps": args.steps, "batch_size": args.batch, "seed": seed, "threads": args.threads, "device": "cpu",
                  "eval_every": args.steps, "checkpoint_every": args.steps,
                  "out_dir": str(work / "runs" / f"s{seed}-k{copies}")},
        "privacy": {"mechanism": args.mechanism, "target_epsilon": args.epsilon, "delta": 1e-5, "max_grad_norm": 1.0,
                    "unit": "patient", "max_records_per_unit": 4, "max_batch_units": args.max_batch_units,
                    "augmentation_multiplicity": copies,
                    # pdp: run.py's basis (k 48 of m 64 public samples), refreshed from the public split
                    "basis": {"k": 48, "public_samples": 64, "refresh_every": 10, "public_data": str(data / "public")}},
    })


def median_step_seconds(run_dir: Path) -> float | None:
    """The median optimizer step's wall time of a finished run (its metrics.json), setup and evaluation excluded."""
    metrics = run_dir / "metrics.json"
    if not metrics.exists():
        return None
    seconds = [r["seconds"] for r in json.loads(metrics.read_text())["train"] if "seconds" in r]
    return round(statistics.median(seconds), 3) if seconds else None


def one_run(args: argparse.Namespace, settings: Any, data: Path, work: Path, seed: int, copies: int) -> dict[str, Any]:
    from fedpose.model import model_from_checkpoint
    from fedpose.runtime import configure_cpu
    from fedpose.train.central import run_training

    configure_cpu(args.threads)
    init = sweep.warm_start_checkpoint(settings, data, work, seed)
    cfg = run_config(args, data, work, init, seed, copies)
    shutil.rmtree(cfg.train.out_dir, ignore_errors=True)
    lines: list[str] = []
    started, cpu_started = time.time(), time.process_time()
    summary = run_training(cfg, progress=False, log=lines.append)
    wall, cpu = time.time() - started, time.process_time() - cpu_started
    model, _ = model_from_checkpoint(Path(cfg.train.out_dir) / "checkpoints" / "last.pt")
    splits = sweep.test_splits(data, settings)
    public, _ = model_from_checkpoint(init)
    privacy = summary["privacy"]
    return {
        "seed": seed, "augmentation_multiplicity": copies,
        "scores": sweep.evaluate_splits(model, {"mixture": splits["mixture"]}, tuple(args.size), settings.flip_test)["mixture"],
        "public_only": sweep.evaluate_splits(public, {"mixture": splits["mixture"]}, tuple(args.size), settings.flip_test)["mixture"],
        "epsilon_text": privacy["epsilon_text"], "noise_multiplier": privacy["noise_multiplier"],
        "sample_rate": privacy["sample_rate"], "rows_per_step": privacy["fixed_shape"]["rows_per_step"],
        "train_wall_seconds": round(wall, 1), "train_cpu_seconds": round(cpu, 1),
        "seconds_per_step": round(wall / args.steps, 3), "step_seconds_median": median_step_seconds(Path(cfg.train.out_dir)),
        "log": lines,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_k: dict[int, list[dict[str, Any]]] = {}
    for entry in runs:
        by_k.setdefault(entry["augmentation_multiplicity"], []).append(entry)
    out: dict[str, Any] = {}
    for copies, entries in sorted(by_k.items()):
        scores = [e["scores"]["pckh50"] for e in entries]
        gains = [e["scores"]["pckh50"] - e["public_only"]["pckh50"] for e in entries]
        out[f"K={copies}"] = {
            "seeds": [e["seed"] for e in entries],
            "pckh50_mean": round(statistics.mean(scores), 2),
            "pckh50_std": round(statistics.stdev(scores), 2) if len(scores) > 1 else None,
            "gain_over_public_only_mean": round(statistics.mean(gains), 2),
            "gain_over_public_only_std": round(statistics.stdev(gains), 2) if len(gains) > 1 else None,
            "run_wall_seconds_per_step_mean": round(statistics.mean(e["seconds_per_step"] for e in entries), 3),  # setup included
            "step_seconds_median_mean": (round(statistics.mean(e["step_seconds_median"] for e in entries), 3)
                                         if all(e.get("step_seconds_median") is not None for e in entries) else None),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/fedpose_augmult_probe"))
    parser.add_argument("--out", type=Path, default=HERE / "augmult_probe.json")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--multiplicities", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--epsilon", type=float, default=8.0, help="per patient, δ = 1e-5, PLD")
    parser.add_argument("--mechanism", default="pdp", choices=["dpsgd", "pdp"],
                        help="pdp (run.py's): dpsgd's noise over all ~0.9 M parameters of the full fine-tune swamps the "
                             "clipped signal at this batch size (a 5-step smoke run fell below the warm start)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="expected patients per batch (q = B / patients)")
    parser.add_argument("--max-batch-units", type=int, default=16,
                        help="unit slots U (below the default, for speed: overflow changes timing only, never ε)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--per-site", type=int, default=80, help="records per site (4 per patient)")
    parser.add_argument("--size", type=int, nargs=2, default=[128, 96])
    parser.add_argument("--backbone", default="tiny_vit_test")
    parser.add_argument("--warm-steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    settings = sweep.Settings(size=tuple(args.size), per_site=args.per_site, backbone=args.backbone, warm_steps=args.warm_steps,
                              threads=args.threads)
    work = args.work
    started = time.time()
    data = sweep.ensure_data(settings, work)
    runs: list[dict[str, Any]] = []
    for seed in args.seeds:
        for copies in args.multiplicities:
            part = work / "parts" / f"{args.mechanism}-s{seed}-k{copies}-{args.steps}steps-eps{args.epsilon:g}.json"
            if not part.exists():
                print(f"[{time.strftime('%H:%M:%S')}] seed {seed}, K = {copies} ...", flush=True)
                part.parent.mkdir(parents=True, exist_ok=True)
                part.write_text(json.dumps(one_run(args, settings, data, work, seed, copies), indent=1))
            entry = json.loads(part.read_text())
            if entry.get("step_seconds_median") is None:  # parts written before it was recorded
                entry["step_seconds_median"] = median_step_seconds(work / "runs" / f"s{seed}-k{copies}")
            print(f"[{time.strftime('%H:%M:%S')}] seed {seed}, K = {copies}: PCKh@0.5 {entry['scores']['pckh50']} "
                  f"(public-only {entry['public_only']['pckh50']}), median step {entry['step_seconds_median']} s", flush=True)
            runs.append(entry)
    result = {
        "what": "augmentation multiplicity K (De et al. 2022): central DP (pdp) fine-tune per patient from the public warm "
                "start, PCKh@0.5 on the held-out mixture test split, mean ± std over seeds; same ε, δ, q, C, steps, so same σ",
        "tuning": "none on the test split: run.py's central-arm optimizer (SGD 0.1, momentum 0.9, C 1), fewer steps",
        "conditions": {**{k: v for k, v in vars(args).items() if k not in ("work", "out")},
                       "sites": settings.sites, "public": settings.public, "test": settings.test,
                       "unit": "patient", "max_records_per_unit": 4, "delta": 1e-5,
                       "accountant": "pld (default)", "scenario": "full", "machine": {"cpus": os.cpu_count(),
                       "python": platform.python_version(), "platform": platform.platform()},
                       "load_at_end": [round(x, 2) for x in os.getloadavg()]},
        "summary": summarize(runs),
        "runs": [{k: v for k, v in r.items() if k != "log"} for r in runs],
        "wall_seconds_this_invocation": round(time.time() - started, 1),
        "train_wall_seconds_all_runs": round(sum(r["train_wall_seconds"] for r in runs), 1),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
