"""COCO person keypoints → fedpose records in the 16-joint MPII order.

COCO has 17 keypoints (nose, eyes, ears, shoulders, elbows, wrists, hips, knees, ankles).
Mapping onto the MPII joints (``fedpose.joints.JOINT_NAMES``):

=====  ===========  ===========================================  ==========
MPII   joint        COCO source                                  kind
=====  ===========  ===========================================  ==========
0      r_ankle      16 right_ankle                               direct
1      r_knee       14 right_knee                                direct
2      r_hip        12 right_hip                                 direct
3      l_hip        11 left_hip                                  direct
4      l_knee       13 left_knee                                 direct
5      l_ankle      15 left_ankle                                direct
6      pelvis       midpoint of 11 left_hip, 12 right_hip        derived (both hips labelled)
7      thorax       midpoint of 5 left_shoulder, 6 right_sh.     derived (both shoulders labelled)
8      upper_neck   —                                            missing (vis 0)
9      head_top     —                                            missing (vis 0)
10     r_wrist      10 right_wrist                               direct
11     r_elbow      8 right_elbow                                direct
12     r_shoulder   6 right_shoulder                             direct
13     l_shoulder   5 left_shoulder                              direct
14     l_elbow      7 left_elbow                                 direct
15     l_wrist      9 left_wrist                                 direct
=====  ===========  ===========================================  ==========

Why upper_neck and head_top are *missing* rather than guessed: COCO's face points (nose, eyes,
ears) sit mid-head; any extrapolation to the crown or the neck base is a pose-dependent guess
(it breaks for profile and tilted heads) and would teach a biased target. Missing joints get
``joints_vis`` 0 and coordinates (−1, −1), exactly like MPII's unannotated joints, so they count
in neither loss nor PCKh.

A COCO keypoint is "annotated" when its flag v > 0 (1 = labelled but occluded, 2 = visible),
matching MPII/HRNet's ``joints_vis`` (annotated, not necessarily visible).

Person box → ``center``/``scale`` as HRNet's ``_xywh2cs``: centre of the (image-clipped) bbox; the
box is padded to the model's aspect ratio (W/H, default 192/256) and ``scale`` = padded box
height / 200 (MPII's unit). The dataset's 1.25 context padding is applied later, by
:class:`fedpose.data.dataset.PoseDataset`, as for MPII.

Head box (for PCKh's head size), derived from the labelled face points when at least
:data:`MIN_FACE_POINTS` of nose/eyes/ears are labelled: a box centred on their mean, of width
``1.2·D`` and height ``1.6·D`` where D is the largest distance between two labelled face points
(≈ ear-to-ear ≈ 0.85 × head width for a frontal head; MPII head boxes are ~1.35× taller than
wide). It is an approximation — PCKh on COCO is indicative, not comparable to MPII numbers.
Otherwise the record has no headbox.

Private head boxes (MaskDP masks every head in a crop, not only the record's own): every person
annotation of the image — including people with too few keypoints to become a record and crowd
regions — contributes one box to ``extra["image_head_boxes"]`` of each record of that image
(:func:`private_head_box`): a generous box around *all* its labelled face points (nose, eyes,
ears; one is enough), at least :data:`MIN_HEAD_FRACTION` of the person box's longer side wide and
tall; a person with no labelled face point, or a crowd region, contributes its whole person box
(the head is somewhere inside it: conservative).
"""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fedpose.data.annotations import AnnotationError, PoseRecord, parse_patient_id
from fedpose.joints import JOINT_INDEX, NUM_JOINTS

COCO_KEYPOINTS: tuple[str, ...] = (
    "nose", "left_eye", "right_eye", "left_ear", "right_ear",
    "left_shoulder", "right_shoulder", "left_elbow", "right_elbow", "left_wrist", "right_wrist",
    "left_hip", "right_hip", "left_knee", "right_knee", "left_ankle", "right_ankle",
)
COCO_INDEX = {name: i for i, name in enumerate(COCO_KEYPOINTS)}

