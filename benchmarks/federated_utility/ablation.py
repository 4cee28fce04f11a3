"""The levers of the private recipe, each switched against the same baseline, 3 seeds.

    python benchmarks/federated_utility/ablation.py --jobs 2          # every lever, resumes finished runs
    python benchmarks/federated_utility/ablation.py --report-only     # rewrite ablation.{json,md,png}
    python benchmarks/federated_utility/ablation.py --resume-from benchmarks/federated_utility/ablation.json --jobs 2

The baseline is ``run.py``'s federated private arm with its defaults (pdp on ``biases_norms``, ε 8
per patient, 3 sites) on the **tuning data** (generator seed 7, never a reported split): the
levers are how the defaults were chosen, so they are measured where choosing is allowed. Each lever
changes one setting (``LEVERS``) and runs the same three seeds (fresh CSPRNG noise every run; the
seed moves sampling, augmentation and the sites' and coordinator's seeds). Every run goes through
``run.py``'s ``run_arm`` — the real RoundRunner and site round over the in-process transport — and
is saved as ``<work>/<lever>/parts/<arm>.json`` when it finishes; all levers share one dataset.

Writes ``ablation.json`` (settings, every run, per-lever mean ± std of the mixture and own-split
PCKh@0.5 and of the gain over the baseline, conditions), ``ablation.md`` and ``ablation.png``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import Arm, Settings, devices_of, ensure_data, load_parts, run_pending, run_workers, worker_share  # noqa: E402

#: the baseline: run.py's defaults, one private setting, on the tuning data
BASELINE: dict[str, Any] = {"data_seed": 7, "mechanisms": ["pdp"], "epsilons": [8.0], "nonprivate": False,
                            "seeds": [0, 1, 2]}

#: lever name → (what it changes, the settings it overrides); each differs from the baseline in one thing
LEVERS: dict[str, tuple[str, dict[str, Any]]] = {
    "baseline": ("pdp, biases_norms, k 64, site basis of turned public images every 5 steps, lr 0.1, B 16, C 1, "
                 "8 rounds × 10 steps, FedAvg", {}),
    "finetune-set": ("trainable set: the paper's finetune scenario (1 M) instead of biases + LayerNorms (6.6 k)",
                     {"scenario": "finetune"}),
    "no-projection": ("dpsgd: no public projection (noise in all 6.6 k directions)", {"mechanisms": ["dpsgd"]}),
    "k16": ("projection rank k 16 instead of 64", {"k": 16}),
    "coordinator-basis": ("basis from the coordinator every 2 rounds (global weights) instead of the sites' every 5 steps",
                          {"site_basis_refresh_steps": None}),
    "upright-basis": ("site basis from upright public images (no ±60° turns)", {"basis_public_rotation": 0.0}),
    "augmult2": ("augmentation multiplicity K 2 (two augmented copies averaged before clipping; 2× compute)",
                 {"augmentation_multiplicity": 2}),
    "ema0.5": ("EMA of the global models over rounds, decay 0.5 (post-processing)", {"ema_decay": 0.5}),
    "fedavgm": ("server momentum 0.9 (FedAvgM) instead of FedAvg", {"aggregation": "fedavgm"}),
    "local20x4": ("20 local steps × 4 rounds instead of 10 × 8 (same 80 steps, same σ)", {"local_steps": 20, "rounds": 4}),
    "clip0.3": ("clipping bound C 0.3 instead of 1", {"max_grad_norm": 0.3}),
    "batch32": ("expected batch 32 patients (q 32/120; σ recalibrated to the same ε)", {"batch_size": 32}),
    "lr0.03": ("site step size 0.03 instead of 0.1", {"site_lr": 0.03}),
    "lr0.2": ("site step size 0.2 instead of 0.1", {"site_lr": 0.2}),
    "lr0.3": ("site step size 0.3 instead of 0.1", {"site_lr": 0.3}),
    "records4": ("4 images of a sampled patient per step instead of 1 (the patient still clipped as one)",
                 {"max_records_per_unit": 4}),
    "rounds16": ("16 rounds × 10 steps instead of 8 (160 steps; σ recalibrated to the same ε; 2× compute)",
                 {"rounds": 16}),
    "norms": ("trainable set: LayerNorm affines and the head's classifiers (norms) instead of biases + LayerNorms",
              {"scenario": "norms"}),
    "norms-head": ("trainable set: LayerNorm affines and the whole head (norms_head) instead of biases + LayerNorms",
                   {"scenario": "norms_head"}),
    "lora": ("trainable set: rank-8 low-rank adapters, LayerNorm affines and the head (lora) instead of biases + LayerNorms",
             {"scenario": "lora"}),
    "fedadam": ("FedAdam on the noisy mean update (server lr 0.01, the library's default) instead of FedAvg",
                {"aggregation": "fedadam", "server_lr": 0.01}),
    "server-cosine": ("server step decayed 1 → 0.1 over the rounds (cosine) instead of constant",
                      {"server_lr_schedule": "cosine"}),
}


def lever_settings(name: str) -> Settings:
    return Settings.model_validate({**BASELINE, **LEVERS[name][1]})


def lever_arms(settings: Settings) -> list[Arm]:
    return [Arm(seed, settings.mechanisms[0], settings.epsilons[0], "federated") for seed in settings.seeds]


def pending() -> list[tuple[str, Arm]]:
    """Every (lever, run), baseline first, seed-major: a cut-short ablation has whole levers."""
    return [(name, arm) for name in LEVERS for arm in lever_arms(lever_settings(name))]


def run_share(work: Path, worker: str) -> None:
    data = ensure_data(lever_settings("baseline"), work)
    shaping = ("sites", "per_site", "public", "test", "size", "data_seed")
    for name in LEVERS:  # one dataset for every lever
        assert all(getattr(lever_settings(name), f) == getattr(lever_settings("baseline"), f) for f in shaping), name
    for name, arm in worker_share(pending(), worker):
        run_pending(lever_settings(name), [arm], work / name, data)


def resume_from(path: Path, work: Path) -> int:
    """Continue an ablation another session began: its runs become this work dir's parts, for every
    lever whose settings are still what produced them."""
    import json

    from run import part_path, settings_differ

    written = 0
    for lever in json.loads(path.read_text())["levers"]:
        name = lever["lever"]
        if name not in LEVERS or settings_differ(lever["settings"], lever_settings(name)):
            print(f"{name}: its settings changed; run again", flush=True)
            continue
        for key, part in lever["runs"].items():
            target = part_path(work / name, key)
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(json.dumps(part))
                written += 1
    return written


def stat(values: list[float]) -> dict[str, float] | None:
    """Mean, sample std (None for one value) and n, or None for no values."""
    return {"mean": round(float(np.mean(values)), 2), "std": round(float(np.std(values, ddof=1)), 2) if len(values) > 1 else None,
            "n": len(values)} if values else None


# -- report --------------------------------------------------------------------------------------------
def summarize(work: Path) -> dict[str, Any]:
    def own(part: dict[str, Any]) -> float:
        return float(np.mean([v["pckh50"] for k, v in part["scores"].items() if k.startswith("site-")]))

    base = {p["seed"]: p for p in load_parts(lever_arms(lever_settings("baseline")), work / "baseline").values()}
    levers = []
    for name, (what, overrides) in LEVERS.items():
        parts = load_parts(lever_arms(lever_settings(name)), work / name)
        runs = sorted(parts.values(), key=lambda p: p["seed"])
        paired = [r for r in runs if r["seed"] in base]
        levers.append({
            "lever": name, "what": what, "overrides": overrides, "settings": lever_settings(name).model_dump(mode="json"),
            "seeds_done": [r["seed"] for r in runs],
            "device": "; ".join(devices_of(runs)),
            "mixture_pckh50": stat([r["scores"]["mixture"]["pckh50"] for r in runs]),
            "own_splits_pckh50": stat([own(r) for r in runs]),
            "mixture_minus_baseline": stat([r["scores"]["mixture"]["pckh50"] - base[r["seed"]]["scores"]["mixture"]["pckh50"] for r in paired]),
            "own_minus_baseline": stat([own(r) - own(base[r["seed"]]) for r in paired]),
            "public_only_mixture": runs[0]["curve_mixture_pckh50"][0] if runs else None,
            "wall_seconds": [r["wall_seconds"] for r in runs],
            "runs": {r["key"]: r for r in runs},  # whole parts: --resume-from writes them back
        })
    return {
        "what": "ablation of the private recipe's levers: each changes one setting of the baseline; federated "
                "private arm, 3 sites, ε 8 per patient ((ε, δ)-DP, add/remove one patient, δ 1e-5, PLD), "
                "PCKh@0.5 of the final global model; mean ± std over seeds (fresh CSPRNG noise every run); "
                "'minus_baseline' pairs each seed with the baseline's run of that seed",
        "data": "tuning data (synthetic generator seed 7): the levers choose the defaults, so they are measured where "
                "choosing is allowed; never a reported split",
        "baseline_settings": lever_settings("baseline").model_dump(),
        "conditions": {"devices": sorted({lever["device"] for lever in levers if lever["device"]}),
                       "threads_per_run": lever_settings("baseline").threads,
                       "note": "on the CPU two runs at a time beside other work, on a GPU up to 15 side by side: "
                               "wall_seconds are not timings (see load_before); each lever's device is its own"},
        "levers": levers,
    }


def fmt(stat: dict[str, float] | None, signed: bool = False) -> str:
    if stat is None:
        return "—"
    mean = f"{stat['mean']:+.1f}" if signed else f"{stat['mean']:.1f}"
    return mean + (f" ± {stat['std']:.1f}" if stat["std"] is not None else "") + ("" if stat["n"] >= 3 else f" (n {stat['n']})")


def markdown(summary: dict[str, Any]) -> str:
    lines = ["# Ablation of the private recipe (tuning data, 3 sites, pdp, ε 8 per patient)", "",
             summary["what"] + ".", "", summary["data"] + ".", "",
             "| lever | what it changes | mixture PCKh@0.5 | own splits | Δ mixture vs baseline | Δ own vs baseline |",
             "|---|---|---|---|---|---|"]
    for lever in summary["levers"]:
        lines.append(f"| {lever['lever']} | {lever['what']} | {fmt(lever['mixture_pckh50'])} | {fmt(lever['own_splits_pckh50'])} | "
                     + ("" if lever["lever"] == "baseline" else f"{fmt(lever['mixture_minus_baseline'], True)} | {fmt(lever['own_minus_baseline'], True)}")
                     + (" | |" if lever["lever"] == "baseline" else " |"))
    public = next((lv["public_only_mixture"] for lv in summary["levers"] if lv["public_only_mixture"] is not None), None)
    lines += ["", f"Public-only (the shipped base) on the tuning mixture: {public:.1f}." if public is not None else "", ""]
    by_device: dict[str, list[str]] = {}
    for lever in summary["levers"]:
        by_device.setdefault(lever["device"] or "not run", []).append(lever["lever"])
    lines += [f"Ran on {device}: {', '.join(names)}." for device, names in by_device.items()] + [""]
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levers = [lv for lv in summary["levers"] if lv["lever"] != "baseline" and lv["mixture_minus_baseline"]]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(levers) + 1.5))
    for row, lever in enumerate(levers):
        stat = lever["mixture_minus_baseline"]
        ax.barh(row, stat["mean"], xerr=stat["std"] or 0, color="tab:green" if stat["mean"] > 0 else "tab:red", alpha=0.8)
    ax.set_yticks(range(len(levers)), [lv["lever"] for lv in levers])
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel("Δ mixture PCKh@0.5 vs the baseline (mean ± std over seeds)")
    ax.set_title("levers of the private recipe (tuning data, 3 sites, pdp, ε 8 per patient)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/fedpose_ablation"))
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (separate processes)")
    parser.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)  # "i/n"
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--resume-from", type=Path, default=None, metavar="ABLATION_JSON",
                        help="first write the runs of a committed ablation.json back into the work dir (levers whose "
                             "settings are unchanged only)")
    args = parser.parse_args()
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    from fedpose.io import atomic_write_json, atomic_write_text

    if args.resume_from is not None:
        print(f"{resume_from(args.resume_from, args.work)} runs taken from {args.resume_from}", flush=True)
    if args.worker:
        run_share(args.work, args.worker)
        return 0
    if not args.report_only:
        started = time.time()
        ensure_data(lever_settings("baseline"), args.work)  # once, before the workers share it
        codes = run_workers([sys.executable, __file__, "--work", str(args.work)], args.jobs)
        print(f"done in {time.time() - started:.0f} s" + (f"; workers exited with {codes}" if any(codes) else ""), flush=True)
    summary = summarize(args.work)
    atomic_write_json(args.out / "ablation.json", summary)
    atomic_write_text(args.out / "ablation.md", markdown(summary))
    plot(summary, args.out / "ablation.png")
    print(f"→ {args.out / 'ablation.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
