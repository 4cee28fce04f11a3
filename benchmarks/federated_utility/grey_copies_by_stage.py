"""What can the grey path learn? A noise-free diagnostic: no clipping, no noise, no sites.

    fedpose data synth --out DATA --sites 3 --per-site 1920 --public 0 --test 160 --size 128x96 --seed 7
    python benchmarks/federated_utility/grey_copies_by_stage.py --data DATA --out FILE.json [--steps 32]

From the main job's public base, each variant trains on the mean loss of 38 grey site images a
step (about what a main-job step's grey rows hold), the sites taking turns, for ``--steps`` steps of
SGD with momentum 0.9; the test split is scored with flip test, grey and colour images apart.

* ``variants``: only the grey copies (model.scenario ``grey_biases_norms``) whose names start with
  one of the variant's prefixes, at the main job's step size 0.1. Colour images never see the
  copies, so their score must not move.
* ``weight_variants``: every weight under the prefixes (a whole grey copy of those units, which no
  scenario offers: the most any trainable set there could teach), at step size 0.003 (the grid's
  non-private step for every weight; 0.01 and 0.03 learned less in trial runs). The grey test
  images are scored with the trained model and the colour ones with the base, as grey copies would
  route them.

The numbers say what a set *can* teach without noise; a larger set carries more DP noise (norm ∝
√parameters). Chooses nothing: grey_early_main_job.json's rule did, with the private recipe.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fedpose.model.pose_model import GREY_EARLY_UNITS

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gain_by_kind import scores_by_kind  # noqa: E402  (this folder's scoring by kind)

REPO = HERE.parents[1]
BASE = REPO / "checkpoints" / "public" / "public-base-tiny_vit_5m_224-128x96-rotation60.pt"
#: variant → the name prefixes of the grey copies it trains ("" = every copy)
VARIANTS: dict[str, tuple[str, ...]] = {
    "every copy": ("",),
    "patch embedding, stages 0-1 (grey_early_biases_norms)": GREY_EARLY_UNITS,
    "patch embedding, stage 0": ("backbone.patch_embed.", "backbone.stages.0."),
    "stage 1": ("backbone.stages.1.",),
    "stages 2-3 and the head": ("backbone.stages.2.", "backbone.stages.3.", "head."),
}
#: variant → the name prefixes of the weights a separate grey model trains ("" = the whole model)
WEIGHT_VARIANTS: dict[str, tuple[str, ...]] = {
    "every weight of the patch embedding": ("backbone.patch_embed.",),
    "every weight of stage 0": ("backbone.stages.0.",),
    "every weight of the patch embedding and stages 0-1": GREY_EARLY_UNITS,
    "every weight of the model": ("",),
}
COPIES_LR, WEIGHTS_LR = 0.1, 0.003
GREY_IMAGES_A_STEP = 38


class GreyPath:
    """The data and scoring every variant shares: each site's grey training records, the test split,
    its grey flags and the base model's test predictions."""

    def __init__(self, data: Path, seed: int, backbone: str, base: Path | None, input_size: tuple[int, int]):
        from fedpose.data.dataset import PoseDataset
        from fedpose.data.loaders import load_records
        from fedpose.federation.config import SiteDataConfig
        from fedpose.model.grey_copies import grey_flags, records_with_gradient
        from fedpose.train.evaluate import predict

        self.seed, self.backbone, self.base, self.input_size = seed, backbone, base, input_size
        copies = self.model("grey_biases_norms")
        augmentation = SiteDataConfig(train=data).augmentation_options()
        self.sites = []
        for site_dir in sorted(data.glob("site-*")):
            records, root = load_records(site_dir)
            dataset = PoseDataset(records, root, input_size=input_size, train=True, seed=seed, **augmentation)
            flags = records_with_gradient(copies.trainable_parameters(), dataset)  # the grey records
            self.sites.append((dataset, [i for i, grey in enumerate(flags) if grey]))
        records, root = load_records(data / "test")
        self.test = PoseDataset(records, root, input_size=input_size, train=False)
        self.test_grey = grey_flags(torch.stack([self.test.load(i, plain=True)["image"] for i in range(len(self.test))])).numpy() > 0.5
        self.base_predictions = predict(copies, self.test, flip_test=True)

    def model(self, scenario: str):
        from fedpose.config import ModelConfig
        from fedpose.model import build_model

        torch.manual_seed(self.seed)
        return build_model(ModelConfig(backbone=self.backbone, scenario=scenario, init_checkpoint=self.base), self.input_size)

    def score(self, model, colour_from_base: bool) -> dict[str, float]:
        from fedpose.train.evaluate import predict

        out = predict(model, self.test, flip_test=True)
        model.train_mode()
        if colour_from_base:
            out = {key: np.where(self.test_grey.reshape(-1, *[1] * (value.ndim - 1)), value, self.base_predictions[key])
                   for key, value in out.items()}
        return scores_by_kind(out, {"all": np.ones_like(self.test_grey), "grey": self.test_grey, "colour": ~self.test_grey})

    def train(self, model, params: list, lr: float, steps: int, colour_from_base: bool) -> dict:
        """``steps`` noise-free steps on grey images; the scores every 16 steps."""
        optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9)
        rng = np.random.default_rng(self.seed)
        model.train_mode()
        curve, started = [self.score(model, colour_from_base)], time.perf_counter()
        for step in range(steps):
            dataset, grey = self.sites[step % len(self.sites)]
            batch = [dataset[int(i)] for i in rng.choice(grey, size=min(GREY_IMAGES_A_STEP, len(grey)), replace=False)]
            optimizer.zero_grad(set_to_none=True)
            logits = model(torch.stack([b["image"] for b in batch]))
            model.loss(*logits, torch.stack([b["joints"] for b in batch]), torch.stack([b["weight"] for b in batch])).mean().backward()
            optimizer.step()
            if (step + 1) % 16 == 0 or step + 1 == steps:
                curve.append(self.score(model, colour_from_base))
        return {"trainable": sum(p.numel() for p in params), "lr": lr, "curve_every_16_steps": curve,
                "seconds": round(time.perf_counter() - started, 1)}


