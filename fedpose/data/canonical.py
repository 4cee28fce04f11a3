"""Canonical windows: every training record's crop source at one fixed size, decoded before training.

Why. Whoever times a site's rounds learns what the rounds cost. Decoding a record's image file
costs what the file is — its size, format and resolution — and a round loads its sampled rows
and padding rows drawn from every record, so without this a patient with large files slowed
every round, sampled or not (an attacker review measured 3.29 vs 3.03 s per round). Here each record's
image is decoded once, when the site first loads its data, into a window of one fixed shape:
same centre as its crop, every crop the augmentation can draw inside it (scale up to
1 + ``scale_jitter``, rotation up to ``rotation_range``), sampled ``OVERSAMPLE_OF_JITTER``-finely
enough that the most zoomed-in crop never upsamples it. A round then reads a fixed number of
bytes from RAM per row and warps them into the crop: the same work for every record.

The windows of a data set are kept in one ``.npy`` under the site's state directory, keyed by the
records, their files' size and modification time, and the geometry (input size, augmentation
bounds, padding); a site loads them whole into memory, never memory-mapped (which pages are
resident would otherwise depend on which units earlier steps sampled).

What this does not hide: building the windows costs what the files cost, once, when the site first
loads its data (or when its data or input size change) — before any round when the operator runs
``fedpose site prepare``. Its time is a single release of a sum over all files, not per round.

Reach. A crop pixel is bilinear in window pixels, each bilinear in source pixels, so a box's
pixels reach ``PRIVATE_PIXEL_REACH`` source pixels plus one window pixel (in source pixels,
1/zoom) past it (:meth:`CanonicalWindows.reach`); a window built from a JPEG decoded at a reduced
size has infinite reach, as before (MaskDP decodes at full size).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from fedpose.data.annotations import PoseRecord
from fedpose.data.image_check import file_stamp
from fedpose.data.loaders import resolve_image_or_raise
from fedpose.data.transforms import PIXEL_STD, WARP_SUPPORT, crop_transform, warp_affine
from fedpose.io import atomic_write, atomic_write_json

VERSION = 1
#: window pixels per crop pixel of the un-augmented crop, as a multiple of 1/(1 − scale_jitter): a crop
#: zoomed in by the largest jitter reads one window pixel per crop pixel
OVERSAMPLE_OF_JITTER = 1.0
#: window pixels beyond the augmentation's extent on every side (bilinear reads one past the edge)
MARGIN = 2


@dataclass(frozen=True)
class WindowGeometry:
    """The fixed shape every record's window has, and how finely it samples the crop."""

    size: tuple[int, int]  #: (H, W) of every window
    oversample: float  #: window pixels per pixel of the un-augmented crop

    @classmethod
    def for_crops(cls, input_size: tuple[int, int], scale_jitter: float, rotation_range: float) -> "WindowGeometry":
        from fedpose.data.dataset import augmentation_extent

        oversample = OVERSAMPLE_OF_JITTER / (1.0 - scale_jitter)
        extent = augmentation_extent(input_size, scale_jitter, rotation_range)
        height, width = (2 * math.ceil(side * oversample / 2) + 2 * MARGIN for side in extent)
        return cls((int(height), int(width)), float(oversample))

    def matrix(self, record: PoseRecord, input_size: tuple[int, int], padding: float) -> np.ndarray:
        """Original → window 2×3 matrix of ``record``: its crop's centre, ``oversample`` × its zoom."""
        scale = float(record.scale) * padding * self.size[0] / (input_size[0] * self.oversample)
        return crop_transform(np.asarray(record.center, dtype=np.float32), scale, self.size)


