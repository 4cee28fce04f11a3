"""Where a DP step's clipping budget goes: each part of the trainable set's share of a sample's
squared gradient norm, against its share of the parameters.

    python benchmarks/federated_utility/gradient_share.py --site DATA/site-1 --public PUBLIC_DIR \\
        [--checkpoint checkpoints/public/public-base-tiny_vit_5m_224-128x96-rotation60.pt] \\
        [--scenario biases_norms] [--samples 48] [--out benchmarks/federated_utility/gradient_share.json]

DP-SGD clips each unit's gradient to C over all trainable parameters jointly, so a part whose
gradients are large takes most of C, and the others learn under the same per-coordinate noise
with a small share of the signal. For each part (a stage of the backbone × the kind of parameter,
and the head's layers) it reports the mean over samples of its share of ‖g‖², the share of the
mean gradient's ‖ḡ‖² (the signal a batch agrees on) and the parameter count, on a site's images
(tuning data) and on public images, at the starting weights. Writes JSON and a PNG beside it.
Tuning data only: never a reported split.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
MAIN_JOB_BASE = REPO / "checkpoints" / "public" / "public-base-tiny_vit_5m_224-128x96-rotation60.pt"


def part_of(name: str) -> str:
    """'stem' / 'stage N' / 'head', and the kind: BatchNorm shift or scale, LayerNorm scale or shift, other bias
    or weight."""
    parts = name.split(".")
    if parts[0] == "head":
        return f"head {parts[1]}"
    where = "stem" if parts[1] == "patch_embed" else f"stage {parts[2]}"
    if "norm" in name:
        kind = "LayerNorm scale" if name.endswith("weight") else "LayerNorm shift"
    elif parts[-2] == "bn":
        kind = "BatchNorm scale" if name.endswith("weight") else "BatchNorm shift"
    else:
        kind = "bias" if name.endswith("bias") else "weight"
    return f"{where} {kind}"


def shares(model, dataset, samples: int) -> dict[str, dict[str, float]]:
    from fedpose.privacy.engine import collate
    from fedpose.privacy.per_sample import frozen_features, per_sample_gradients

    batch = collate([dataset[i] for i in range(samples)])
    images, joints, weight = batch["image"], batch["joints"], batch["weight"]
    squared: dict[str, float] = defaultdict(float)  # Σ_i ‖g_i‖² per part
    gradient_sums: dict[str, torch.Tensor] = {}  # Σ_i g_i per tensor
    for start in range(0, samples, 16):
        grads, _ = per_sample_gradients(model, frozen_features(model, images[start:start + 16]), joints[start:start + 16],
                                        weight[start:start + 16])
        for name, grad in grads.items():
            flat = grad.reshape(grad.shape[0], -1).double()
            squared[part_of(name)] += float(flat.pow(2).sum())
            gradient_sums[name] = gradient_sums.get(name, 0) + flat.sum(0)
    count: dict[str, int] = defaultdict(int)
    signal: dict[str, float] = defaultdict(float)  # ‖ḡ‖² per part
    for name, total in gradient_sums.items():
        count[part_of(name)] += total.numel()
        signal[part_of(name)] += float((total / samples).pow(2).sum())
    norm, agreed, parameters = sum(squared.values()), sum(signal.values()), sum(count.values())
    return {part: {"parameters": count[part], "parameter_share": count[part] / parameters,
                   "squared_norm_share": squared[part] / norm, "mean_gradient_share": signal[part] / agreed}
            for part in sorted(squared, key=lambda p: -squared[p])}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    site = result["site"]
    parts = list(site)[:12]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = range(len(parts))
    ax.bar([i - 0.27 for i in x], [site[p]["parameter_share"] for p in parts], 0.27, label="share of parameters")
    ax.bar(list(x), [site[p]["squared_norm_share"] for p in parts], 0.27, label="share of ‖g‖², site images")
    ax.bar([i + 0.27 for i in x], [result["public"][p]["squared_norm_share"] for p in parts], 0.27,
           label="share of ‖g‖², public images")
    ax.set_yscale("log")
    ax.set_ylim(1e-5, 1.5)
    ax.set_xticks(list(x), parts, rotation=40, ha="right", fontsize=8)
    ax.set_title(f"where the clipped gradient goes: {result['settings']['scenario']} of {result['settings']['backbone']}",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--site", type=Path, required=True, help="a site's training split (tuning data)")
    parser.add_argument("--public", type=Path, required=True, help="public images")
    parser.add_argument("--checkpoint", type=Path, default=MAIN_JOB_BASE)
    parser.add_argument("--backbone", default="tiny_vit_5m_224")
    parser.add_argument("--scenario", default="biases_norms")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("gradient_share.json"))
    args = parser.parse_args()

    from fedpose.config import ModelConfig
    from fedpose.data.dataset import PoseDataset
    from fedpose.data.loaders import load_records
    from fedpose.model import build_model

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    started = time.perf_counter()
    model = build_model(ModelConfig(backbone=args.backbone, scenario=args.scenario, init_checkpoint=args.checkpoint),
                        (128, 96))
    what = " ".join(p.replace("\n", " ") for p in __doc__.split("\n\n") if not p.startswith("    "))  # not the usage
    result: dict = {"what": what,
                    "settings": {"backbone": args.backbone, "scenario": args.scenario, "checkpoint": str(args.checkpoint),
                                 "site": str(args.site), "public": str(args.public), "samples": args.samples,
                                 "input_size": [128, 96], "augmentation": "training augmentation, rotation 30 (site) / 60 "
                                 "(public, as the base's last stage), dataset seed 0; one image each"}}
    for key, path, rotation in (("site", args.site, 30.0), ("public", args.public, 60.0)):
        records, root = load_records(path)
        dataset = PoseDataset(records, root, (128, 96), train=True, rotation=rotation, seed=0)
        result[key] = shares(model, dataset, args.samples)
    result["conditions"] = {"device": "cpu", "threads": 1, "machine": platform.processor() or platform.machine(),
                            "cpus": os.cpu_count(), "torch": torch.__version__, "python": sys.version.split()[0],
                            "seconds": round(time.perf_counter() - started, 1)}
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    plot(result, args.out.with_suffix(".png"))
    for part, values in list(result["site"].items())[:6]:
        print(f"{part:26s} {values['parameters']:6d} parameters ({values['parameter_share']:.1%}): "
              f"{values['squared_norm_share']:.1%} of ‖g‖² on site images, "
              f"{result['public'][part]['squared_norm_share']:.1%} on public ones")
    return 0


if __name__ == "__main__":
    sys.exit(main())
