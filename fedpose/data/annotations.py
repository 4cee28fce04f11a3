"""The one annotation schema fedpose reads and writes (MPII, HRNet style).

A dataset directory holds ``annotations.json`` (a list of records) and the images it names,
relative to the directory (or to ``images/`` inside it). One record per person:

    {"image": "000001.png", "joints": 16×[x, y], "joints_vis": 16×{0,1},
     "center": [x, y], "scale": s, "headbox": [[x1, y1], [x2, y2]], "patient_id": "p-017"}

``scale`` follows the MPII convention: the person box is ``200·scale`` pixels tall.
``patient_id`` is optional: who is in the image, when the site knows it. It makes patient-level
privacy possible (the protection unit, :mod:`fedpose.data.units`); records of one patient may span
many images. The image file name identifies the image.
Synthetic data, MPII and COCO (after joint mapping) all load into :class:`PoseRecord`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedpose.io import atomic_write_text
from fedpose.joints import NUM_JOINTS

ANNOTATIONS_FILE = "annotations.json"


class AnnotationError(ValueError):
    """An annotation file or record is malformed; the message names the file, record and field."""


@dataclass
class PoseRecord:
    image: str
    joints: np.ndarray  # (16, 2) float32, pixel coordinates in the original image
    joints_vis: np.ndarray  # (16,) float32 in {0, 1}; 0 = missing or not annotated
    center: np.ndarray  # (2,) float32
    scale: float
    headbox: np.ndarray | None = None  # (2, 2) float32 [[x1, y1], [x2, y2]]
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. synthetic "site", "face_box"
    patient_id: str | None = None  # who this person is, when annotated (protection unit "patient")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "image": self.image,
            "joints": np.round(self.joints.astype(float), 4).tolist(),
            "joints_vis": [int(v) for v in self.joints_vis],
            "center": np.round(self.center.astype(float), 4).tolist(),
            "scale": round(float(self.scale), 6),
        }
        if self.headbox is not None:
            out["headbox"] = np.round(self.headbox.astype(float), 4).tolist()
        if self.patient_id is not None:
            out["patient_id"] = self.patient_id
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any], where: str = "record") -> "PoseRecord":
        def need(key: str) -> Any:
            if key not in raw:
                raise AnnotationError(f"{where}: missing field '{key}'")
            return raw[key]

        try:
            joints = np.asarray(need("joints"), dtype=np.float32)
            vis = np.asarray(raw.get("joints_vis", [1] * NUM_JOINTS), dtype=np.float32)
            center = np.asarray(need("center"), dtype=np.float32)
            scale = float(need("scale"))
            headbox = np.asarray(raw["headbox"], dtype=np.float32) if raw.get("headbox") is not None else None
        except (TypeError, ValueError) as exc:
            raise AnnotationError(f"{where}: non-numeric value ({exc})") from exc
        if joints.shape != (NUM_JOINTS, 2):
            raise AnnotationError(f"{where}: 'joints' must be {NUM_JOINTS}×2, got shape {joints.shape}")
        if vis.shape != (NUM_JOINTS,):
            raise AnnotationError(f"{where}: 'joints_vis' must have {NUM_JOINTS} entries, got {vis.shape}")
        if center.shape != (2,):
            raise AnnotationError(f"{where}: 'center' must be [x, y], got shape {center.shape}")
        if not scale > 0:
            raise AnnotationError(f"{where}: 'scale' must be positive, got {scale}")
        if headbox is not None and headbox.shape != (2, 2):
            raise AnnotationError(f"{where}: 'headbox' must be [[x1, y1], [x2, y2]], got shape {headbox.shape}")
        if not np.isfinite(joints).all():
            raise AnnotationError(f"{where}: 'joints' contains NaN or Inf")
        # the crop is warped from center and scale, and MaskDP masks the head box: a non-finite one
        # would make the record's image non-finite (refused here, before any privacy spend)
        if not np.isfinite(center).all():
            raise AnnotationError(f"{where}: 'center' contains NaN or Inf")
        if not math.isfinite(scale):
            raise AnnotationError(f"{where}: 'scale' must be finite, got {scale}")
        if headbox is not None and not np.isfinite(headbox).all():
            raise AnnotationError(f"{where}: 'headbox' contains NaN or Inf")
        patient_id = parse_patient_id(raw.get("patient_id"), where)
        known = {"image", "joints", "joints_vis", "center", "scale", "headbox", "patient_id"}
        extra = {k: v for k, v in raw.items() if k not in known}
        return cls(str(need("image")), joints, (vis > 0).astype(np.float32), center, scale, headbox, extra, patient_id)


def parse_patient_id(value: Any, where: str) -> str | None:
    """An annotated patient id as a non-empty string (ints are accepted: registries often number
    patients); None when absent. Anything else is an error naming the record."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise AnnotationError(f"{where}: 'patient_id' must be a string or an integer, got {type(value).__name__}")
    text = str(value).strip()
    if not text:
        raise AnnotationError(f"{where}: 'patient_id' is empty (omit the field when the patient is unknown)")
    return text


