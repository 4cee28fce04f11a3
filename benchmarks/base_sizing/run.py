"""Compute facts that size issue 26's public pre-training and sweep: step time per backbone and
trainable set, non-private and per-sample DP, and the cost of synthetic images.

    python benchmarks/base_sizing/run.py                       # 128×96, batch 40, 1 torch thread
    python benchmarks/base_sizing/run.py --repeats 5 --images 400

Writes benchmarks/base_sizing/results.json. Method: the step is
:func:`benchmarks.step_cost.run.timed_step` on a fixed batch of exactly B random images (speed does
not depend on pixel values or weights); per (backbone, scenario) one warm-up step per mechanism,
then ``--repeats`` round-robin steps of "none" (plain autograd) and "dpsgd" (per-sample
gradients, clipping, secure noise: the existing engine). Wall and process-CPU seconds are both
recorded: on a shared machine the wall time is inflated by the load (recorded), the CPU time much
less so — plan with the CPU time on an idle machine, quote wall times only with their load.
Synthetic images: ``generate_dataset`` with one worker, end to end (render + PNG + manifest).
How the splits differ (``--split-images`` per split, 10 sites): from the generated annotations
and pixels, each split's pose-family and background mix, mean RGB and brightness spread, and the
total-variation distance of the mixes between the public split and each site and between sites.
What that means for learning is measured in benchmarks/learnability (public-only model vs the
same model fine-tuned on a site, on that site's test distribution).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "step_cost"))

from run import RandomPoseSet, load_average, privacy_config, timed_step  # noqa: E402  (step_cost's helpers)

from fedpose.config import ModelConfig  # noqa: E402
from fedpose.io import atomic_write_json  # noqa: E402
from fedpose.model import build_model  # noqa: E402
from fedpose.privacy.engine import build_engine, collate  # noqa: E402
from fedpose.runtime import cpu_model  # noqa: E402

#: (backbone, scenario) pairs probed by default: the test backbone, the product's (finetune and full),
#: and the registered middle-sized candidate for the sweep's base
DEFAULT_MODELS = ("tiny_vit_test:full", "tiny_vit_mid:full", "tiny_vit_mid:finetune",
                  "tiny_vit_5m_224:finetune", "tiny_vit_5m_224:full")


def probe_model(backbone: str, scenario: str, size: tuple[int, int], batch_size: int, repeats: int) -> dict:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model(ModelConfig(backbone=backbone, scenario=scenario), size)
    data = RandomPoseSet(4 * batch_size, size)
    batch = collate([data[i] for i in range(batch_size)])
    engines = {name: build_engine(privacy_config(name, 1, 1), model, len(data), batch_size, 10, None, 0)
               for name in ("none", "dpsgd")}
    for engine in engines.values():
        timed_step(engine, model, batch, torch.device("cpu"))
    wall: dict[str, list[float]] = {name: [] for name in engines}
    cpu: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            _, seconds, cpu_seconds = timed_step(engine, model, batch, torch.device("cpu"))
            wall[name].append(round(seconds, 3))
            cpu[name].append(round(cpu_seconds, 3))
    total = sum(p.numel() for p in model.parameters())
    result = {
        "backbone": backbone, "scenario": scenario, "parameters": total, "trainable_parameters": model.num_trainable(),
        "wall_seconds_per_step": {n: statistics.median(t) for n, t in wall.items()},
        "cpu_seconds_per_step": {n: statistics.median(t) for n, t in cpu.items()},
        "all_wall_seconds": wall, "all_cpu_seconds": cpu,
    }
    result["dpsgd_cpu_ratio"] = round(result["cpu_seconds_per_step"]["dpsgd"] / result["cpu_seconds_per_step"]["none"], 3)
    print(f"{backbone}:{scenario} p={result['trainable_parameters']:,}/{total:,} cpu s/step {result['cpu_seconds_per_step']} "
          f"wall {result['wall_seconds_per_step']} load {load_average()}", flush=True)
    return result


def probe_synthetic(images: int, size: tuple[int, int]) -> dict:
    from fedpose.data.synthetic import generate_dataset

    out = Path(tempfile.mkdtemp(prefix="base-sizing-synth-"))
    try:
        public, test = images // 2, images // 4
        per_site = (images - public - test) // 2
        wall0, cpu0 = time.perf_counter(), time.process_time()
        generate_dataset(out / "data", sites=2, per_site=per_site, public=public, test=test, size=size, seed=0,
                         workers=1, progress=False)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        shutil.rmtree(out, ignore_errors=True)
    n = public + test + 2 * per_site
    return {"images": n, "size_hw": list(size), "workers": 1, "wall_seconds": round(wall, 2), "cpu_seconds": round(cpu, 2),
            "cpu_ms_per_image": round(1000 * cpu / n, 2), "wall_ms_per_image": round(1000 * wall / n, 2)}


def _mix(records: list[dict], key: str) -> dict[str, float]:
    counts: dict[str, int] = {}
    for record in records:
        counts[record[key]] = counts.get(record[key], 0) + 1
    return {name: round(n / len(records), 3) for name, n in sorted(counts.items())}


def _tv(a: dict[str, float], b: dict[str, float]) -> float:
    return round(0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b)), 3)


def probe_split_differences(images: int, size: tuple[int, int], sites: int = 10) -> dict:
    import json

    import numpy as np
    from PIL import Image

    from fedpose.data.synthetic import generate_dataset

    out = Path(tempfile.mkdtemp(prefix="base-sizing-splits-"))
    try:
        generate_dataset(out / "data", sites=sites, per_site=images, public=images, test=1, size=size, seed=0,
                         workers=1, progress=False)
        splits: dict[str, dict] = {}
        for name in ["public"] + [f"site-{k}" for k in range(1, sites + 1)]:
            records = json.loads((out / "data" / name / "annotations.json").read_text())
            pixels = np.stack([np.asarray(Image.open(out / "data" / name / r["image"]).convert("RGB"), dtype=np.float64)
                               for r in records])
            splits[name] = {"pose_family": _mix(records, "pose_family"), "background": _mix(records, "background"),
                            "mean_rgb": [round(float(c), 1) for c in pixels.mean(axis=(0, 1, 2))],
                            "image_brightness_std": round(float(pixels.mean(axis=(1, 2, 3)).std()), 1)}
    finally:
        shutil.rmtree(out, ignore_errors=True)
    site_names = [n for n in splits if n != "public"]
    tv = {key: {"public_vs_site": {n: _tv(splits["public"][key], splits[n][key]) for n in site_names},
                "site_vs_site_mean": round(float(np.mean([_tv(splits[a][key], splits[b][key])
                                                          for i, a in enumerate(site_names) for b in site_names[i + 1:]])), 3)}
          for key in ("pose_family", "background")}
    return {"images_per_split": images, "size_hw": list(size), "splits": splits, "total_variation": tv}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, nargs=2, default=(128, 96), metavar=("H", "W"))
    parser.add_argument("--batch", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per mechanism (after 1 warm-up)")
    parser.add_argument("--models", nargs="*", default=list(DEFAULT_MODELS),
                        help="backbone:scenario pairs (none: keep the step times already in --out)")
    parser.add_argument("--images", type=int, default=200, help="synthetic images to generate (0: skip)")
    parser.add_argument("--split-images", type=int, default=0, help="images per split for the split comparison (0: skip)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=HERE / "results.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    size = tuple(args.size)
    started_load = load_average()
    results: dict = {"conditions": {
        "input_size_hw": list(size), "batch_size": args.batch, "torch_threads": torch.get_num_threads(),
        "timed_steps_per_mechanism": args.repeats, "torch": torch.__version__, "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(), "load_average_start": started_load,
        "note": "random images and weights; 'none' = plain autograd, 'dpsgd' = the engine's per-sample clip + secure noise",
    }, "models": []}
    if not args.models and args.out.exists():  # only the data probes: keep the step times measured before
        import json

        previous = json.loads(args.out.read_text())
        results.update({key: previous[key] for key in ("conditions", "models", "synthetic") if key in previous})
    for pair in args.models:
        backbone, scenario = pair.split(":")
        results["models"].append(probe_model(backbone, scenario, size, args.batch, args.repeats))
        atomic_write_json(args.out, results)
    if args.images:
        results["synthetic"] = probe_synthetic(args.images, size)
        print(f"synthetic: {results['synthetic']}", flush=True)
    if args.split_images:
        started = load_average()
        results["split_differences"] = probe_split_differences(args.split_images, size)
        results["split_differences"]["load_average_start_end"] = [started, load_average()]
        print(f"split differences: {results['split_differences']['total_variation']}", flush=True)
    if args.models:
        results["conditions"]["load_average_end"] = load_average()
    atomic_write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
