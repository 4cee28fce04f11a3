"""Federation benchmark: a real 3-site deployment on 127.0.0.1 (gRPC + TLS + SuperNode auth).

Measures, per round: wall time at the coordinator vs the sites' local compute time (goal: the
federation's overhead ≤ 15 % of a round), bytes down (global weights + basis) and up (Δ) per site,
and the basis payload per site for full (fp32 / fp16 / bf16) vs compact transport at the demo
model. Writes ``benchmarks/federation/results.json``.

    python benchmarks/federation/run.py [--rounds 3] [--config configs/demo.toml]

Overhead is reported two ways, because deployment starts a new ClientApp process per message:
``overhead_vs_slowest_site`` = 1 − (slowest site's local round time) / (round exchange time)
includes that process start (imports of torch/timm/opacus); ``clientapp_start_seconds`` measures
the start alone in a fresh process so the two can be told apart. A site's compute time never
leaves it (it grows with the realised batch sizes): the benchmark reads it from each site's local
diagnostics (``<state_dir>/rounds.jsonl``), which it can because all sites run on this machine. Timings on a shared 2-core
machine are noisy: the load average at the start and end is recorded with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = Path(__file__).with_name("results.json")


def clientapp_start_seconds() -> float:
    """Wall time of what every ClientApp process pays before training: Python + the app + torch/timm."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import sites.client_app, torch, timm, fedpose.model"], cwd=REPO, check=True)
    return time.perf_counter() - start


def deployment(config: Path, rounds: int, run_dir: Path, base_port: int) -> list[dict]:
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0")
    cmd = [sys.executable, "-m", "fedpose.cli", "deploy", "local", "--sites", "3", "--rounds", str(rounds), "--config", str(config),
           "--run-dir", str(run_dir), "--base-port", str(base_port)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    return json.loads((run_dir / "coordinator" / "history.json").read_text())["rounds"]


def site_compute_seconds(run_dir: Path) -> dict[int, dict[str, float]]:
    """round → site → seconds of local work, from each site's own diagnostics log."""
    from fedpose.federation.local_training import ROUND_LOG

    out: dict[int, dict[str, float]] = {}
    for state_dir in sorted((run_dir / "sites").iterdir()):
        log = state_dir / ROUND_LOG
        for line in log.read_text().splitlines() if log.exists() else []:
            entry = json.loads(line)
            if entry.get("seconds") is not None:
                out.setdefault(int(entry["round"]), {})[state_dir.name] = float(entry["seconds"])
    return out


def basis_bytes(config: Path) -> dict:
    """Per-site basis payload bytes, full (3 dtypes) vs compact, at the config's coordinator model."""
    import torch

    from fedpose.cli.simulate import resolve_federation
    from fedpose.federation.public_basis import compute_basis
    from fedpose.model import build_model

    federation, synthetic, _ = resolve_federation(config, [])
    coordinator = federation.coordinator
    public = coordinator.public_data or (Path(synthetic["dir"]) / "public" if synthetic else None)
    if public is None:
        return {"skipped": "no public data in the config"}
    torch.manual_seed(0)
    model = build_model(coordinator.model, tuple(coordinator.data.input_size))
    k, m = coordinator.basis.k, coordinator.basis.public_samples
    out = {"k": k, "public_samples": m, "trainable_parameters": model.num_trainable()}
    for transport, dtype in (("full", "float32"), ("full", "float16"), ("full", "bfloat16"), ("compact", "float32")):
        start = time.perf_counter()
        message = compute_basis(model, public, k=k, m=m, version=1, transport=transport, dtype=dtype)
        name = f"full_{dtype}" if transport == "full" else "compact"
        out[name] = {"bytes_per_site": message.nbytes, "coordinator_seconds": time.perf_counter() - start}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "demo.toml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--run-dir", type=Path, default=REPO / "runs" / "bench-federation")
    parser.add_argument("--base-port", type=int, default=9192)
    parser.add_argument("--from-run", action="store_true",
                        help="summarize the rounds already in --run-dir (e.g. a run stopped after its first long round) instead of deploying")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    load_before = os.getloadavg()
    start_seconds = clientapp_start_seconds()
    if args.from_run:
        rounds = json.loads((args.run_dir / "coordinator" / "history.json").read_text())["rounds"]
    else:
        if args.run_dir.exists():
            import shutil

            shutil.rmtree(args.run_dir)  # a benchmark always starts fresh (never resumes)
        rounds = deployment(args.config, args.rounds, args.run_dir, args.base_port)
    per_round = []
    local_seconds = site_compute_seconds(args.run_dir)
    for r in rounds:
        computes = local_seconds.get(int(r["round"]), {})
        slowest = max(computes.values()) if computes else 0.0
        per_round.append({
            "round": r["round"], "wall_seconds": r["wall_seconds"], "exchange_seconds": r["exchange_seconds"],
            "site_compute_seconds": computes,
            "overhead_vs_slowest_site": 1 - slowest / r["exchange_seconds"] if r["exchange_seconds"] else None,
            "overhead_excluding_clientapp_start": 1 - (slowest + start_seconds) / r["exchange_seconds"] if r["exchange_seconds"] else None,
            "bytes_down": {s: v.get("bytes_down") for s, v in r["sites"].items()},
            "bytes_up": {s: v.get("bytes_up") for s, v in r["sites"].items()},
            "basis_version": r.get("basis_version"), "basis_bytes_sent": r.get("basis_bytes"),
            "statuses": {s: v["status"] for s, v in r["sites"].items()},
        })
    results = {
        "conditions": {
            "config": str(args.config), "sites": 3, "rounds_measured": len(per_round), "from_existing_run": args.from_run, "transport": "gRPC (grpc-rere) + TLS + SuperNode auth, 127.0.0.1",
            "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
            "load_average_before": load_before, "load_average_after": os.getloadavg(),
            "note": "3 sites share 2 cores; the load averages say how busy the machine was",
        },
        "clientapp_start_seconds": start_seconds,
        "rounds": per_round,
        "basis": basis_bytes(args.config),
    }
    args.out.write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "rounds"}, indent=2))
    for r in per_round:
        print(f"round {r['round']}: exchange {r['exchange_seconds']:.1f} s, overhead vs slowest site {r['overhead_vs_slowest_site']:.1%}, "
              f"excluding ClientApp start {r['overhead_excluding_clientapp_start']:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