def train_copies(path: GreyPath, prefixes: tuple[str, ...], steps: int) -> dict:
    """The grey copies under ``prefixes`` only."""
    from fedpose.model.grey_copies import is_grey_copy_key

    model = path.model("grey_biases_norms")
    params = _train_only(model, lambda name: is_grey_copy_key(name) and name.startswith(prefixes))
    return {"prefixes": list(prefixes), **path.train(model, params, COPIES_LR, steps, colour_from_base=False)}


def train_weights(path: GreyPath, prefixes: tuple[str, ...], steps: int) -> dict:
    """Every weight under ``prefixes`` of a separate grey model (colour images scored with the base)."""
    model = path.model("full")
    params = _train_only(model, lambda name: name.startswith(prefixes))
    return {"prefixes": list(prefixes), **path.train(model, params, WEIGHTS_LR, steps, colour_from_base=True)}


def _train_only(model, trains) -> list:
    """Freeze every parameter whose name ``trains`` rejects; the ones it keeps."""
    for name, param in model.named_parameters():
        param.requires_grad_(trains(name))
    return [param for param in model.parameters() if param.requires_grad]


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
    path = GreyPath(args.data, args.seed, args.backbone, Path(args.base) if args.base else None, size)
    results = {name: train_copies(path, prefixes, args.steps) for name, prefixes in VARIANTS.items()}
    weights = {name: train_weights(path, prefixes, args.steps) for name, prefixes in WEIGHT_VARIANTS.items()}
    args.out.write_text(json.dumps({"what": __doc__.split("\n\n", 2)[2].strip(), "data": str(args.data), "steps": args.steps,
                                    "seed": args.seed, "threads": args.threads, "variants": results,
                                    "weight_variants": weights}, indent=1, ensure_ascii=False))
    for name, result in {**results, **weights}.items():
        first, last = result["curve_every_16_steps"][0], result["curve_every_16_steps"][-1]
        print(f"{name}: {result['trainable']} parameters, grey {first['grey']} -> {last['grey']}, colour {last['colour']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
