"""Adversarial: no head pixel reaches MaskDP's noise-free masked view, at any zoom (issue 24, item 5).

MaskDP sends the gradient of the masked crop without noise, so the masked crop must be a function
of the non-head pixels only. The attacker (a coordinator, or anyone who sees the site's updates)
holds two source images that differ only in head pixels — every pixel touching an annotated head
box (grown by ``privacy.mask.margin``), filled with fresh random values — and checks whether the
site's masked view of any record changes. Small people make it hard: their crops are *upsampled*
(zoom 2–7 at 256×192), and one source pixel's bilinear support then spans several crop pixels.

Every path from a head pixel to the masked view is exercised with the site's own code (the
``PoseDataset`` built with the options a site uses, ``mask_view`` as the engine calls it): bilinear
resampling at every zoom, the training augmentation (scale jitter, rotation, flip, drawn by the
dataset), crops that run past the image border, several heads per crop (four people close
together), non-integer box corners, and real MPII photographs scaled down to small people.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedpose.config import PrivacyConfig
from fedpose.data.annotations import PoseRecord
from fedpose.data.dataset import PoseDataset
from fedpose.data.loaders import load_records, resolve_image_or_raise
from fedpose.privacy.engine import collate
from fedpose.privacy.public_views import dataset_view_options, mask_boxes, mask_view

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
INPUT_SIZE = (256, 192)
#: person scales relative to a 200-px-tall person (MPII scale 1): zoom at 256×192 ≈ 1.02 / factor
PERSON_SCALES = (1.0, 0.5, 0.25, 0.15)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The ops here are tiny (one 256×192 crop at a time): threads only add contention on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def head_pixels(box: np.ndarray, margin: float, shape: tuple[int, int]) -> tuple[slice, slice]:
    """Rows and columns of every pixel (centre on an integer) that touches ``box`` grown by ``margin`` × its size."""
    (x1, y1), (x2, y2) = np.asarray(box, dtype=np.float64)
    grow_x, grow_y = margin * (x2 - x1), margin * (y2 - y1)
    x1, x2, y1, y2 = x1 - grow_x, x2 + grow_x, y1 - grow_y, y2 + grow_y
    height, width = shape
    r0, r1 = np.clip([np.ceil(y1 - 0.5), np.floor(y2 + 0.5) + 1], 0, height).astype(int)  # clipped: no negative index
    c0, c1 = np.clip([np.ceil(x1 - 0.5), np.floor(x2 + 0.5) + 1], 0, width).astype(int)
    return slice(r0, max(r0, r1)), slice(c0, max(c0, c1))


def randomize_heads(image: np.ndarray, boxes: list[np.ndarray], margin: float, rng: np.random.Generator) -> np.ndarray:
    """``image`` with every head pixel replaced by a random value (and nothing else changed)."""
    altered = image.copy()
    for box in boxes:
        rows, cols = head_pixels(box, margin, image.shape[:2])
        altered[rows, cols] = rng.integers(0, 256, altered[rows, cols].shape, dtype=np.uint8)
    return altered


def write_sites(tmp: Path, images: dict[str, np.ndarray], records: list[PoseRecord], margin: float,
                rng: np.random.Generator) -> None:
    """Two copies of one site's training data: ``tmp/original/site-1`` and ``tmp/heads/site-1``, where
    every head pixel (of the boxes as the site reads them back) is random; nothing else differs."""
    for folder in ("original", "heads"):
        (tmp / folder / "site-1").mkdir(parents=True)
        (tmp / folder / "site-1" / "annotations.json").write_text(json.dumps([r.to_json() for r in records]))
    stored, _ = load_records(tmp / "original" / "site-1")
    for name, image in images.items():
        boxes = [r.headbox for r in stored if r.image == name]
        for folder, pixels in (("original", image), ("heads", randomize_heads(image, boxes, margin, rng))):
            Image.fromarray(pixels).save(tmp / folder / "site-1" / name, compress_level=0)  # fast; lossless either way


def attack(tmp: Path, privacy: dict, draws: int) -> dict[str, int]:
    """Draw every record ``draws`` times from both sites' training sets (built by the site's own
    ``load_site_dataset``, same seed: the same augmentation each time) and count the samples whose
    masked view changes, whose crop shows the change, and that the old one-crop-pixel reach (main
    before the fix) would have leaked."""
    from site_round_helpers import site_config

    from fedpose.federation.local_training import load_site_dataset

    sites = {folder: site_config(tmp / folder, tmp / f"state-{folder}", mechanism="maskdp", noise_multiplier=1.0, mask=privacy)
             for folder in ("original", "heads")}
    original, heads = (load_site_dataset(sites[folder], INPUT_SIZE) for folder in ("original", "heads"))
    mask = sites["original"].privacy.mask
    counts = {"samples": 0, "changed": 0, "visible": 0, "old_rule_changed": 0, "rotated": 0, "flipped": 0}
    for _ in range(draws):
        for index in range(len(original)):
            a, b = collate([original[index]]), collate([heads[index]])
            assert (a["rotation"], a["scale"], a["flipped"]) == (b["rotation"], b["scale"], b["flipped"])
            counts["samples"] += 1
            counts["rotated"] += bool(a["rotation"][0] != 0)
            counts["flipped"] += bool(a["flipped"][0])
            counts["visible"] += not torch.equal(a["image"], b["image"])
            counts["changed"] += not torch.equal(mask_view(a, sites["original"].privacy), mask_view(b, sites["heads"].privacy))
            old = [mask_boxes(s["image"], s["head_boxes"], mask.margin, mask.fill, s["head_count"], reach=1.0) for s in (a, b)]
            counts["old_rule_changed"] += not torch.equal(*old)
    return counts


def synthetic_site(tmp: Path, factor: float, margin: float, seed: int) -> None:
    """4 noise images × 4 people close together (heads in each other's crops, some past the image
    border), people ``factor`` × 200 px tall; head boxes at non-integer corners."""
    rng = np.random.default_rng(seed)
    scale = factor  # MPII scale: the person is 200·scale px tall
    side = int(260 * scale) + 24
    records: list[PoseRecord] = []
    images: dict[str, np.ndarray] = {}
    for image_index in range(4):
        name = f"scene{image_index}.png"
        images[name] = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
        for _ in range(4):
            cx, cy = rng.uniform(0.1, 0.9, 2) * side
            size = 36 * scale * rng.uniform(0.8, 1.2)
            hx, hy = cx + rng.uniform(-12, 12) * scale, cy - 70 * scale
            box = np.array([[hx - size / 2, hy - size / 2], [hx + size / 2, hy + size * 0.6]], np.float32)
            joints = np.stack([rng.uniform(cx - 40 * scale, cx + 40 * scale, 16),
                               rng.uniform(cy - 90 * scale, cy + 90 * scale, 16)], 1).astype(np.float32)
            joints[8], joints[9] = (hx, hy + size * 0.5), (hx, hy - size * 0.45)  # upper neck, head top: in the box
            records.append(PoseRecord(name, joints, np.ones(16, np.float32), np.array([cx, cy], np.float32), scale, box))
    write_sites(tmp, images, records, margin, rng)


@pytest.mark.parametrize("margin", [0.0, 0.15])
def test_head_pixels_never_change_the_masked_view_of_small_upsampled_people(tmp_path: Path, margin: float) -> None:
    for factor in PERSON_SCALES:
        synthetic_site(tmp_path / f"x{factor}", factor, margin, seed=int(factor * 100))
        counts = attack(tmp_path / f"x{factor}", {"region": "head", "margin": margin}, draws=2)
        assert counts["changed"] == 0, (factor, counts)
        # not vacuous: the heads are in (most) crops, the augmentation rotates and flips them ...
        assert counts["visible"] >= counts["samples"] * 3 // 4, (factor, counts)
        assert counts["rotated"] > 0 and counts["flipped"] > 0, (factor, counts)
        # ... and the attack catches a reach of one crop pixel (main before the fix) once crops are upsampled
        if factor <= 0.25:
            assert counts["old_rule_changed"] > 0, (factor, counts)


def test_head_pixels_never_change_the_masked_view_of_real_mpii_people_at_any_scale(tmp_path: Path) -> None:
    records, root = load_records(SHARED_DATA / "mpii-real")
    assert len(records) == 5 and all(r.headbox is not None for r in records)
    margin = 0.0  # the annotated head box itself: the strictest case
    rng = np.random.default_rng(3)
    by_image = {r.image: np.asarray(Image.open(resolve_image_or_raise(root, r.image)).convert("RGB")) for r in records}
    old_rule_leaks = 0
    for factor in PERSON_SCALES:
        small: dict[str, np.ndarray] = {}
        for name, full in by_image.items():
            size = (max(1, round(full.shape[1] * factor)), max(1, round(full.shape[0] * factor)))
            small[Path(name).stem + ".png"] = np.asarray(Image.fromarray(full).resize(size, Image.Resampling.LANCZOS))
        scaled = [replace(r, image=Path(r.image).stem + ".png", joints=r.joints * factor, center=r.center * factor,
                          scale=r.scale * factor, headbox=r.headbox * factor) for r in records]
        write_sites(tmp_path / f"x{factor}", small, scaled, margin, rng)
        counts = attack(tmp_path / f"x{factor}", {"region": "head", "margin": margin}, draws=4)
        assert counts["changed"] == 0, (factor, counts)
        assert counts["visible"] == counts["samples"], (factor, counts)
        old_rule_leaks += counts["old_rule_changed"]
    assert old_rule_leaks > 0  # the real people, scaled down, leak under the old reach


def test_a_maskdp_site_decodes_at_full_size_and_a_reduced_decode_masks_the_whole_crop() -> None:
    """A JPEG decoded at a reduced size mixes whole 8×8 / 16×16 blocks of the file into each pixel:
    no box-shaped mask describes that, so MaskDP's datasets never do it, and a crop that was
    decoded that way anyway is masked entirely rather than leak."""
    records, root = load_records(SHARED_DATA / "mpii-real")
    big = max(range(len(records)), key=lambda i: records[i].scale)  # zoom ≈ 0.2: a reduced decode kicks in
    privacy = PrivacyConfig(mechanism="maskdp", noise_multiplier=1.0)
    assert dataset_view_options(privacy)["reduced_decode"] is False
    assert dataset_view_options(PrivacyConfig(mechanism="dpsgd", noise_multiplier=1.0))["reduced_decode"] is True
    site = collate([PoseDataset(records, root, INPUT_SIZE, **dataset_view_options(privacy))[big]])
    assert bool(torch.isfinite(site["private_reach"]).all())
    assert not bool((mask_view(site, privacy) == 0).all())
    reduced = collate([PoseDataset(records, root, INPUT_SIZE, reduced_decode=True)[big]])
    assert bool(torch.isinf(reduced["private_reach"]).all())
    assert bool((mask_view(reduced, privacy) == 0).all())  # fill 'mean' is 0 in normalized space


def test_a_head_box_that_does_not_hold_the_head_masks_the_person_instead(tmp_path: Path) -> None:
    """A red-team (2026-12-07) loaded degenerate, 2-px and shifted head boxes without a word, and the
    real head reached the noise-free masked view. A box must have an area and hold the visible upper
    neck and head top (with a quarter of its size to spare); otherwise the person box is masked."""
    from fedpose.data.dataset import head_box_holds_head

    joints = np.zeros((16, 2), np.float32)
    joints[8], joints[9] = (50, 40), (50, 10)  # upper neck, head top
    def record(box) -> PoseRecord:
        return PoseRecord("a.png", joints, np.ones(16, np.float32), np.array([50, 80], np.float32), 0.5,
                          np.asarray(box, np.float32))
    assert head_box_holds_head(record([[35, 8], [65, 42]]))
    assert head_box_holds_head(record([[35, 12], [65, 42]]))  # head top on (near) the edge
    for bad in ([[0, 0], [0, 0]], [[49, 10], [51, 11]], [[95, 8], [125, 42]], [[65, 42], [35, 8]]):
        assert not head_box_holds_head(record(bad)), bad
    hidden = joints.copy()
    hidden_record = PoseRecord("a.png", hidden, np.r_[np.ones(8), np.zeros(2), np.ones(6)].astype(np.float32),
                               np.array([50, 80], np.float32), 0.5, np.asarray([[95, 8], [125, 42]], np.float32))
    assert head_box_holds_head(hidden_record)  # no visible head joint to contradict the box
    dataset = PoseDataset([record([[95, 8], [125, 42]])], tmp_path, INPUT_SIZE, train=False)
    assert dataset.head_boxes_replaced == 1
    assert np.allclose(dataset._image_heads["a.png"][0], dataset._person_box(record([[95, 8], [125, 42]])))
