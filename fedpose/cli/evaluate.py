"""``fedpose eval`` (PCKh of a checkpoint on a dataset) and ``fedpose predict`` (skeleton overlays)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from fedpose.cli.common import UserError, collect_images, examples, print_json


FLIP_TEST_HELP = ("predict from each crop alone, not from the mean of the crop's and its mirror's distributions "
                  "(flip test, the default: about 2 PCKh@0.5 better on the synthetic sites, twice the forward passes)")


def register(subparsers: argparse._SubParsersAction) -> None:
    ev = subparsers.add_parser(
        "eval",
        help="PCKh of a checkpoint on an annotated dataset",
        description="Decode the model's SimCC predictions, map them to the original images and score PCKh "
                    "(MPII protocol, head boxes) on every record that has a head box.",
    )
    ev.add_argument("--checkpoint", required=True, type=Path,
                    help="a checkpoint file (e.g. RUN_DIR/checkpoints/best.pt), a `fedpose train` run directory (its "
                         "last checkpoint), a `fedpose export` directory (model.safetensors), or a federation's model: the "
                         "coordinator's global.npz or its checkpoint directory (its published model: global_ema.npz, the moving average, "
                         "when coordinator.ema is on)")
    ev.add_argument("--data", required=True, type=Path, help="dataset directory, annotations json or COCO keypoints json")
    ev.add_argument("--batch-size", type=int, default=32, help="images per forward pass (default 32)")
    ev.add_argument("--max-samples", type=int, default=None, help="evaluate the first N records only")
    ev.add_argument("--overlays", type=Path, default=None, help="also write a PNG grid of the first 16 crops (prediction + GT)")
    ev.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ev.add_argument("--no-flip-test", dest="flip_test", action="store_false", help=FLIP_TEST_HELP)
    ev.add_argument("--device", default="auto", help="auto (CUDA when available, else the CPU), cpu, cuda or cuda:N")
    ev.epilog = examples(
        'fedpose eval --checkpoint runs/train --data data/test   # a run directory: its last checkpoint',
        'fedpose eval --checkpoint release/ --data data/test --json   # an export directory (model.safetensors)',
    )
    ev.set_defaults(handler=run_eval)

    pr = subparsers.add_parser(
        "predict",
        help="draw predicted skeletons on images",
        description="Predict the 16 joints on each image (the whole image is taken as the person box) and "
                    "write <name>_pose.png overlays plus predictions.json to --out.",
    )
    pr.add_argument("--checkpoint", required=True, type=Path,
                    help="a checkpoint file (e.g. RUN_DIR/checkpoints/best.pt), a `fedpose train` run directory (its "
                         "last checkpoint), a `fedpose export` directory (model.safetensors), or a federation's model: the "
                         "coordinator's global.npz or its checkpoint directory (its published model: global_ema.npz, the moving average, "
                         "when coordinator.ema is on)")
    pr.add_argument("images", nargs="+", type=Path, metavar="IMAGE",
                    help="image files, or directories (walked recursively for images)")
    pr.add_argument("--out", required=True, type=Path, help="output directory")
    pr.add_argument("--min-confidence", type=float, default=0.0,
                    help="hide joints whose confidence is below this (0–1: the peak SimCC probability relative to a "
                         "training target's peak; saturated outputs count as 0)")
    pr.add_argument("--device", default="auto", help="auto (CUDA when available, else the CPU), cpu, cuda or cuda:N")
    pr.add_argument("--no-flip-test", dest="flip_test", action="store_false", help=FLIP_TEST_HELP)
    pr.epilog = examples(
        'fedpose predict --checkpoint release/ photos/ --out poses/   # every image under photos/',
        'fedpose predict --checkpoint runs/demo/coordinator a.jpg b.png --out poses/ --min-confidence 0.3',
    )
    pr.set_defaults(handler=run_predict)


def _load_model(path: Path, device_setting: str):
    """(the checkpoint's model on the ``--device``, that device in words)."""
    from fedpose.config import ConfigError
    from fedpose.federation.global_model import GlobalModelError
    from fedpose.model import CheckpointError, load_model
    from fedpose.runtime import describe_device, resolve_device

    try:
        device = resolve_device(device_setting, "--device")
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    try:
        model = load_model(path)
    except (CheckpointError, GlobalModelError) as exc:  # each names the file and what is wrong
        raise UserError(str(exc)) from None
    return model.to(device), describe_device(device)


def run_eval(args: argparse.Namespace) -> int:
    from fedpose.data.dataset import PoseDataset, load_records
    from fedpose.train.evaluate import evaluate

    if args.batch_size < 1:
        raise UserError("--batch-size must be >= 1")
    if args.max_samples is not None and args.max_samples < 1:
        raise UserError("--max-samples must be >= 1")
    model, device = _load_model(args.checkpoint, args.device)
    records, root = load_records(args.data)
    if not records:
        raise UserError(f"{args.data}: the dataset has no records")
    dataset = PoseDataset(records, root, input_size=model.input_size, train=False)
    try:
        scores = evaluate(model, dataset, batch_size=args.batch_size, max_samples=args.max_samples, flip_test=args.flip_test)
    except ValueError as exc:
        raise UserError(f"{args.data}: {exc}") from None
    if args.overlays is not None:
        _write_eval_overlays(model, dataset, args.overlays, flip_test=args.flip_test)
    if args.json:
        print_json({"checkpoint": str(args.checkpoint), "data": str(args.data), **scores, "flip_test": args.flip_test, "device": device})
    else:
        test = "flip test" if args.flip_test else "no flip test"
        from fedpose.federation.global_model import global_checkpoint_path

        shown = global_checkpoint_path(args.checkpoint) or args.checkpoint  # a coordinator directory: which of its models
        print(f"PCKh@0.5 of {shown} on {args.data} ({scores['samples']} people, {test}, device {device}):")
        for key in ("Head", "Shoulder", "Elbow", "Wrist", "Hip", "Knee", "Ankle", "Mean", "Mean@0.1"):
            value = scores[key]
            print(f"  {key:<9} {'n/a' if math.isnan(value) else f'{value:6.2f}'}")
    return 0


def _write_eval_overlays(model, dataset, path: Path, count: int = 16, flip_test: bool = True) -> None:
    import numpy as np
    from torch.utils.data import Subset

    from fedpose.data.dataset import denormalize
    from fedpose.train.evaluate import predict
    from fedpose.viz import save_overlays

    subset = Subset(dataset, range(min(count, len(dataset))))
    result = predict(model, subset, batch_size=count, flip_test=flip_test)
    items = [subset[i] for i in range(len(subset))]
    images = [denormalize(item["image"]) for item in items]
    gts = np.stack([item["joints"].numpy() for item in items])
    gt_vis = np.stack([item["weight"].numpy() for item in items])
    save_overlays(images, result["preds_crop"], path, gts=gts, gt_vis=gt_vis)


def run_predict(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    from PIL import Image

    from fedpose.data.annotations import PoseRecord
    from fedpose.data.dataset import DEFAULT_PADDING, PoseDataset
    from fedpose.data.transforms import PIXEL_STD, crop_to_original
    from fedpose.io import atomic_write_json
    from fedpose.joints import JOINT_NAMES, NUM_JOINTS
    from fedpose.runtime import model_device
    from fedpose.viz import draw_skeleton, save_png

    images = collect_images([str(p) for p in args.images], exclude=args.out)  # files, and directories walked
    model, device = _load_model(args.checkpoint, args.device)
    height, width = model.input_size
    args.out.mkdir(parents=True, exist_ok=True)
    predictions = []
    saturated_joints = 0
    model.eval()
    for path in images:
        try:
            with Image.open(path) as img:
                original = np.asarray(img.convert("RGB"))
        except OSError as exc:
            raise UserError(f"{path}: not a readable image ({exc})") from None
        h, w = original.shape[:2]
        # the whole image is the person box, at the model's aspect ratio (the crop pads the rest)
        scale = max(h, w * height / width) / PIXEL_STD / DEFAULT_PADDING
        record = PoseRecord(path.name, np.zeros((NUM_JOINTS, 2), np.float32), np.zeros(NUM_JOINTS, np.float32),
                            np.array([w / 2, h / 2], np.float32), scale)
        item = PoseDataset([record], path.parent, input_size=model.input_size, train=False)[0]
        with torch.no_grad():
            coords, confidence, _, _ = model.predict_crops(item["image"].unsqueeze(0).to(model_device(model)), flip_test=args.flip_test)
            coords, confidence = coords.cpu(), confidence.cpu()
        joints = crop_to_original(coords[0].numpy(), item["center"].numpy(), float(item["scale"]), model.input_size)
        normalized, saturated = (t[0].numpy() for t in model.codec.normalized_confidence(confidence))
        conf = np.where(saturated, 0.0, normalized)
        saturated_joints += int(saturated.sum())
        overlay = draw_skeleton(original, joints, (conf >= args.min_confidence).astype(np.float32))
        out_png = save_png(overlay, args.out / f"{path.stem}_pose.png")
        predictions.append({
            "image": str(path), "overlay": str(out_png),
            "joints": {name: [round(float(x), 2), round(float(y), 2)] if np.isfinite([x, y]).all() else None
                       for name, (x, y) in zip(JOINT_NAMES, joints)},
            "confidence": {name: None if sat else round(float(c), 4) for name, c, sat in zip(JOINT_NAMES, conf, saturated)},
        })
        print(f"{path} → {out_png}")
    atomic_write_json(args.out / "predictions.json", {
        "checkpoint": str(args.checkpoint), "device": device, "flip_test": args.flip_test, "confidence": CONFIDENCE_MEANING,
        "predictions": predictions})
    if saturated_joints:
        print(f"WARNING: {saturated_joints} of {NUM_JOINTS * len(images)} joints have saturated outputs (a peak "
              "probability far sharper than any training target: typical of a diverged model); their confidence is "
              "null in predictions.json", file=sys.stderr)
    return 0


#: what predictions.json's confidences are (written into it)
CONFIDENCE_MEANING = (
    "per joint, the peak SimCC probability (the less certain axis) relative to the peak of a training target, capped "
    "at 1 (1: as sharp as the labels the model was trained on); null where the output is saturated (more than "
    "2× sharper than any target), which is not certainty. Uncalibrated: not a probability of "
    "being correct"
)
