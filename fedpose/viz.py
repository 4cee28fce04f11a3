"""Pictures: skeleton overlays, image grids and training curves (PIL + matplotlib's Agg backend).

Colours follow the usual pose convention: the person's *left* limbs in one colour, *right* limbs
in another, the spine/head in a third, so a left/right swap is visible at a glance.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from fedpose.io import atomic_write
from fedpose.joints import JOINT_NAMES, NUM_JOINTS, SKELETON

Color = tuple[int, int, int]
LEFT_COLOR: Color = (40, 120, 255)  # blue
RIGHT_COLOR: Color = (255, 60, 40)  # red
CENTER_COLOR: Color = (255, 200, 0)  # yellow
GT_COLOR: Color = (60, 220, 60)  # green, for ground truth drawn beside a prediction


def _side(joint: int) -> str:
    name = JOINT_NAMES[joint]
    return "left" if name.startswith("l_") else "right" if name.startswith("r_") else "center"


def bone_color(parent: int, child: int) -> Color:
    """Left colour if both ends are left joints (or one left + centre), likewise right; else centre."""
    sides = {_side(parent), _side(child)} - {"center"}
    if sides == {"left"}:
        return LEFT_COLOR
    if sides == {"right"}:
        return RIGHT_COLOR
    return CENTER_COLOR


def joint_color(joint: int) -> Color:
    return {"left": LEFT_COLOR, "right": RIGHT_COLOR, "center": CENTER_COLOR}[_side(joint)]


def _to_pil(image: np.ndarray | Image.Image) -> Image.Image:
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise ValueError(f"expected a uint8 (H, W, 3) image, got dtype {array.dtype} shape {array.shape}")
    return Image.fromarray(array)


def draw_skeleton(
    image: np.ndarray | Image.Image,
    joints: np.ndarray,
    vis: np.ndarray | None = None,
    color: Color | None = None,
    line_width: int | None = None,
) -> np.ndarray:
    """Return a copy of ``image`` (uint8 HWC) with the 16-joint skeleton drawn on it.

    Bones are drawn only between joints with ``vis > 0``. ``color`` forces a single colour
    (e.g. :data:`GT_COLOR`); by default left/right/centre colours. Line width defaults to
    ~1.2% of the image's smaller side (at least 2 px).
    """
    canvas = _to_pil(image).copy()
    pts = np.asarray(joints, dtype=np.float64)
    if pts.shape != (NUM_JOINTS, 2):
        raise ValueError(f"joints must be ({NUM_JOINTS}, 2), got {pts.shape}")
    shown = np.ones(NUM_JOINTS, bool) if vis is None else np.asarray(vis).reshape(NUM_JOINTS) > 0
    shown &= np.isfinite(pts).all(axis=1)
    width = line_width or max(2, round(0.012 * min(canvas.size)))
    radius = max(2, round(1.2 * width))
    draw = ImageDraw.Draw(canvas)
    for parent, child in SKELETON:
        if shown[parent] and shown[child]:
            draw.line([tuple(pts[parent]), tuple(pts[child])], fill=color or bone_color(parent, child), width=width)
    for j in np.flatnonzero(shown):
        x, y = pts[j]
        draw.ellipse([x - radius, y - radius, x + radius, y + radius], fill=color or joint_color(int(j)),
                     outline=(255, 255, 255))
    return np.asarray(canvas)


def image_grid(images: Sequence[np.ndarray], ncols: int | None = None, pad: int = 2) -> np.ndarray:
    """Tile equally sized uint8 HWC images into one image (row-major, black padding)."""
    if not images:
        raise ValueError("image_grid needs at least one image")
    shapes = {np.asarray(im).shape for im in images}
    if len(shapes) != 1:
        raise ValueError(f"image_grid needs equally sized images, got shapes {sorted(shapes)}")
    height, width, channels = shapes.pop()
    ncols = ncols or math.ceil(math.sqrt(len(images)))
    nrows = math.ceil(len(images) / ncols)
    grid = np.zeros((nrows * height + (nrows + 1) * pad, ncols * width + (ncols + 1) * pad, channels), np.uint8)
    for i, im in enumerate(images):
        r, c = divmod(i, ncols)
        y, x = pad + r * (height + pad), pad + c * (width + pad)
        grid[y:y + height, x:x + width] = im
    return grid


def save_png(image: np.ndarray, path: str | Path, compress_level: int = 6, shared: bool = False) -> Path:
    """Write a uint8 (H, W, 3) image as PNG atomically; returns the path. ``compress_level`` 1 is
    ~3× faster than the default 6 with ~10 % larger files (noisy images barely compress).
    ``shared``: the umask's mode instead of owner-only (:func:`fedpose.io.atomic_write`)."""
    buffer = io.BytesIO()
    _to_pil(image).save(buffer, format="PNG", compress_level=compress_level)
    atomic_write(path, lambda fh: fh.write(buffer.getvalue()), shared=shared)
    return Path(path)


def save_overlays(
    images: Sequence[np.ndarray],
    preds: np.ndarray,
    path: str | Path,
    vis: np.ndarray | None = None,
    gts: np.ndarray | None = None,
    gt_vis: np.ndarray | None = None,
    ncols: int | None = None,
) -> Path:
    """Grid PNG of images with predicted skeletons (left/right colours) and, if given, GT in green.

    ``images`` uint8 HWC (e.g. :func:`fedpose.data.dataset.denormalize` of input crops);
    ``preds``/``gts`` (N, 16, 2) in the images' pixel frame; ``vis``/``gt_vis`` (N, 16).
    """
    preds = np.asarray(preds)
    if len(preds) != len(images):
        raise ValueError(f"{len(images)} images but {len(preds)} predictions")
    tiles = []
    for i, image in enumerate(images):
        tile = np.asarray(image)
        if gts is not None:
            tile = draw_skeleton(tile, gts[i], None if gt_vis is None else gt_vis[i], color=GT_COLOR,
                                 line_width=max(1, round(0.006 * min(tile.shape[:2]))))
        tiles.append(draw_skeleton(tile, preds[i], None if vis is None else vis[i]))
    return save_png(image_grid(tiles, ncols), path)


def save_curves(
    history: Sequence[dict[str, Any]], path: str | Path, keys: Sequence[str] | None = None, x_key: str = "step"
) -> Path:
    """Plot metric curves from a list of dicts (one per step/round) into a PNG, one panel per key.

    ``keys`` default to every numeric key except ``x_key``; entries lacking a key are skipped
    (e.g. validation metrics logged every n steps). The x axis is ``x_key`` if present, else the index.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        raise ValueError("save_curves needs a non-empty history")
    if keys is None:
        keys = sorted({k for row in history for k, v in row.items()
                       if k != x_key and isinstance(v, (int, float)) and not isinstance(v, bool)})
    if not keys:
        raise ValueError("save_curves: no numeric keys to plot")
    fig, axes = plt.subplots(len(keys), 1, figsize=(6.4, 2.2 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        points = [(row.get(x_key, i), row[key]) for i, row in enumerate(history)
                  if isinstance(row.get(key), (int, float))]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="." if len(points) < 50 else None, linewidth=1.2)
        ax.set_ylabel(key)
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel(x_key)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    atomic_write(path, lambda fh: fh.write(buffer.getvalue()))
    return Path(path)
