"""``fedpose pckh``: score predictions against ground truth with PCKh (MPII protocol)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from fedpose.cli.common import UserError, examples, print_json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "pckh",
        help="PCKh@0.5 (per group, Mean) and Mean@0.1 of predictions vs ground truth",
        description=(
            "Compare predicted joints with ground truth. GT: an annotations file or dataset "
            "(MPII/HRNet json list with headboxes, dataset dir, or COCO keypoints json). "
            'PRED: {"preds": N×16×2} in the same pixel frame and order as GT (no ±1 shift is '
            "applied). Joints with joints_vis 0 and people without a head box are not scored."
        ),
    )
    parser.add_argument("--gt", required=True, type=Path, help="ground-truth annotations (json or dataset dir)")
    parser.add_argument("--pred", required=True, type=Path, help='predictions json: {"preds": N×16×2}')
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.epilog = examples(
        'fedpose pckh --gt data/mpii-valid/valid.json --pred data/mpii-valid/preds_hg_s8.json',
    )
    parser.set_defaults(handler=run)


def _read_preds(path: Path):
    import numpy as np

    if not path.exists():
        raise UserError(f"{path}: prediction file not found")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict) or "preds" not in raw:
        raise UserError(f'{path}: expected an object with key "preds" (N×16×2)')
    try:
        preds = np.asarray(raw["preds"], dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise UserError(f'{path}: "preds" is not a numeric N×16×2 array ({exc})') from exc
    return preds


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from fedpose.data.loaders import load_records
    from fedpose.eval.pckh import PCKH_KEYS, pckh
    from fedpose.joints import NUM_JOINTS

    records, _ = load_records(args.gt)
    preds = _read_preds(args.pred)
    if preds.ndim != 3 or preds.shape[1:] != (NUM_JOINTS, 2):
        raise UserError(f"{args.pred}: preds must have shape (N, {NUM_JOINTS}, 2), got {preds.shape}")
    if len(preds) != len(records):
        raise UserError(f"{args.pred} has {len(preds)} predictions but {args.gt} has {len(records)} people")
    if not any(r.headbox is not None for r in records):
        raise UserError(f"{args.gt}: no record has a headbox; PCKh needs head boxes")
    joints = np.stack([r.joints for r in records])
    vis = np.stack([r.joints_vis for r in records])
    headboxes = np.stack([r.headbox if r.headbox is not None else np.zeros((2, 2)) for r in records])
    try:
        result = pckh(preds, joints, vis, headboxes)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    result = {key: (round(result[key], 4) if math.isfinite(result[key]) else None) for key in PCKH_KEYS}
    if args.json:
        print_json(result)
        return 0
    scored = int(sum(1 for r in records if r.headbox is not None))
    print(f"PCKh  ({scored} people scored, {int(vis.sum())} annotated joints; Head = head top)")
    print("  ".join(f"{key:>8}" for key in PCKH_KEYS))
    print("  ".join(f"{'n/a' if v is None else f'{v:.2f}':>8}" for v in result.values()))
    return 0
