"""Utility of every privacy mechanism: PCKh@0.5 after private fine-tuning on one site.

    python benchmarks/mechanisms/run.py                       # defaults below (reduced size, CPU)
    python benchmarks/mechanisms/run.py --clips 0.01 0.1 1.0 --finetune-steps 200

Protocol (paper 001/000's, scaled down to a 2-core CPU and synthetic data):
1. synthetic data (``fedpose data synth``): public split, one site, test split;
2. pre-train the whole model non-privately on the public split (stands in for COCO pre-training);
3. fine-tune on the site (scenario "finetune": stage 3 + LayerNorms + head) with each mechanism,
   for each target ε (δ = 4e-5, PLD, σ calibrated over the planned steps), clipping bound C and
   protection unit (``--units record patient``: a patient's summed gradient is clipped as one);
   PDP/FP-DP take their basis from the public split (k, m, refresh as configured);
4. PCKh@0.5 Mean on the test split.

Writes results.json (updated after every run, so an interrupted sweep keeps what it finished and
``--resume`` skips it), results.md (table) and results.png (chart) next to this file. Every ε
is reported with its guarantee type: FDP and MaskDP ε are not record-level DP ε.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from fedpose.config import ModelConfig, OptimConfig, PrivacyConfig, PublicViewConfig
from fedpose.data.dataset import PoseDataset
from fedpose.data.loaders import load_records
from fedpose.data.units import UNITS_FINEST_FIRST, UnitIndex
from fedpose.io import atomic_write_json, atomic_write_text
from fedpose.model import build_model
from fedpose.privacy.engine import build_engine
from fedpose.privacy.mechanisms import NOISY_MECHANISM_NAMES
from fedpose.privacy.public_views import ImagePublicView
from fedpose.privacy.report import format_epsilon
from fedpose.runtime import configure_cpu
from fedpose.train.evaluate import evaluate
from fedpose.train.loop import TrainingDiverged, calibrate_batch_norm, train_steps
from fedpose.train.optim import build_optimizer, build_scheduler

HERE = Path(__file__).resolve().parent
DP_MECHANISMS = NOISY_MECHANISM_NAMES


def ensure_data(args: argparse.Namespace) -> Path:
    root = args.data
    if (root / "public" / "annotations.json").exists():
        return root
    h, w = args.size
    cmd = [sys.executable, "-m", "fedpose.cli", "data", "synth", "--out", str(root), "--sites", "1",
           "--per-site", str(args.site_size), "--public", str(args.public_size), "--test", str(args.test_size),
           "--size", f"{h}x{w}", "--workers", "1", "--quiet"]
    print("generating synthetic data:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return root


def dataset(path: Path, size: tuple[int, int], train: bool, seed: int = 0, public_view: ImagePublicView | None = None) -> PoseDataset:
    records, image_root = load_records(path)
    return PoseDataset(records, image_root, input_size=size, train=train, seed=seed, public_view=public_view)


def public_view_config(args: argparse.Namespace) -> PublicViewConfig:
    return PublicViewConfig(kind=args.view, factor=args.view_factor, bits=args.view_bits,
                            blur={"kernel_size": args.blur_kernel, "sigma": args.blur_sigma})


def new_model(args: argparse.Namespace, scenario: str):
    torch.manual_seed(args.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # finetune without init_checkpoint: weights are loaded below
        return build_model(ModelConfig(backbone=args.backbone, scenario=scenario), tuple(args.size))


def pretrain(args: argparse.Namespace, public: PoseDataset, test: PoseDataset) -> tuple[dict, dict]:
    path = args.work / "pretrained.pt"
    if path.exists():
        saved = torch.load(path, weights_only=False)
        return saved["state"], saved["metrics"]
    model = new_model(args, "scratch")
    # frozen BatchNorm statistics from public images (fedpose train does the same for scratch runs)
    calibrate_batch_norm(model, public)
    optim_cfg = OptimConfig(lr=args.pretrain_lr, warmup_steps=min(50, args.pretrain_steps // 10))
    optimizer = build_optimizer(model, optim_cfg)
    engine = build_engine(PrivacyConfig(), model, len(public), args.batch, args.pretrain_steps, seed=args.seed)
    started = time.perf_counter()
    history = train_steps(model, engine, public, optimizer, args.pretrain_steps,
                          scheduler=build_scheduler(optimizer, optim_cfg, args.pretrain_steps), description="pretrain (public)")
    metrics = evaluate(model, test, batch_size=32, max_samples=args.eval_samples, flip_test=args.flip_test)
    metrics.update(seconds=time.perf_counter() - started, final_loss=history[-1]["loss"])
    print(f"pretrained on public: PCKh@0.5 Mean {metrics['Mean']:.2f} ({metrics['seconds']:.0f} s)", flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    torch.save({"state": model.state_dict(), "metrics": metrics}, path)
    return model.state_dict(), metrics


def finetune(args, state, site, public_views, test, mechanism: str, epsilon: float | None, clip: float,
             unit: str = "record") -> dict:
    model = new_model(args, "finetune")
    model.load_state_dict(state)
    model.train_mode()
    h, _ = args.size
    privacy = PrivacyConfig() if mechanism == "none" else PrivacyConfig(
        mechanism=mechanism, target_epsilon=epsilon, max_grad_norm=clip, delta=args.delta,
        basis={"k": args.k, "public_samples": args.public_samples, "refresh_every": args.refresh_every},
        public_view=public_view_config(args), unit=unit,
    )
    units = UnitIndex.from_records(site.records, unit, "site-1")
    engine = build_engine(privacy, model, len(site), args.batch, args.finetune_steps, public_dataset=public_views, seed=args.seed,
                          units=units)
    optim_cfg = OptimConfig(name=args.optimizer, lr=args.finetune_lr, weight_decay=0.0)
    optimizer = build_optimizer(model, optim_cfg)
    started = time.perf_counter()
    try:
        train_steps(model, engine, site, optimizer, args.finetune_steps,
                    scheduler=build_scheduler(optimizer, optim_cfg, args.finetune_steps), description=f"{mechanism} ε={epsilon} C={clip} per {unit}")
        diverged = False
    except TrainingDiverged as exc:
        print(f"{mechanism} ε={epsilon} C={clip}: {exc}", flush=True)
        diverged = True
    seconds = time.perf_counter() - started
    # A run whose weights blew up (too much noise for the step size) is a result, not a crash: score 0.
    metrics = {"Mean": 0.0, "Mean@0.1": 0.0, "diverged": True} if diverged else evaluate(
        model, test, batch_size=32, max_samples=args.eval_samples, flip_test=args.flip_test)
    report = engine.privacy_report()
    return {
        "mechanism": mechanism, "guarantee": report["guarantee"], "target_epsilon": epsilon, "unit": unit,
        "epsilon": report.get("epsilon"), "delta": report.get("delta"), "epsilon_text": report["epsilon_text"],
        "noise_multiplier": engine.noise_multiplier, "max_grad_norm": clip if mechanism != "none" else None,
        "sample_rate": engine.sample_rate, "steps": args.finetune_steps,
        "pckh_mean": metrics["Mean"], "pckh_mean_at_0.1": metrics.get("Mean@0.1"), "pckh": metrics, "diverged": diverged,
        "train_seconds": seconds, "basis_refresh_seconds": engine.basis_seconds,
    }


def run_unit(run: dict) -> str:
    """A run's protection unit (runs recorded before units existed were per record)."""
    return run.get("unit", "record")


