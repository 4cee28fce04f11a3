"""Every cell of the federated_utility benchmark in one table: sites × mechanism × ε, each arm.

    python benchmarks/federated_utility/summary.py     # → summary.{json,md,png} (no training, 2 s)

The sweep ran in parts (``run.py --out DIR``, one folder per recipe or cell, each with its own
``results.json``); this reads the folders named in :data:`CELLS` — for each cell the recipe the
docs report as current (four images of a sampled patient a step wherever it was run) — and lays
them side by side with the goals of issue 26 on the sites' own test splits. Nothing is re-run or
re-selected here: which folder holds a cell's current recipe is fixed below, with the reason.

Yardsticks ("recovers" = (federated − public-only) / (non-private − public-only)): at 10 sites the
non-private central run of 160 steps (``sites10_nonprivate_rounds16``: the base condition ≥ 60 is
met there, not at 80 steps); at 3 sites the non-private central run of the 3-site sweep (80 steps,
one image a step: the four-image non-private arms were not run at 3 sites); on the product's
backbone its own non-private central run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARMS = ("site-alone", "federated", "central")
GOAL_RECOVERS = {2.0: 0.40, 8.0: 0.70}


@dataclass(frozen=True)
class Cell:
    sites: int
    backbone: str
    mechanism: str
    epsilon: float
    folder: str  #: the sweep part holding this cell's current recipe
    images: int  #: images of a sampled patient a step
    yardstick: str  #: the folder whose non-private central arm is the 100 % of "recovers"
    why: str


CELLS = (
    Cell(10, "tiny_vit_test", "pdp", 2.0, "sites10_four_images", 4, "sites10_nonprivate_rounds16", "site lr 0.1 (chosen on the 10-site tuning data at ε 2)"),
    Cell(10, "tiny_vit_test", "pdp", 8.0, "sites10_grey_basis", 4, "sites10_nonprivate_rounds16", "site lr 0.2, two thirds of the PDP basis's public images grey (each chosen on the 10-site tuning data at ε 8)"),
    Cell(10, "tiny_vit_test", "fpdp", 2.0, "sites10_fpdp", 4, "sites10_nonprivate_rounds16", "site lr 0.1, FDP (replace-one): ε not comparable with DP's"),
    Cell(10, "tiny_vit_test", "fpdp", 8.0, "sites10_fpdp", 4, "sites10_nonprivate_rounds16", "site lr 0.2, FDP (replace-one): ε not comparable with DP's"),
    Cell(10, "tiny_vit_test", "dpsgd", 8.0, "sites10_dpsgd", 4, "sites10_nonprivate_rounds16", "site lr 0.2; dpsgd at ε 2 not run at 10 sites"),
    Cell(3, "tiny_vit_test", "pdp", 2.0, "sites3_four_images", 4, ".", "the 10-site four-image recipe (site lr 0.1), not re-tuned"),
    Cell(3, "tiny_vit_test", "pdp", 8.0, "sites3_pdp_four_images_eps8_lr01", 4, ".", "site lr 0.1 (chosen on the 3-site tuning data: +0.30 over the 10-site 0.2, at the rule's threshold)"),
    Cell(3, "tiny_vit_test", "dpsgd", 2.0, ".", 1, ".", "one image a step (four not run for dpsgd at ε 2, 3 sites); lr 0.03"),
    Cell(3, "tiny_vit_test", "dpsgd", 8.0, "sites3_dpsgd_four_images_lr01", 4, ".", "site lr 0.1 (chosen on the 3-site tuning data: +2.7 over the 10-site 0.2)"),
    Cell(3, "tiny_vit_test", "fpdp", 2.0, "sites3_fpdp_four_images", 4, ".", "FDP (replace-one)"),
    Cell(3, "tiny_vit_test", "fpdp", 8.0, "sites3_fpdp_four_images_eps8_lr01", 4, ".", "FDP (replace-one), site lr 0.1 (chosen on the 3-site tuning data: +0.6 over the 10-site 0.2)"),
    Cell(3, "tiny_vit_5m_224", "pdp", 8.0, "product_backbone_four_images", 4, "product_backbone_four_images", "the product's backbone, its ±30° public base; one H100"),
)


@cache  # several cells read the same folder (the 10-site yardstick: five of them)
def _table(folder: str) -> list[dict]:
    return json.loads((HERE / folder / "results.json").read_text())["table"]


def _row(table: list[dict], mechanism: str, epsilon: float | None, arm: str) -> dict:
    return next(r for r in table if r["mechanism"] == mechanism and r["epsilon"] == epsilon and r["arm"] == arm)


def summarise(cell: Cell) -> dict:
    table = _table(cell.folder)
    public = _row(table, "none", None, "public-only")["own50_mean"]
    reference = _row(_table(cell.yardstick), "none", None, "central")["own50_mean"]
    arms = {arm: {"mean": (r := _row(table, cell.mechanism, cell.epsilon, arm))["own50_mean"], "std": r["own50_std"],
                  "seeds": r["seeds"]} for arm in ARMS}
    federated, alone, central = (arms[a]["mean"] for a in ("federated", "site-alone", "central"))
    recovers = (federated - public) / (reference - public)
    goal = GOAL_RECOVERS[cell.epsilon]
    return {**cell.__dict__, "public_only": public, "nonprivate_reference": reference, "arms": arms,
            "recovers": round(recovers, 3), "recovers_goal": goal, "recovers_met": recovers >= goal,
            "federated_minus_alone": round(federated - alone, 2), "federated_minus_alone_met": federated - alone >= 5,
            "central_minus_federated": round(central - federated, 2), "central_minus_federated_met": central - federated <= 3}


def markdown(rows: list[dict]) -> str:
    def mark(met: bool) -> str:
        return "met" if met else "**missed**"

    lines = ["# Federated utility: every cell, current recipe", "",
             "Own test splits, PCKh@0.5 in %, mean ± std over 3 seeds (fresh CSPRNG noise each); ε per patient at "
             "δ = 1e-5, PLD (pdp, dpsgd: DP, add/remove; fpdp: FDP, replace-one). Goals (issue 26): recovers ≥ 40 % "
             "(ε 2) / 70 % (ε 8) of public-only → non-private; federated ≥ site-alone + 5; central − federated ≤ 3. "
             "Made by `summary.py` from the folders named; the docs say how each recipe was chosen.", "",
             "| sites | backbone | mechanism | ε | images a step | public-only | site-alone | federated | central | "
             "non-private ref. | recovers | fed − alone | central − fed | folder | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        arm = {a: f"{r['arms'][a]['mean']:.1f} ± {r['arms'][a]['std']:.1f}" for a in ARMS}
        lines.append(
            f"| {r['sites']} | {r['backbone']} | {r['mechanism']} | {r['epsilon']:g} | {r['images']} | {r['public_only']:.1f} | "
            f"{arm['site-alone']} | {arm['federated']} | {arm['central']} | {r['nonprivate_reference']:.1f} | "
            f"{100 * r['recovers']:.1f} % ({mark(r['recovers_met'])}) | {r['federated_minus_alone']:+.1f} "
            f"({mark(r['federated_minus_alone_met'])}) | {r['central_minus_federated']:+.1f} ({mark(r['central_minus_federated_met'])}) | "
            f"`{r['folder']}` | {r['why']} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['sites']} sites{' (product)' if r['backbone'] != 'tiny_vit_test' else ''}\n{r['mechanism']} ε {r['epsilon']:g}"
              for r in rows]
    fig, ax = plt.subplots(figsize=(13, 4.5))
    for i, r in enumerate(rows):
        ax.bar(i, 100 * r["recovers"], color="tab:blue" if r["recovers_met"] else "tab:gray")
        ax.plot([i - 0.4, i + 0.4], [100 * r["recovers_goal"]] * 2, color="tab:red")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("federated private: % of public-only → non-private")
    ax.set_title("Federated utility, every cell (red: the goal; blue: met, grey: missed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    rows = [summarise(cell) for cell in CELLS]
    (HERE / "summary.json").write_text(json.dumps({"cells": rows}, indent=1) + "\n")
    (HERE / "summary.md").write_text(markdown(rows))
    plot(rows, HERE / "summary.png")
    print(markdown(rows))


if __name__ == "__main__":
    main()
