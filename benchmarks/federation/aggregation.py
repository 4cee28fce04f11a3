"""Coordinator-side cost of one federated round, without Flower.

Part of the federation benchmark. Measures, for the real trainable-parameter layout of
tiny_vit_5m_224 + SimCC head at 256×192 (scenario "full": all parameters; "finetune": stage 3 +
LayerNorms + head):

* aggregation time for N simulated site updates: validation + streaming weighted FedAvg + one
  server-optimizer step (fedavg / fedavgm / fedadam), and peak traced memory (tracemalloc) for
  N = 10 and N = 100 — streaming keeps it independent of N;
* basis transport: bytes per site per refresh, full (fp32/fp16/bf16) vs compact recipe, and the
  cost of the basis math (Gram + eigh for the mixing matrix, Gᵀ·mix to build V — the latter is
  what a site pays per refresh in compact mode, on top of computing G), k = 50, m = 100.

Updates are random float32 arrays generated one at a time inside the stream (generation time is
measured separately and subtracted). Run: ``python benchmarks/federation/aggregation.py [--sites 100]``
→ ``benchmarks/federation/aggregation_results.json``. Timings are noisy on a shared 2-core box.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import tracemalloc
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fedpose.federation.aggregation import aggregate_round, build_server_optimizer
from fedpose.federation.basis_transport import BasisRecipe, apply_mixing, basis_mixing, encode_full
from fedpose.federation.config import AggregationConfig
from fedpose.io import atomic_write_json

OUT = Path(__file__).with_name("aggregation_results.json")
MIB = 2**20


def model_layout(scenario: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the trainable parameters (what sites send as Δ)."""
    from fedpose.config import ModelConfig
    from fedpose.model import build_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # finetune without init checkpoint: frozen weights random (irrelevant here)
        model = build_model(ModelConfig(backbone="tiny_vit_5m_224", scenario=scenario), (256, 192))
    return {name: tuple(p.shape) for name, p in model.trainable_parameters().items()}


def random_arrays(layout: dict[str, tuple[int, ...]], rng: np.random.Generator, scale: float) -> dict[str, np.ndarray]:
    return {name: rng.standard_normal(shape, dtype=np.float32) * np.float32(scale) for name, shape in layout.items()}


def site_stream(layout: dict[str, tuple[int, ...]], n_sites: int, seed: int, gen_seconds: list[float]) -> Iterator[tuple[str, dict[str, np.ndarray], float]]:
    """Lazily generated (site id, Δ, weight): one update alive at a time, like decoding replies."""
    rng = np.random.default_rng(seed)
    for i in range(n_sites):
        t0 = time.perf_counter()
        update = random_arrays(layout, rng, 1e-3)
        gen_seconds.append(time.perf_counter() - t0)
        yield f"site-{i:03d}", update, float(100 + i)


def time_round(layout: dict[str, tuple[int, ...]], n_sites: int, strategy: str) -> dict[str, float]:
    weights = random_arrays(layout, np.random.default_rng(0), 0.02)
    optimizer = build_server_optimizer(AggregationConfig(strategy=strategy))
    gen: list[float] = []
    t0 = time.perf_counter()
    result = aggregate_round(weights, site_stream(layout, n_sites, 1, gen), optimizer, max_norm=1e6)
    total = time.perf_counter() - t0
    assert len(result.accepted) == n_sites and result.weights is not None
    aggregation = total - sum(gen)
    return {"aggregation_s": round(aggregation, 3), "per_update_ms": round(1000 * aggregation / n_sites, 2),
            "update_generation_s_excluded": round(sum(gen), 3)}


def peak_memory(layout: dict[str, tuple[int, ...]], n_sites: int, strategy: str) -> float:
    weights = random_arrays(layout, np.random.default_rng(0), 0.02)
    optimizer = build_server_optimizer(AggregationConfig(strategy=strategy))
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    aggregate_round(weights, site_stream(layout, n_sites, 1, []), optimizer, max_norm=1e6)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return round((peak - base) / MIB, 1)


def basis_section(p: int, k: int = 50, m: int = 100) -> dict[str, object]:
    rng = np.random.default_rng(2)
    g = rng.standard_normal((m, p), dtype=np.float32)
    t0 = time.perf_counter()
    mixing = basis_mixing(g, k)
    mixing_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    basis = apply_mixing(g, mixing)
    apply_s = time.perf_counter() - t0
    del g
    full = {}
    for dtype in ("float32", "float16", "bfloat16"):
        t0 = time.perf_counter()
        message = encode_full(basis, 1, "w", dtype)  # type: ignore[arg-type]
        full[dtype] = {"bytes": message.nbytes, "MiB": round(message.nbytes / MIB, 1), "encode_s": round(time.perf_counter() - t0, 2)}
        del message
    recipe = BasisRecipe(1, "0" * 64, tuple(range(m)), mixing, "public-set-digest").encode()
    return {
        "p": p, "k": k, "m": m,
        "full": full,
        "compact_bytes": recipe.nbytes,
        "compact_fraction_of_full_fp32": recipe.nbytes / full["float32"]["bytes"],
        "compact_fraction_of_full_bf16": recipe.nbytes / full["bfloat16"]["bytes"],
        "gram_eigh_mixing_s": round(mixing_s, 2),
        "site_rebuild_V_from_G_s": round(apply_s, 2),
        "note": "compact mode also needs the site to compute G (m public per-sample gradients) itself: "
                "~11 s at 256x192 for p=2.88M per FACTS.md (not re-measured here)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sites", type=int, default=100)
    parser.add_argument("--scenarios", nargs="+", default=["full", "finetune"])
    parser.add_argument("--skip-basis", action="store_true")
    args = parser.parse_args()

    results: dict[str, object] = {
        "conditions": {
            "machine": f"{platform.machine()}, shared 2-core box (other test suites running: timings noisy)",
            "numpy": np.__version__, "sites": args.sites,
            "updates": "float32 Δ over the trainable parameters, generated one at a time (generation excluded)",
            "memory": "tracemalloc peak above baseline during aggregate_round (validation + streaming mean + server step); "
                      "global weights and inputs allocated before the baseline",
        },
        "aggregation": {},
    }
    for scenario in args.scenarios:
        layout = model_layout(scenario)
        params = int(sum(np.prod(s) for s in layout.values()))
        row: dict[str, object] = {"trainable_params": params, "arrays": len(layout),
                                  "update_MiB_fp32": round(4 * params / MIB, 1)}
        for strategy in ("fedavg", "fedavgm", "fedadam"):
            row[strategy] = time_round(layout, args.sites, strategy)
            print(f"[{scenario}] {strategy}: {row[strategy]}", flush=True)
        row["peak_MiB"] = {f"fedadam_{n}_sites": peak_memory(layout, n, "fedadam") for n in (10, args.sites)}
        row["naive_stack_MiB_for_reference"] = round(args.sites * 4 * params / MIB, 1)
        print(f"[{scenario}] peak memory: {row['peak_MiB']}", flush=True)
        results["aggregation"][scenario] = row  # type: ignore[index]
        atomic_write_json(OUT, results)
    if not args.skip_basis:
        finetune_p = int(sum(np.prod(s) for s in model_layout("finetune").values()))
        results["basis_transport"] = basis_section(finetune_p)
        print(f"[basis] {results['basis_transport']}", flush=True)
    atomic_write_json(OUT, results)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
