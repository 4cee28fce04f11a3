"""Per-sample cost of PoseDataset.__getitem__ on the real MPII / COCO files (train augmentation).

    python benchmarks/data_pipeline/run.py [--repeats 40] [--input-size 256 192]

Writes benchmarks/data_pipeline/results.json: median milliseconds per sample for each data set,
with and without the in-memory image cache, plus the median JPEG decode (full vs reduced).
Timings are wall-clock on whatever else the machine is running: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE.parents[2] / "shared" / "data"


def time_calls(fn, repeats: int) -> float:
    samples = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(i)
        samples.append(time.perf_counter() - start)
    return 1000.0 * statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--input-size", type=int, nargs=2, default=(256, 192), metavar=("H", "W"))
    args = parser.parse_args()

    from fedpose.data.dataset import PoseDataset, load_image, load_records
    from fedpose.io import atomic_write_json

    size = tuple(args.input_size)
    results: dict = {"input_size": list(size), "repeats": args.repeats, "ms_per_sample": {}}
    for name in ("mpii-real", "coco-real"):
        records, root = load_records(DATA / name)
        for cache in (False, True):
            dataset = PoseDataset(records, root, size, train=True, seed=0, cache_images=cache)
            for i in range(len(dataset)):
                dataset[i]  # warm the cache (and the OS file cache)
            ms = time_calls(lambda i: dataset[i % len(dataset)], args.repeats)
            results["ms_per_sample"][f"{name}{'+cache' if cache else ''}"] = round(ms, 2)
    records, root = load_records(DATA / "mpii-real")
    path = root / "images" / records[0].image
    zoom = size[0] / (200 * records[0].scale * 1.25)
    results["mpii_jpeg_decode_ms"] = {
        "full": round(time_calls(lambda i: load_image(path), args.repeats), 2),
        f"reduced(zoom={zoom:.3f})": round(time_calls(lambda i: load_image(path, zoom), args.repeats), 2),
    }
    atomic_write_json(HERE / "results.json", results)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