# MPII joint ← one COCO keypoint.
DIRECT: dict[str, str] = {
    "r_ankle": "right_ankle", "r_knee": "right_knee", "r_hip": "right_hip",
    "l_hip": "left_hip", "l_knee": "left_knee", "l_ankle": "left_ankle",
    "r_wrist": "right_wrist", "r_elbow": "right_elbow", "r_shoulder": "right_shoulder",
    "l_shoulder": "left_shoulder", "l_elbow": "left_elbow", "l_wrist": "left_wrist",
}
# MPII joint ← midpoint of two COCO keypoints (both must be labelled).
MIDPOINT: dict[str, tuple[str, str]] = {
    "pelvis": ("left_hip", "right_hip"),
    "thorax": ("left_shoulder", "right_shoulder"),
}
# MPII joints COCO cannot provide.
MISSING: tuple[str, ...] = ("upper_neck", "head_top")

FACE_POINTS: tuple[str, ...] = ("nose", "left_eye", "right_eye", "left_ear", "right_ear")
MIN_FACE_POINTS = 3
HEADBOX_WIDTH_FACTOR = 1.2
HEADBOX_HEIGHT_FACTOR = 1.6
#: private head box: margin around the labelled face points, × their largest distance D (the crown and
#: chin lie beyond the eyes and ears: 0.9·D above/below and 0.6·D left/right of the points' hull gives a
#: box ≥ 1.2·D wide and ≥ 1.8·D tall, larger than the PCKh head box's 1.2·D × 1.6·D around the same points)
MASK_PAD_X, MASK_PAD_Y = 0.6, 0.9
#: private head box: minimum side, × the longer side of the person box (a head is ~1/7 of a standing
#: person; 1/4 is generous and covers single-point and foreshortened faces)
MIN_HEAD_FRACTION = 0.25
DEFAULT_ASPECT_RATIO = 192 / 256  # W / H of fedpose's default input
PIXEL_STD = 200.0


def is_coco(raw: Any) -> bool:
    return isinstance(raw, dict) and "annotations" in raw and "images" in raw


