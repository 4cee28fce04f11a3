"""MPII in HRNet's json layout: a list of people with joints, joints_vis, center, scale (+ headbox).

Accepted inputs: a dataset directory holding ``annotations.json`` (images beside it or in
``images/``), or a path to such a json file (e.g. HRNet's ``valid.json``), whose directory is
then the image root. HRNet's files use the same field names as fedpose's schema
(:mod:`fedpose.data.annotations`); missing joints are stored as (−1, −1) with ``joints_vis`` 0.
Images are not opened here (they are decoded lazily by the dataset), so an annotation-only
file such as ``valid.json`` is usable for evaluation.
"""

from __future__ import annotations

from pathlib import Path

from fedpose.data.annotations import ANNOTATIONS_FILE, AnnotationError, PoseRecord, read_annotations


def mpii_annotation_file(path: str | Path) -> Path:
    path = Path(path)
    return path / ANNOTATIONS_FILE if path.is_dir() else path


def load_mpii(path: str | Path) -> tuple[list[PoseRecord], Path]:
    """Records and image root from an MPII/HRNet-style dataset directory or json file."""
    file = mpii_annotation_file(path)
    if not file.exists():
        raise AnnotationError(f"{file}: annotation file not found")
    return read_annotations(file), file.parent
