"""Which grey copies teach the grey images? A noise-free diagnostic: no clipping, no noise, no sites.

    fedpose data synth --out DATA --sites 3 --per-site 1920 --public 0 --test 160 --size 128x96 --seed 7
    python benchmarks/federated_utility/grey_copies_by_stage.py --data DATA --out FILE.json [--steps 32]

From the main job's public base, each variant trains only the grey copies (model.scenario
``grey_biases_norms``) whose names start with one of its prefixes, for ``--steps`` steps of SGD
(0.1, momentum 0.9, the main job's) on the mean loss of 38 grey site images a step (about what a
main-job step's grey rows hold), the sites taking turns; the test split is scored with flip test,
grey and colour images apart (colour images never see the copies, so their score must not move).
The numbers say what a subset *can* teach without noise; a smaller subset carries less DP noise
(norm ∝ √parameters). Chooses nothing: grey_early_main_job.json's rule did, with the private recipe.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from fedpose.model.pose_model import GREY_EARLY_UNITS

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "checkpoints" / "public" / "public-base-tiny_vit_5m_224-128x96-rotation60.pt"
#: variant → the name prefixes of the grey copies it trains ("" = every copy)
VARIANTS: dict[str, tuple[str, ...]] = {
    "every copy": ("",),
    "patch embedding, stages 0-1 (grey_early_biases_norms)": GREY_EARLY_UNITS,
    "patch embedding, stage 0": ("backbone.patch_embed.", "backbone.stages.0."),
    "stage 1": ("backbone.stages.1.",),
    "stages 2-3 and the head": ("backbone.stages.2.", "backbone.stages.3.", "head."),
}
GREY_IMAGES_A_STEP = 38


def run_variant(data: Path, prefixes: tuple[str, ...], steps: int, seed: int, backbone: str, base: Path | None,
                input_size: tuple[int, int]) -> dict:
    from fedpose.config import ModelConfig
    from fedpose.data.dataset import PoseDataset
    from fedpose.data.loaders import load_records
    from fedpose.eval.pckh import pckh
    from fedpose.federation.config import SiteDataConfig
    from fedpose.model import build_model
    from fedpose.model.grey_copies import grey_flags, is_grey_copy_key, records_with_gradient
    from fedpose.train.evaluate import predict

    torch.manual_seed(seed)
    model = build_model(ModelConfig(backbone=backbone, scenario="grey_biases_norms", init_checkpoint=base), input_size)
    params = []
    for name, param in model.named_parameters():
        param.requires_grad_(is_grey_copy_key(name) and name.startswith(prefixes))
        if param.requires_grad:
            params.append(param)
    augmentation = SiteDataConfig(train=data).augmentation_options()
    sites = []
    for site_dir in sorted(data.glob("site-*")):
        records, root = load_records(site_dir)
        dataset = PoseDataset(records, root, input_size=input_size, train=True, seed=seed, **augmentation)
        flags = records_with_gradient(model.trainable_parameters(), dataset)
        sites.append((dataset, [i for i, grey in enumerate(flags) if grey]))
    records, root = load_records(data / "test")
    test = PoseDataset(records, root, input_size=input_size, train=False)
    test_grey = grey_flags(torch.stack([test.load(i, plain=True)["image"] for i in range(len(test))])).numpy() > 0.5

    def score() -> dict[str, float | None]:
        out = predict(model, test, flip_test=True)
        model.train_mode()
        return {kind: round(float(pckh(out["preds"][m], out["joints"][m], out["joints_vis"][m], out["headbox"][m])["Mean"]), 2)
                if m.any() else None for kind, m in (("all", np.ones_like(test_grey)), ("grey", test_grey), ("colour", ~test_grey))}

    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    rng = np.random.default_rng(seed)
    curve, started = [score()], time.perf_counter()
    for step in range(steps):
        dataset, grey = sites[step % len(sites)]
        batch = [dataset[int(i)] for i in rng.choice(grey, size=min(GREY_IMAGES_A_STEP, len(grey)), replace=False)]
        optimizer.zero_grad(set_to_none=True)
        logits = model(torch.stack([b["image"] for b in batch]))
        model.loss(*logits, torch.stack([b["joints"] for b in batch]), torch.stack([b["weight"] for b in batch])).mean().backward()
        optimizer.step()
        if (step + 1) % 16 == 0 or step + 1 == steps:
            curve.append(score())
    return {"prefixes": list(prefixes), "trainable": sum(p.numel() for p in params), "curve_every_16_steps": curve,
            "seconds": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="a synthetic dataset (site-*/, test/)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backbone", default="tiny_vit_5m_224")
    parser.add_argument("--base", default=str(BASE), help="the public base ('' for random weights: tests only)")
    parser.add_argument("--size", default="128x96", help="HEIGHTxWIDTH")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    size = tuple(int(v) for v in args.size.split("x"))
    base = Path(args.base) if args.base else None
    results = {name: run_variant(args.data, prefixes, args.steps, args.seed, args.backbone, base, size)
               for name, prefixes in VARIANTS.items()}
    args.out.write_text(json.dumps({"what": __doc__.split("\n\n")[2].strip(), "data": str(args.data), "steps": args.steps,
                                    "seed": args.seed, "threads": args.threads, "variants": results}, indent=1, ensure_ascii=False))
    for name, result in results.items():
        print(f"{name}: {result['trainable']} parameters, grey {result['curve_every_16_steps'][0]['grey']} -> "
              f"{result['curve_every_16_steps'][-1]['grey']}, colour {result['curve_every_16_steps'][-1]['colour']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
