"""Geometric transforms between an original image and the model's input crop.

Conventions (HRNet's ``get_affine_transform``, so numbers match the pose literature):

- Pixel coordinates put pixel *centres* on integers (cv2 convention): pixel ``(i, j)`` covers
  ``[i-0.5, i+0.5]``. Every point function here and the image warp use the same convention,
  so a joint at the centre of a pixel stays at the centre of the corresponding crop pixel.
- ``scale`` is MPII's: the crop is ``200·scale`` pixels *tall* in the original image, and
  ``200·scale·W/H`` wide, i.e. the crop keeps the model input's aspect ratio (H, W).
- The crop centre ``center`` maps to ``(W/2, H/2)`` in the input (HRNet maps to ``W·0.5``, not
  ``(W-1)/2``; we keep that so HRNet-trained numbers transfer).
- ``rot`` is in degrees; positive rotates the *content* counter-clockwise on screen as in HRNet
  (the source box is rotated by ``rot``, so the crop shows the image rotated by ``-rot``).
- Sizes are always ``(H, W)`` — the order of ``DataConfig.input_size`` — never cv2's ``(W, H)``.
- A horizontal flip of the crop maps ``x → W − 1 − x`` and swaps left/right joints
  (:data:`fedpose.joints.FLIP_PAIRS`); it is folded into the same affine so one warp does both.

cv2 is not available here; images are warped with PIL's ``Image.transform(AFFINE, BILINEAR)``,
which samples in a half-pixel-shifted frame — :func:`warp_affine` converts exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from fedpose.joints import flip_permutation

# MPII's scale unit: the person box is PIXEL_STD·scale pixels tall.
PIXEL_STD = 200.0


def _as_3x3(matrix: np.ndarray) -> np.ndarray:
    out = np.eye(3, dtype=np.float64)
    out[:2] = matrix
    return out


def get_affine_transform(
    center: np.ndarray | tuple[float, float],
    scale: float,
    rot: float,
    output_size: tuple[int, int],
    inverse: bool = False,
) -> np.ndarray:
    """2×3 matrix mapping original-image points into the (H, W) crop (or back if ``inverse``).

    Equivalent to HRNet's ``get_affine_transform(center, [s·W/H, s], rot, (W, H))`` — the
    three-point cv2 solve is replaced by its closed form ``p' = k·R(−rot)·(p − c) + (W/2, H/2)``
    with ``k = H / (200·scale)``.
    """
    height, width = output_size
    if height <= 0 or width <= 0:
        raise ValueError(f"output_size must be positive (H, W), got {output_size}")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    cx, cy = float(center[0]), float(center[1])
    k = height / (PIXEL_STD * float(scale))
    theta = math.radians(rot)
    cos, sin = math.cos(theta), math.sin(theta)
    # R(-theta) = [[cos, sin], [-sin, cos]]
    linear = k * np.array([[cos, sin], [-sin, cos]], dtype=np.float64)
    offset = np.array([width * 0.5, height * 0.5]) - linear @ np.array([cx, cy])
    forward = np.concatenate([linear, offset[:, None]], axis=1)
    if not inverse:
        return forward
    return np.linalg.inv(_as_3x3(forward))[:2]


def flip_matrix(width: int) -> np.ndarray:
    """2×3 matrix of the horizontal mirror ``x → W − 1 − x`` of a crop ``width`` pixels wide."""
    return np.array([[-1.0, 0.0, width - 1.0], [0.0, 1.0, 0.0]])


def compose(second: np.ndarray, first: np.ndarray) -> np.ndarray:
    """2×3 matrix applying ``first`` then ``second``."""
    return (_as_3x3(second) @ _as_3x3(first))[:2]


def invert(matrix: np.ndarray) -> np.ndarray:
    return np.linalg.inv(_as_3x3(matrix))[:2]


def affine_points(points: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """Apply a 2×3 affine to points of shape (..., 2); returns float32 of the same shape."""
    pts = np.asarray(points, dtype=np.float64)
    out = pts @ matrix[:, :2].T + matrix[:, 2]
    return out.astype(np.float32)


def crop_to_original(
    points: np.ndarray, center: np.ndarray, scale: float, output_size: tuple[int, int], rot: float = 0.0
) -> np.ndarray:
    """Map points from the (H, W) input crop back to the original image (predictions → GT frame).

    ``points`` may be (16, 2) or batched (N, 16, 2) with per-sample ``center`` (N, 2) and
    ``scale`` (N,).
    """
    pts = np.asarray(points, dtype=np.float64)
    if pts.ndim == 3:
        centers = np.asarray(center, dtype=np.float64).reshape(-1, 2)
        scales = np.asarray(scale, dtype=np.float64).reshape(-1)
        rots = np.broadcast_to(np.asarray(rot, dtype=np.float64), scales.shape)
        if not (len(centers) == len(scales) == len(pts)):
            raise ValueError(
                f"batched crop_to_original needs one center/scale per sample: "
                f"{len(pts)} samples, {len(centers)} centers, {len(scales)} scales"
            )
        return np.stack([
            crop_to_original(p, c, float(s), output_size, float(r)) for p, c, s, r in zip(pts, centers, scales, rots)
        ])
    inverse = get_affine_transform(center, float(scale), rot, output_size, inverse=True)
    return affine_points(pts, inverse)


def warp_affine(image: Image.Image, matrix: np.ndarray, output_size: tuple[int, int]) -> Image.Image:
    """Warp ``image`` into an (H, W) image with the 2×3 original→crop ``matrix`` (bilinear, black fill).

    PIL maps output pixel ``i`` to source ``A(i + 0.5) − 0.5`` in integer-centre coordinates, so
    the inverse matrix is conjugated by a half-pixel shift to match cv2.warpAffine exactly.
    """
    height, width = output_size
    inverse = _as_3x3(invert(matrix))
    shift = np.array([[1.0, 0.0, 0.5], [0.0, 1.0, 0.5], [0.0, 0.0, 1.0]])
    unshift = np.array([[1.0, 0.0, -0.5], [0.0, 1.0, -0.5], [0.0, 0.0, 1.0]])
    pil_matrix = (shift @ inverse @ unshift)[:2].reshape(-1)
    return image.transform(
        (width, height), Image.Transform.AFFINE, tuple(float(v) for v in pil_matrix),
        resample=Image.Resampling.BILINEAR, fillcolor=(0, 0, 0) if image.mode == "RGB" else 0,
    )


#: Source pixels (along x and along y) a pixel's value reaches in an image warped by
#: :func:`warp_affine`: bilinear sampling reads the source pixels whose centres are less than 1 px
#: from the sample point, whatever the zoom (PIL's affine transform does not antialias).
WARP_SUPPORT = 1.0


def reach_in_crop(matrix: np.ndarray, distance: float) -> np.ndarray:
    """(x, y) half-extents, in crop pixels, of a source square of half-side ``distance`` mapped by
    ``matrix`` (its bounding box: rotation, zoom and flip included). A source region grown by
    ``distance`` maps inside its mapped bounding box grown by this much on each side."""
    linear = np.abs(np.asarray(matrix, dtype=np.float64)[:, :2])
    return distance * linear.sum(axis=1)


def flip_joints(joints: np.ndarray, vis: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Mirror joints in a frame ``width`` pixels wide and swap left/right labels."""
    perm = flip_permutation()
    mirrored = np.asarray(joints, dtype=np.float32).copy()
    mirrored[..., 0] = width - 1 - mirrored[..., 0]
    return mirrored[..., perm, :], np.asarray(vis)[..., perm]


