"""Tuning grid for the main job's recipe (configs/demo.toml), many variants side by side on one GPU.

    python benchmarks/federated_utility/main_job_grid.py --out DIR [--jobs 14] [--data-seeds 7 8 9] [--only NAME ...]

Every variant is the main job's recipe, read from ``configs/demo.toml`` (backbone, trainable set, public
base, patients a step, rounds × local steps, ε, the sites' optimizer, images per patient, the data
sizes), with a few settings changed (``VARIANTS``), trained as ``run.py``'s federated arm: the real
coordinator round loop and site round, in process (``run.run_arm``). Tuning data only (generator
seeds 7, 8, 9 by default, never the reported seed 0); DP noise is fresh CSPRNG noise in every run.

Two differences from ``fedpose simulate --config configs/demo.toml``, the same for every variant:
the transport is in-process (no Flower messaging), and every site's ε_max is the run's ε, so site 3
trains round 2 as well (the demo's site 3, ε_max 0.8, refuses it). A variant that wins here is
checked with ``fedpose simulate`` on the same tuning seeds on the CPU before it is adopted.

The recipe ``configs/demo.toml`` holds changes: ``main_job_grid_h200.json`` ran it at 2 rounds × 8 steps
without the moving average (its ``settings_of_shipped``), where "steps16" is 2 × 16 and "steps8" would
repeat it; since 2026-12-05 "shipped" also scores the mean of the rounds' models ("no-ema": the iterate).
Merge only files of the same shipped recipe.

Each finished run is written to ``DIR/main_job_grid.json`` at once, so a run cut short keeps what
finished. ``--summarize A.json B.json … --out DIR`` merges such files and adds, per variant, its mean
gain and its difference from the shipped recipe paired by data seed (and draws them: DIR/main_job_grid.png).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

#: name → the settings (``run.Settings`` fields) it changes from the main job's recipe, in the order run
VARIANTS: dict[str, dict[str, Any]] = {
    "shipped": {},
    "lr0.2": {"site_lr": 0.2},
    "lr0.3": {"site_lr": 0.3},
    "lr0.05": {"site_lr": 0.05},
    "ceiling-eps50": {"epsilons": [50.0]},  # diagnostic: what the recipe gains with little noise (σ 0.256)
    # run.py's default site_lr_at steps dpsgd at ε 2 with 0.03 (its 3-site tuning): said here, as it ran
    "eps2-lr0.03": {"epsilons": [2.0], "site_lr_at": {"dpsgd@2": 0.03}},
    "server-lr2": {"server_lr": 2.0},
    "momentum0-lr0.5": {"site_momentum": 0.0, "site_lr": 0.5},
    "rotation60": {"site_rotation_clip": 2.0},
    "adamw-lr1e-3": {"site_optimizer": "adamw", "site_lr": 1e-3},
    "adamw-lr3e-3": {"site_optimizer": "adamw", "site_lr": 3e-3},
    "norms_head": {"scenario": "norms_head"},
    "steps10": {"local_steps": 10},  # 2 × 10 steps, σ for the same ε: 25 % more compute
    "lr0.15": {"site_lr": 0.15},
    "lora": {"scenario": "lora"},  # rank-8 adapters on the last stage + LayerNorms + head
    # biases and LayerNorms + the last stage's adapters (head frozen) ran from a probe patch: main_job_grid_h200.json
    # diagnostic: all weights, no privacy (run.py's non-private arm: unclipped SGD 0.003), the same 16 steps
    "nonprivate-full": {"mechanisms": ["none"]},
    "nonprivate-full-lr0.01": {"mechanisms": ["none"], "nonprivate_lr": 0.01},
    "nonprivate-full-lr0.03": {"mechanisms": ["none"], "nonprivate_lr": 0.03},
    "nonprivate-full-steps16": {"mechanisms": ["none"], "local_steps": 16},  # 2 × 16 steps: what more steps would buy
    "steps16": {"local_steps": 16},  # 2 × 16 steps at the same ε (σ recalibrated): the shipped recipe since 2026-12-04
    "steps8": {"local_steps": 8},  # 2 × 8 steps at the same ε: the shipped recipe of main_job_grid_h200.json
    "no-ema": {"ema_decay": 0.0},  # the round-2 iterate instead of the mean of the rounds' models (shipped since 2026-12-05)
}


def demo_settings(data_seed: int) -> dict[str, Any]:
    """run.Settings fields that reproduce configs/demo.toml (its first site's optimizer and privacy),
    read as ``fedpose simulate`` validates it."""
    from fedpose.cli.simulate import load_federation
    from fedpose.privacy.accountant import epsilon_for

    demo, synthetic, _ = load_federation(REPO / "configs" / "demo.toml", [])
    coordinator, site = demo.coordinator, demo.sites[0]
    privacy = site.privacy
    steps = coordinator.rounds * site.local_steps
    epsilon = epsilon_for(privacy.noise_multiplier, privacy.sample_rate, steps, privacy.delta, accountant="pld")[0]
    return {
        "size": list(synthetic["size"]), "sites": len(demo.sites), "per_site": synthetic["per_site"], "public": 0,
        "test": synthetic["test"], "data_seed": data_seed,
        "backbone": coordinator.model.backbone, "scenario": coordinator.model.scenario,
        "init_checkpoint": str(coordinator.model.init_checkpoint),
        "batch_size": site.train.batch_size, "rounds": coordinator.rounds, "local_steps": site.local_steps,
        "site_lr": site.optim.lr, "site_momentum": site.optim.momentum, "site_optimizer": site.optim.name,
        "ema_decay": coordinator.ema.decay,
        "max_grad_norm": privacy.max_grad_norm, "delta": privacy.delta, "unit": privacy.unit,
        "max_records_per_unit": privacy.max_records_per_unit, "mechanisms": [privacy.mechanism],
        "epsilons": [round(epsilon, 2)],
        "site_basis_refresh_steps": None, "seeds": [0], "nonprivate": False, "threads": 1, "chunk_size": 128,
    }


def data_dir(scratch: Path, data_seed: int) -> Path:
    """Where the data of generator seed ``data_seed`` is generated once and read by every run."""
    return scratch / f"data-{data_seed}"


def run_one(variant: str, data_seed: int, scratch: Path, overrides: dict[str, Any], repeat: int = 0) -> dict[str, Any]:
    import run

    settings = run.Settings.model_validate({**demo_settings(data_seed), **overrides, **VARIANTS[variant]})
    data = run.ensure_data(settings, data_dir(scratch, data_seed))
    # repeat r is run seed r (coordinator.seed r, site k's train.seed 100·r + k), as the README's seeds 0, 1, 2
    private = settings.mechanisms[0] != "none"
    arm = run.Arm(seed=repeat, mechanism=settings.mechanisms[0], epsilon=settings.epsilons[0] if private else None, kind="federated")
    result = run.run_arm(settings, arm, data, scratch / f"work-{variant}-{data_seed}-{repeat}")
    curve = result["curve_mixture_pckh50"]
    return {"variant": variant, "data_seed": data_seed, "repeat": repeat, "changes": VARIANTS[variant], "curve": curve, "final": curve[-1],
            "gain": round(curve[-1] - curve[0], 2), "noise_multiplier": result["noise_multiplier"],
            "epsilon_spent": result["epsilon_spent"], "site_rounds": result["site_rounds"],
            "wall_seconds": result["wall_seconds"], "device": result["device"], "torch": result["torch"]}


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: its runs' gains per data seed, their mean, and the mean over data seeds of
    (variant's mean − shipped's mean on that seed). A run in which no site trained a round (every
    guard refused) measured nothing and is left out."""
    import numpy as np

    results = [r for r in results if any("ok" in rounds for rounds in r.get("site_rounds", {"": ["ok"]}).values())]

    def gains(variant: str) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        for r in results:
            if r["variant"] == variant:
                out.setdefault(r["data_seed"], []).append(r["gain"])
        return dict(sorted(out.items()))

    shipped = gains("shipped")
    summary = {}
    for variant in dict.fromkeys(r["variant"] for r in results):
        mine = gains(variant)
        paired = [float(np.mean(g) - np.mean(shipped[s])) for s, g in mine.items() if s in shipped]
        summary[variant] = {"runs": sum(map(len, mine.values())), "gains_by_data_seed": mine,
                            "mean_gain": round(float(np.mean([x for g in mine.values() for x in g])), 2),
                            "minus_shipped_paired": round(float(np.mean(paired)), 2) if paired else None}
    return summary


def plot(summary: dict[str, Any], path: Path) -> None:
    """Each variant's runs (gain over round 0, one dot a run, coloured by data seed) and their mean,
    best mean first; the shipped recipe's runs as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = sorted(summary, key=lambda v: -summary[v]["mean_gain"])
    seeds = sorted({int(seed) for row in summary.values() for seed in row["gains_by_data_seed"]})
    colours = dict(zip(seeds, plt.get_cmap("tab10").colors))
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(variants) + 1.4))
    shipped = [g for gains in summary["shipped"]["gains_by_data_seed"].values() for g in gains] if "shipped" in summary else []
    if shipped:
        ax.axvspan(min(shipped), max(shipped), color="0.9", zorder=0, label="shipped: range of its runs")
    for y, variant in enumerate(variants):
        for seed, gains in summary[variant]["gains_by_data_seed"].items():
            ax.scatter(gains, [y] * len(gains), s=14, color=colours[int(seed)], zorder=2)
        ax.plot([summary[variant]["mean_gain"]] * 2, [y - 0.35, y + 0.35], color="black", lw=2, zorder=3)
    for seed in seeds:
        ax.scatter([], [], s=14, color=colours[seed], label=f"data seed {seed}")
    ax.axvline(5.0, color="tab:red", ls="--", lw=1, label="goal: +5 on every seed")
    ax.set_yticks(range(len(variants)), variants, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(left=max(-3.0, ax.get_xlim()[0]))  # collapsed variants (about −20) are clipped: the table has them
    ax.set_xlabel("PCKh@0.5 gain over round 0 (round 2); bar: the variant's mean")
    ax.set_title("main job's recipe and variants, tuning data", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--summarize", type=Path, nargs="+", metavar="JSON", help="merge these outputs into DIR, then exit")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/fedpose_main_job_grid"))
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--data-seeds", type=int, nargs="+", default=[7, 8, 9])
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=1, help="runs of each variant on each data seed: run seeds 0, 1, …")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=JSON",
                        help="change a setting of every variant (a smoke test: --set backbone=tiny_vit_test ...)")
    parser.add_argument("--one", nargs=3, metavar=("VARIANT", "DATA_SEED", "REPEAT"), help=argparse.SUPPRESS)  # a worker
    parser.add_argument("--data", type=int, metavar="DATA_SEED", help=argparse.SUPPRESS)  # a data generator
    args = parser.parse_args()
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    overrides = {key: json.loads(value) for key, value in (o.split("=", 1) for o in args.overrides)}
    if args.summarize:
        merged = [json.loads(path.read_text()) for path in args.summarize]
        results = [r for m in merged for r in m["results"]]
        args.out.mkdir(parents=True, exist_ok=True)
        summary = summarize(results)
        (args.out / "main_job_grid.json").write_text(json.dumps({
            **{k: v for k, v in merged[0].items() if k not in ("summary", "results")}, "summary": summary, "results": results}, indent=1))
        plot(summary, args.out / "main_job_grid.png")
        return 0
    if args.data is not None:
        import run

        run.ensure_data(run.Settings.model_validate({**demo_settings(args.data), **overrides}), data_dir(args.scratch, args.data))
        return 0
    if args.one:
        result = run_one(args.one[0], int(args.one[1]), args.scratch, overrides, int(args.one[2]))
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    def worker(*mode: str) -> list[str]:  # this script in one of its hidden modes, with the same settings
        return [sys.executable, __file__, "--out", str(args.out), "--scratch", str(args.scratch), *mode,
                *sum((["--set", o] for o in args.overrides), [])]

    started = time.time()
    # the data first, one process per generator seed, so the runs only read it
    generators = [subprocess.Popen(worker("--data", str(seed))) for seed in args.data_seeds]
    if any(g.wait() for g in generators):
        raise SystemExit("data generation failed")
    print(f"[{time.time() - started:.0f} s] data ready", flush=True)

    pending = [(v, s, r) for r in range(args.repeats) for v in args.only for s in args.data_seeds]
    running: dict[tuple[str, int, int], subprocess.Popen[str]] = {}
    results: list[dict[str, Any]] = []
    args.out.mkdir(parents=True, exist_ok=True)
    while pending or running:
        while pending and len(running) < args.jobs:
            variant, seed, repeat = pending.pop(0)
            running[(variant, seed, repeat)] = subprocess.Popen(
                worker("--one", variant, str(seed), str(repeat)), stdout=subprocess.PIPE, text=True)
        time.sleep(2)
        for key, process in list(running.items()):
            if process.poll() is None:
                continue
            del running[key]
            lines = [line for line in (process.stdout.read() if process.stdout else "").splitlines() if line.startswith("RESULT ")]
            if process.returncode or not lines:
                print(f"[{time.time() - started:.0f} s] {key}: FAILED (exit {process.returncode})", flush=True)
                continue
            result = json.loads(lines[-1][len("RESULT "):])
            results.append(result)
            print(f"[{time.time() - started:.0f} s] {key}: curve {result['curve']} gain {result['gain']} ({result['wall_seconds']} s)", flush=True)
            (args.out / "main_job_grid.json").write_text(json.dumps({
                "what": __doc__.split("\n\n")[0].strip(), "settings_of_shipped": {**demo_settings(args.data_seeds[0]), **overrides},
                "jobs": args.jobs, "cpu_cores": os.cpu_count(), "results": results}, indent=1))
    print(f"done in {time.time() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
