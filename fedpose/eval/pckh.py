"""PCKh — the MPII metric: fraction of joints within ``t · head size`` of the ground truth.

Definition (Andriluka et al. 2014; the evaluation code of MPII, stacked hourglass and HRNet):

- head size = ``0.6 · ‖headbox[1] − headbox[0]‖`` (0.6 × the head rectangle's diagonal);
- a joint counts only if annotated (``joints_vis > 0``; MPII's ``1 − jnt_missing``);
- it is correct when ``‖pred − gt‖ ≤ t · head size`` (inclusive: on the published
  predictions some joints lie *exactly* on the 0.5 boundary);
- groups pool both sides (correct / annotated over the left and right joint); "Head" is the head
  top only; "Mean" pools the 14 joints without pelvis and thorax — i.e. the per-joint PCKh weighted
  by joint counts, as HRNet's ``np.sum(PCKh * jnt_ratio)``;
- people whose head box has zero size cannot be scored and are skipped (their joints count
  nowhere), instead of dividing by zero.

Coordinate frame: predictions and ground truth must be in the *same* pixel frame; no ±1 shift is
applied here. For ``shared/data/mpii-valid``: ``valid.json`` holds its joints in the frame of the
published ``preds_hg_s8.json`` (1-based MPII), so comparing them directly reproduces the published
PCKh@0.5 to 2 decimals (Head 96.79 … Mean 89.09); shifting either side by one pixel does not
(Mean 88.88 for gt+1, 89.23 for gt−1). ``joints_vis`` plays the role of the .mat ``jnt_missing``
(missing joints are stored as (−1, −1) with vis 0).

HRNet reports group values as the mean of the left and right *percentages*; we pool counts,
which is identical when both sides have equal counts and differs by < 0.002 points on MPII
validation, but stays defined when one side has no annotated joint. HRNet's "Mean@0.1" reads
``pckAll[11]`` (threshold 0.11, an off-by-one); ours is the true t = 0.1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedpose.joints import NUM_JOINTS, PCKH_EXCLUDED, PCKH_GROUPS

HEAD_SIZE_FACTOR = 0.6
PCKH_KEYS: tuple[str, ...] = (*PCKH_GROUPS.keys(), "Mean", "Mean@0.1")


def _check_shapes(preds: np.ndarray, joints: np.ndarray, joints_vis: np.ndarray, headboxes: np.ndarray) -> None:
    n = preds.shape[0] if preds.ndim else 0
    expected = {
        "preds": (preds, (n, NUM_JOINTS, 2)),
        "joints": (joints, (n, NUM_JOINTS, 2)),
        "joints_vis": (joints_vis, (n, NUM_JOINTS)),
        "headboxes": (headboxes, (n, 2, 2)),
    }
    if preds.ndim != 3 or preds.shape[1:] != (NUM_JOINTS, 2):
        raise ValueError(f"preds must have shape (N, {NUM_JOINTS}, 2), got {preds.shape}")
    for name, (array, shape) in expected.items():
        if array.shape != shape:
            raise ValueError(
                f"{name} must have shape {shape} to match {n} predictions, got {array.shape}"
            )
    if not np.isfinite(preds).all():
        raise ValueError("preds contain NaN or Inf")


def pckh_per_joint(
    preds: np.ndarray, joints: np.ndarray, joints_vis: np.ndarray, headboxes: np.ndarray, threshold: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per-joint (correct counts (16,), annotated counts (16,)) at one threshold."""
    preds = np.asarray(preds, dtype=np.float64)
    joints = np.asarray(joints, dtype=np.float64)
    vis = np.asarray(joints_vis, dtype=np.float64)
    headboxes = np.asarray(headboxes, dtype=np.float64)
    _check_shapes(preds, joints, vis, headboxes)
    head_size = HEAD_SIZE_FACTOR * np.linalg.norm(headboxes[:, 1] - headboxes[:, 0], axis=1)
    scorable = (vis > 0) & (head_size[:, None] > 0)
    distance = np.linalg.norm(preds - joints, axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        correct = scorable & (distance <= threshold * head_size[:, None])
    return correct.sum(axis=0).astype(np.float64), scorable.sum(axis=0).astype(np.float64)


def _percent(correct: float, total: float) -> float:
    return float(100.0 * correct / total) if total > 0 else float("nan")


def pckh(
    preds: np.ndarray,
    joints: np.ndarray,
    joints_vis: np.ndarray,
    headboxes: np.ndarray,
    thresholds: Sequence[float] = (0.5, 0.1),
) -> dict[str, float]:
    """PCKh in percent: groups and "Mean" at ``thresholds[0]``, "Mean@<t>" for each further t.

    Shapes: preds, joints (N, 16, 2) in the same pixel frame; joints_vis (N, 16); headboxes
    (N, 2, 2) as [[x1, y1], [x2, y2]]. A group with no annotated joint is NaN.
    """
    if not thresholds:
        raise ValueError("need at least one threshold")
    counted = [j for j in range(NUM_JOINTS) if j not in PCKH_EXCLUDED]
    correct, total = pckh_per_joint(preds, joints, joints_vis, headboxes, thresholds[0])
    result = {name: _percent(correct[list(idx)].sum(), total[list(idx)].sum()) for name, idx in PCKH_GROUPS.items()}
    result["Mean"] = _percent(correct[counted].sum(), total[counted].sum())
    for threshold in thresholds[1:]:
        correct_t, total_t = pckh_per_joint(preds, joints, joints_vis, headboxes, threshold)
        result[f"Mean@{threshold:g}"] = _percent(correct_t[counted].sum(), total_t[counted].sum())
    return result