def inside_crop(points: np.ndarray, output_size: tuple[int, int]) -> np.ndarray:
    """Boolean mask of points in ``[0, W) × [0, H)`` — the range SimCC's bins cover (RTMPose's
    rule for zeroing a keypoint's weight)."""
    height, width = output_size
    x, y = points[..., 0], points[..., 1]
    return (x >= 0) & (x < width) & (y >= 0) & (y < height)


@dataclass(frozen=True)
class Augmentation:
    """One random draw of the training-time geometric augmentation."""

    scale_factor: float = 1.0
    rotation: float = 0.0
    flip: bool = False


def sample_augmentation(
    rng: np.random.Generator, scale_jitter: float, rotation: float, flip: bool, rotation_range: float | None = None
) -> Augmentation:
    """HRNet's recipe: scale ×clip(1 + N(0, sf), 1−sf, 1+sf); rotation clip(N(0, rf), ±2rf) with
    probability 0.6, else 0; flip p = 0.5. The rotation's clip is ``rotation_range`` (default ``rotation``:
    one rf, fedpose's default, so ``rotation`` is the hard range; HRNet's 2rf is ``data.rotation_clip = 2``)."""
    bound = rotation if rotation_range is None else rotation_range
    factor = float(np.clip(1.0 + rng.normal() * scale_jitter, 1.0 - scale_jitter, 1.0 + scale_jitter))
    angle = 0.0
    if rotation > 0 and rng.random() <= 0.6:
        angle = float(np.clip(rng.normal() * rotation, -bound, bound))
    flipped = bool(flip and rng.random() < 0.5)
    return Augmentation(factor, angle, flipped)


def crop_transform(
    center: np.ndarray, scale: float, output_size: tuple[int, int], aug: Augmentation = Augmentation()
) -> np.ndarray:
    """The full original→input 2×3 matrix for one sample: crop, jitter, rotation, optional flip."""
    matrix = get_affine_transform(center, scale * aug.scale_factor, aug.rotation, output_size)
    if aug.flip:
        matrix = compose(flip_matrix(output_size[1]), matrix)
    return matrix
