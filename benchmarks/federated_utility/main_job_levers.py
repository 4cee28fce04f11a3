"""The main job's levers in one table and one chart: every probe of configs/demo.toml's recipe that
``main_job_simulate.py`` ran on the tuning data, against the published models of the recipe it
challenged.

    python benchmarks/federated_utility/main_job_levers.py     # writes main_job_levers.{json,md,png}

A probe file (``*_main_job.json`` with ``baseline_published_flip_test``) holds its rule, fixed
before its runs, its runs (generator seeds 7, 8, 9: tuning data, never the reported seed 0; the
shipped run seeds) and the baseline's published PCKh@0.5 (flip test) on the same data sets. The
difference is paired by data seed. A file may hold several variants (runs with different
overrides); a variant that diverged has fewer scored runs and is shown as such. Nothing is trained
here: the table only reads what the probes recorded.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "main_job_levers"

#: probe file → what it changed, in a few words (a new probe adds its line; the test checks that
#: every probe file in this folder has one)
LEVERS: dict[str, str] = {
    "grey_only_main_job.json": "grey copies: grey images train their own biases and LayerNorms (adopted)",
    "grey_copies_main_job.json": "copies for both kinds, both trained",
    "tail_average_main_job.json": "each site publishes the mean of its round's last 8 iterates",
    "batch48_main_job.json": "48 patients a step (σ 2.4665 for the same ε)",
    "steps28_main_job.json": "28 steps a round (σ 2.1818 for the same ε)",
    "affines_main_job.json": "BatchNorm scales trained too (affines)",
    "gradient_scales_main_job.json": "per-tensor gradient scales before the clip",
    "stem_convolution_main_job.json": "the stem's convolution trained too",
    "site_lr02_main_job.json": "site step size 0.2 instead of 0.1",
    "grey_bn_scales_main_job.json": "grey copies of the BatchNorm scales too",
    "rounds4_main_job.json": "4 rounds × 8 steps instead of 2 × 16",
    "grey_augmentation_main_job.json": "half the site images' loads seen in grey",
    "grey_rows_main_job.json": "two grey rows a patient instead of four (a speed lever: 40 % less round time)",
    "grey_early_main_job.json": "grey copies of the patch embedding and first two stages only (5 k of 31 k parameters)",
}
#: the recipes the probes were measured against, in the order they were shipped (baseline_scores
#: reads each one's published models from the runs that made it)
BASELINES: tuple[str, ...] = (
    "biases_norms (shipped until 2026-12-05)",
    "grey copies (shipped since 2026-12-05)",
    "grey copies, four rows a patient (its own runs, 2026-12-07)",
    "grey copies, two rows a patient (shipped 2026-12-07)",
)


def probes(folder: Path = HERE) -> dict[str, dict[str, Any]]:
    """Every probe file of the main job in ``folder`` (a baseline to pair with, and runs), by file name, parsed."""
    parsed = {path.name: json.loads(path.read_text()) for path in sorted(folder.glob("*_main_job.json"))}
    return {name: probe for name, probe in parsed.items() if "baseline_published_flip_test" in probe}


def baseline_scores(folder: Path = HERE) -> dict[str, dict[str, float]]:
    """Recipe name → its published PCKh@0.5 (flip test) by data seed, read from the runs that made it."""
    flip = json.loads((folder / "flip_test_main_job.json").read_text())["runs"]
    grey = json.loads((folder / "grey_only_main_job.json").read_text())["runs"]
    # the code of the canonical windows (2026-12-06) changed the shipped recipe's draws: a probe since then ran its own
    rows = json.loads((folder / "grey_rows_main_job.json").read_text())
    by_seed = [{seed: run["published"]["flip_test"] for seed, run in flip.items()}]
    by_seed += [{str(run["data_seed"]): run["published_pckh50"] for run in runs} for runs in (grey, rows["baseline_runs"], rows["runs"])]
    return dict(zip(BASELINES, by_seed, strict=True))


def decision_of(probe: dict[str, Any]) -> str:
    """The probe's own verdict, as its file states it (top level or in its summary)."""
    summary = probe.get("summary")
    text = (probe.get("decision") or (summary.get("decision") if isinstance(summary, dict) else None) or "").lower()
    return next((verdict for verdict in ("not adopted", "adopted") if text.startswith(verdict)), "see its file")


