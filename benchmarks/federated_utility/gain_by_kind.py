"""Where a model's gain comes from: PCKh@0.5 on each kind of test image the sites hold and the
public set lacks, against the rest.

    python benchmarks/federated_utility/gain_by_kind.py --data DATA/test --models BASE.pt runs/demo/coordinator \\
        [--labels base published] [--out benchmarks/federated_utility/gain_by_kind.json]

The synthetic sites differ from the public split in two ways (fedpose/data/synthetic/profiles.py):
night-time infrared images (stored with R = G = B; counted grey by the rule that picks the grey
copies, :func:`fedpose.model.grey_copies.grey_flags`) and patients in bed (the record's
``extra.lying``). The test split mixes the sites' distributions, so a model's PCKh@0.5 there is a
mixture of the two kinds and the rest; this script scores each part separately (flip test, as the
main job scores), for the base and for what private training made of it. Writes JSON and a PNG
beside it. Tuning data only: never a reported split.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[2]

#: the parts scored: (name, what it holds)
KINDS = (("all", "every test image"),
         ("grey", "infrared: grey by the grey copies' rule (fedpose.model.grey_copies.grey_flags)"), ("colour", "the rest"),
         ("lying", "a patient in bed (extra.lying)"), ("upright", "the rest"))


def is_grey(path: Path) -> bool:
    """Whether the image file at ``path`` is grey by the product's rule (the one that picks the
    grey copies: :func:`fedpose.model.grey_copies.grey_flags`)."""
    from fedpose.data.dataset import normalize
    from fedpose.model.grey_copies import grey_flags

    pixels = np.asarray(Image.open(path).convert("RGB"))
    return bool(grey_flags(normalize(pixels)[None]).item())


def kind_masks(records: list, root: Path) -> dict[str, np.ndarray]:
    """{kind: (N,) bool} for :data:`KINDS`, in the records' order."""
    from fedpose.data.annotations import resolve_image

    grey = np.array([is_grey(resolve_image(root, record.image)) for record in records], dtype=bool)
    lying = np.array([bool(record.extra.get("lying")) for record in records], dtype=bool)
    everything = np.ones(len(records), dtype=bool)
    return {"all": everything, "grey": grey, "colour": ~grey, "lying": lying, "upright": ~lying}


def scores_by_kind(prediction: dict[str, np.ndarray], masks: dict[str, np.ndarray]) -> dict[str, float]:
    """PCKh@0.5 (MPII's mean, percent) of ``prediction`` (:func:`fedpose.train.evaluate.predict`'s
    arrays) on each kind; NaN for a kind with no image."""
    from fedpose.eval.pckh import pckh

    out = {}
    for kind, mask in masks.items():
        if not mask.any():
            out[kind] = float("nan")
            continue
        scores = pckh(prediction["preds"][mask], prediction["joints"][mask], prediction["joints_vis"][mask],
                      prediction["headbox"][mask])
        out[kind] = round(float(scores["Mean"]), 2)
    return out


def write_png(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [kind for kind, _ in KINDS]
    labels = list(result["models"])
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    width = 0.8 / len(labels)
    for index, label in enumerate(labels):
        values = [result["models"][label]["pckh50"][kind] for kind in kinds]
        ax.bar(np.arange(len(kinds)) + index * width, values, width, label=label)
    counts = result["images"]
    ax.set_xticks(np.arange(len(kinds)) + width * (len(labels) - 1) / 2, [f"{k}\n({counts[k]})" for k in kinds])
    ax.set_ylabel("PCKh@0.5 (flip test)")
    ax.set_ylim(0, 118)  # room above the bars for the legend
    ax.set_yticks(range(0, 101, 20))
    ax.set_title("PCKh@0.5 by kind of test image", fontsize=10)
    ax.legend(fontsize=8, ncol=len(labels), loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="a test split (tuning data)")
    parser.add_argument("--models", type=Path, nargs="+", required=True,
                        help="checkpoint files or coordinator directories (their published model)")
    parser.add_argument("--labels", nargs="+", help="one name per model (default: the paths)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("gain_by_kind.json"))
    args = parser.parse_args()
    if args.labels and len(args.labels) != len(args.models):
        parser.error("--labels needs one name per model")
    from fedpose.data.dataset import PoseDataset, load_records
    from fedpose.model import load_model
    from fedpose.train.evaluate import predict

    started = time.time()
    records, root = load_records(args.data)
    masks = kind_masks(records, root)
    result = {
        "what": __doc__.split("\n\n")[0].replace("\n", " "),
        "data": str(args.data),
        "images": {kind: int(mask.sum()) for kind, mask in masks.items()},
        "kinds": dict(KINDS),
        "models": {},
        "conditions": {"python": platform.python_version(), "threads": os.environ.get("OMP_NUM_THREADS", "default"),
                       "argv": sys.argv[1:], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
    }
    for index, path in enumerate(args.models):
        label = args.labels[index] if args.labels else str(path)
        model = load_model(path)  # a checkpoint file or a coordinator directory (its published model)
        prediction = predict(model, PoseDataset(records, root, input_size=model.input_size, train=False), flip_test=True)
        result["models"][label] = {"path": str(path), "pckh50": scores_by_kind(prediction, masks)}
        print(label, result["models"][label]["pckh50"], flush=True)
    result["conditions"]["seconds"] = round(time.time() - started, 1)
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    write_png(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
