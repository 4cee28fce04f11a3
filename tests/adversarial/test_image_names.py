"""Image names in the annotations, against the code that counts images by name: LDP-Slicing's one
release, the protection units and MaskDP's head boxes. An absolute name used to send the
"privatized" copy's training onto the raw file (its PNG already existed where the copy would be
written, so the randomized response was skipped), and one file under two names was privatized
twice, counted as two image units and masked for only one name's people."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from fedpose.config import InputPrivacyConfig
from fedpose.data.annotations import AnnotationError, PoseRecord, write_annotations
from fedpose.data.image_check import check_images
from fedpose.privacy.input_privacy import InputPrivacyError, privatize_dataset

CFG = InputPrivacyConfig(mechanism="ldp-slicing", epsilon=8.0)


def _record(name: str) -> PoseRecord:
    joints = np.random.default_rng(0).uniform(8, 40, (16, 2)).astype(np.float32)
    return PoseRecord(name, joints, np.ones(16, np.float32), np.array([24, 24], np.float32), 0.2)


def _image(path, seed: int = 1) -> np.ndarray:
    rgb = np.random.default_rng(seed).integers(0, 256, (48, 48, 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rgb).save(path)
    return rgb


def _dataset(root, names: list[str]):
    root.mkdir(parents=True, exist_ok=True)
    write_annotations(root / "annotations.json", [_record(name) for name in names])
    return root


@pytest.mark.parametrize("escape", ["absolute", "dot-dot"])
def test_a_name_outside_the_dataset_is_not_privatized_and_nothing_is_written(tmp_path, escape) -> None:
    raw = tmp_path / "pacs" / "p1.png"
    pixels = _image(raw)
    name = str(raw) if escape == "absolute" else "../pacs/p1.png"
    src = _dataset(tmp_path / "site", [name])
    before = sorted(p.name for p in raw.parent.iterdir())
    with pytest.raises(InputPrivacyError, match="must be a relative path inside the dataset directory"):
        privatize_dataset(src, tmp_path / "private", CFG)
    assert sorted(p.name for p in raw.parent.iterdir()) == before  # no copy written beside the raw file
    assert np.array_equal(np.asarray(Image.open(raw)), pixels)
    assert not (tmp_path / "private").exists()


@pytest.mark.parametrize("alias", ["images/img.png", "./img.png", "link.png"])
def test_one_file_under_two_names_is_refused(tmp_path, alias) -> None:
    src = tmp_path / "site"
    _image(src / "images" / "img.png")
    if alias == "link.png":
        (src / "link.png").symlink_to(src / "images" / "img.png")
    _dataset(src, ["img.png", alias])
    with pytest.raises(AnnotationError, match="are one file"):
        privatize_dataset(src, tmp_path / "private", CFG)
    with pytest.raises(AnnotationError, match="are one file"):
        check_images([_record("img.png"), _record(alias)], src)


def test_a_copy_of_one_photograph_under_another_name_is_refused(tmp_path) -> None:
    """A red-team (2026-12-07): a byte-identical copy passed every check — two image units for one
    photograph, its patients not merged, and LDP-Slicing released it twice (twice its ε per pixel;
    the two releases averaged came closer to the raw photograph). Images are compared by content."""
    import shutil

    src = tmp_path / "site"
    _image(src / "ward_0001.png")
    shutil.copyfile(src / "ward_0001.png", src / "ward_0001_copy.png")
    _dataset(src, ["ward_0001.png", "ward_0001_copy.png"])
    with pytest.raises(AnnotationError, match="'ward_0001.png' and 'ward_0001_copy.png' hold the same bytes"):
        privatize_dataset(src, tmp_path / "private", CFG)
    with pytest.raises(AnnotationError, match="hold the same bytes"):
        check_images([_record("ward_0001.png"), _record("ward_0001_copy.png")], src, cache_file=tmp_path / "check.json")
    assert not list((tmp_path).glob("private*/*.png"))  # nothing released


def test_one_name_per_file_still_privatizes(tmp_path) -> None:
    src = tmp_path / "site"
    _image(src / "images" / "a.png")
    _image(src / "b.png", seed=2)
    _dataset(src, ["a.png", "b.png", "a.png"])  # one image, two people: one name
    assert privatize_dataset(src, tmp_path / "private", CFG)["mechanism"] == "ldp-slicing"
    assert check_images([_record("a.png"), _record("b.png")], src) == 2