def read_annotations(path: str | Path) -> list[PoseRecord]:
    """Read an annotations.json file (or a dataset directory containing one)."""
    path = Path(path)
    if path.is_dir():
        path = path / ANNOTATIONS_FILE
    if not path.exists():
        raise AnnotationError(f"{path}: annotation file not found")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise AnnotationError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, list):
        raise AnnotationError(f"{path}: expected a JSON list of records, got {type(raw).__name__}")
    return [PoseRecord.from_json(r, where=f"{path} record {i}") for i, r in enumerate(raw)]


def write_annotations(path: str | Path, records: list[PoseRecord]) -> None:
    """Write records atomically: a crash mid-write leaves the previous file intact."""
    path = Path(path)
    if path.is_dir():
        path = path / ANNOTATIONS_FILE
    atomic_write_text(path, json.dumps([r.to_json() for r in records]))


def resolve_image(dataset_dir: Path, image: str) -> Path:
    """Images live beside annotations.json or in its images/ subfolder (an absolute name is read
    where it points: the black-box audit adds its canaries so)."""
    for candidate in (dataset_dir / image, dataset_dir / "images" / image):
        if candidate.exists():
            return candidate
    raise AnnotationError(f"{dataset_dir}: image '{image}' not found (looked in . and images/)")


def file_digest(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes: an image's identity whatever it is named."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def refuse_image_aliases(dataset_dir: Path, files: Mapping[str, Path], digests: Mapping[str, str] | None = None) -> None:
    """:class:`AnnotationError` when two image names of the annotations are one image: one file
    ("x.png" and "images/x.png", "./x.png", a link) or two files with the same bytes (a copy). Units,
    LDP-Slicing's single release and MaskDP's head boxes count images by name, so an image named
    twice would be two units (its patients not merged), privatized twice (twice its ε per pixel), or
    masked for only one name's people. ``digests``: name → :func:`file_digest`, where the caller has
    them (else each file is read)."""
    seen: dict[tuple[int, int], str] = {}
    by_content: dict[str, str] = {}
    for name, path in files.items():
        status = os.stat(path)  # follows links: one file, one identity
        key = (status.st_dev, status.st_ino)
        if key in seen:
            raise AnnotationError(f"{dataset_dir}: the image names '{seen[key]}' and '{name}' are one file ({path}); "
                                  "name each image one way in the annotations")
        seen[key] = name
        content = digests[name] if digests is not None and name in digests else file_digest(path)
        if content in by_content:
            raise AnnotationError(f"{dataset_dir}: the images '{by_content[content]}' and '{name}' hold the same bytes: one "
                                  "photograph under two names; keep one file and name it in every record that shows it")
        by_content[content] = name
