"""One-run audits of every DP mechanism at two ε: ε_lower next to the claimed ε.

    python benchmarks/audit/run.py [--steps 100] [--canaries 1000] [--black-box-steps 30] [--black-box-canaries 100] [--epsilons 2 8]
        → benchmarks/audit/results.{json,md,png}

Central training of the small TinyViT ("tiny_vit_test", 64×64) on synthetic data generated into
``--data`` (one site split as the private set, the public split as S_pub for pdp/fpdp), SGD, σ
calibrated by the default accountant (PLD) over the run's steps. White-box rows for dpsgd, pdp,
fpdp and maskdp over ``--steps`` steps (pdp/fpdp canaries are directions of the public basis, k per
step, so at most k × steps of them); black-box rows for dpsgd over ``--black-box-steps`` steps
(canary images scored by loss, no augmentation so a canary seen in a batch stays the same image;
longer runs forget the canaries seen early: at 100 steps the σ = 0 black-box audit saw nothing).
σ = 0 rows show what each audit sees when nothing is hidden. Each row is one training run (one audit), so ε_lower is a single draw at 95 % confidence,
not an average; it is the larger of the Steinke et al. and the f-DP bounds, both in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from fedpose.audit import BLACK_BOX, WHITE_BOX, audit_central
from fedpose.config import RunConfig

HERE = Path(__file__).resolve().parent
MECHANISMS = ("dpsgd", "pdp", "fpdp", "maskdp")
#: (mechanism, mode) audited with σ = 0 as well: the audit's reach when nothing is hidden
BLIND_ROWS = (("dpsgd", WHITE_BOX), ("pdp", WHITE_BOX), ("fpdp", WHITE_BOX), ("maskdp", WHITE_BOX), ("dpsgd", BLACK_BOX))
TRAIN_SEED, AUDIT_SEED, DATA_SEED = 1, 0, 0


def config(args: argparse.Namespace, data: Path, mechanism: str, mode: str, privacy: dict) -> RunConfig:
    augmentation = {} if mode == WHITE_BOX else {"flip": False, "scale_jitter": 0.0, "rotation": 0.0}
    steps = args.steps if mode == WHITE_BOX else args.black_box_steps
    return RunConfig.model_validate({
        "data": {"train": str(data / "site-1"), "input_size": [64, 64], **augmentation},
        "model": {"backbone": "tiny_vit_test", "scenario": "scratch"},
        "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.0, "weight_decay": 0.0, "cosine": False},
        "train": {"batch_size": args.batch, "steps": steps, "threads": args.threads, "seed": TRAIN_SEED},
        # per record, as the rows were first measured: the synthetic records name patients, so the
        # default unit would be per patient — fewer, larger units, each step ~20× the rows on the CPU
        "privacy": {"mechanism": mechanism, "max_grad_norm": 1.0, "delta": 1e-5, "unit": "record",
                    "basis": {"k": args.k, "public_samples": args.k, "refresh_every": 10, "public_data": str(data / "public")},
                    "public_view": {"factor": 8}, **privacy},
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("/tmp/fedpose-audit-bench/data"))
    parser.add_argument("--steps", type=int, default=100, help="white-box steps")
    parser.add_argument("--black-box-steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--per-site", type=int, default=64)
    parser.add_argument("--k", type=int, default=16, help="pdp/fpdp basis size (= public samples per basis)")
    parser.add_argument("--canaries", type=int, default=1000, help="white-box canaries (pdp/fpdp: at most k × steps)")
    parser.add_argument("--black-box-canaries", type=int, default=100,
                        help="black-box canaries: each is a training record, so many dilute each one's share of the steps")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 8.0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-prefix", default="results")
    args = parser.parse_args()

    import torch

    from fedpose.data.synthetic import ensure_dataset

    ensure_dataset(args.data, sites=1, per_site=args.per_site, public=32, test=4, size=(64, 64), seed=DATA_SEED, progress=False)
    started = time.perf_counter()
    plan = [(m, mode, {"noise_multiplier": 0.0}, None) for m, mode in BLIND_ROWS]
    plan += [(m, WHITE_BOX, {"target_epsilon": e}, e) for m in MECHANISMS for e in args.epsilons]
    plan += [("dpsgd", BLACK_BOX, {"target_epsilon": e}, e) for e in args.epsilons]
    rows = []
    for mechanism, mode, privacy, target in plan:
        t0 = time.perf_counter()
        canaries = args.black_box_canaries if mode == BLACK_BOX else args.canaries
        if mode == WHITE_BOX and mechanism in ("pdp", "fpdp"):
            canaries = min(canaries, args.k * args.steps)
        result = audit_central(config(args, args.data, mechanism, mode, privacy), canaries, seed=AUDIT_SEED, mode=mode).to_dict()
        result.update(target_epsilon=target, run_seconds=round(time.perf_counter() - t0, 1))
        rows.append(result)
        print(f"{mechanism:7s} {mode:9s} target ε={target}: {result['epsilon_lower_text']} | claimed {result['epsilon_text']}", flush=True)
    results = {
        "what": "one-run audits (max of Steinke, Nasr & Jagielski 2023 and the f-DP bound of Mahloujifar et al. 2024) "
                "of central training, per mechanism, mode and target ε",
        "conditions": {"steps": args.steps, "black_box_steps": args.black_box_steps, "batch": args.batch, "site_records": args.per_site,
                       "white_box_canaries": args.canaries, "black_box_canaries": args.black_box_canaries,
                       "basis_k": args.k, "model": "tiny_vit_test 64x64, scratch", "optimizer": "sgd lr 0.05",
                       "unit": "record",
                       "black_box_augmentation": "none (flip, scale jitter and rotation off)",
                       "delta": 1e-5, "confidence": 0.95,
                       "seeds": {"train": TRAIN_SEED, "audit": AUDIT_SEED, "data": DATA_SEED},
                       "dp_randomness": "CSPRNG, unseeded: noise and Poisson sampling differ between reruns, so do the rows",
                       "device": "cpu", "torch_threads": args.threads, "torch": torch.__version__,
                       "python": platform.python_version(), "machine": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "load_average_end": round(os.getloadavg()[0], 1),
                       "seconds": round(time.perf_counter() - started, 1)},
        "rows": rows,
    }
    (HERE / f"{args.out_prefix}.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = ["| mechanism | mode | guarantee | steps | claimed ε (accountant) | ε_lower (95 %) | Steinke | f-DP | canaries | guesses correct |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        claimed = "∞ (σ = 0)" if r["epsilon"] is None else f"{r['epsilon']:.3g} ({r['accountant'].upper()})"
        lines.append(f"| {r['mechanism']} | {r['mode']} | {r['guarantee']} | {r['steps']} | {claimed} | {r['epsilon_lower']:.3g} | "
                     f"{r['epsilon_lower_steinke']:.3g} | {r['epsilon_lower_fdp']:.3g} | {r['canaries']} | {r['correct']}/{r['guesses']} |")
    (HERE / f"{args.out_prefix}.md").write_text("\n".join(lines) + "\n")
    plot(rows, HERE / f"{args.out_prefix}.png")
    print(f"wrote {HERE / args.out_prefix}.{{json,md,png}} in {results['conditions']['seconds']} s")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['mechanism']}\n{r['mode']}\n" + ("σ=0" if r["epsilon"] is None else f"ε={r['target_epsilon']:g}") for r in rows]
    xs = range(len(rows))
    ceiling = max(r["epsilon_lower"] for r in rows) * 1.3
    fig, ax = plt.subplots(figsize=(12, 4.5))
    ax.bar([x - 0.2 for x in xs], [ceiling if r["epsilon"] is None else r["epsilon"] for r in rows], 0.4,
           label="claimed ε (PLD; hatched: ∞, σ = 0)", color="tab:blue")
    for x, r in zip(xs, rows):
        if r["epsilon"] is None:
            ax.bar(x - 0.2, ceiling, 0.4, color="white", edgecolor="tab:blue", hatch="//")
    ax.bar([x + 0.2 for x in xs], [r["epsilon_lower"] for r in rows], 0.4, label="ε_lower (one-run audit, 95 %)", color="tab:orange")
    ax.scatter([x + 0.2 for x in xs], [r["epsilon_lower_steinke"] for r in rows], color="black", marker="_", s=120, zorder=3,
               label="of which Steinke et al. alone")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("ε (δ = 1e-5)")
    ax.set_title("one-run audit: lower bound vs claim (DP for dpsgd/pdp, FDP for fpdp, MaskDP for maskdp)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
