"""Overlays on a real MPII image, image grids and curve plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedpose.data.dataset import PoseDataset, denormalize, load_records
from fedpose.joints import JOINT_INDEX, SKELETON
from fedpose.viz import LEFT_COLOR, RIGHT_COLOR, draw_skeleton, image_grid, save_curves, save_overlays, save_png

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="module")
def mpii_sample():
    records, root = load_records(DATA / "mpii-real")
    record = records[0]
    image = np.asarray(Image.open(root / "images" / record.image).convert("RGB"))
    return image, record


def _near(image: np.ndarray, point: np.ndarray, radius: int = 3) -> np.ndarray:
    x, y = int(round(point[0])), int(round(point[1]))
    return image[max(0, y - radius):y + radius + 1, max(0, x - radius):x + radius + 1].reshape(-1, 3)


def test_overlay_on_real_mpii_image(mpii_sample, tmp_path):
    image, record = mpii_sample
    drawn = draw_skeleton(image, record.joints, record.joints_vis)
    assert drawn.shape == image.shape and drawn.dtype == np.uint8
    assert not np.shares_memory(drawn, image)
    # every visible joint got a marker: pixels around it changed
    for j in np.flatnonzero(record.joints_vis):
        changed = np.abs(_near(drawn, record.joints[j]).astype(int) - _near(image, record.joints[j]).astype(int))
        assert changed.max() > 60, f"joint {j} not drawn"
    # bone midpoints carry the side colour: left upper arm blue, right thigh red
    for (a, b), colour in (((JOINT_INDEX["l_shoulder"], JOINT_INDEX["l_elbow"]), LEFT_COLOR),
                           ((JOINT_INDEX["r_hip"], JOINT_INDEX["r_knee"]), RIGHT_COLOR)):
        assert (a, b) in SKELETON or (b, a) in SKELETON
        mid = (record.joints[a] + record.joints[b]) / 2
        assert (np.abs(_near(drawn, mid, 1).astype(int) - colour).max(axis=1) <= 2).any()
    # far from the person nothing changed
    np.testing.assert_array_equal(drawn[:40, :40], image[:40, :40])
    out = save_png(drawn, tmp_path / "overlay.png")
    np.testing.assert_array_equal(np.asarray(Image.open(out)), drawn)


def test_invisible_joints_are_not_drawn(mpii_sample):
    image, record = mpii_sample
    vis = record.joints_vis.copy()
    vis[JOINT_INDEX["l_wrist"]] = 0
    drawn = draw_skeleton(image, record.joints, vis)
    wrist = record.joints[JOINT_INDEX["l_wrist"]]
    # the wrist is at the end of the forearm: with it hidden, its surroundings stay untouched
    np.testing.assert_array_equal(_near(drawn, wrist, 2), _near(image, wrist, 2))


def test_save_overlays_of_dataset_crops(tmp_path):
    records, root = load_records(DATA / "mpii-real")
    dataset = PoseDataset(records, root, (128, 96), train=False)
    samples = [dataset[i] for i in range(len(dataset))]
    crops = [denormalize(s["image"]) for s in samples]
    gts = np.stack([s["joints"].numpy() for s in samples])
    preds = gts + 3.0
    path = save_overlays(crops, preds, tmp_path / "overlays.png", vis=np.stack([s["weight"].numpy() for s in samples]),
                         gts=gts, ncols=5)
    grid = np.asarray(Image.open(path))
    assert grid.shape == (128 + 4, 5 * 96 + 6 * 2, 3)


def test_image_grid_layout_and_errors():
    tiles = [np.full((4, 3, 3), i * 40, np.uint8) for i in range(5)]
    grid = image_grid(tiles, ncols=2, pad=1)
    assert grid.shape == (3 * 4 + 4, 2 * 3 + 3, 3)
    assert (grid[1:5, 1:4] == 0).all() and (grid[1:5, 5:8] == 40).all() and (grid[11:15, 1:4] == 160).all()
    with pytest.raises(ValueError, match="equally sized"):
        image_grid([np.zeros((4, 3, 3), np.uint8), np.zeros((5, 3, 3), np.uint8)])
    with pytest.raises(ValueError, match="joints must be"):
        draw_skeleton(tiles[0], np.zeros((17, 2)), np.ones(17))


def test_save_curves_writes_png(tmp_path):
    history = [{"step": i, "loss": 1.0 / (i + 1), "epsilon": 0.01 * i} for i in range(30)]
    history[10]["pckh_mean"] = 20.0
    history[20]["pckh_mean"] = 35.0
    path = save_curves(history, tmp_path / "curves.png")
    image = Image.open(path)
    assert image.format == "PNG" and image.size[0] > 300 and image.size[1] > 3 * 150  # 3 panels
    single = save_curves(history, tmp_path / "loss.png", keys=["loss"])
    assert Image.open(single).size[1] < image.size[1]
    with pytest.raises(ValueError):
        save_curves([], tmp_path / "empty.png")
