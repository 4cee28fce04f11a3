"""Synthetic-data generation speed: a full dataset end to end, plus a per-image cost breakdown.

    python benchmarks/synth_speed/run.py                 # 10 000 images at 256x192, 2 workers
    python benchmarks/synth_speed/run.py --images 2000 --workers 1 2

Writes benchmarks/synth_speed/results.json. The machine is shared: the 1-minute load average
before and after each run is recorded next to the timings, since other jobs slow it down.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from fedpose.data.synthetic import SplitSpec, generate_dataset, render_example
from fedpose.io import atomic_write_json

HERE = Path(__file__).resolve().parent


def split_counts(images: int, sites: int) -> dict[str, int]:
    """public 30 %, test 10 %, the rest shared by the sites."""
    public, test = int(images * 0.3), int(images * 0.1)
    per_site = (images - public - test) // sites
    return {"public": public, "test": images - public - per_site * sites, "per_site": per_site, "sites": sites}


def per_image_breakdown(size: tuple[int, int], count: int) -> dict[str, float]:
    spec = SplitSpec("site-1", count, "site", 1)
    """CPU time (process_time: unaffected by other jobs waiting for the CPU) and wall time per image."""
    render_cpu, encode_cpu, wall, png_bytes = [], [], [], []
    for i in range(count):
        w0, t0 = time.perf_counter(), time.process_time()
        image, _ = render_example(0, spec, i, size, n_sites=3)
        t1 = time.process_time()
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="PNG", compress_level=1)
        t2 = time.process_time()
        render_cpu.append(t1 - t0)
        encode_cpu.append(t2 - t1)
        wall.append(time.perf_counter() - w0)
        png_bytes.append(buf.tell())
    cpu_per_image = float(np.mean(render_cpu) + np.mean(encode_cpu))
    return {
        "images": count,
        "render_cpu_ms_mean": round(1000 * float(np.mean(render_cpu)), 2),
        "png_encode_cpu_ms_mean": round(1000 * float(np.mean(encode_cpu)), 2),
        "wall_ms_mean": round(1000 * float(np.mean(wall)), 2),
        "png_kib_mean": round(float(np.mean(png_bytes)) / 1024, 1),
        # What 2 processes on 2 otherwise idle cores would do (process start-up not included).
        "projected_seconds_per_10k_images_2_idle_cores": round(10_000 * cpu_per_image / 2, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--size", type=int, nargs=2, default=(256, 192), metavar=("H", "W"))
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--breakdown", type=int, default=100, help="images for the single-process breakdown")
    args = parser.parse_args()
    size = tuple(args.size)
    counts = split_counts(args.images, args.sites)
    results = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "note": "shared machine: other jobs were running; see load averages",
        "size_hw": list(size),
        "counts": counts,
        "runs": [],
    }
    results["breakdown"] = per_image_breakdown(size, args.breakdown)
    print("per-image:", results["breakdown"], flush=True)
    for workers in args.workers:
        out = Path(tempfile.mkdtemp(prefix="synth_speed_"))
        try:
            load_before = os.getloadavg()[0]
            t0 = time.perf_counter()
            generate_dataset(out / "ds", size=size, seed=0, workers=workers, progress=True, **counts)
            seconds = time.perf_counter() - t0
            disk = sum(p.stat().st_size for p in (out / "ds").rglob("*") if p.is_file())
        finally:
            shutil.rmtree(out, ignore_errors=True)
        run = {
            "workers": workers, "images": args.images, "seconds": round(seconds, 1),
            "images_per_second": round(args.images / seconds, 1),
            "seconds_per_10k_images": round(seconds * 10_000 / args.images, 1),
            "dataset_mib": round(disk / 2**20, 1),
            "load_average_1min_before": round(load_before, 2), "load_average_1min_after": round(os.getloadavg()[0], 2),
        }
        print(run, flush=True)
        results["runs"].append(run)
    atomic_write_json(HERE / "results.json", results)


if __name__ == "__main__":
    main()
