"""Can a pose model learn the synthetic data? Train TinyViT+SimCC from scratch on the public split
for a fixed CPU-time budget, then report PCKh on the test split (a mixture of the site
distributions — a related but different distribution, like MPII after COCO pre-training).

    python benchmarks/synth_speed/learnability.py --cpu-minutes 15

A mean-pose baseline (the average training pose placed in each test crop) is reported next to
it, so "learned something" means clearly above that line. Writes learnability.json here.
The training loop is deliberately plain (AdamW, no DP) — it measures the data, not the trainer.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch

from fedpose.config import ModelConfig
from fedpose.data.annotations import read_annotations
from fedpose.data.dataset import PoseDataset
from fedpose.data.synthetic import ensure_dataset
from fedpose.data.transforms import crop_to_original
from fedpose.eval.pckh import pckh
from fedpose.io import atomic_write_json
from fedpose.model import build_model

HERE = Path(__file__).resolve().parent


def predict(model, dataset: PoseDataset, batch_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Predictions in the original image frame, plus per-sample crop centers/scales."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False)
    preds, centers, scales = [], [], []
    model.eval()
    with torch.no_grad():
        for batch in loader:
            coords, _ = model.decode(*model(batch["image"]))
            preds.append(coords.numpy())
            centers.append(batch["center"].numpy())
            scales.append(batch["scale"].numpy())
    model.train_mode()
    centers_all, scales_all = np.concatenate(centers), np.concatenate(scales)
    crop = np.concatenate(preds)
    return crop_to_original(crop, centers_all, scales_all, dataset.input_size), centers_all, scales_all


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="/tmp/fedpose_synth_learnability")
    parser.add_argument("--public", type=int, default=3000)
    parser.add_argument("--test", type=int, default=300)
    parser.add_argument("--backbone", default="tiny_vit_5m_224")
    parser.add_argument("--input", type=int, nargs=2, default=(256, 192), metavar=("H", "W"))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--cpu-minutes", type=float, default=15.0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)

    ensure_dataset(args.data, sites=3, per_site=0, public=args.public, test=args.test, size=(256, 192), seed=0)
    root = Path(args.data)
    input_size = tuple(args.input)
    train_set = PoseDataset(read_annotations(root / "public"), root / "public", input_size, train=True, seed=0)
    test_records = read_annotations(root / "test")
    test_set = PoseDataset(test_records, root / "test", input_size, train=False)

    model = build_model(ModelConfig(backbone=args.backbone, scenario="scratch"), input_size)
    params = list(model.trainable_parameters().values())
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-4)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)

    budget = args.cpu_minutes * 60
    cpu0, wall0, step, losses = time.process_time(), time.perf_counter(), 0, []
    mean_pose_sum, mean_pose_count = np.zeros((16, 2)), np.zeros((16, 1))
    done = False
    while not done:
        for batch in loader:
            logits_x, logits_y = model(batch["image"])
            loss = model.loss(logits_x, logits_y, batch["joints"], batch["weight"]).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            w = batch["weight"].numpy()[..., None]
            mean_pose_sum += (batch["joints"].numpy() * w).sum(0)
            mean_pose_count += w.sum(0)
            losses.append(loss.item())
            step += 1
            if step % 20 == 0:
                print(f"step {step} loss {np.mean(losses[-20:]):.4f} cpu {time.process_time() - cpu0:.0f}s", flush=True)
            if time.process_time() - cpu0 >= budget:
                done = True
                break
    cpu_seconds, wall_seconds = time.process_time() - cpu0, time.perf_counter() - wall0

    joints = np.stack([r.joints for r in test_records])
    vis = np.stack([r.joints_vis for r in test_records])
    headboxes = np.stack([r.headbox for r in test_records])
    preds, centers, scales = predict(model, test_set, args.batch_size)
    model_pckh = pckh(preds, joints, vis, headboxes)
    mean_pose = mean_pose_sum / np.maximum(mean_pose_count, 1)
    baseline = crop_to_original(np.broadcast_to(mean_pose, (len(test_records), 16, 2)), centers, scales, input_size)
    baseline_pckh = pckh(baseline, joints, vis, headboxes)
    result = {
        "backbone": args.backbone, "scenario": "scratch (no pretrained weights available)",
        "input_size": list(input_size), "batch_size": args.batch_size, "lr": args.lr,
        "train_images": len(train_set), "test_images": len(test_records), "steps": step,
        "epochs": round(step * args.batch_size / len(train_set), 2),
        "cpu_seconds": round(cpu_seconds, 1), "wall_seconds": round(wall_seconds, 1), "torch_threads": args.threads,
        "load_average_1min_end": round(os.getloadavg()[0], 2),
        "loss_first_20": round(float(np.mean(losses[:20])), 4), "loss_last_20": round(float(np.mean(losses[-20:])), 4),
        "test_pckh": {k: round(v, 2) for k, v in model_pckh.items()},
        "mean_pose_baseline_pckh": {k: round(v, 2) for k, v in baseline_pckh.items()},
    }
    print(result)
    atomic_write_json(HERE / "learnability.json", result)


if __name__ == "__main__":
    main()
