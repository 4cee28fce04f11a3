"""Does a site round's wall time reveal the data? (issue 24, item 3)

    python benchmarks/timing/run.py                       # 5 rounds per condition, 3 local steps
    python benchmarks/timing/run.py --rounds 5 --steps 3 --batch 2 --sample-rate 0.0833333 --max-records-per-unit 1  # results.json

Writes benchmarks/timing/results.json. Method:
* the real site round (``fedpose.federation.local_training.run_site_round``, no Flower) on the
  tiny test model (tiny_vit_test, 64×64 synthetic data), DP-SGD, the same declared settings
  (B, q, caps, steps) for four datasets: the auditor's N = 16 vs N = 96 records, and 96 records
  whose first 48 are one patient ("large patient present") vs the other 48 alone ("absent");
* three modes: ``round`` (this code: a site's round does fixed work, its steps whole chunks and
  the last one the round's spare), ``step`` (every step padded to the fixed step shape, what sites
  did until 2026-12-04: the hook drops the engine's round) and ``unpadded`` (each step computes
  only the sampled rows, what main did before fixed-shape steps: the engine's ``fixed_shape_rows``
  is replaced by one that drops the padding), so the padding's cost and the leak it closes are
  measured on the same machine in the same run;
* rounds run round-robin over (mode, dataset), rotated each round, so slow phases of a shared
  machine and the cost of switching hit all alike;
  each round's wall time is split into its steps (timed around ``engine.step``, data loading of the
  batch included) and the rest (budget, data loading and image check, unit index, model build);
* reported per (mode, dataset): median and range of round, step and outside-step seconds; and per
  mode the ratio of the medians N = 96 / N = 16 and present / absent. The load average at start
  and end is recorded: on a shared 2-core machine numbers are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

from fedpose.federation.local_training import run_site_round  # noqa: E402
from fedpose.privacy.engine import SPARE_ROWS_KEY  # noqa: E402
from site_round_helpers import INPUT_SIZE, global_model, site_config  # noqa: E402

LARGE_PATIENT = 48


def make_datasets(root: Path) -> dict[str, Path]:
    from fedpose.data.synthetic import ensure_dataset

    ensure_dataset(root / "synthetic", sites=1, per_site=96, public=4, test=4, size=INPUT_SIZE, seed=0, progress=False)
    source = root / "synthetic" / "site-1"
    records = json.loads((source / "annotations.json").read_text())

    def subset(name: str, chosen: list[dict], large: bool = False) -> Path:
        target = root / name
        chosen = [dict(r) for r in chosen]
        if large:
            for record in chosen[:LARGE_PATIENT]:
                record["patient_id"] = "large-patient"
        for record in chosen:
            (target / record["image"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source / record["image"], target / record["image"])
        (target / "annotations.json").write_text(json.dumps(chosen))
        return target

    return {"n16": subset("n16", records[:16]), "n96": subset("n96", records),
            "large_present": subset("present", records, large=True), "large_absent": subset("absent", records[LARGE_PATIENT:])}


def hook_for(mode: str, step_seconds: list[float], real_rows: list[int], rows: list[int]):
    def hook(engine: Any) -> None:
        step = engine.step
        if mode == "step":
            engine.round_steps, engine.round = None, None
        if mode == "unpadded":
            def real_only(sampled: list[int], slots: list[int], num_slots: int | None = None) -> tuple[list[int], list[int], list[bool]]:
                if not sampled:  # main computed no rows here; one masked row stands in (the engine needs a row)
                    return [0], [0], [False]
                return list(sampled), list(slots), [True] * len(sampled)

            engine.fixed_shape_rows = real_only
        batches = engine.batches

        def timed_batches(dataset: Any) -> Any:
            stream = batches(dataset)
            while True:
                started = time.perf_counter()
                batch = next(stream)
                timed_batches.loading = time.perf_counter() - started
                yield batch

        def timed_step(model: Any, batch: dict) -> dict:
            started = time.perf_counter()
            metrics = step(model, batch)
            step_seconds.append(time.perf_counter() - started + getattr(timed_batches, "loading", 0.0))
            real_rows.append(int(metrics["batch_size"]))
            rows.append(int(batch["image"].shape[0]) + len(batch.get(SPARE_ROWS_KEY, ())))  # the last step's spare too
            return metrics

        engine.batches, engine.step = timed_batches, timed_step

    return hook


def summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--sample-rate", type=float, default=1 / 6, help="declared q (24 patients at N = 96: 4 per batch)")
    parser.add_argument("--max-records-per-unit", type=int, default=4)
    parser.add_argument("--max-batch-units", type=int, default=None, help="default: from --batch (fedpose.privacy.fixed_shape)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load_start = [round(x, 2) for x in os.getloadavg()]
    weights = global_model()
    modes, names = ("round", "step", "unpadded"), ("n16", "n96", "large_present", "large_absent")
    raw: dict[str, dict[str, dict[str, list]]] = {m: {n: {"round": [], "steps": [], "round_steps": [], "outside": [], "real_rows": [], "rows": []}
                                                      for n in names} for m in modes}
    with tempfile.TemporaryDirectory(prefix="timing-bench-") as tmp:
        data = make_datasets(Path(tmp))
        conditions = [(mode, name) for mode in modes for name in names]
        for round_id in range(1, args.rounds + 1):
            # rotated each round: whichever condition runs first after the last one pays for the switch
            shift = (round_id - 1) % len(conditions)
            for mode, name in conditions[shift:] + conditions[:shift]:
                site = site_config(data[name].parent, Path(tmp) / "state" / mode / name, eps_max=1e6, local_steps=args.steps,
                                   sample_rate=args.sample_rate, max_records_per_unit=args.max_records_per_unit,
                                   max_batch_units=args.max_batch_units)
                site = site.model_copy(update={"data": site.data.model_copy(update={"train": str(data[name])}),
                                               "train": site.train.model_copy(update={"batch_size": args.batch})})
                steps: list[float] = []
                entry = raw[mode][name]
                started = time.perf_counter()
                result = run_site_round(site, "bench", round_id, weights[0], weights[1], args.steps,
                                        engine_hook=hook_for(mode, steps, entry["real_rows"], entry["rows"]))
                seconds = time.perf_counter() - started
                if result.reply.status != "ok":
                    raise RuntimeError(f"{mode}/{name} round {round_id}: {result.reply}")
                entry["round"].append(seconds)
                entry["steps"].extend(steps)
                entry["round_steps"].append(sum(steps))
                entry["outside"].append(seconds - sum(steps))
                print(f"{mode:9s} {name:14s} round {round_id}: {seconds:.3f} s (steps {sum(steps):.3f} s)", flush=True)
    results: dict[str, Any] = {}
    for mode in modes:
        per = {}
        for name in names:
            entry = raw[mode][name]
            per[name] = {"round_seconds": summary(entry["round"]), "step_seconds": summary(entry["steps"]),
                         "steps_seconds_per_round": summary(entry["round_steps"]),
                         "outside_step_seconds": summary(entry["outside"]),
                         "rows_per_step": sorted(set(entry["rows"])), "real_rows_per_step": summary(entry["real_rows"])}
        median = {name: per[name]["round_seconds"]["median"] for name in names}
        step_median = {name: per[name]["step_seconds"]["median"] for name in names}
        steps_median = {name: per[name]["steps_seconds_per_round"]["median"] for name in names}
        per["ratios"] = {"round_n96_over_n16": round(median["n96"] / median["n16"], 3),
                         "round_present_over_absent": round(median["large_present"] / median["large_absent"], 3),
                         "round_steps_n96_over_n16": round(steps_median["n96"] / steps_median["n16"], 3),
                         "round_steps_present_over_absent": round(steps_median["large_present"] / steps_median["large_absent"], 3),
                         "step_n96_over_n16": round(step_median["n96"] / step_median["n16"], 3),
                         "step_present_over_absent": round(step_median["large_present"] / step_median["large_absent"], 3)}
        results[mode] = per
    # what padding costs: a round's DP steps, against the same round unpadded
    results["padding_cost"] = {
        mode: {name: round(results[mode][name]["steps_seconds_per_round"]["median"]
                           / results["unpadded"][name]["steps_seconds_per_round"]["median"], 2) for name in names}
        for mode in ("round", "step")
    }
    output = {
        "conditions": {
            "model": "tiny_vit_test (scratch)", "input_size": list(INPUT_SIZE), "mechanism": "dpsgd", "unit": "patient (auto)",
            "batch_size": args.batch, "sample_rate": args.sample_rate, "max_records_per_unit": args.max_records_per_unit,
            "max_batch_units": args.max_batch_units,
            "local_steps": args.steps, "rounds": args.rounds, "threads": 1, "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "load_average_start": load_start,
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "results": results,
        "raw": raw,
    }
    args.out.write_text(json.dumps(output, indent=1) + "\n")
    print(json.dumps({"ratios": {m: results[m]["ratios"] for m in modes}, "padding_cost": results["padding_cost"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
