"""Pose utility of training on LDP-sliced synthetic images, ε_total ∈ {2.4, 20, 58} vs clean.

    python benchmarks/ldp_utility/run.py [--train 400] [--test 100] [--steps 300] [--size 128x96]
        [--epsilons 2.4 20 58] [--work-dir /tmp/fedpose_ldp_utility] [--no-ll-prune-ablation]

For each setting the site's training split AND the test split are privatized once with
``privatize_dataset`` (a site privatizes every image before training or evaluation), a small
non-private model is trained on the privatized training split, and PCKh@0.5 is measured on the
privatized test split (what the site itself can evaluate) and on the clean test split (how the
model does on real images). Writes results.json and examples.png (one test image at every ε)
beside this file. Progress is logged per setting; sizes are small on purpose (CPU, shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent


def train_and_evaluate(train_dir: Path, test_dirs: dict[str, Path], args: argparse.Namespace) -> dict[str, float]:
    """Non-private training with the library's loop (fedpose.train), PCKh@0.5 Mean per test set.

    A from-scratch model's frozen BatchNorm statistics are calibrated on the training images it
    is given (the privatized ones in a privatized setting), as ``fedpose train`` does.
    """
    import torch

    from fedpose.config import ModelConfig, OptimConfig, PrivacyConfig
    from fedpose.data.dataset import PoseDataset, load_records
    from fedpose.model import build_model
    from fedpose.privacy.engine import build_engine
    from fedpose.runtime import configure_cpu
    from fedpose.train import build_optimizer, build_scheduler, calibrate_batch_norm, evaluate, train_steps

    torch.manual_seed(args.seed)
    configure_cpu(args.threads)
    size = args.input_size

    def dataset(directory: Path, train: bool) -> PoseDataset:
        records, root = load_records(directory)
        return PoseDataset(records, root, input_size=size, train=train, seed=args.seed, cache_images=True)

    train_set = dataset(train_dir, train=True)
    model = build_model(ModelConfig(backbone=args.backbone, scenario="scratch"), size)
    calibrate_batch_norm(model, train_set)
    optim_cfg = OptimConfig(lr=args.lr, weight_decay=0.01, warmup_steps=min(50, args.steps // 10), cosine=True)
    optimizer = build_optimizer(model, optim_cfg)
    engine = build_engine(PrivacyConfig(), model, len(train_set), args.batch, args.steps, seed=args.seed)
    history = train_steps(model, engine, train_set, optimizer, args.steps, build_scheduler(optimizer, optim_cfg, args.steps),
                          description=train_dir.name)
    print(f"    final loss {history[-1]['loss']:.4f}", flush=True)
    return {name: round(float(evaluate(model, dataset(directory, train=False), batch_size=32)["Mean"]), 2)
            for name, directory in test_dirs.items()}


def mean_pose_baseline(train_dir: Path, test_dir: Path, size: tuple[int, int]) -> float:
    """PCKh@0.5 of predicting the training set's mean joint positions in the crop frame, ignoring
    the pixels: what a model learns from the crop alone (the crop comes from the annotation box)."""
    import torch

    from fedpose.data.annotations import read_annotations
    from fedpose.data.dataset import PoseDataset
    from fedpose.data.transforms import crop_to_original
    from fedpose.eval.pckh import pckh

    train = PoseDataset(read_annotations(train_dir), train_dir, size, train=False)
    samples = [train[i] for i in range(len(train))]
    joints = torch.stack([s["joints"] for s in samples]).numpy()
    weight = torch.stack([s["weight"] for s in samples]).numpy()[..., None]
    mean = (joints * weight).sum(0) / np.maximum(weight.sum(0), 1)
    test = PoseDataset(read_annotations(test_dir), test_dir, size, train=False)
    rows = [test[i] for i in range(len(test))]
    preds = crop_to_original(np.repeat(mean[None], len(rows), 0), np.stack([r["center"].numpy() for r in rows]),
                             np.array([r["scale"] for r in rows]), size)
    result = pckh(preds, np.stack([r["joints_original"].numpy() for r in rows]),
                  np.stack([r["joints_vis"].numpy() for r in rows]), np.stack([r["headbox"].numpy() for r in rows]))
    return round(float(result["Mean"]), 2)


def example_grid(test_dir: Path, settings: list[dict], out: Path, seed: int) -> None:
    """One test image, clean and privatized at every setting (seeded, for the figure only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedpose.data.annotations import read_annotations, resolve_image
    from fedpose.privacy.input_privacy import load_rgb
    from fedpose.privacy.ldp_slicing import LdpSlicer

    image = load_rgb(resolve_image(test_dir, read_annotations(test_dir)[0].image))
    panels = [("clean", image)]
    epsilons = sorted({s["epsilon"] for s in settings if s["epsilon"] is not None})
    for epsilon in epsilons:
        for ll_prune in (True, False):
            slicer = LdpSlicer(epsilon, ll_prune=ll_prune, seed=seed)
            panels.append((f"ε={epsilon:g}{' LL-pruned' if ll_prune else ''}", slicer(image).rgb))
    if epsilons:  # the re-centred alternative (ll_offset=128), for comparison with the specified clamp
        recentred = LdpSlicer(epsilons[-1], ll_prune=True, ll_offset=128.0, seed=seed)(image).rgb
        panels.append((f"ε={epsilons[-1]:g} LL-pruned\n+128 offset", recentred))
    fig, axes = plt.subplots(1, len(panels), figsize=(2.2 * len(panels), 3.2))
    for ax, (title, picture) in zip(axes, panels):
        ax.imshow(picture)
        ax.set_title(title, fontsize=8)
        ax.axis("off")
    fig.suptitle("LDP-Slicing (pure ε_total-LDP per masked pixel)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--test", type=int, default=100)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--size", default="128x96", help="image and model input size HxW")
    parser.add_argument("--backbone", default="tiny_vit_test")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[2.4, 20.0, 58.0])
    parser.add_argument("--no-ll-prune-ablation", dest="ablation", action="store_false",
                        help="skip the ε=20 run without LL pruning")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="run only these settings and merge them into the existing results.json (e.g. eps20-ll-offset128)")
    parser.add_argument("--work-dir", default="/tmp/fedpose_ldp_utility")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    args = parser.parse_args()

    from fedpose.config import InputPrivacyConfig
    from fedpose.data.synthetic import ensure_dataset, parse_size
    from fedpose.privacy.input_privacy import privatize_dataset

    args.input_size = parse_size(args.size)
    work = Path(args.work_dir)
    data = work / "synthetic"
    print(f"synthetic data: {args.train} train / {args.test} test at {args.size} in {data}", flush=True)
    ensure_dataset(data, sites=1, per_site=args.train, public=0, test=args.test, size=args.input_size,
                   seed=args.seed, progress=False)
    train_clean, test_clean = data / "site-1", data / "test"

    settings: list[dict] = [{"name": "clean", "epsilon": None, "ll_prune": None}]
    settings += [{"name": f"eps{e:g}", "epsilon": e, "ll_prune": True} for e in args.epsilons]
    if args.ablation:
        settings.append({"name": "eps20-no-ll-prune", "epsilon": 20.0, "ll_prune": False})
        # the specified clamp after LL pruning drops every negative detail; ll_offset re-centres first
        settings.append({"name": "eps20-ll-offset128", "epsilon": 20.0, "ll_prune": True, "ll_offset": 128.0})
    all_settings = settings
    if args.only:
        settings = [s for s in settings if s["name"] in args.only]

    baseline = mean_pose_baseline(train_clean, test_clean, args.input_size)
    print(f"mean-pose baseline (no pixels used): PCKh@0.5 {baseline}", flush=True)
    rows = []
    for s in settings:
        print(f"== {s['name']}", flush=True)
        start = time.time()
        if s["epsilon"] is None:
            train_dir, test_dirs, guarantee = train_clean, {"clean_test": test_clean}, None
        else:
            # seed=None: CSPRNG noise, as a site would use. Each directory is privatized once.
            cfg = InputPrivacyConfig(mechanism="ldp-slicing", epsilon=s["epsilon"], ll_prune=s["ll_prune"],
                                     ll_offset=s.get("ll_offset", 0.0))
            train_dir = work / f"{s['name']}-train"
            test_private = work / f"{s['name']}-test"
            guarantee = privatize_dataset(train_clean, train_dir, cfg)
            privatize_dataset(test_clean, test_private, cfg)
            test_dirs = {"private_test": test_private, "clean_test": test_clean}
        scores = train_and_evaluate(train_dir, test_dirs, args)
        row = {**s, "pckh_mean_at_0.5": scores, "seconds": round(time.time() - start, 1)}
        if guarantee is not None:
            row["guarantee"] = {k: guarantee[k] for k in ("guarantee_statement", "epsilon_total", "delta",
                                                          "unit_protected", "epsilon_per_original_pixel")}
        rows.append(row)
        print(f"   PCKh@0.5 {scores} in {row['seconds']} s", flush=True)

    if args.only:  # keep the other settings' rows from the last full run
        previous = json.loads((HERE / "results.json").read_text())["results"]
        rows = [r for r in previous if r["name"] not in args.only] + rows
        rows.sort(key=lambda r: [s["name"] for s in all_settings].index(r["name"]))
    example_grid(test_clean, all_settings, HERE / "examples.png", args.seed)
    payload = {
        "benchmark": "ldp_utility",
        "setup": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
        "protocol": "train on the privatized site split; PCKh@0.5 (mean over 14 joints) on the privatized "
                    "and on the clean synthetic test split; non-private optimizer (input privacy only)",
        "machine": f"{os.cpu_count()} CPU cores; load average at the end {os.getloadavg()[0]:.1f}",
        "baseline_mean_pose_pckh": baseline,
        "results": rows,
    }
    (HERE / "results.json").write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {HERE / 'results.json'} and {HERE / 'examples.png'}")


if __name__ == "__main__":
    main()
