"""How often a correct claim fails the CI audit test by chance: the tail of ε_lower under fresh noise.

    python benchmarks/audit/false_alarm.py [--runs 3000] [--real 0] → benchmarks/audit/false_alarm.json

`tests/test_audit.py` asserts ε_lower ≤ ε for FDP and MaskDP at a correct claim of ε 2 (replace_one,
q = 4/16, 10 steps, 1000 white-box canaries, canary seed 0, 95 % confidence). The bound holds with
probability ≥ 95 % for *any* mechanism meeting the claim; this script measures how far below that the
test's own false-alarm rate is, so that a red run can be told apart from a leak.

* **simulated** (``--runs``): the audit's own pieces without the model — :class:`CanarySet` (the test's
  seed: the same inclusion coins, directions and sampling coins as every CI run), :class:`SecureNoise`
  at the test's σ, and :func:`best_lower_bound`. The audit subtracts the data's part of every release
  exactly (``audit_data_release``), so the scores are the canaries' sum plus the noise whatever the
  model: this is the distribution of the test's ε_lower under a correct implementation.
* **real** (``--real``): the test's private audit run end to end through central training (the real
  engine and data, fresh noise each run), as a check that the simulation is the real distribution.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))  # the CI test's setting and config builder, never copied

from site_round_helpers import BATCH_SIZE, PER_SITE, make_site_data  # noqa: E402
from test_audit import STEPS, central_config  # noqa: E402

from fedpose.audit import DEFAULT_CANARIES as CANARIES, DEFAULT_CONFIDENCE as CONFIDENCE, audit_central  # noqa: E402
from fedpose.io import atomic_write_json  # noqa: E402
from fedpose.privacy.accountant import epsilon_for, noise_multiplier_for  # noqa: E402
from fedpose.privacy.accountants.base import REPLACE_ONE  # noqa: E402
from fedpose.privacy.audit_bound import best_lower_bound  # noqa: E402
from fedpose.privacy.canaries import CanarySet  # noqa: E402
from fedpose.privacy.noise import SecureNoise  # noqa: E402

#: the rest of the test's setting: its claim and δ, q of the test's site (records per step / records),
#: and audit_central's default canary seed, which the test keeps (the same coins in every CI run)
TARGET_EPSILON, DELTA, SAMPLE_RATE, CANARY_SEED = 2.0, 1e-5, BATCH_SIZE / PER_SITE, 0
#: coordinates per canary block: any block size gives the same scores (isotropic noise, orthonormal directions)
BLOCK = 4


def simulated_lower_bound(sigma: float, noise: SecureNoise) -> float:
    canaries = CanarySet.create(CANARIES, CANARIES * BLOCK, REPLACE_ONE, 1.0, SAMPLE_RATE, CANARY_SEED, releases=STEPS)
    scores = np.zeros(CANARIES)
    for step in range(STEPS):
        release = canaries.step_gradient(step) + noise.normal(CANARIES * BLOCK, sigma)  # in units of C (B cancels)
        scores += canaries.scores(release, step)
    return best_lower_bound(scores, canaries.included, DELTA, CONFIDENCE).epsilon_lower


def real_lower_bounds(runs: int, mechanism: str) -> list[float]:
    root = make_site_data(Path(tempfile.mkdtemp(prefix="fedpose-false-alarm-")))
    config = central_config(root, mechanism=mechanism, target_epsilon=TARGET_EPSILON)
    return [float(audit_central(config).to_dict()["epsilon_lower"]) for _ in range(runs)]


def summary(values: list[float], claimed: float) -> dict:
    array = np.asarray(values)
    return {"runs": int(array.size), "mean": float(array.mean()), "std": float(array.std()),
            "quantiles": {q: float(np.quantile(array, float(q))) for q in ("0.5", "0.9", "0.99", "0.999")},
            "max": float(array.max()), "above_claim": int((array > claimed).sum()),
            "at_least_1.5": int((array >= 1.5).sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3000, help="simulated audits")
    parser.add_argument("--real", type=int, default=0, help="real audits (central training, ~20 s each)")
    parser.add_argument("--mechanism", default="fdp", choices=("fdp", "maskdp"))
    parser.add_argument("--out", type=Path, default=HERE / "false_alarm.json")
    args = parser.parse_args()

    sigma = noise_multiplier_for(TARGET_EPSILON, SAMPLE_RATE, STEPS, DELTA, relation=REPLACE_ONE, accountant="pld")
    claimed, _ = epsilon_for(sigma, SAMPLE_RATE, STEPS, DELTA, relation=REPLACE_ONE, accountant="pld")
    started = time.time()
    noise = SecureNoise()
    simulated = []
    for run in range(args.runs):
        simulated.append(simulated_lower_bound(sigma, noise))
        if (run + 1) % 500 == 0:
            print(f"simulated {run + 1}/{args.runs}: max ε_lower so far {max(simulated):.3f}", flush=True)
    simulated_seconds = time.time() - started
    result = {
        "what": "ε_lower of the CI test's audit at a correct FDP/MaskDP claim, under fresh noise: how often a correct "
                "implementation fails it by chance",
        "setting": {"claimed_epsilon": claimed, "delta": DELTA, "relation": REPLACE_ONE, "accountant": "pld",
                    "noise_multiplier": sigma, "sample_rate": SAMPLE_RATE, "steps": STEPS, "canaries": CANARIES,
                    "canary_seed": CANARY_SEED, "confidence": CONFIDENCE,
                    "test": "tests/test_audit.py::test_feature_dp_audit_fires_without_noise_and_stays_below_a_correct_claim"},
        "simulated": {**summary(simulated, claimed), "seconds": round(simulated_seconds, 1)},
        "conditions": {"machine": platform.machine(), "processor": platform.processor() or None, "cpus": os.cpu_count(),
                       "date": time.strftime("%Y-%m-%d"), "noise": SecureNoise.description},
    }
    if args.real:
        started = time.time()
        real = real_lower_bounds(args.real, args.mechanism)
        result["real"] = {**summary(real, claimed), "mechanism": args.mechanism, "seconds": round(time.time() - started, 1)}
    atomic_write_json(args.out, result)
    print(json.dumps({key: result[key] for key in ("simulated", "real") if key in result}, indent=1))


if __name__ == "__main__":
    main()
