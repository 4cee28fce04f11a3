"""What distributed noise under secure aggregation would buy: σ and the noise in the federated mean.

    python benchmarks/distributed_noise/run.py     # → results.json, results.md (a few seconds)

Today each site adds its own full DP noise (local DP per site, PLD): the coordinator's average of
n sites carries √n sites' noise, n× central DP's variance — the measured reason the 10-site
federated arm trails the central one (docs/benchmarks.md, `sites10_dpsgd`). Under secure
aggregation the coordinator sees only the sum, so each of h trusted sites could add a share and
the sum carry the whole; the shares must be integers (secure aggregation adds modulo M), so the
noise must be a discrete one closed under sums: Skellam (``skellam.py``, its bounds and why).

For the recipes of the federated_utility benchmark and the main job, and each target ε per
patient: the σ a site needs alone (PLD, what ships), the total σ the Skellam mechanism needs
(RDP, the bounds in ``skellam.py``; γ·C = 4096, d = the trainable set's size), and the standard
deviation of the noise in the federation's averaged gradient relative to today's:

* central DP with a trusted aggregator (Gaussian, PLD):      1/√n;
* Skellam, shares sized for h honest sites (h = n and ⌈n/2⌉): σ_Skellam / (σ_local·√h);
* Skellam with a tight subsampling analysis, h = n: it cannot beat the Gaussian's RDP (the
  Skellam approaches the Gaussian as μ grows), σ_Gaussian,RDP / (σ_local·√n) — the payoff of
  checking the bound ``skellam.py`` leaves out,

plus ε_alone: what a site's own share guarantees if every other site and the coordinator collude
(its share's variance, μ/h). No training is run: the federated_utility tables give what a given
noise level buys.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import skellam  # noqa: E402  (the benchmark's own module, next to this file)

from fedpose.privacy.accountant import noise_multiplier_for  # noqa: E402

#: γ·C: the clipped unit gradient's norm on the integer grid (2¹²: √d adds 2 % to Δ₂ at d = 6576)
SCALED_CLIP = 4096.0
DELTA = 1e-5

#: trainable parameters of the federated_utility benchmark's set (tiny_vit_test, biases_norms)
BENCHMARK_DIMENSION = 6576


def settings() -> list[tuple[str, int, float, int, int, tuple[float, ...]]]:
    """(name, sites, q, steps, trainable parameters, targets): the benchmark's recipes, and the main
    job's read from configs/demo.toml (as benchmarks/accountants does), its trainable set counted on
    the model it builds."""
    from fedpose.cli.simulate import resolve_federation
    from fedpose.model import build_model

    federation, _, _ = resolve_federation(ROOT / "configs" / "demo.toml", [])
    site, coordinator = federation.sites[0], federation.coordinator
    model = build_model(coordinator.model.model_copy(update={"init_checkpoint": ROOT / coordinator.model.init_checkpoint}),
                        tuple(coordinator.data.input_size))
    demo_dimension = sum(p.numel() for p in model.trainable_parameters().values())
    demo_steps = coordinator.rounds * site.local_steps
    return [
        ("federated_utility, 10 sites (four images, 16 of 120 patients a step, 8 rounds × 10 steps)", 10, 16 / 120, 80,
         BENCHMARK_DIMENSION, (2.0, 8.0)),
        ("federated_utility, 3 sites (the same recipe)", 3, 16 / 120, 80, BENCHMARK_DIMENSION, (2.0, 8.0)),
        (f"main job, configs/demo.toml ({coordinator.model.backbone}, q {site.privacy.sample_rate:.4g}, {demo_steps} steps)",
         len(federation.sites), site.privacy.sample_rate, demo_steps, demo_dimension, (1.0,)),
    ]


def row(name: str, sites: int, sample_rate: float, steps: int, dimension: int, target: float) -> dict:
    local = noise_multiplier_for(target, sample_rate, steps, DELTA, rel_tolerance=1e-4, accountant="pld")
    gaussian_rdp = noise_multiplier_for(target, sample_rate, steps, DELTA, rel_tolerance=1e-4, accountant="rdp")
    total = skellam.noise_multiplier_for(target, DELTA, max_grad_norm=1.0, scale=SCALED_CLIP, dimension=dimension,
                                         sample_rate=sample_rate, steps=steps)
    event = skellam.SkellamEvent.rounded(total, 1.0, SCALED_CLIP, dimension, sample_rate, steps)
    shares = []
    for honest in sorted({sites, math.ceil(sites / 2)}, reverse=True):  # h = n first
        share = skellam.SkellamEvent(event.variance / honest, event.l2_sensitivity, event.l1_sensitivity, sample_rate, steps)
        shares.append({"honest_sites": honest, "mean_noise_vs_today": round(total / (local * math.sqrt(honest)), 3),
                       "epsilon_alone": round(skellam.epsilon([share], DELTA), 2)})
    return {"setting": name, "sites": sites, "sample_rate": sample_rate, "steps": steps, "dimension": dimension,
            "target_epsilon": target, "sigma_local_pld": round(local, 4), "sigma_skellam_rdp": round(total, 4),
            "sigma_gaussian_rdp": round(gaussian_rdp, 4), "skellam_over_local": round(total / local, 3),
            "mean_noise_vs_today": {"central_gaussian": round(1 / math.sqrt(sites), 3),
                                    "skellam_at_gaussian_rdp_limit": round(gaussian_rdp / (local * math.sqrt(sites)), 3)},
            "skellam_shares": shares}


def markdown(result: dict) -> str:
    lines = ["# Distributed noise under secure aggregation: what it would buy", "",
             "σ per patient-level target ε (δ = 1e-5, add/remove one patient); noise = std of the noise in the "
             "federation's averaged gradient, today's local DP per site = 1.", "",
             "| recipe | ε | σ alone (PLD) | σ Skellam total (RDP) | ratio | noise: central Gaussian | noise: Skellam, h = n | "
             "noise: Skellam, h = ⌈n/2⌉ | noise: Gaussian-RDP limit, h = n | ε of a site's own share, h = n / ⌈n/2⌉ |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        noise, all_sites, half = r["mean_noise_vs_today"], r["skellam_shares"][0], r["skellam_shares"][-1]
        lines.append(f"| {r['setting']} | {r['target_epsilon']:g} | {r['sigma_local_pld']} | {r['sigma_skellam_rdp']} | "
                     f"{r['skellam_over_local']} | {noise['central_gaussian']} | {all_sites['mean_noise_vs_today']} | "
                     f"{half['mean_noise_vs_today']} | {noise['skellam_at_gaussian_rdp_limit']} | "
                     f"{all_sites['epsilon_alone']} / {half['epsilon_alone']} |")
    lines += ["", f"Conditions: {json.dumps(result['conditions'])}", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    start = time.time()
    rows = [row(name, sites, q, steps, d, target) for name, sites, q, steps, d, targets in settings() for target in targets]
    result = {"rows": rows, "conditions": {
        "scaled_clip": SCALED_CLIP, "delta": DELTA, "skellam_orders": [min(skellam.ORDERS), max(skellam.ORDERS)],
        "local_accountant": "pld (dp-accounting), what ships", "skellam_accountant":
            "RDP: Agarwal et al. 2021 Thm 3.5 + Zhu & Wang 2019 Thm 6 (general Poisson-subsampling bound), Balle et al. 2020",
        "machine": platform.machine(), "seconds": round(time.time() - start, 1), "date": time.strftime("%Y-%m-%d")}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "results.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
