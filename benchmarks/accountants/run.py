"""σ needed for a target ε, RDP vs PLD, at the demo's and the mechanisms benchmark's (q, steps, δ).

    python benchmarks/accountants/run.py            # → benchmarks/accountants/results.json

For each setting, neighbouring relation (add/remove: dpsgd, pdp; replace-one: fdp, fpdp, maskdp;
replace-one with visible membership: FDP-family budgets written before 2026-11-27) and target
ε ∈ {0.8, 2, 8}: the smallest σ (to 0.5 %,
``noise_multiplier_for``) under each accountant, the ε each accountant gives at the PLD σ, and the
noise saved (for replace-one, RDP has only the visible-membership curve, a valid but loose bound,
so its "saving" is the gain of hiding the batch membership too). Settings are read from the configs
they describe, so the numbers follow them.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import tomllib
from pathlib import Path

from fedpose.privacy.accountant import epsilon_for, noise_multiplier_for
from fedpose.privacy.accountants import ADD_REMOVE, REPLACE_ONE, REPLACE_PUBLIC_MEMBERSHIP

ROOT = Path(__file__).resolve().parents[2]
TARGETS = (0.8, 2.0, 8.0)
ACCOUNTANTS = ("rdp", "pld")


def settings() -> list[dict]:
    demo = tomllib.loads((ROOT / "configs" / "demo.toml").read_text())
    site = demo["sites"][0]
    rounds = int(demo["coordinator"]["rounds"])
    mech = json.loads((ROOT / "benchmarks" / "mechanisms" / "results.json").read_text())
    mech_run = next(r for r in mech["runs"] if r["mechanism"] == "dpsgd")
    return [
        {"name": "demo (configs/demo.toml: a site's whole run)", "sample_rate": float(site["privacy"]["sample_rate"]),
         "steps": rounds * int(site["local_steps"]), "delta": float(site["privacy"]["delta"])},
        {"name": "mechanisms benchmark (benchmarks/mechanisms/results.json)", "sample_rate": float(mech_run["sample_rate"]),
         "steps": int(mech_run["steps"]), "delta": float(mech["conditions"]["delta"])},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    for setting in settings():
        q, steps, delta = setting["sample_rate"], setting["steps"], setting["delta"]
        for relation in (ADD_REMOVE, REPLACE_ONE, REPLACE_PUBLIC_MEMBERSHIP):
            for target in TARGETS:
                sigma = {a: noise_multiplier_for(target, q, steps, delta, relation=relation, accountant=a) for a in ACCOUNTANTS}
                at_pld_sigma = {a: epsilon_for(sigma["pld"], q, steps, delta, relation=relation, accountant=a)[0]
                                for a in ACCOUNTANTS}
                row = {"setting": setting["name"], "sample_rate": q, "steps": steps, "delta": delta,
                       "neighbouring_relation": relation, "target_epsilon": target,
                       "sigma_rdp": sigma["rdp"], "sigma_pld": sigma["pld"],
                       "noise_saved_percent": 100 * (1 - sigma["pld"] / sigma["rdp"]),
                       "epsilon_at_sigma_pld": at_pld_sigma}
                rows.append(row)
                print(f"{setting['name'][:22]:22s} {relation:26s} ε={target:<4g} σ_RDP={sigma['rdp']:.4f} "
                      f"σ_PLD={sigma['pld']:.4f} saved {row['noise_saved_percent']:.1f} %", flush=True)
    results = {
        "what": "smallest noise multiplier σ (to 0.5 %) whose ε ≤ target, by accountant; guarantee (ε, δ)-DP for "
                "add_remove (dpsgd, pdp), (ε, δ)-FDP/MaskDP for replace_one (fdp, fpdp, maskdp) and for "
                "replace_public_membership (FDP-family budgets written before 2026-11-27)",
        "accountants": {"rdp": "dp-accounting RDP (orders up to 1024, Balle et al. 2020 conversion); replace_one: the "
                               "replace_public_membership curve (a valid, loose bound)",
                        "pld": "dp-accounting PLD (add_remove, replace_one: pessimistic, grid 1e-4); closed form "
                               "(replace_public_membership)"},
        "conditions": {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                       "seconds": round(time.perf_counter() - started, 1)},
        "rows": rows,
    }
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out} in {results['conditions']['seconds']} s")


if __name__ == "__main__":
    main()
