"""MPII / COCO loaders, format auto-detection and image errors, on the real shared files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fedpose.data.annotations import AnnotationError
from fedpose.data.coco import box_to_center_scale, coco_to_mpii, headbox_from_face, load_coco
from fedpose.data.dataset import ImageLoadError, PoseDataset, load_records
from fedpose.joints import JOINT_INDEX, NUM_JOINTS

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
COCO_FILE = DATA / "coco-real" / "person_keypoints.json"


@pytest.fixture(scope="module")
def valid():
    return load_records(DATA / "mpii-valid" / "valid.json")


@pytest.fixture(scope="module")
def coco_raw():
    return json.loads(COCO_FILE.read_text())


def test_load_records_detects_every_format(valid):
    mpii, mpii_root = load_records(DATA / "mpii-real", check_images=True)
    assert len(mpii) == 5 and mpii_root == DATA / "mpii-real"
    coco_dir, coco_root = load_records(DATA / "coco-real", check_images=True)
    coco_file, _ = load_records(COCO_FILE)
    assert coco_root == DATA / "coco-real" and len(coco_dir) == len(coco_file) > 0
    valid, valid_root = valid
    assert len(valid) == 2958 and valid_root == DATA / "mpii-valid"
    # mpii-real holds the first rows of the validation split
    np.testing.assert_allclose(mpii[0].joints, valid[0].joints)


def test_mpii_missing_joints_are_invisible(valid):
    valid, _ = valid
    joints = np.stack([r.joints for r in valid])
    vis = np.stack([r.joints_vis for r in valid])
    assert (vis == 0).sum() > 0
    np.testing.assert_array_equal(joints[vis == 0], -1.0)


def test_coco_mapping_on_real_file(coco_raw):
    records, _ = load_coco(COCO_FILE)
    expected = [a for a in coco_raw["annotations"] if not a["iscrowd"] and a["num_keypoints"] > 0]
    assert len(records) == len(expected)
    first = next(r for r in records if r.extra["coco_annotation_id"] == expected[0]["id"])
    kp = np.asarray(expected[0]["keypoints"], dtype=np.float32).reshape(17, 3)
    names = ["nose", "left_eye", "right_eye", "left_ear", "right_ear", "left_shoulder", "right_shoulder",
             "left_elbow", "right_elbow", "left_wrist", "right_wrist", "left_hip", "right_hip",
             "left_knee", "right_knee", "left_ankle", "right_ankle"]
    coco = {n: kp[i, :2] for i, n in enumerate(names)}
    for mpii_name, coco_name in [("r_ankle", "right_ankle"), ("l_ankle", "left_ankle"), ("r_knee", "right_knee"),
                                 ("l_hip", "left_hip"), ("r_wrist", "right_wrist"), ("l_elbow", "left_elbow"),
                                 ("r_shoulder", "right_shoulder"), ("l_shoulder", "left_shoulder")]:
        np.testing.assert_allclose(first.joints[JOINT_INDEX[mpii_name]], coco[coco_name])
    np.testing.assert_allclose(first.joints[JOINT_INDEX["pelvis"]], (coco["left_hip"] + coco["right_hip"]) / 2)
    np.testing.assert_allclose(first.joints[JOINT_INDEX["thorax"]],
                               (coco["left_shoulder"] + coco["right_shoulder"]) / 2)
    assert first.joints_vis[JOINT_INDEX["head_top"]] == 0 and first.joints_vis[JOINT_INDEX["upper_neck"]] == 0
    assert first.joints_vis.sum() == 14
    # The person's right side is on the image's left for this frontal view (right shoulder x < left).
    assert first.joints[JOINT_INDEX["r_shoulder"], 0] < first.joints[JOINT_INDEX["l_shoulder"], 0]


def test_coco_unlabelled_keypoints_and_midpoints():
    kp = np.zeros((17, 3), np.float32)
    kp[11] = [10, 20, 2]  # left hip only
    kp[5] = [30, 40, 1]   # left shoulder, occluded but labelled
    kp[6] = [50, 40, 2]   # right shoulder
    joints, vis = coco_to_mpii(kp)
    assert vis[JOINT_INDEX["l_hip"]] == 1 and vis[JOINT_INDEX["r_hip"]] == 0
    assert vis[JOINT_INDEX["pelvis"]] == 0  # needs both hips
    assert vis[JOINT_INDEX["thorax"]] == 1 and tuple(joints[JOINT_INDEX["thorax"]]) == (40.0, 40.0)
    assert vis.sum() == 4 and joints.shape == (NUM_JOINTS, 2)
    np.testing.assert_array_equal(joints[vis == 0], -1.0)


def test_coco_center_scale_and_headbox(coco_raw):
    center, scale = box_to_center_scale(np.array([10.0, 20.0, 60.0, 100.0]), aspect_ratio=0.75)
    np.testing.assert_allclose(center, [40.0, 70.0])
    assert scale == pytest.approx(0.5)  # tall box: height 100 → 0.5
    _, wide_scale = box_to_center_scale(np.array([0.0, 0.0, 150.0, 100.0]), aspect_ratio=0.75)
    assert wide_scale == pytest.approx(1.0)  # wide box padded to 150/0.75 = 200 tall
    ann = coco_raw["annotations"][0]
    box = headbox_from_face(np.asarray(ann["keypoints"]))
    face = np.asarray(ann["keypoints"], dtype=np.float32).reshape(17, 3)[:5, :2]
    assert box is not None
    assert (face >= box[0]).all() and (face <= box[1]).all()  # the face points lie in the head box
    assert headbox_from_face(np.zeros(51)) is None


def test_every_coco_record_fits_its_crop():
    records, root = load_records(DATA / "coco-real")
    dataset = PoseDataset(records, root, (128, 96), train=False)
    for i, record in enumerate(records):
        sample = dataset[i]
        # the box-derived crop (1.25 padding) keeps every labelled joint inside the input
        assert sample["weight"].sum() == record.joints_vis.sum(), record.extra


def test_corrupt_and_missing_images_name_the_file(tmp_path):
    src = DATA / "mpii-real"
    shutil.copy(src / "annotations.json", tmp_path / "annotations.json")
    (tmp_path / "images").mkdir()
    records = json.loads((src / "annotations.json").read_text())
    shutil.copy(src / "images" / records[0]["image"], tmp_path / "images" / records[0]["image"])
    # record 1: truncated JPEG (header only); record 2: not an image at all; others missing
    good = (src / "images" / records[1]["image"]).read_bytes()
    (tmp_path / "images" / records[1]["image"]).write_bytes(good[:2000])
    (tmp_path / "images" / records[2]["image"]).write_bytes(b"this is not a jpeg")

    loaded, root = load_records(tmp_path)
    dataset = PoseDataset(loaded, root, (64, 64))
    assert dataset[0]["image"].shape == (3, 64, 64)
    for index in (1, 2):
        with pytest.raises(ImageLoadError, match=records[index]["image"]):
            dataset[index]
    with pytest.raises(ImageLoadError, match=records[3]["image"]):
        dataset[3]
    with pytest.raises(ImageLoadError, match=records[3]["image"]):
        load_records(tmp_path, check_images=True)


def test_bad_annotation_inputs(tmp_path):
    with pytest.raises(AnnotationError, match="no such file"):
        load_records(tmp_path / "nope.json")
    with pytest.raises(AnnotationError, match="no annotations.json and no COCO"):
        load_records(tmp_path)
    (tmp_path / "x.json").write_text('{"foo": 1}')
    with pytest.raises(AnnotationError, match="neither a list of pose records nor a COCO"):
        load_records(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("{not json")
    with pytest.raises(AnnotationError, match="not valid JSON"):
        load_records(tmp_path / "y.json")
    bad = {"images": [{"id": 1, "file_name": "a.jpg", "width": 10, "height": 10}],
           "annotations": [{"image_id": 1, "bbox": [0, 0, 5, 5], "keypoints": [1, 2, 2]}]}
    (tmp_path / "z.json").write_text(json.dumps(bad))
    with pytest.raises(AnnotationError, match="expected 51 keypoint values"):
        load_records(tmp_path / "z.json")