@dataclass
class CanonicalWindows:
    """Every record's window (uint8 N×H×W×3, in memory) and its original → window matrix."""

    windows: np.ndarray
    matrices: np.ndarray  #: N×2×3
    reductions: np.ndarray  #: N: the factor the source image was decoded smaller by (1: full size)

    def window(self, index: int) -> np.ndarray:
        return self.windows[index]

    def matrix(self, index: int) -> np.ndarray:
        return self.matrices[index]

    def reach(self, index: int, source_reach: float) -> float:
        """Source pixels a box's pixels reach past it in a crop warped from this window (module docstring)."""
        if self.reductions[index] != 1:
            return math.inf
        return source_reach + (WARP_SUPPORT + 1e-3) / _zoom(self.matrices[index])

    def __len__(self) -> int:
        return len(self.windows)


def _zoom(matrix: np.ndarray) -> float:
    """Window pixels per source pixel of an original → window matrix (a scaling: windows never rotate)."""
    return float(np.abs(matrix[:, :2]).max())


def _key(records: Sequence[PoseRecord], root: Path, geometry: WindowGeometry, input_size: tuple[int, int],
         padding: float, reduced_decode: bool) -> str:
    digest = hashlib.sha256(json.dumps([VERSION, geometry.size, geometry.oversample, list(input_size), padding,
                                        reduced_decode]).encode())
    for record in records:
        stamp = file_stamp(resolve_image_or_raise(root, record.image))
        digest.update(json.dumps([record.image, stamp, [float(v) for v in record.center], float(record.scale)]).encode())
    return digest.hexdigest()[:20]


def canonical_windows(
    records: Sequence[PoseRecord],
    root: str | Path,
    input_size: tuple[int, int],
    scale_jitter: float,
    rotation_range: float,
    padding: float,
    cache_dir: str | Path,
    reduced_decode: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> CanonicalWindows:
    """The records' windows: read from ``cache_dir`` when built for the same records, files and
    geometry, else built (every image decoded once) and saved there, replacing older windows of
    this input size."""
    from fedpose.data.dataset import load_image, reduction_matrix
    from fedpose.data.transforms import compose, invert

    root, cache_dir = Path(root), Path(cache_dir)
    geometry = WindowGeometry.for_crops(input_size, scale_jitter, rotation_range)
    matrices = np.stack([geometry.matrix(r, input_size, padding) for r in records]) if records else np.zeros((0, 2, 3))
    prefix = f"windows-{input_size[0]}x{input_size[1]}-"
    key = _key(records, root, geometry, input_size, padding, reduced_decode)
    array_path, done_path = cache_dir / f"{prefix}{key}.npy", cache_dir / f"{prefix}{key}.json"
    if done_path.exists() and array_path.exists():
        windows = np.load(array_path)  # whole, into memory: never memory-mapped (module docstring)
        reductions = np.asarray(json.loads(done_path.read_text())["reductions"], dtype=np.int64)
        if windows.shape == (len(records), *geometry.size, 3) and len(reductions) == len(records):
            return CanonicalWindows(windows, matrices, reductions)
    windows = np.zeros((len(records), *geometry.size, 3), np.uint8)
    reductions = np.ones(len(records), np.int64)
    for index, record in enumerate(records):
        zoom = _zoom(matrices[index]) if reduced_decode else 1.0
        image, reduction = load_image(resolve_image_or_raise(root, record.image), zoom)
        image_matrix = matrices[index] if reduction == 1 else compose(matrices[index], invert(reduction_matrix(reduction)))
        windows[index] = np.asarray(warp_affine(image, image_matrix, geometry.size))
        reductions[index] = reduction
        if progress is not None:
            progress(index + 1, len(records))
    cache_dir.mkdir(parents=True, exist_ok=True)
    for stale in cache_dir.glob(f"{prefix}*"):
        stale.unlink()
    atomic_write(array_path, lambda fh: np.save(fh, windows))
    atomic_write_json(done_path, {"version": VERSION, "records": len(records), "size": list(geometry.size),
                                  "oversample": geometry.oversample, "reductions": reductions.tolist()})
    return CanonicalWindows(windows, matrices, reductions)
