"""How a public base's rotation augmentation changes what it knows of the sites' patients in bed.

The shipped bases (``checkpoints/public/``) were pre-trained with fedpose's default rotation
(``data.rotation = 30``: N(0, 30²) degrees clipped to ±30°), while HRNet's published recipe clips
the same draw at ±60° (``data.rotation_clip = 2``). The synthetic sites' patients in bed lie
tilted 40–60°, so the clip decides whether a public base has ever seen such a pose. This script
scores bases on datasets' test splits — whole, and split by the generator's ``lying`` flag — with
``fedpose eval`` (the documented command), and collects the main job's reports
(``runs/demo/coordinator/report.json``) of runs made from each base:

    python benchmarks/public_base/rotation_probe.py \\
        --base shipped=checkpoints/public/public-base-tiny_vit_test-128x96.pt \\
        --base rotation_clip_2=runs/public-bases/public-base-tiny_vit_test-128x96-rot2.pt \\
        --data main_job=data/synthetic-hospitals --data sweep_reported=DIR --data sweep_tuning=DIR \\
        --report rotation_clip_2:0=PATH --report rotation_clip_2:1=PATH ... \\
        --out benchmarks/public_base/rotation_probe.json

How the bases and datasets were made is recorded in ``--note`` (the commands run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

FEDPOSE = [sys.executable, "-m", "fedpose.cli"]


def pckh(checkpoint: Path, data: Path) -> float:
    out = subprocess.run([*FEDPOSE, "eval", "--checkpoint", str(checkpoint), "--data", str(data), "--json", "--device", "cpu"],
                         check=True, capture_output=True, text=True)
    return round(float(json.loads(out.stdout)["Mean"]), 2)


def subsets(test_dir: Path) -> dict[str, Path]:
    """The test split whole, and its records with and without a patient in bed (annotation json
    files beside the images, so ``fedpose eval`` finds them)."""
    records = json.loads((test_dir / "annotations.json").read_text())
    out = {"all": test_dir}
    for name, keep in (("in_bed", True), ("upright", False)):
        chosen = [r for r in records if bool(r.get("lying")) == keep]
        path = test_dir / f".rotation-probe-{name}.json"
        path.write_text(json.dumps(chosen))
        out[f"{name} ({len(chosen)})"] = path
    return out


def _mean(value: float | dict) -> float:
    return value["Mean"] if isinstance(value, dict) else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", action="append", required=True, help="NAME=CHECKPOINT")
    parser.add_argument("--data", action="append", required=True, help="NAME=DATASET_DIR (its test/ split is scored)")
    parser.add_argument("--report", action="append", default=[], help="BASE:SEED=REPORT_JSON of a main-job run")
    parser.add_argument("--note", action="append", default=[], help="how the bases, datasets and runs were made")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    bases = dict(item.split("=", 1) for item in args.base)
    datasets = dict(item.split("=", 1) for item in args.data)
    scores: dict[str, dict[str, dict[str, float]]] = {}
    for data_name, data_dir in datasets.items():
        parts = subsets(Path(data_dir) / "test")
        try:
            for base_name, checkpoint in bases.items():
                scores.setdefault(base_name, {})[data_name] = {part: pckh(Path(checkpoint), path) for part, path in parts.items()}
                print(base_name, data_name, scores[base_name][data_name], flush=True)
        finally:
            for path in parts.values():
                if path.is_file():
                    path.unlink()
    main_job: dict[str, dict[str, dict[str, float]]] = {}
    for item in args.report:
        key, path = item.split("=", 1)
        base_name, seed = key.split(":")
        report = json.loads(Path(path).read_text())
        curve = [round(float(r["pckh"]["Mean"]), 2) for r in report["rounds"]]
        main_job.setdefault(base_name, {})[seed] = {"round_0": round(float(_mean(report["initial_pckh"])), 2), "curve": curve,
                                                   "final": curve[-1], "gain": round(curve[-1] - float(_mean(report["initial_pckh"])), 2)}
    result = {
        "conditions": {"device": "cpu", "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                       "metric": "PCKh@0.5 (fedpose eval, MPII protocol, head boxes)", "notes": args.note},
        "bases": bases, "datasets": datasets, "pckh": scores, "main_job": main_job,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
