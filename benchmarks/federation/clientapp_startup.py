"""What a site's ClientApp process spends loading before it answers: a SuperNode starts a fresh
process for every message (docs/deployment.md), so this is paid per stage and per round.

Two cases, each in fresh Python processes (the file cache warm after the first):
- ``secagg_stage``: ``import sites.client_app`` — all a secure-aggregation stage (setup, share keys,
  unmask) loads; torch must not be among it;
- ``train``: the same, then what the train handler does before its data work —
  ``start_training_threads()`` (torch's threads, flushing subnormals) and the training module.

    python benchmarks/federation/clientapp_startup.py [--repeats 7]
    → benchmarks/federation/clientapp_startup_results.json (median and range per case, conditions)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fedpose.runtime import cpu_model

REPO = Path(__file__).resolve().parents[2]
OUT = Path(__file__).with_name("clientapp_startup_results.json")

CASES = {
    "secagg_stage": "import sites.client_app",
    "train": "import sites.client_app as app; app.start_training_threads(); import fedpose.federation.local_training",
}


def timed_process(code: str) -> tuple[float, bool]:
    """Wall seconds of one fresh process running ``code`` (interpreter start included), and whether
    it had loaded torch."""
    probe = f"{code}\nimport sys; print('torch' in sys.modules)"
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True,
                         env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    return time.perf_counter() - started, out.stdout.strip().splitlines()[-1] == "True"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    timed_process(CASES["train"])  # warm the file cache once, not counted
    results = {}
    for name, code in CASES.items():
        runs = [timed_process(code) for _ in range(args.repeats)]
        seconds = [s for s, _ in runs]
        results[name] = {"median_seconds": round(statistics.median(seconds), 3), "min_seconds": round(min(seconds), 3),
                         "max_seconds": round(max(seconds), 3), "torch_loaded": runs[0][1], "code": code}
        print(f"{name}: median {results[name]['median_seconds']:.2f} s over {args.repeats} processes "
              f"(torch loaded: {runs[0][1]})", flush=True)
    report = {
        "what": "seconds a fresh ClientApp process spends loading before it answers (per message: docs/deployment.md)",
        "results": results,
        "conditions": {"repeats": args.repeats, "cpu": cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version(),
                       "load_before": [round(v, 2) for v in load_before], "load_after": [round(v, 2) for v in os.getloadavg()],
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
    }
    args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
