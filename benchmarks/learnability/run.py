"""Learnability: can the default model learn the synthetic data in a CPU budget, and does
fine-tuning on one site's data help on that site? These are the non-private reference numbers
for the privacy benchmarks.

    python benchmarks/learnability/run.py                     # defaults below, writes results.json
    python benchmarks/learnability/run.py --input 256 192 --scratch-cpu-minutes 20

1. Generate (or reuse) a synthetic dataset: one public split (the public profile) and one site
   (site-1, its own distribution); the test split is drawn from site-1's distribution.
2. ``scratch``: tiny_vit_5m_224 + SimCC from random weights on the public split, non-private,
   for at most ``--scratch-cpu-minutes`` of process CPU time (all threads, data loading
   included). PCKh@0.5 on the test split.
3. ``finetune``: from that model, scenario ``finetune`` (stages 0–2 frozen) on site-1's training
   images for ``--finetune-cpu-minutes``. PCKh on the same test split (site-1's distribution).
A mean-pose baseline (average training pose in crop coordinates) is reported for scale.
The run uses the library's own loop (fedpose.train.train_steps with the "none" engine).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedpose.config import ModelConfig, OptimConfig, PrivacyConfig
from fedpose.data.dataset import PoseDataset, load_records
from fedpose.data.synthetic import ensure_dataset
from fedpose.data.transforms import crop_to_original
from fedpose.eval.pckh import pckh
from fedpose.io import atomic_write_json
from fedpose.model import build_model, save_checkpoint
from fedpose.privacy.engine import build_engine
from fedpose.runtime import configure_cpu
from fedpose.train import build_optimizer, build_scheduler, calibrate_batch_norm, evaluate, train_steps

HERE = Path(__file__).resolve().parent


def cpu_seconds() -> float:
    return time.process_time()


def train_phase(
    model: Any, dataset: PoseDataset, args: argparse.Namespace, cpu_minutes: float, lr: float, max_steps: int, seed: int,
    fixed_steps: int | None = None,
) -> dict[str, Any]:
    """Train for at most ``cpu_minutes`` of process CPU time: a short probe fixes the step count,
    so the warm-up + cosine schedule spans the whole budget. ``fixed_steps`` overrides the budget."""
    optim_cfg = OptimConfig(lr=lr, weight_decay=0.05, warmup_steps=args.warmup, cosine=True)
    engine = build_engine(PrivacyConfig(), model, len(dataset), args.batch_size, max_steps, None, seed)
    batches = engine.batches(dataset)
    optimizer = build_optimizer(model, optim_cfg)
    cpu0, wall0 = cpu_seconds(), time.time()
    # Probe at the warm-up's start (lr tiny): measures the CPU cost of a step under current load.
    probe_scheduler = build_scheduler(optimizer, optim_cfg, max_steps)
    probe = train_steps(model, engine, dataset, optimizer, args.probe_steps, probe_scheduler, progress=False, batches=batches)
    per_step = (cpu_seconds() - cpu0) / args.probe_steps
    total = int(min(max_steps, max(args.probe_steps + 1, cpu_minutes * 60 / per_step)))
    if fixed_steps is not None:
        total = max(args.probe_steps + 1, fixed_steps)
    scheduler = build_scheduler(optimizer, optim_cfg, total)
    for _ in range(args.probe_steps):
        scheduler.step()
    history = probe + train_steps(
        model, engine, dataset, optimizer, total - args.probe_steps, scheduler, progress=True,
        batches=batches, first_step=args.probe_steps,
    )
    losses = [h["loss"] for h in history]
    return {
        "steps": total, "batch_size": args.batch_size, "samples_seen": total * args.batch_size,
        "epochs": round(total * args.batch_size / len(dataset), 2), "lr": lr,
        "cpu_seconds": round(cpu_seconds() - cpu0, 1), "wall_seconds": round(time.time() - wall0, 1),
        "cpu_seconds_per_step_probe": round(per_step, 3),
        "loss_first_20": round(float(np.mean(losses[:20])), 4), "loss_last_20": round(float(np.mean(losses[-20:])), 4),
        "loss_curve": [round(float(np.mean(losses[i:i + 50])), 4) for i in range(0, len(losses), 50)],
    }


def mean_pose_baseline(train: PoseDataset, test: PoseDataset, samples: int = 200) -> dict[str, float]:
    """PCKh of predicting the average training pose (crop frame) for every test person."""
    crops = np.stack([train[i]["joints"].numpy() for i in range(min(samples, len(train)))])
    weights = np.stack([train[i]["weight"].numpy() for i in range(min(samples, len(train)))])
    mean = (crops * weights[..., None]).sum(0) / np.maximum(weights.sum(0), 1)[:, None]
    items = [test[i] for i in range(len(test))]
    preds = crop_to_original(
        np.repeat(mean[None], len(items), 0), np.stack([t["center"].numpy() for t in items]),
        np.array([t["scale"] for t in items]), test.input_size,
    )
    return pckh(preds, np.stack([t["joints_original"].numpy() for t in items]),
                np.stack([t["joints_vis"].numpy() for t in items]), np.stack([t["headbox"].numpy() for t in items]))


def rounded(scores: dict[str, float]) -> dict[str, float]:
    return {k: round(float(v), 2) for k, v in scores.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="/tmp/fedpose_learnability_data")
    parser.add_argument("--public", type=int, default=2000)
    parser.add_argument("--site", type=int, default=400, help="site-1 training images")
    parser.add_argument("--test", type=int, default=300)
    parser.add_argument("--backbone", default="tiny_vit_5m_224")
    parser.add_argument("--input", type=int, nargs=2, default=(128, 96), metavar=("H", "W"))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--finetune-lr", type=float, default=5e-4)
    parser.add_argument("--label-sigma", type=float, default=4.0)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--probe-steps", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=5000)
    parser.add_argument("--scratch-cpu-minutes", type=float, default=20.0)
    parser.add_argument("--finetune-cpu-minutes", type=float, default=5.0)
    parser.add_argument("--scratch-steps", type=int, default=None, help="fixed step count (overrides the CPU budget)")
    parser.add_argument("--finetune-steps", type=int, default=None, help="fixed step count (overrides the CPU budget)")
    parser.add_argument("--rotation", type=float, default=0.0, help="training rotation augmentation ± degrees")
    parser.add_argument("--scale-jitter", type=float, default=0.0, help="training scale augmentation ±")
    parser.add_argument("--calibration-images", type=int, default=64,
                        help="public images that set the scratch model's BatchNorm statistics (0 = keep the noise calibration)")
    parser.add_argument("--note", default="", help="free-text note stored under conditions (e.g. why steps were capped)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "results.json")
    args = parser.parse_args()

    configure_cpu(args.threads)
    torch.manual_seed(args.seed)
    size = tuple(args.input)
    t0 = time.time()
    ensure_dataset(args.data, sites=1, per_site=args.site, public=args.public, test=args.test, size=size, seed=args.seed)
    generation_seconds = time.time() - t0
    data = Path(args.data)

    def dataset(split: str, train: bool) -> PoseDataset:
        records, root = load_records(data / split)
        return PoseDataset(records, root, input_size=size, train=train, seed=args.seed, cache_images=True,
                           rotation=args.rotation, scale_jitter=args.scale_jitter)

    public, site, test = dataset("public", True), dataset("site-1", True), dataset("test", False)
    results: dict[str, Any] = {
        "conditions": {
            "machine": f"{os.cpu_count()} cores shared with other jobs; load average at start {os.getloadavg()[0]:.1f}",
            "torch_threads": args.threads, "torch": torch.__version__,
            "budget": "process CPU time (all threads, data loading included)",
            "note": args.note,
        },
        "recipe": {"rotation": args.rotation, "scale_jitter": args.scale_jitter, "calibration_images": args.calibration_images,
                   "head": "SimCC, 3x3 conv to 32 maps per joint"},
        "data": {"dir": str(data), "public": len(public), "site-1": len(site), "test": len(test),
                 "test_distribution": "site-1", "image_size": list(size), "generation_wall_seconds": round(generation_seconds, 1)},
        "model": {"backbone": args.backbone, "input_size": list(size), "split_factor": 2, "label_sigma": args.label_sigma},
        "mean_pose_baseline_pckh": rounded(mean_pose_baseline(public, test)),
    }

    model = build_model(ModelConfig(backbone=args.backbone, scenario="scratch", label_sigma=args.label_sigma), size)
    if args.calibration_images > 0:  # BatchNorm always runs on running statistics; start them at the data's
        calibrate_batch_norm(model, public, args.calibration_images)
    results["scratch"] = {"train": train_phase(model, public, args, args.scratch_cpu_minutes, args.lr, args.max_steps, args.seed,
                                             args.scratch_steps)}
    results["scratch"]["test_pckh"] = rounded(evaluate(model, test, batch_size=64))
    results["scratch_site_test_before_finetune"] = "same test split (site-1 distribution) as finetune.test_pckh"
    checkpoint = data.parent / "learnability_scratch.pt"
    save_checkpoint(checkpoint, model, step=results["scratch"]["train"]["steps"])
    print("scratch:", results["scratch"]["test_pckh"], flush=True)
    atomic_write_json(args.out, results)

    finetune = build_model(ModelConfig(backbone=args.backbone, scenario="finetune", label_sigma=args.label_sigma,
                                       init_checkpoint=checkpoint), size)
    results["finetune"] = {
        "trainable_parameters": finetune.num_trainable(),
        "train": train_phase(finetune, site, args, args.finetune_cpu_minutes, args.finetune_lr, args.max_steps, args.seed + 1,
                             args.finetune_steps),
    }
    results["finetune"]["test_pckh"] = rounded(evaluate(finetune, test, batch_size=64))
    results["conditions"]["load_average_end"] = round(os.getloadavg()[0], 1)
    print("finetune:", results["finetune"]["test_pckh"], flush=True)
    atomic_write_json(args.out, results)


if __name__ == "__main__":
    main()