def coco_to_mpii(keypoints: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(17, 3) COCO [x, y, v] → MPII joints (16, 2) and joints_vis (16,) per the table above."""
    kp = np.asarray(keypoints, dtype=np.float32).reshape(len(COCO_KEYPOINTS), 3)
    labelled = kp[:, 2] > 0
    joints = np.full((NUM_JOINTS, 2), -1.0, dtype=np.float32)
    vis = np.zeros(NUM_JOINTS, dtype=np.float32)
    for mpii, coco in DIRECT.items():
        src = COCO_INDEX[coco]
        if labelled[src]:
            joints[JOINT_INDEX[mpii]] = kp[src, :2]
            vis[JOINT_INDEX[mpii]] = 1.0
    for mpii, (a, b) in MIDPOINT.items():
        ia, ib = COCO_INDEX[a], COCO_INDEX[b]
        if labelled[ia] and labelled[ib]:
            joints[JOINT_INDEX[mpii]] = 0.5 * (kp[ia, :2] + kp[ib, :2])
            vis[JOINT_INDEX[mpii]] = 1.0
    return joints, vis


def headbox_from_face(keypoints: np.ndarray) -> np.ndarray | None:
    """Approximate MPII head box from labelled nose/eyes/ears, or None (see module docstring)."""
    kp = np.asarray(keypoints, dtype=np.float64).reshape(len(COCO_KEYPOINTS), 3)
    face = np.array([kp[COCO_INDEX[n], :2] for n in FACE_POINTS if kp[COCO_INDEX[n], 2] > 0])
    if len(face) < MIN_FACE_POINTS:
        return None
    extent = max(float(np.linalg.norm(p - q)) for p, q in combinations(face, 2))
    if extent <= 0:
        return None
    cx, cy = face.mean(axis=0)
    half_w, half_h = 0.5 * HEADBOX_WIDTH_FACTOR * extent, 0.5 * HEADBOX_HEIGHT_FACTOR * extent
    return np.array([[cx - half_w, cy - half_h], [cx + half_w, cy + half_h]], dtype=np.float32)


def private_head_box(keypoints: np.ndarray, bbox_xywh: Sequence[float]) -> np.ndarray:
    """The box MaskDP masks for one COCO person, [[x1, y1], [x2, y2]] (see the module docstring)."""
    x, y, w, h = (float(v) for v in bbox_xywh)
    person = np.array([[x, y], [x + max(w, 0.0), y + max(h, 0.0)]])
    kp = np.asarray(keypoints, dtype=np.float64).reshape(len(COCO_KEYPOINTS), 3)
    face = np.array([kp[COCO_INDEX[n], :2] for n in FACE_POINTS if kp[COCO_INDEX[n], 2] > 0]).reshape(-1, 2)
    if len(face) == 0:
        return person
    extent = max([float(np.linalg.norm(p - q)) for p, q in combinations(face, 2)] + [0.0])
    low, high = face.min(axis=0), face.max(axis=0)
    low = low - np.array([MASK_PAD_X, MASK_PAD_Y]) * extent
    high = high + np.array([MASK_PAD_X, MASK_PAD_Y]) * extent
    centre, half = (low + high) / 2, (high - low) / 2
    half = np.maximum(half, 0.5 * MIN_HEAD_FRACTION * max(w, h))
    return np.stack([centre - half, centre + half])


def box_to_center_scale(
    box_xywh: np.ndarray, aspect_ratio: float = DEFAULT_ASPECT_RATIO
) -> tuple[np.ndarray, float]:
    """HRNet's ``_xywh2cs`` with a scalar (height) scale: pad to W/H = aspect_ratio, scale = h/200."""
    x, y, w, h = (float(v) for v in box_xywh)
    center = np.array([x + 0.5 * w, y + 0.5 * h], dtype=np.float32)
    if w > aspect_ratio * h:
        h = w / aspect_ratio
    return center, h / PIXEL_STD


def _clip_box(bbox: list[float], width: float, height: float) -> np.ndarray | None:
    x, y, w, h = bbox
    x1, y1 = max(0.0, x), max(0.0, y)
    x2 = min(width - 1.0, x1 + max(0.0, w - 1.0))
    y2 = min(height - 1.0, y1 + max(0.0, h - 1.0))
    if x2 < x1 or y2 < y1 or w <= 0 or h <= 0:
        return None
    return np.array([x1, y1, x2 - x1, y2 - y1], dtype=np.float32)


def records_from_coco(
    raw: dict[str, Any], where: str, aspect_ratio: float = DEFAULT_ASPECT_RATIO, min_keypoints: int = 1
) -> list[PoseRecord]:
    """One record per non-crowd person annotation with ≥ ``min_keypoints`` labelled keypoints."""
    images = {}
    image_patients: dict[Any, str | None] = {}  # a clinical export may tag each image with its patient
    for i, img in enumerate(raw["images"]):
        try:
            images[img["id"]] = (str(img["file_name"]), float(img["width"]), float(img["height"]))
            image_patients[img["id"]] = parse_patient_id(img.get("patient_id"), f"{where}: images[{i}]")
        except (KeyError, TypeError, ValueError) as exc:
            raise AnnotationError(f"{where}: images[{i}] needs id, file_name, width, height ({exc!r})") from exc
    person_ids = {c["id"] for c in raw.get("categories", []) if c.get("name") == "person"} or {1}
    head_boxes = _image_head_boxes(raw["annotations"], person_ids, where)
    records: list[PoseRecord] = []
    for i, ann in enumerate(raw["annotations"]):
        at = f"{where} annotations[{i}] (id {ann.get('id')})"
        if ann.get("category_id", 1) not in person_ids or ann.get("iscrowd", 0):
            continue
        try:
            keypoints = np.asarray(ann["keypoints"], dtype=np.float32)
            image_id = ann["image_id"]
            bbox = [float(v) for v in ann["bbox"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise AnnotationError(f"{at}: needs keypoints, image_id and bbox ({exc!r})") from exc
        if keypoints.size != 3 * len(COCO_KEYPOINTS):
            raise AnnotationError(f"{at}: expected {3 * len(COCO_KEYPOINTS)} keypoint values, got {keypoints.size}")
        if int((keypoints.reshape(-1, 3)[:, 2] > 0).sum()) < min_keypoints:
            continue
        if image_id not in images:
            raise AnnotationError(f"{at}: image_id {image_id} not in 'images'")
        file_name, width, height = images[image_id]
        box = _clip_box(bbox, width, height)
        if box is None:
            continue
        joints, vis = coco_to_mpii(keypoints)
        center, scale = box_to_center_scale(box, aspect_ratio)
        records.append(PoseRecord(
            image=file_name, joints=joints, joints_vis=vis, center=center, scale=scale,
            headbox=headbox_from_face(keypoints),
            extra={"coco_annotation_id": ann.get("id"), "coco_image_id": image_id,
                   "image_head_boxes": head_boxes.get(image_id, [])},
            # the person's own tag wins over the image's (an image may show several patients)
            patient_id=parse_patient_id(ann.get("patient_id"), at) or image_patients[image_id],
        ))
    return records


def _image_head_boxes(annotations: list[dict[str, Any]], person_ids: set[Any], where: str) -> dict[Any, list[list[list[float]]]]:
    """image id → the private head box of every person annotation (crowd regions and people with
    no keypoints included: they are people whose faces may be in someone's crop)."""
    boxes: dict[Any, list[list[list[float]]]] = {}
    for i, ann in enumerate(annotations):
        if ann.get("category_id", 1) not in person_ids:
            continue
        try:
            bbox = [float(v) for v in ann["bbox"]]
            keypoints = np.asarray(ann.get("keypoints") or [0.0] * 3 * len(COCO_KEYPOINTS), dtype=np.float64)
        except (KeyError, TypeError, ValueError) as exc:
            raise AnnotationError(f"{where} annotations[{i}] (id {ann.get('id')}): needs a numeric bbox ({exc!r})") from exc
        if keypoints.size != 3 * len(COCO_KEYPOINTS) or ann.get("iscrowd", 0):
            keypoints = np.zeros(3 * len(COCO_KEYPOINTS))  # a crowd region: its whole box is private
        box = private_head_box(keypoints, bbox)
        boxes.setdefault(ann.get("image_id"), []).append(np.round(box, 2).tolist())
    return boxes


def find_coco_file(directory: Path) -> Path | None:
    """The single COCO keypoints json in ``directory``, or None if there is none."""
    found = []
    for candidate in sorted(directory.glob("*.json")):
        try:
            raw = json.loads(candidate.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if is_coco(raw):
            found.append(candidate)
    if len(found) > 1:
        raise AnnotationError(f"{directory}: several COCO annotation files ({', '.join(p.name for p in found)}); pass one")
    return found[0] if found else None


def load_coco(
    path: str | Path, aspect_ratio: float = DEFAULT_ASPECT_RATIO, min_keypoints: int = 1
) -> tuple[list[PoseRecord], Path]:
    """Records + image root from a COCO keypoints json (or a directory holding one).

    The image root is the json's directory; images may sit beside it or in ``images/``.
    """
    path = Path(path)
    if path.is_dir():
        found = find_coco_file(path)
        if found is None:
            raise AnnotationError(f"{path}: no COCO keypoints json (with 'images' and 'annotations') found")
        path = found
    if not path.exists():
        raise AnnotationError(f"{path}: annotation file not found")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise AnnotationError(f"{path}: not valid JSON ({exc})") from exc
    if not is_coco(raw):
        raise AnnotationError(f"{path}: not a COCO keypoints file (needs 'images' and 'annotations')")
    return records_from_coco(raw, str(path), aspect_ratio, min_keypoints), path.parent