def write_outputs(results: dict) -> None:
    stem = results["conditions"]["out_prefix"]
    atomic_write_json(HERE / f"{stem}.json", results)
    runs = results["runs"]
    lines = [
        f"# Mechanism comparison (PCKh@0.5 Mean, synthetic data, reduced size; fine-tuning optimizer {results['conditions']['optimizer']})", "",
        f"Conditions: {json.dumps(results['conditions'])}", "",
        f"Pre-trained on the public split only (no site data): **{results['pretrained']['Mean']:.2f}**", "",
        "| mechanism | guarantee | unit | C | target ε | achieved (guarantee, δ, accountant) | σ | PCKh@0.5 Mean | Mean@0.1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        lines.append(
            f"| {run['mechanism']} | {run['guarantee']} | {run_unit(run) if run['mechanism'] != 'none' else '—'} | {run['max_grad_norm'] if run['max_grad_norm'] is not None else '—'} | "
            f"{run['target_epsilon'] if run['target_epsilon'] is not None else '—'} | {run['epsilon_text']} | "
            f"{run['noise_multiplier']:.3f} | {run['pckh_mean']:.2f}{' (diverged)' if run.get('diverged') else ''} | "
            f"{run['pckh_mean_at_0.1'] or float('nan'):.2f} |"
        )
    lines += ["", "FDP (fdp, fpdp) and MaskDP ε protect less than record-level DP ε (see DESIGN.md); compare within a guarantee type.",
              "A patient-level ε protects every record of one patient at once (one unit = all their crops); a record-level ε "
              "protects one crop. One seed per row: differences of 1–2 points are within run-to-run noise."]
    atomic_write_text(HERE / f"{stem}.md", "\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clips = sorted({r["max_grad_norm"] for r in runs if r["max_grad_norm"] is not None})
    units = [u for u in UNITS_FINEST_FIRST if any(run_unit(r) == u for r in runs if r["mechanism"] != "none")]
    epsilons = sorted({r["target_epsilon"] for r in runs if r["target_epsilon"] is not None})
    panels = [(clip, unit) for clip in clips for unit in units]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (clip, unit) in zip(axes[0], panels):
        width = 0.8 / max(1, len(epsilons))
        for j, eps in enumerate(epsilons):
            values = [next((r["pckh_mean"] for r in runs if r["mechanism"] == m and r["target_epsilon"] == eps
                            and r["max_grad_norm"] == clip and run_unit(r) == unit), math.nan) for m in DP_MECHANISMS]
            ax.bar([i + j * width for i in range(len(DP_MECHANISMS))], values, width, label=f"target ε = {eps} (δ = {results['conditions']['delta']})")
        none = next((r["pckh_mean"] for r in runs if r["mechanism"] == "none"), None)
        if none is not None:
            ax.axhline(none, color="k", ls="--", lw=1, label="non-private fine-tune")
        ax.axhline(results["pretrained"]["Mean"], color="gray", ls=":", lw=1, label="public pre-training only")
        ax.set_xticks([i + width * (len(epsilons) - 1) / 2 for i in range(len(DP_MECHANISMS))])
        ax.set_xticklabels([f"{m}\n({next((r['guarantee'] for r in runs if r['mechanism'] == m), '')})" for m in DP_MECHANISMS])
        ax.set_ylabel("PCKh@0.5 Mean (%)")
        ax.set_title(f"C = {clip}, ε per {unit}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / f"{stem}.png", dpi=110)
    plt.close(fig)


def merge(target: Path, sources: list[Path]) -> int:
    """Add the runs of ``sources`` to ``target`` (a run = mechanism, target ε, C; later files win)."""
    results = json.loads(target.read_text())
    key = lambda run: (run["mechanism"], run["target_epsilon"], run["max_grad_norm"], run_unit(run))  # noqa: E731
    runs = {key(run): run for run in results["runs"]}
    conditions = results["conditions"]
    conditions["out_prefix"] = target.stem
    for source in sources:
        other = json.loads(source.read_text())
        protocol = ("size", "backbone", "pretrain_steps", "finetune_steps", "finetune_lr", "optimizer", "delta", "batch")
        mismatch = [name for name in protocol if other["conditions"].get(name) != conditions.get(name)]
        if mismatch:
            raise SystemExit(f"{source}: not the same protocol as {target} ({', '.join(mismatch)} differ)")
        runs.update({key(run): run for run in other["runs"]})
        conditions["clips"] = sorted(set(conditions["clips"]) | set(other["conditions"]["clips"]))
        conditions["units"] = [u for u in UNITS_FINEST_FIRST
                               if u in set(conditions.get("units", ["record"])) | set(other["conditions"].get("units", ["record"]))]
        conditions["note"] += f"; runs merged from {source.name}"
    results["runs"] = sorted(runs.values(), key=lambda r: (r["mechanism"] != "none", r["max_grad_norm"] or 0,
                                                           UNITS_FINEST_FIRST.index(run_unit(r)), r["target_epsilon"] or 0))
    write_outputs(results)
    print(f"{target}: {len(results['runs'])} runs")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("/tmp/fedpose_mechbench/data"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/fedpose_mechbench"))
    parser.add_argument("--size", type=int, nargs=2, default=(128, 96), metavar=("H", "W"))
    parser.add_argument("--backbone", default="tiny_vit_5m_224")
    parser.add_argument("--site-size", type=int, default=400)
    parser.add_argument("--public-size", type=int, default=500)
    parser.add_argument("--test-size", type=int, default=160)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--pretrain-lr", type=float, default=1e-3)
    parser.add_argument("--finetune-steps", type=int, default=60)
    parser.add_argument("--finetune-lr", type=float, default=5e-4)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                        help="fine-tuning optimizer. AdamW rescales every coordinate, which spreads the noise left in "
                             "PDP's k-dim subspace over all parameters; SGD keeps the projection's noise reduction")
    parser.add_argument("--out-prefix", default="results", help="results file stem (results.json/.md/.png)")
    parser.add_argument("--mechanisms", nargs="+", default=["none", *DP_MECHANISMS])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[0.2, 0.8])
    parser.add_argument("--clips", type=float, nargs="+", default=[0.1])
    parser.add_argument("--delta", type=float, default=4e-5)
    parser.add_argument("--units", nargs="+", choices=UNITS_FINEST_FIRST, default=["record"],
                        help="protection units to fine-tune at (the synthetic site annotates patient_id)")
    parser.add_argument("--k", type=int, default=50)
    parser.add_argument("--public-samples", type=int, default=100)
    parser.add_argument("--refresh-every", type=int, default=20)
    parser.add_argument("--view", choices=["downsample_quantize", "gaussian_blur"], default="downsample_quantize",
                        help="FDP / FP-DP public view ψ (privacy.public_view.kind)")
    parser.add_argument("--view-factor", type=int, default=PublicViewConfig().factor, help="downsample_quantize block f")
    parser.add_argument("--view-bits", type=int, default=PublicViewConfig().bits, help="downsample_quantize bits b")
    parser.add_argument("--blur-kernel", type=int, default=11, help="gaussian_blur kernel (only with --view gaussian_blur)")
    parser.add_argument("--blur-sigma", type=float, default=3.0, help="gaussian_blur σ (only with --view gaussian_blur)")
    parser.add_argument("--eval-samples", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--resume", action="store_true", help="keep finished runs from results.json")
    parser.add_argument("--flip-test", action="store_true",
                        help="score with flip test (fedpose's default since 2026-12-05); off: the protocol of the committed "
                             "results, which a resumed run must not mix with it")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                        help="merge the runs of these result files (same protocol, e.g. one process per C) into "
                             "<out-prefix>.json and re-render its table and chart; trains nothing")
    args = parser.parse_args()
    if args.merge:
        return merge(HERE / f"{args.out_prefix}.json", args.merge)
    configure_cpu(args.threads)

    size = tuple(args.size)
    root = ensure_data(args)
    public_train = dataset(root / "public", size, train=True, seed=args.seed)
    public_views = dataset(root / "public", size, train=False)  # basis samples: no augmentation
    # ψ(x) computed once per record before augmentation (used by fdp / fpdp only)
    site = dataset(root / "site-1", size, train=True, seed=args.seed + 1, public_view=ImagePublicView(public_view_config(args)))
    test = dataset(root / "test", size, train=False)
    state, pretrained = pretrain(args, public_train, test)

    conditions = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("resume",)}
    conditions["note"] = "2-core CPU machine; synthetic data; reduced steps/size vs the papers"
    results = {"conditions": conditions, "pretrained": pretrained, "runs": []}
    previous = HERE / f"{args.out_prefix}.json"
    if args.resume and previous.exists():
        results["runs"] = json.loads(previous.read_text()).get("runs", [])

    plan = [("none", None, None)] if "none" in args.mechanisms else []
    plan = [(m, eps, clip, "record") for m, eps, clip in plan]
    plan += [(m, eps, clip, unit) for clip in args.clips for unit in args.units for eps in args.epsilons
             for m in args.mechanisms if m != "none"]
    for mechanism, eps, clip, unit in plan:
        done = any(r["mechanism"] == mechanism and r["target_epsilon"] == eps and r["max_grad_norm"] == clip
                   and run_unit(r) == unit for r in results["runs"])
        if done:
            continue
        run = finetune(args, state, site, public_views, test, mechanism, eps, clip or 1.0, unit)
        if mechanism == "none":
            run["max_grad_norm"] = None
        results["runs"].append(run)
        write_outputs(results)
        text = run["epsilon_text"] if mechanism != "none" else format_epsilon(math.inf, 0, "none")
        print(f"{mechanism:7s} C={clip} target ε={eps}: PCKh@0.5 Mean {run['pckh_mean']:.2f}  [{text}]  ({run['train_seconds']:.0f} s)", flush=True)
    write_outputs(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
