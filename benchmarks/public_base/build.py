"""Build the public pre-trained bases (issue 26, item 1): each backbone trained non-privately on
synthetic *public* data only, at the federations' input size (128×96). No site data, no privacy
cost. Every base is exactly `configs/pretrain-federation.toml` with the backbone (and the steps this
machine affords) set on the command line, so the documented command rebuilds it:

    fedpose data synth --out data/synthetic-pretrain --public 40000 --test 400 --sites 10 \\
        --per-site 0 --size 128x96 --seed 1
    fedpose train --config configs/pretrain-federation.toml \\
        --set model.backbone=BACKBONE --set train.steps=STEPS --set train.out_dir=runs/pretrain-BACKBONE

This script runs those commands for several backbones at once (one process each: on a GPU the
model step is short and each process's single-threaded image pipeline is the bottleneck, so
running them side by side uses the machine's cores). Steps are sized to a wall-clock budget from a
short timed run of each (the per-step seconds fedpose records, data loading included), then every
backbone gets a full run with a complete learning-rate schedule. The result of each is written
as a weights-only fedpose checkpoint (what `model.init_checkpoint` reads: architecture + weights,
no optimizer state, config, metrics or RNG state) and `results.json` records the conditions.

    python benchmarks/public_base/build.py --budget-s 330 --export runs/public-bases

With `--steps BACKBONE=STEPS,...` the timed runs are skipped and each base gets exactly those
steps: how the shipped bases are rebuilt after a recipe change (the steps stay those of
checkpoints/public/README.md, so only the recipe differs).

Nothing is selected on any split: the last step's weights are the base. The validation PCKh (the
synthetic sites' mixture of the seed-1 dataset) is for watching only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "pretrain-federation.toml"
DATA = Path("data/synthetic-pretrain")
SMOKE_STEPS = 40
#: the smoke run's first steps include one-off costs (allocator warm-up, kernel selection)
SMOKE_SKIP = 10
#: the exported base's file name ({backbone} replaced); checkpoints/public/README.md names the shipped ones
EXPORT_NAME = "public-base-{backbone}-128x96.pt"


def fedpose(*args: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    with log.open("ab") as sink:
        return subprocess.Popen([sys.executable, "-m", "fedpose.cli", *args], cwd=REPO, stdout=sink,
                                stderr=subprocess.STDOUT, env=env)


def train_args(backbone: str, steps: int, out_dir: Path, extra: list[str]) -> list[str]:
    every = max(1, steps // 4)
    return ["train", "--config", str(CONFIG), "--set", f"model.backbone={backbone}", "--set", f"train.steps={steps}",
            "--set", f"train.out_dir={out_dir}", "--set", f"train.eval_every={every}",
            "--set", f"train.checkpoint_every={steps}", *[x for s in extra for x in ("--set", s)]]


def run_all(jobs: dict[str, list[str]], log_dir: Path) -> dict[str, float]:
    started = time.perf_counter()
    procs = {name: fedpose(*args, log=log_dir / f"{name}.log") for name, args in jobs.items()}
    walls = {}
    for name, proc in procs.items():
        if proc.wait() != 0:
            raise SystemExit(f"{name}: fedpose train failed (exit {proc.returncode}); see {log_dir / (name + '.log')}")
        walls[name] = round(time.perf_counter() - started, 1)
    return walls


def step_seconds(run_dir: Path) -> float:
    train = json.loads((run_dir / "metrics.json").read_text())["train"]
    return statistics.median(r["seconds"] for r in train[SMOKE_SKIP:] or train)


def weights_only(run_dir: Path, target: Path) -> dict:
    """The run's last checkpoint without optimizer/scheduler/config/metrics/RNG state."""
    from fedpose.model.checkpoint import load_checkpoint

    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    payload = {**ckpt, "optimizer": None, "scheduler": None, "config": None, "metrics": None, "rng": None, "extra": {},
               "step": 0}
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, target)
    return ckpt["model_spec"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbones", default="tiny_vit_5m_224,tiny_vit_mid,tiny_vit_test")
    parser.add_argument("--budget-s", type=float, default=330.0, help="wall-clock seconds for the full runs")
    parser.add_argument("--public", type=int, default=40000)
    parser.add_argument("--work", type=Path, default=Path("runs/public-base"))
    parser.add_argument("--export", type=Path, default=Path("runs/public-bases"))
    parser.add_argument("--set", action="append", default=[], help="extra config overrides for every run")
    parser.add_argument("--steps", default="", help="BACKBONE=STEPS,...: fixed steps, no timed runs")
    parser.add_argument("--name", default=EXPORT_NAME,
                        help="file name of each exported base; {backbone} is replaced (the shipped ±60° tiny base: "
                        "'public-base-{backbone}-128x96-rotation60-steps4000.pt')")
    args = parser.parse_args()
    fixed_steps = {b: int(n) for b, n in (item.split("=") for item in args.steps.split(",") if item)}
    backbones = list(fixed_steps) or args.backbones.split(",")
    # named before any work: a bad --name must not surface only at export, hours of training later
    try:
        file_names = {b: args.name.format(backbone=b) for b in backbones}
    except (KeyError, IndexError, ValueError) as err:
        parser.error(f"--name {args.name!r}: only {{backbone}} can be filled in ({err!r})")
    if len(set(file_names.values())) < len(backbones):
        parser.error(f"--name {args.name!r}: several backbones would overwrite one file; put {{backbone}} in it")
    args.work.mkdir(parents=True, exist_ok=True)
    conditions = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__, "cpu_count": os.cpu_count(), "concurrent_runs": len(backbones),
        "config": str(CONFIG.relative_to(REPO)), "overrides": args.set, "public_images": args.public,
    }
    t0 = time.perf_counter()
    if not (DATA / "public" / "annotations.json").exists():
        synth = fedpose("data", "synth", "--out", str(DATA), "--public", str(args.public), "--test", "400", "--sites", "10",
                        "--per-site", "0", "--size", "128x96", "--seed", "1", "--workers", str(os.cpu_count() or 2),
                        log=args.work / "synth.log")
        if synth.wait() != 0:
            raise SystemExit(f"fedpose data synth failed; see {args.work / 'synth.log'}")
    conditions["synth_seconds"] = round(time.perf_counter() - t0, 1)
    print(f"data: {conditions['synth_seconds']} s", flush=True)

    if fixed_steps:
        steps, per_step = fixed_steps, {}
    else:
        smoke = {b: train_args(b, SMOKE_STEPS, args.work / f"smoke-{b}", args.set) for b in backbones}
        run_all(smoke, args.work)
        per_step = {b: step_seconds(REPO / args.work / f"smoke-{b}") for b in backbones}
        # 0.85: the full runs also evaluate 4 times and save; keep the schedule whole inside the budget
        steps = {b: max(100, int(args.budget_s * 0.85 / s) // 100 * 100) for b, s in per_step.items()}
        print(f"smoke: seconds/step {per_step} → steps {steps}", flush=True)

    full = {b: train_args(b, steps[b], args.work / f"full-{b}", args.set) for b in backbones}
    walls = run_all(full, args.work)
    results = {"conditions": {**conditions, "total_seconds": round(time.perf_counter() - t0, 1)}, "bases": {}}
    for b in backbones:
        run_dir = REPO / args.work / f"full-{b}"
        metrics = json.loads((run_dir / "metrics.json").read_text())
        spec = weights_only(run_dir, args.export / file_names[b])
        results["bases"][b] = {
            "steps": steps[b], "smoke_seconds_per_step": round(per_step[b], 4) if b in per_step else None,
            "seconds_per_step": round(step_seconds(run_dir), 4), "wall_seconds": walls[b],
            "final_loss": metrics["train"][-1].get("loss"),
            "val_curve": [{"step": v["step"], "PCKh@0.5": round(v["Mean"], 2)} for v in metrics.get("val", [])],
            "model_spec": spec, "file": file_names[b],
        }
        print(f"{b}: {steps[b]} steps in {walls[b]} s, val {results['bases'][b]['val_curve'][-1:]}", flush=True)
    (args.export / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