def variants(name: str, probe: dict[str, Any], baselines: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """The probe file's variants (runs grouped by their overrides), each paired with its baseline."""
    base = {seed: round(score, 2) for seed, score in probe["baseline_published_flip_test"].items()}
    recipe = next((name for name, scores in baselines.items()
                   if {seed: round(scores[seed], 2) for seed in base} == base), None)
    if recipe is None:
        raise ValueError(f"{name}: its baseline {base} is no known recipe's published models ({sorted(baselines)})")
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for run in probe["runs"]:
        groups.setdefault(tuple(run["overrides"]), []).append(run)
    rows = []
    for overrides, runs in groups.items():
        scored = {str(run["data_seed"]): run["published_pckh50"] for run in runs if run.get("published_pckh50") is not None}
        differences = {seed: round(score - base[seed], 2) for seed, score in sorted(scored.items())}
        values = list(differences.values())
        # several variants in one file: name each by what its overrides set ("KEY=value" → "value")
        lever = LEVERS[name] + (f" [{'; '.join(o.split('=', 1)[-1].removesuffix(' (probe patch)') for o in overrides)}]"
                                    if len(groups) > 1 else "")
        rows.append({"lever": lever, "file": name, "baseline": recipe, "seeds_run": sorted(str(run["data_seed"]) for run in runs),
                     "published": scored, "minus_baseline": differences,
                     "mean": round(statistics.fmean(values), 2) if values else None,
                     "std": round(statistics.stdev(values), 2) if len(values) > 1 else None,
                     "decision": decision_of(probe)})
    return rows


def table(folder: Path = HERE) -> list[dict[str, Any]]:
    baselines = baseline_scores(folder)
    rows = [row for name, probe in probes(folder).items() for row in variants(name, probe, baselines)]
    return sorted(rows, key=lambda row: (BASELINES.index(row["baseline"]), row["file"]))


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["# The main job's levers (tuning data)", "",
             "configs/demo.toml's recipe, one change at a time, by `main_job_simulate.py` (`fedpose simulate` as users run it): "
             "the published model's PCKh@0.5 with flip test minus the baseline recipe's on the same data set (generator seeds "
             "7 / 8 / 9, never the reported seed 0; the shipped run seeds; fresh noise). Each probe's rule was fixed before its "
             "runs (most: adopt at ≥ +0.5 on average) and is in its file. Made by `main_job_levers.py`.", "",
             "| lever | against | seed 7 | seed 8 | seed 9 | mean ± std | verdict | file |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [f"{row['minus_baseline'][seed]:+.2f}" if seed in row["minus_baseline"] else
                 "diverged" if seed in row["seeds_run"] else "not run" for seed in ("7", "8", "9")]
        spread = f"{row['mean']:+.2f} ± {row['std']:.2f}" if row["std"] is not None else (
            f"{row['mean']:+.2f}" if row["mean"] is not None else "—")
        lines.append(f"| {row['lever']} | {row['baseline']} | {' | '.join(cells)} | {spread} | {row['decision']} | `{row['file']}` |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [row for row in rows if row["published"]]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(shown) + 1.6))
    for y, row in enumerate(shown):
        values = list(row["minus_baseline"].values())
        ax.scatter(values, [y] * len(values), s=18, color="0.55", zorder=2)
        ax.scatter([row["mean"]], [y], marker="D", s=40, color="tab:green" if row["mean"] >= 0.5 else "tab:red", zorder=3)
    for y, (before, row) in enumerate(zip([None, *shown], shown)):
        if before is None or before["baseline"] != row["baseline"]:  # each baseline recipe's probes under its name
            if before is not None:
                ax.axhline(y - 0.5, color="0.7", lw=0.6)
            ax.text(0.99, y - 0.35, f"against {row['baseline']}", transform=ax.get_yaxis_transform(), ha="right",
                    va="bottom", fontsize=7, color="0.35")
    ax.axvline(0, color="0.3", lw=0.8)
    ax.axvline(0.5, color="tab:green", lw=0.8, ls="--", label="+0.5: most probes' rule")
    ax.set(ylim=(len(shown) - 0.5, -0.5),  # the first lever on top
           xlabel="published PCKh@0.5 minus the baseline recipe's (flip test)\ndots: data seeds 7 / 8 / 9; diamond: their mean")
    ax.set_yticks(range(len(shown)), [row["lever"][:80] for row in shown], fontsize=7)
    ax.legend(fontsize=7, loc="lower left", title="The main job's levers on the tuning data", title_fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main() -> int:
    rows = table()
    OUT.with_suffix(".json").write_text(json.dumps({"what": "main_job_levers.py: the main job's probes on the tuning data, "
                                                    "paired with their baseline recipe by data seed", "rows": rows},
                                                   indent=1, ensure_ascii=False) + "\n")
    text = markdown(rows)
    OUT.with_suffix(".md").write_text(text)
    plot(rows, OUT.with_suffix(".png"))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
