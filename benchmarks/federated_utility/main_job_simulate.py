"""The main job as users run it (``fedpose simulate --config configs/demo.toml``), on chosen data sets,
with both of its models scored: the round-2 iterate (``global.npz``) and the model the coordinator
publishes (its directory: ``global_ema.npz`` when ``coordinator.ema`` is on).

    python benchmarks/federated_utility/main_job_simulate.py --out FILE.json --data-seeds 10 11 12 \\
        [--set coordinator.ema.decay=0.5 ...] [--run-seed 0] [--scratch DIR] [--keep-going]

Each data set runs in its own scratch directory (``configs/demo.toml`` copied, ``checkpoints/`` linked,
the data generated there by the command itself), one run at a time, and is appended to FILE.json as
soon as it is scored, so a run cut short keeps what finished and a rerun skips the data sets done.
``--keep-going`` records a run that fails (``"failed"``, what it printed) and goes on with the next data
set; without it the first failure stops the script (a rerun skips recorded failures too). ``--run-seed
S`` adds the README's seed overrides (``coordinator.seed=S``, site I's ``train.seed = 100·S + I + 1``).
The decision rules these runs served are in the JSON files they wrote (``main_job_ema_cpu.json``);
this script only runs and scores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO / "configs" / "demo.toml"
#: a round line's PCKh as the coordinator prints it ("round   2 | PCKh@0.5 = 67.19 (moving average …")
ROUND_PCKH = re.compile(r"^round +(\d+) \| PCKh@0\.5 = ([0-9.]+)", re.MULTILINE)


def printed_curve(log: str) -> list[float]:
    """PCKh@0.5 of rounds 0, 1, … as the run printed them."""
    return [float(pckh) for _, pckh in sorted((int(r), p) for r, p in ROUND_PCKH.findall(log))]


def round_lines(log: str) -> list[str]:
    """The round lines a run printed, as printed."""
    return [line for line in log.splitlines() if line.startswith("round")]


def site_count(config: Path = DEMO_CONFIG) -> int:
    """How many ``[[sites]]`` the main job's config declares (each gets a seed override)."""
    return len(tomllib.loads(config.read_text())["sites"])


def seed_overrides(run_seed: int, sites: int) -> list[str]:
    """The README's seed-S overrides: the coordinator's seed and every site's sampling/noise seed."""
    return [f"coordinator.seed={run_seed}"] + [f"sites.{i}.train.seed={100 * run_seed + i + 1}" for i in range(sites)]


def score(fedpose: Path, checkpoint: Path, data: Path) -> float:
    """PCKh@0.5 of ``checkpoint`` on ``data`` (``fedpose eval --json``)."""
    out = subprocess.run([str(fedpose), "eval", "--checkpoint", str(checkpoint), "--data", str(data), "--json"],
                         check=True, capture_output=True, text=True).stdout
    return float(json.loads(out)["Mean"])


def failed_run(data_seed: int, overrides: list[str], done: subprocess.CompletedProcess, seconds: float) -> dict[str, Any]:
    """The record of a run ``fedpose simulate`` ended with an error (a variant that diverged: every
    update rejected by the coordinator's norm bound, say): what it printed, nothing scored."""
    return {"data_seed": data_seed, "overrides": overrides, "failed": f"fedpose simulate exited {done.returncode}",
            "printed_curve_pckh50": printed_curve(done.stdout),
            "round_lines": round_lines(done.stdout),
            "last_error": next((line for line in reversed(done.stderr.splitlines()) if line.startswith("fedpose: error")), None),
            "simulate_seconds_with_data": round(seconds, 1)}


def run_one(data_seed: int, overrides: list[str], scratch: Path, keep_going: bool = False) -> dict[str, Any]:
    """One ``fedpose simulate`` of the main job on generator seed ``data_seed``, scored."""
    fedpose = Path(sys.executable).with_name("fedpose")
    work = scratch / f"data-seed-{data_seed}"
    shutil.rmtree(work / "runs", ignore_errors=True)  # a run cut short: its budgets would refuse a restart
    (work / "configs").mkdir(parents=True, exist_ok=True)
    shutil.copy(DEMO_CONFIG, work / "configs" / "demo.toml")
    if not (work / "checkpoints").exists():
        (work / "checkpoints").symlink_to(REPO / "checkpoints")
    command = [str(fedpose), "simulate", "--config", "configs/demo.toml", "--set", f"synthetic.seed={data_seed}"]
    command += [arg for override in overrides for arg in ("--set", override)]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=work, capture_output=True, text=True, env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        if keep_going:
            return failed_run(data_seed, overrides, done, seconds)
        raise SystemExit(f"data seed {data_seed}: fedpose simulate exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    coordinator, test = work / "runs" / "demo" / "coordinator", work / "data" / "synthetic-hospitals" / "test"
    curve = printed_curve(done.stdout)
    iterate, published = score(fedpose, coordinator / "global.npz", test), score(fedpose, coordinator, test)
    return {"data_seed": data_seed, "overrides": overrides, "printed_curve_pckh50": curve,
            "round_lines": round_lines(done.stdout),
            "iterate_pckh50": round(iterate, 2), "published_pckh50": round(published, 2),
            "published_minus_iterate": round(published - iterate, 2), "gain_published": round(published - curve[0], 2),
            "gain_iterate": round(iterate - curve[0], 2), "simulate_seconds_with_data": round(seconds, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file, appended to as runs finish")
    parser.add_argument("--data-seeds", type=int, nargs="+", required=True, help="synthetic generator seeds, run in this order")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to fedpose simulate for every run (e.g. coordinator.ema.decay=0.5)")
    parser.add_argument("--run-seed", type=int, default=None, help="the README's seed-S overrides")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/fedpose_main_job_simulate"))
    parser.add_argument("--keep-going", action="store_true",
                        help="record a run that fails (e.g. a diverging variant) and go on with the next data set")
    args = parser.parse_args()
    overrides = args.overrides + (seed_overrides(args.run_seed, site_count()) if args.run_seed is not None else [])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = json.loads(args.out.read_text()) if args.out.is_file() else {
        "what": "configs/demo.toml run by `fedpose simulate` per data set; the round-2 iterate and the published model scored",
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}, "runs": []}
    for data_seed in args.data_seeds:
        if any(r["data_seed"] == data_seed and r["overrides"] == overrides for r in out["runs"]):
            print(f"data seed {data_seed}: done already", flush=True)
            continue
        result = run_one(data_seed, overrides, args.scratch, args.keep_going)
        out["runs"].append(result)
        args.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
        if "failed" in result:
            print(f"data seed {data_seed}: {result['failed']}: {result['last_error']}", flush=True)
            continue
        print(f"data seed {data_seed}: {result['printed_curve_pckh50']} iterate {result['iterate_pckh50']} "
              f"published {result['published_pckh50']} ({result['simulate_seconds_with_data']:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
