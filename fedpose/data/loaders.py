"""Reading any supported annotation format into PoseRecords (torch-free, so the CLI stays fast).

``load_records(path)`` auto-detects the format; see its docstring. Loaders per format live in
:mod:`fedpose.data.mpii` and :mod:`fedpose.data.coco`.
"""

from __future__ import annotations

import json
from pathlib import Path

from fedpose.data.annotations import ANNOTATIONS_FILE, AnnotationError, PoseRecord, resolve_image
from fedpose.data.coco import DEFAULT_ASPECT_RATIO, find_coco_file, is_coco, load_coco
from fedpose.data.mpii import load_mpii


class ImageLoadError(AnnotationError):
    """An image named by a record is missing or cannot be decoded; the message names the file."""


def resolve_image_or_raise(root: Path, image: str) -> Path:
    """Like :func:`resolve_image` but raising :class:`ImageLoadError` (names the file)."""
    try:
        return resolve_image(root, image)
    except AnnotationError as exc:
        raise ImageLoadError(str(exc)) from exc


def load_records(
    path: str | Path, check_images: bool = False, aspect_ratio: float = DEFAULT_ASPECT_RATIO
) -> tuple[list[PoseRecord], Path]:
    """Records in the 16-joint MPII order + the image root, auto-detecting the format.

    - a directory holding ``annotations.json`` → fedpose/MPII/HRNet schema (also synthetic data);
    - a ``.json`` file holding a list → the same schema (e.g. HRNet's ``valid.json``);
    - a ``.json`` with ``images`` and ``annotations`` keys, or a directory holding exactly one such
      file → COCO keypoints (mapped per :mod:`fedpose.data.coco`; ``aspect_ratio`` W/H pads boxes).

    ``check_images`` verifies that every referenced image exists (the dataset decodes lazily, so
    a corrupt file is reported, with its path, when first read).
    """
    path = Path(path)
    if path.is_dir():
        if (path / ANNOTATIONS_FILE).exists():
            records, root = load_mpii(path)
        elif find_coco_file(path) is not None:
            records, root = load_coco(path, aspect_ratio=aspect_ratio)
        else:
            raise AnnotationError(
                f"{path}: no {ANNOTATIONS_FILE} and no COCO keypoints json found in this directory"
            )
    elif path.is_file():
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AnnotationError(f"{path}: not valid JSON ({exc})") from exc
        if is_coco(raw):
            records, root = load_coco(path, aspect_ratio=aspect_ratio)
        elif isinstance(raw, list):
            records, root = load_mpii(path)
        else:
            raise AnnotationError(
                f"{path}: neither a list of pose records nor a COCO keypoints file "
                f"(top-level keys: {sorted(raw)[:8] if isinstance(raw, dict) else type(raw).__name__})"
            )
    else:
        raise AnnotationError(f"{path}: no such file or directory")
    if check_images:
        for name in sorted({r.image for r in records}):
            resolve_image_or_raise(root, name)
    return records, root
