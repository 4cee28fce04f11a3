"""Is it the noise, the clipping or the projection? One site's private fine-tuning, taken apart.

    python benchmarks/federated_utility/noise_or_subspace.py        # the first question's regimes → noise_or_subspace.json
    python benchmarks/federated_utility/noise_or_subspace.py --regime dpsgd:biases_norms:-:1:0.03 pdp:biases_norms:64:1:0.03

Every private recipe of the sweep's tuning probes ended within ±1 PCKh@0.5 of the public base, while
non-private fine-tuning gained +7 to +9 (tuning_probes.json). This runs one site's training (the
tuning data, data_seed 7: never a reported split; the shipped public base; per patient, B = 16 of
120 patients, 80 steps — a site's whole budget in the sweep) through the engine the sites use,
switching one ingredient at a time. A regime is ``mechanism:scenario:k:noise:lr`` (see
:class:`Regime`): mechanism "none" (plain SGD), "dpsgd" (clipping; with noise 0 NOT private, a
diagnostic), "pdp" (clipping and the projection onto a public basis the site computes every 5
steps, k = ``k``), "fdp" / "fpdp" (plus the noise-free gradient on ψ). Each result is kept in
``<work>/parts`` (resumable); the JSON gathers them all.

What it found (noise_or_subspace.json): the projection, not the noise or the clipping, held PDP at
the base (``finetune``, σ = 0: clipping alone +8.0, clipping + projection k 4 +0.8); the 6.6 k
biases and LayerNorm affines (``model.scenario = "biases_norms"``) keep most of the gain and pay
under real noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CHECKPOINTS = {"tiny_vit_test": "checkpoints/public/public-base-tiny_vit_test-128x96.pt",
               "tiny_vit_5m_224": "checkpoints/public/public-base-tiny_vit_5m_224-128x96.pt"}
SIZE = (128, 96)
EPSILON, DELTA = 8.0, 1e-5


@dataclasses.dataclass(frozen=True)
class Regime:
    """One way to train the site: ``noise`` scales the ε = 8 σ (0: σ = 0, a diagnostic, not private;
    1: the real mechanism; 0.32: the noise a site would carry in a mean over 10 such sites)."""

    mechanism: str
    scenario: str = "finetune"
    k: int | None = None
    noise: float = 1.0
    lr: float = 0.1
    lora_rank: int = 8

    @classmethod
    def parse(cls, text: str) -> "Regime":
        """``mechanism:scenario:k:noise:lr[:lora_rank]``, ``-`` for no projection, e.g. ``pdp:finetune:4:1:0.1``."""
        mechanism, scenario, k, noise, lr, *rank = text.split(":")
        return cls(mechanism, scenario, None if k == "-" else int(k), float(noise), float(lr), int(rank[0]) if rank else 8)

    @property
    def name(self) -> str:
        rank = f":{self.lora_rank}" if self.scenario == "lora" else ""
        return f"{self.mechanism}:{self.scenario}:{'-' if self.k is None else self.k}:{self.noise:g}:{self.lr:g}{rank}"


def _layer_norm_names(model: Any) -> set[str]:
    from fedpose.model.pose_model import _is_layer_norm

    return {f"{m}.{p}" for m, module in model.named_modules() if _is_layer_norm(module) for p, _ in module.named_parameters(recurse=False)}


def _biases(model: Any) -> set[str]:
    return {n for n, _ in model.named_parameters() if n.endswith(".bias")}


def _with_prefix(model: Any, *prefixes: str) -> set[str]:
    return {n for n, _ in model.named_parameters() if n.startswith(prefixes)}


#: candidate trainable sets not (yet) among the model's scenarios: name → the set's parameter names
EXTRA_SETS: dict[str, Any] = {
    "layernorms": _layer_norm_names,
    "head_linears": lambda model: _with_prefix(model, "head.") - _with_prefix(model, "head.joint_conv."),
    #: biases_norms without the stem and stage 0 (a frozen prefix again: cheaper per-sample gradients)
    "biases_norms_from_stage1": lambda model: (_biases(model) | _layer_norm_names(model))
    - _with_prefix(model, "backbone.patch_embed.", "backbone.stages.0."),
    "cls": lambda model: _with_prefix(model, "head.cls_x.", "head.cls_y."),
}


#: the first question: nonprivate, clipping only, clipping + projection (σ = 0), the real mechanisms
DEFAULT_REGIMES = ["none:finetune:-:0:0.01", "dpsgd:finetune:-:0:0.1", "pdp:finetune:4:0:0.1", "pdp:finetune:48:0:0.1",
                   "pdp:finetune:4:1:0.1", "dpsgd:finetune:-:1:0.1"]


def run_regime(regime: Regime, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from fedpose.config import ModelConfig, PrivacyConfig
    from fedpose.data.dataset import PoseDataset, load_records, public_basis_dataset
    from fedpose.data.synthetic import ensure_dataset
    from fedpose.data.units import UnitIndex
    from fedpose.federation.config import SiteOptimConfig
    from fedpose.model import build_model, model_from_checkpoint
    from fedpose.privacy.engine import build_engine, resolve_noise_multiplier
    from fedpose.privacy.mechanisms import get_mechanism
    from fedpose.privacy.public_views import dataset_view_options
    from fedpose.train.evaluate import evaluate
    from fedpose.train.loop import train_steps
    from fedpose.train.optim import build_optimizer, build_scheduler

    mechanism, k, scenario, lr, name = regime.mechanism, regime.k, regime.scenario, regime.lr, regime.name
    torch.set_num_threads(args.threads)
    data = work / "data"
    ensure_dataset(data, sites=3, per_site=480, public=64, test=240, size=SIZE, seed=7, workers=1, progress=False)
    records, root = load_records(data / args.site)
    units = UnitIndex.from_records(records, "patient")
    if scenario == "lora":  # the adapters are built with the model, zero-initialised on top of the checkpoint
        model = build_model(ModelConfig(backbone=args.backbone, scenario="lora", lora_rank=regime.lora_rank,
                                        init_checkpoint=REPO / CHECKPOINTS[args.backbone]), SIZE)
    else:
        model, _ = model_from_checkpoint(REPO / CHECKPOINTS[args.backbone])
        if scenario in EXTRA_SETS:  # a candidate set, tried here before it becomes a model.scenario
            wanted = EXTRA_SETS[scenario](model)
            model._trainable_in = lambda _: wanted  # type: ignore[method-assign]
        model.set_scenario(scenario)
    privacy: dict[str, Any] = {"mechanism": mechanism}
    if mechanism != "none":
        rate = args.batch / units.num_units  # q over patients
        privacy.update(sample_rate=rate, delta=DELTA, unit="patient", max_records_per_unit=args.records_per_patient, max_grad_norm=1.0)
        privacy["noise_multiplier"] = regime.noise * resolve_noise_multiplier(
            PrivacyConfig(mechanism=mechanism, target_epsilon=EPSILON, delta=DELTA, sample_rate=rate), rate, args.steps)
        if k is not None:
            privacy["basis"] = {"k": k, "public_samples": 64, "refresh_every": 5, "public_rotation": args.rotation}
        if get_mechanism(mechanism).uses_dataset_public_view:  # the sweep's ψ: 8×8 block means, 3 bits
            privacy["public_view"] = {"kind": "downsample_quantize", "factor": 8, "bits": 3}
    config = PrivacyConfig.model_validate(privacy)
    dataset = PoseDataset(records, root, input_size=SIZE, train=True, seed=args.seed, **dataset_view_options(config))
    public = public_basis_dataset(data / "public", SIZE, args.rotation) if k is not None else None
    engine = build_engine(config, model, dataset_size=len(dataset), batch_size=args.batch, planned_steps=args.steps,
                          public_dataset=public, seed=args.seed, units=units if mechanism != "none" else None)
    optim = SiteOptimConfig(name="sgd", lr=lr, momentum=0.9, weight_decay=0.0)
    optimizer = build_optimizer(model, optim)
    test_records, test_root = load_records(data / "test")
    splits = {"mixture": test_records, args.site: [r for r in test_records if r.extra.get("site") == args.site]}

    def scores() -> dict[str, float]:
        out = {s: round(evaluate(model, PoseDataset(recs, test_root, input_size=SIZE, train=False), batch_size=32)["Mean"], 2)
               for s, recs in splits.items()}
        model.train_mode()
        return out

    started = time.time()
    curve = [scores()]
    batches = engine.batches(dataset)
    history: list[dict[str, Any]] = []
    for chunk in range(args.steps // args.eval_every):
        history += train_steps(model, engine, dataset, optimizer, args.eval_every, scheduler=build_scheduler(optimizer, optim, args.eval_every),
                               progress=False, batches=batches, first_step=chunk * args.eval_every)
        curve.append(scores())
        print(f"  {name} step {(chunk + 1) * args.eval_every}: {curve[-1]}", flush=True)
    return {
        "regime": name, **dataclasses.asdict(regime), "trainable_parameters": model.num_trainable(),
        "backbone": args.backbone, "records_per_patient": args.records_per_patient, "batch": args.batch, "steps": args.steps,
        "seed": args.seed, "basis_public_rotation": args.rotation if k is not None else None,
        "noise_meaning": ("none" if mechanism == "none" else "σ = 0 (diagnostic, not private)" if regime.noise == 0
                          else "ε = 8 per patient" if regime.noise == 1 else f"{regime.noise:g} × the ε = 8 σ (diagnostic)"),
        "noise_multiplier": engine.noise_multiplier,
        "epsilon": round(engine.epsilon(), 3) if mechanism != "none" and regime.noise > 0 else None,
        "start": curve[0], "end": curve[-1], "gain_mixture": round(curve[-1]["mixture"] - curve[0]["mixture"], 2),
        "gain_own": round(curve[-1][args.site] - curve[0][args.site], 2), "curve": curve,
        "grad_norm_median": round(float(sum(h.get("grad_norm_median", 0.0) for h in history) / len(history)), 3),
        "wall_seconds": round(time.time() - started, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/fedpose_noise_or_subspace"))
    parser.add_argument("--out", type=Path, default=HERE / "noise_or_subspace.json")
    parser.add_argument("--regime", nargs="*", default=DEFAULT_REGIMES, help="mechanism:scenario:k:noise:lr[:lora_rank] (see Regime)")
    parser.add_argument("--site", default="site-1")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rotation", type=float, default=60.0, help="privacy.basis.public_rotation of the site basis")
    parser.add_argument("--backbone", default="tiny_vit_test", choices=list(CHECKPOINTS), help="the shipped public base to start from")
    parser.add_argument("--records-per-patient", type=int, default=1, help="privacy.max_records_per_unit")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

    parts = args.work / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    tag = f"s{args.seed}-b{args.batch}-t{args.steps}-r{args.rotation:g}" + (f"-m{args.records_per_patient}" if args.records_per_patient != 1 else "") \
        + ("" if args.backbone == "tiny_vit_test" else f"-{args.backbone}")
    for regime in map(Regime.parse, args.regime):
        name = regime.name
        path = parts / f"{name.replace(':', '_')}-{tag}.json"
        if path.exists():
            continue
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
        result = run_regime(regime, args.work, args)
        path.write_text(json.dumps(result, indent=1))
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {result['start']} → {result['end']} ({result['wall_seconds']} s)", flush=True)
    results = [json.loads(p.read_text()) for p in sorted(parts.glob("*.json"))]
    args.out.write_text(json.dumps({
        "what": __doc__.split("\n\n")[0].strip(),
        "conditions": {"site": args.site, "data_seed": 7, "checkpoints": CHECKPOINTS, "input_size": list(SIZE), "unit": "patient",
                       "patients": 120, "records_per_patient_per_step": args.records_per_patient, "batch": args.batch, "steps": args.steps,
                       "max_grad_norm": 1.0, "basis": "site-computed every 5 steps, 64 public images turned within ±R",
                       "optimizer": "sgd momentum 0.9, constant lr", "threads": args.threads, "cpus": os.cpu_count(),
                       "python": platform.python_version(), "test": "240 mixture crops, 80 per site"},
        "results": results,
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
