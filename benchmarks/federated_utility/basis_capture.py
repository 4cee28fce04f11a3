"""How much of a site's clipped mean gradient a public projection basis keeps, against its noise.

    python benchmarks/federated_utility/basis_capture.py     # → basis_capture.json (~2 min on 1 thread)

PDP-SGD releases V Vᵀ (mean of clipped per-unit gradients) + noise in the k directions of V. The
useful signal per step is ‖Vᵀ ḡ‖ (ḡ: a site's clipped mean gradient, C = 1); the noise's norm is
σ·C·√k / B. This measures both for the sweep's tuning data (data_seed 7: never a reported split) at
the shipped public base, for bases from: upright public images (the default), public images turned
by ``privacy.basis.public_rotation`` (the sites' patients lie tilted in bed), and — as the
unattainable reference — other records of the site itself. σ is the sweep's at ε = 8 per patient
(B = 16 of 120 patients, 80 steps, PLD).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/fedpose_basis_capture"))
    parser.add_argument("--out", type=Path, default=HERE / "basis_capture.json")
    parser.add_argument("--scenario", default="finetune")
    args = parser.parse_args()

    import torch

    from fedpose.config import PrivacyConfig
    from fedpose.data.dataset import PoseDataset, load_records, public_basis_dataset
    from fedpose.data.synthetic import ensure_dataset
    from fedpose.model import model_from_checkpoint
    from fedpose.privacy.engine import collate, resolve_noise_multiplier
    from fedpose.privacy.per_sample import frozen_features, gradient_matrix
    from fedpose.privacy.projection import basis_from_gradients

    torch.set_num_threads(1)
    started = time.time()
    size = (128, 96)
    data = args.work / "data"
    ensure_dataset(data, sites=3, per_site=480, public=64, test=240, size=size, seed=7, workers=1, progress=False)
    checkpoint = "checkpoints/public/public-base-tiny_vit_test-128x96.pt"
    model, _ = model_from_checkpoint(REPO / checkpoint)
    model.set_scenario(args.scenario)
    model.train_mode()

    def gradients(dataset: PoseDataset, ids: range) -> torch.Tensor:
        batch = collate([dataset[i] for i in ids])
        return gradient_matrix(model, frozen_features(model, batch["image"]), batch["joints"], batch["weight"]).clone()

    site_records, site_root = load_records(data / "site-1")
    site = PoseDataset(site_records, site_root, input_size=size, train=True, seed=0)  # as a site trains on it
    per_sample = gradients(site, range(64))
    clipped_mean = (per_sample / per_sample.norm(dim=1, keepdim=True).clamp(min=1.0)).mean(0)
    rate, steps, batch_units = 16 / 120, 80, 16
    sigma = resolve_noise_multiplier(PrivacyConfig(mechanism="pdp", target_epsilon=8.0, delta=1e-5, sample_rate=rate), rate, steps)

    sources = {
        "public, upright (default)": gradients(public_basis_dataset(data / "public", size), range(64)),
        "public, public_rotation 30": gradients(public_basis_dataset(data / "public", size, 30.0), range(64)),
        "public, public_rotation 60": gradients(public_basis_dataset(data / "public", size, 60.0), range(64)),
        "site-1 itself, other records (reference, not private-safe)": gradients(site, range(64, 128)),
    }
    rows = []
    for name, matrix in sources.items():
        for k in (2, 4, 8, 16, 32, 48):
            vectors = basis_from_gradients(matrix, k)[0]
            signal = float((vectors.T @ clipped_mean).norm())
            noise = sigma * k**0.5 / batch_units
            rows.append({"basis": name, "k": k, "signal": round(signal, 4), "signal_fraction": round(signal / float(clipped_mean.norm()), 3),
                         "noise_norm": round(noise, 4), "signal_to_noise": round(signal / noise, 3)})
            print(f"{name:58s} k={k:2d} signal {signal:.4f} ({signal / float(clipped_mean.norm()):.2f}) noise {noise:.3f} ratio {signal / noise:.3f}", flush=True)
    result = {
        "what": "per-step signal kept by a k-dimensional public basis vs the noise in it (PDP-SGD), site-1 of the tuning data",
        "conditions": {"data": "synthetic, data_seed 7 (tuning), site-1 (64 training crops, augmented as in training)",
                       "checkpoint": checkpoint, "scenario": args.scenario, "input_size_hw": list(size), "clip": 1.0,
                       "noise_multiplier": round(sigma, 4), "expected_batch_units": batch_units, "sample_rate": round(rate, 4),
                       "steps": steps, "epsilon_per_patient": 8.0, "delta": 1e-5, "accountant": "PLD",
                       "public_samples": 64, "torch_threads": 1, "machine": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()]},
        "clipped_mean_gradient_norm": round(float(clipped_mean.norm()), 4),
        "median_per_sample_gradient_norm": round(float(per_sample.norm(dim=1).median()), 3),
        "trainable_parameters": int(per_sample.shape[1]),
        "rows": rows,
        "wall_seconds": round(time.time() - started, 1),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"→ {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
