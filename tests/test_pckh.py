"""PCKh: reproduces the published stacked-hourglass numbers on MPII validation; edge cases; CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedpose.eval.pckh import PCKH_KEYS, pckh
from fedpose.joints import JOINT_INDEX, NUM_JOINTS

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
VALID = DATA / "mpii-valid" / "valid.json"
PREDS = DATA / "mpii-valid" / "preds_hg_s8.json"
# Published PCKh@0.5 of bearpaw/pytorch-pose hg_s8_b1 on the MPII validation split (DESIGN.md).
PUBLISHED = {"Head": 96.79, "Shoulder": 95.19, "Elbow": 90.08, "Wrist": 85.32,
             "Hip": 87.48, "Knee": 84.26, "Ankle": 80.73, "Mean": 89.09}


@pytest.fixture(scope="module")
def mpii_valid():
    raw = json.loads(VALID.read_text())
    preds = np.asarray(json.loads(PREDS.read_text())["preds"], dtype=np.float64)
    joints = np.asarray([r["joints"] for r in raw], dtype=np.float64)
    vis = np.asarray([r["joints_vis"] for r in raw], dtype=np.float64)
    headboxes = np.asarray([r["headbox"] for r in raw], dtype=np.float64)
    return preds, joints, vis, headboxes


def test_reproduces_published_numbers(mpii_valid):
    result = pckh(*mpii_valid)
    assert set(result) == set(PCKH_KEYS)
    for key, value in PUBLISHED.items():
        assert round(result[key], 2) == value, key
    assert 0 < result["Mean@0.1"] < result["Mean"]


def test_one_pixel_shift_does_not_reproduce(mpii_valid):
    """The frame convention matters: shifting GT by one pixel changes the mean by > 0.1."""
    preds, joints, vis, headboxes = mpii_valid
    assert abs(pckh(preds, joints + 1, vis, headboxes)["Mean"] - PUBLISHED["Mean"]) > 0.1


def _one_person(offsets: dict[str, float], head_size: float = 10.0):
    joints = np.zeros((1, NUM_JOINTS, 2))
    preds = joints.copy()
    for name, dx in offsets.items():
        preds[0, JOINT_INDEX[name], 0] = dx
    side = head_size / 0.6 / np.sqrt(2)  # headbox diagonal = head_size / 0.6
    headbox = np.array([[[0.0, 0.0], [side, side]]])
    return preds, joints, np.ones((1, NUM_JOINTS)), headbox


def test_threshold_is_inclusive_and_groups_pool_sides():
    # head size 10 → threshold 5 px at 0.5, 1 px at 0.1
    preds, joints, vis, hb = _one_person({"l_wrist": 5.0, "r_wrist": 5.01, "head_top": 0.99, "l_ankle": 1.01})
    result = pckh(preds, joints, vis, hb)
    assert result["Wrist"] == pytest.approx(50.0)  # 5.0 is correct (≤), 5.01 is not
    assert result["Head"] == 100.0 and result["Ankle"] == 100.0
    assert result["Mean"] == pytest.approx(100 * 13 / 14)
    assert result["Mean@0.1"] == pytest.approx(100 * 11 / 14)  # l/r wrist, l_ankle miss at 1 px


def test_pelvis_thorax_excluded_and_invisible_ignored():
    preds, joints, vis, hb = _one_person({"pelvis": 100.0, "thorax": 100.0, "r_knee": 100.0})
    vis[0, JOINT_INDEX["r_knee"]] = 0
    result = pckh(preds, joints, vis, hb)
    assert result["Mean"] == 100.0 and result["Knee"] == 100.0
    vis[0, JOINT_INDEX["l_knee"]] = 0
    assert np.isnan(pckh(preds, joints, vis, hb)["Knee"])  # nothing annotated: undefined, not 0 or 100


def test_people_without_head_box_are_skipped():
    preds, joints, vis, hb = _one_person({"l_wrist": 100.0})
    preds2, joints2, vis2, _ = _one_person({})
    result = pckh(np.concatenate([preds, preds2]), np.concatenate([joints, joints2]),
                  np.concatenate([vis, vis2]), np.concatenate([hb, np.zeros((1, 2, 2))]))
    assert result["Wrist"] == 50.0  # only the first person is scored


def test_shape_errors():
    preds, joints, vis, hb = _one_person({})
    with pytest.raises(ValueError, match="joints must have shape"):
        pckh(preds, np.zeros((2, NUM_JOINTS, 2)), vis, hb)
    with pytest.raises(ValueError, match="preds must have shape"):
        pckh(np.zeros((1, 17, 2)), joints, vis, hb)
    with pytest.raises(ValueError, match="headboxes must have shape"):
        pckh(preds, joints, vis, np.zeros((1, 4)))
    with pytest.raises(ValueError, match="NaN"):
        pckh(np.full_like(preds, np.nan), joints, vis, hb)


def _fedpose(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("fedpose")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "fedpose.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})


def test_cli_json_reproduces_published_numbers():
    done = _fedpose("pckh", "--gt", str(VALID), "--pred", str(PREDS), "--json")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert list(result) == list(PCKH_KEYS)
    for key, value in PUBLISHED.items():
        assert round(result[key], 2) == value, key


def test_cli_table_and_errors(tmp_path):
    table = _fedpose("pckh", "--gt", str(VALID), "--pred", str(PREDS))
    assert table.returncode == 0 and "89.09" in table.stdout and "Shoulder" in table.stdout
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"preds": np.zeros((3, NUM_JOINTS, 2)).tolist()}))
    done = _fedpose("pckh", "--gt", str(VALID), "--pred", str(short), "--json")
    assert done.returncode == 2 and "3 predictions" in done.stderr and "2958" in done.stderr
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"preds": np.zeros((2958, 17, 2)).tolist()}))
    done = _fedpose("pckh", "--gt", str(VALID), "--pred", str(wrong))
    assert done.returncode == 2 and "(N, 16, 2)" in done.stderr
