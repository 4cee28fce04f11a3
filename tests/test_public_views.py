"""Public feature maps ψ: the many-to-one FDP view (and the degenerate blur), computed before
augmentation; MaskDP masking every annotated head in the crop."""

from __future__ import annotations

import pytest
import torch

import json
import typing
from pathlib import Path

import numpy as np
from PIL import Image

from fedpose.config import PrivacyConfig, PublicViewConfig
from fedpose.data.coco import private_head_box
from fedpose.data.dataset import PoseDataset, augmentation_extent, context_window, normalize
from fedpose.data.loaders import load_records
from fedpose.data.transforms import Augmentation, affine_points, compose, crop_transform, invert, warp_affine
from fedpose.privacy.public_views import (
    PUBLIC_VIEWS,
    ImagePublicView,
    area_downsample,
    box_masks,
    dataset_public_view,
    downsample_quantize,
    quantize,
    union_box_masks,
    fill_value,
    gaussian_blur,
    gaussian_kernel1d,
    mask_boxes,
    mask_view,
    private_region_boxes,
)


def test_kernel_is_normalised_and_symmetric() -> None:
    kernel = gaussian_kernel1d(11, 2.0)
    assert kernel.sum().item() == pytest.approx(1.0, abs=1e-6)
    assert torch.allclose(kernel, kernel.flip(0))
    with pytest.raises(ValueError, match="odd"):
        gaussian_kernel1d(10, 2.0)


def test_blur_keeps_constants_and_removes_fine_detail() -> None:
    constant = torch.full((1, 3, 32, 24), 0.7)
    assert torch.allclose(gaussian_blur(constant, 9, 3.0), constant, atol=1e-6)
    checker = ((torch.arange(32)[:, None] + torch.arange(24)[None, :]) % 2).float() * 2 - 1
    blurred = gaussian_blur(checker.expand(1, 3, 32, 24).clone(), 9, 3.0)
    assert blurred.abs().max() < 0.05 * checker.abs().max()  # pixel-level detail is gone
    # linear with a unit-sum kernel: blurring commutes with per-channel normalisation
    x = torch.rand(2, 3, 32, 24)
    mean, std = torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1), torch.tensor([0.2, 0.25, 0.3]).view(1, 3, 1, 1)
    assert torch.allclose(gaussian_blur((x - mean) / std, 7, 2.0), (gaussian_blur(x, 7, 2.0) - mean) / std, atol=1e-5)


def test_box_masks_cover_the_enlarged_box_only() -> None:
    # margin +1 px each side → [3, 9] × [1, 7]; reach +0.5 (x), +1.5 (y) → [2.5, 9.5] × [-0.5, 8.5]
    masks = box_masks(torch.tensor([[4.0, 2.0, 8.0, 6.0]]), 12, 16, margin=0.25, reach=torch.tensor([[0.5, 1.5]]))
    expected = torch.zeros(12, 16, dtype=torch.bool)
    expected[0:9, 3:10] = True  # pixel centres inside the grown box (boundary included), clipped to the image
    assert torch.equal(masks[0], expected)
    # an unbounded reach (a crop whose resampling no box describes) masks everything
    assert bool(box_masks(torch.tensor([[4.0, 2.0, 8.0, 6.0]]), 12, 16, 0.0, reach=torch.tensor([[float("inf"), 1.0]])).all())
    with pytest.raises(ValueError, match="reach"):
        box_masks(torch.tensor([[4.0, 2.0, 8.0, 6.0]]), 12, 16, 0.0, reach=torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="reach"):
        box_masks(torch.tensor([[4.0, 2.0, 8.0, 6.0]]), 12, 16, 0.0, reach=-1.0)


def test_mask_removes_every_private_pixel_and_keeps_the_rest() -> None:
    images = torch.randn(2, 3, 20, 16)
    boxes = torch.tensor([[2.5, 3.0, 9.2, 11.0], [0.0, 0.0, 16.0, 5.0]])
    out = mask_boxes(images, boxes, margin=0.0, fill="mean", reach=0.5)
    masks = box_masks(boxes, 20, 16, 0.0, reach=0.5)
    assert torch.all(out.permute(0, 2, 3, 1)[masks] == 0)
    assert torch.equal(out.permute(0, 2, 3, 1)[~masks], images.permute(0, 2, 3, 1)[~masks])
    # the public view does not depend on the private pixels at all
    changed = images.clone()
    changed.permute(0, 2, 3, 1)[masks] = torch.randn(int(masks.sum()), 3)
    assert torch.equal(mask_boxes(changed, boxes, 0.0, "mean", reach=0.5), out)


def test_undeclared_region_masks_the_whole_image() -> None:
    out = mask_boxes(torch.randn(1, 3, 8, 8), torch.zeros(1, 4), margin=0.1, fill="zero", reach=0.5)
    assert torch.allclose(out, fill_value("zero").view(1, 3, 1, 1).expand(1, 3, 8, 8))
    black = fill_value("zero") * torch.tensor([0.229, 0.224, 0.225]) + torch.tensor([0.485, 0.456, 0.406])
    assert torch.allclose(black, torch.zeros(3), atol=1e-6)  # 'zero' is a black pixel after un-normalising


def test_mask_view_masks_every_box_of_the_configured_region() -> None:
    heads = torch.tensor([[[8.0, 8.0, 12.0, 12.0], [1.0, 12.0, 3.0, 14.0], [0.0, 0.0, 0.0, 0.0]]])
    batch = {
        "image": torch.randn(1, 3, 16, 16),
        "head_boxes": heads, "head_count": torch.tensor([2]),
        "face_boxes": torch.tensor([[[1.0, 1.0, 4.0, 4.0]]]), "face_count": torch.tensor([1]),
        "private_reach": torch.tensor([[0.5, 0.5]]),  # the image is its own source: pixels touching a box
    }
    head = mask_view(batch, PrivacyConfig(mask={"region": "head", "margin": 0.0}))
    face = mask_view(batch, PrivacyConfig(mask={"region": "face", "margin": 0.0}))
    assert torch.all(head[0, :, 8:13, 8:13] == 0) and torch.all(head[0, :, 12:15, 1:4] == 0)
    assert torch.equal(head[0, :, 0:5, 0:5], batch["image"][0, :, 0:5, 0:5])  # the padding slot masks nothing
    assert torch.all(face[0, :, 1:5, 1:5] == 0) and torch.equal(face[0, :, 9:12, 9:12], batch["image"][0, :, 9:12, 9:12])
    # no declared box at all: nothing of the image is public
    assert bool(union_box_masks(heads, torch.tensor([0]), 16, 16, 0.0, reach=0.5).all())
    with pytest.raises(KeyError, match="face_boxes"):
        private_region_boxes({"image": batch["image"]}, "face")
    with pytest.raises(KeyError, match="private_reach"):
        mask_view({k: v for k, v in batch.items() if k != "private_reach"}, PrivacyConfig(mask={"region": "head"}))
    with pytest.raises(ValueError, match="counts"):
        union_box_masks(heads, torch.tensor([4]), 16, 16, 0.0, reach=0.5)


# -- FDP's ψ: many-to-one, with a known null space ------------------------------------------

def test_every_configurable_view_is_registered_and_only_blur_is_invertible() -> None:
    kinds = set(typing.get_args(PublicViewConfig.model_fields["kind"].annotation))
    assert kinds == set(PUBLIC_VIEWS)
    assert {name for name, kind in PUBLIC_VIEWS.items() if not kind.many_to_one} == {"gaussian_blur"}
    assert PublicViewConfig().kind == "downsample_quantize"  # the default protects something
    assert dataset_public_view(PrivacyConfig(mechanism="dpsgd", noise_multiplier=1.0)) is None
    assert dataset_public_view(PrivacyConfig(mechanism="fpdp", noise_multiplier=1.0)) is not None


def null_space_texture(rng: np.random.Generator, height: int, width: int, factor: int, amplitude: int) -> np.ndarray:
    """Integer texture whose sum over every factor×factor block is 0: in the null space of the block mean."""
    half = factor * factor // 2
    signs = np.array([1] * half + [-1] * half)
    out = np.zeros((height, width, 3), np.int32)
    for by in range(0, height, factor):
        for bx in range(0, width, factor):
            for c in range(3):
                block = rng.permutation(signs) * int(rng.integers(1, amplitude + 1))
                out[by: by + factor, bx: bx + factor, c] = block.reshape(factor, factor)
    return out


def bin_centred_blocks(rng: np.random.Generator, height: int, width: int, factor: int, bits: int) -> np.ndarray:
    """Block-constant image whose block values sit at the centres of their b-bit bins."""
    step = 256 // (1 << bits)
    levels = rng.integers(0, 1 << bits, size=(height // factor, width // factor, 3)) * step + step // 2
    return np.repeat(np.repeat(levels, factor, axis=0), factor, axis=1).astype(np.int32)


def test_images_differing_only_in_the_null_space_have_identical_views() -> None:
    rng = np.random.default_rng(0)
    factor, bits, height, width = 8, 3, 64, 48
    base = bin_centred_blocks(rng, height, width, factor, bits)
    step = 256 // (1 << bits)
    # (1) any texture finer than a block (zero mean per block, up to ±15 grey levels: a face's
    # features, skin and cloth texture) and (2) any change of a block's mean within its bin
    texture = null_space_texture(rng, height, width, factor, amplitude=15)
    shift = np.repeat(np.repeat(rng.integers(-7, 8, size=(height // factor, width // factor, 3)), factor, 0), factor, 1)
    first = np.clip(base, 0, 255).astype(np.uint8)
    second = (base + texture).astype(np.uint8)
    third = base + null_space_texture(rng, height, width, factor, amplitude=8) + shift  # stays inside the bin
    assert third.min() >= 0 and third.max() <= 255
    third = third.astype(np.uint8)
    assert np.abs(first.astype(int) - second.astype(int)).mean() > 7 and not np.array_equal(second, third)
    views = [downsample_quantize(image, factor, bits) for image in (first, second, third)]
    assert np.array_equal(views[0], views[1]) and np.array_equal(views[0], views[2])
    # ψ is not constant: a block mean moved into another bin changes it
    moved = first.copy()
    moved[:factor, :factor] = np.clip(moved[:factor, :factor].astype(int) + step, 0, 255).astype(np.uint8)
    assert not np.array_equal(downsample_quantize(moved, factor, bits), views[0])


def test_view_of_a_real_face_ignores_zero_mean_detail_inside_each_block() -> None:
    records, root = load_records(SHARED_DATA / "mpii-real")
    record = records[0]
    (x1, y1), (x2, y2) = record.headbox
    image = np.asarray(Image.open(root / "images" / record.image).convert("RGB"))
    factor, bits = 8, 3
    top, left = int(y1) // factor * factor, int(x1) // factor * factor
    face = image[top: top + 128, left: left + 128].copy()  # a 128×128 window over the head
    # Replace the face's detail: keep each block's mean, redistribute its pixels (a different face, same ψ)
    swapped = face.astype(np.int64)
    blocks = swapped.reshape(16, factor, 16, factor, 3).transpose(0, 2, 4, 1, 3).reshape(16, 16, 3, factor * factor)
    rng = np.random.default_rng(1)
    for index in np.ndindex(16, 16, 3):
        blocks[index] = rng.permutation(blocks[index])  # same multiset of values: same block mean
    swapped = blocks.reshape(16, 16, 3, factor, factor).transpose(0, 3, 1, 4, 2).reshape(128, 128, 3).astype(np.uint8)
    assert np.abs(swapped.astype(int) - face.astype(int)).mean() > 5  # visibly different pixels
    assert np.array_equal(downsample_quantize(swapped, factor, bits), downsample_quantize(face, factor, bits))
    assert np.array_equal(quantize(area_downsample(swapped, factor), bits), quantize(area_downsample(face, factor), bits))


def test_bad_view_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="8×8 blocks"):
        area_downsample(np.zeros((20, 16, 3), np.uint8), 8)
    with pytest.raises(ValueError, match="uint8"):
        downsample_quantize(np.zeros((16, 16, 3), np.float32), 8, 3)
    with pytest.raises(ValueError, match="bits"):
        quantize(np.zeros(3), 9)
    with pytest.raises(ValueError, match="multiple of the public view's block"):
        context_window((100, 96), 8, (0.0, 0.0))
    with pytest.raises(ValueError, match="factor"):
        PrivacyConfig(public_view={"factor": 1})


# -- ψ is computed once per record, before augmentation ----------------------------------------

def write_dataset(directory: Path, images: list[np.ndarray]) -> list[dict]:
    """One record per image, cropped so the un-augmented crop is the image itself (zoom 1, no shift)."""
    directory.mkdir(parents=True, exist_ok=True)
    height, width = images[0].shape[:2]
    records = []
    for i, image in enumerate(images):
        Image.fromarray(image).save(directory / f"{i}.png")
        joints = [[width * (0.3 + 0.025 * j), height * (0.2 + 0.04 * j)] for j in range(16)]
        records.append({"image": f"{i}.png", "joints": joints, "joints_vis": [1] * 16, "center": [width / 2, height / 2],
                        "scale": height / (200 * 1.25), "headbox": [[width * 0.4, height * 0.05], [width * 0.6, height * 0.2]]})
    (directory / "annotations.json").write_text(json.dumps(records))
    return records


def test_datasets_of_images_differing_in_the_null_space_give_identical_public_images(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    size, factor, bits = (64, 48), 8, 3
    base = bin_centred_blocks(rng, *size, factor, bits)
    images = [base.astype(np.uint8), (base + null_space_texture(rng, *size, factor, 15)).astype(np.uint8)]
    view = ImagePublicView(PublicViewConfig(factor=factor, bits=bits))
    samples = []
    for i, image in enumerate(images):
        write_dataset(tmp_path / str(i), [image])
        records, root = load_records(tmp_path / str(i))
        for train in (False, True):  # same seed: the same (data-independent) augmentation draws
            dataset = PoseDataset(records, root, input_size=size, train=train, seed=5, public_view=view)
            samples.append([dataset[0] for _ in range(4)])
    for eval_or_train in (0, 1):
        for a, b in zip(samples[eval_or_train], samples[2 + eval_or_train]):
            assert not torch.equal(a["image"], b["image"])  # the private crops differ
            assert torch.equal(a["public_image"], b["public_image"])  # their public views do not


def test_public_image_is_the_augmented_view_of_the_original_not_the_view_of_the_augmented_crop() -> None:
    records, root = load_records(SHARED_DATA / "coco-real")
    size = (256, 192)
    view = ImagePublicView(PublicViewConfig(factor=8, bits=3))
    dataset = PoseDataset(records, root, input_size=size, train=True, seed=3, rotation=30.0, scale_jitter=0.25,
                          public_view=view)
    seen_rotation = False
    for index in range(len(records)):
        sample = dataset[index]
        record = records[index]
        aug = Augmentation(sample["scale"] / (record.scale * dataset.padding), sample["rotation"], sample["flipped"])
        matrix = crop_transform(record.center, record.scale * dataset.padding, size, aug)
        # independently: ψ of the un-augmented context window of the original image ...
        window_h, window_w = dataset.context_size
        window_matrix = crop_transform(record.center, record.scale * dataset.padding * window_h / size[0], (window_h, window_w))
        original = Image.open(root / "images" / record.image).convert("RGB")
        public_window = view(np.asarray(warp_affine(original, window_matrix, (window_h, window_w))))
        # ... then this sample's augmentation
        expected = normalize(np.asarray(warp_affine(Image.fromarray(public_window), compose(matrix, invert(window_matrix)), size)))
        assert torch.equal(sample["public_image"], expected), record.image
        # and it is not ψ applied after augmentation
        crop = np.asarray(warp_affine(original, matrix, size))
        assert not torch.equal(sample["public_image"], normalize(view(crop)))
        seen_rotation |= abs(sample["rotation"]) > 1
        # ψ is computed once: a second draw reuses the cached compact view
        assert index in dataset._public_cache
    assert seen_rotation


def test_context_window_holds_every_augmented_crop() -> None:
    size, block = (256, 192), 8
    window = context_window(size, block, augmentation_extent(size, 0.25, 30.0))
    assert all(w % block == 0 for w in window) and all((w - s) % (2 * block) == 0 for w, s in zip(window, size))
    rng = np.random.default_rng(0)
    center, scale = np.array([500.0, 400.0]), 2.0
    window_matrix = crop_transform(center, scale * window[0] / size[0], window)
    corners = np.array([[0, 0], [size[1] - 1, 0], [0, size[0] - 1], [size[1] - 1, size[0] - 1]], np.float64)
    for _ in range(200):
        aug = Augmentation(float(rng.uniform(0.75, 1.25)), float(rng.uniform(-30, 30)), bool(rng.random() < 0.5))
        in_window = affine_points(affine_points(corners, invert(crop_transform(center, scale, size, aug))), window_matrix)
        assert (in_window >= -0.5 - 1e-6).all() and (in_window[:, 0] <= window[1] - 0.5 + 1e-6).all()
        assert (in_window[:, 1] <= window[0] - 0.5 + 1e-6).all()


def test_the_context_window_covers_the_rotation_range_not_one_std() -> None:
    """With HRNet's clip (data.rotation_clip = 2) a crop may turn by up to 2 × data.rotation: ψ's window
    must hold those crops too, or their public view would be cut off."""
    records, root = load_records(SHARED_DATA / "coco-real")
    view = ImagePublicView(PublicViewConfig(factor=8, bits=3))
    size = (256, 192)
    narrow = PoseDataset(records, root, input_size=size, train=True, rotation=30.0, public_view=view)
    wide = PoseDataset(records, root, input_size=size, train=True, rotation=30.0, rotation_range=60.0, public_view=view)
    assert narrow.context_size == context_window(size, 8, augmentation_extent(size, 0.25, 30.0))
    assert wide.context_size == context_window(size, 8, augmentation_extent(size, 0.25, 60.0))
    # a portrait crop turned 60° is wider than any turned ≤ 30° (its height peaks near 37° either way)
    assert wide.context_size[1] > narrow.context_size[1] and wide.context_size[0] >= narrow.context_size[0]


# -- MaskDP: every annotated head in the crop ------------------------------------------------------

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def unmasked_head_pixels(masks: torch.Tensor, matrix: np.ndarray, heads: np.ndarray) -> int:
    """Crop pixels whose centre maps (back to the original frame) inside one of ``heads`` but is not masked."""
    height, width = masks.shape
    back = invert(matrix)
    unmasked = ~masks.numpy()
    count = 0
    for (x1, y1), (x2, y2) in heads:
        # only the pixels near the head's image in the crop can map inside it
        hull = affine_points(np.array([[x1, y1], [x2, y1], [x1, y2], [x2, y2]], np.float64), matrix)
        c0, r0 = np.maximum(np.floor(hull.min(0)) - 1, 0).astype(int)
        c1, r1 = np.minimum(np.ceil(hull.max(0)) + 2, [width, height]).astype(int)
        if c0 >= c1 or r0 >= r1:
            continue
        rows, cols = np.mgrid[r0:r1, c0:c1]
        original = affine_points(np.stack([cols.ravel(), rows.ravel()], 1).astype(np.float64), back)
        inside = (original[:, 0] >= x1) & (original[:, 0] <= x2) & (original[:, 1] >= y1) & (original[:, 1] <= y2)
        count += int((inside & unmasked[rows.ravel(), cols.ravel()]).sum())
    return count


def test_no_mpii_validation_crop_shows_part_of_an_annotated_head() -> None:
    records, root = load_records(SHARED_DATA / "mpii-valid" / "valid.json")
    size = (256, 192)
    dataset = PoseDataset(records, root, input_size=size, train=False)  # annotation-only: no image is read here
    by_image: dict[str, list[np.ndarray]] = {}
    for record in records:
        by_image.setdefault(record.image, []).append(np.asarray(record.headbox, np.float64))
    multi = [i for i, r in enumerate(records) if len(by_image[r.image]) > 1]
    assert len(multi) == 444
    rng = np.random.default_rng(0)
    leaks, own_only_leaks = 0, 0
    for index in multi:
        record = records[index]
        for aug in (Augmentation(), Augmentation(float(rng.uniform(0.75, 1.25)), float(rng.uniform(-30, 30)), bool(rng.random() < 0.5))):
            matrix = crop_transform(record.center, record.scale * dataset.padding, size, aug)
            boxes = dataset.private_boxes(index, matrix)
            masks = union_box_masks(boxes["head_boxes"][None], boxes["head_count"][None], *size, margin=0.0,
                                    reach=boxes["private_reach"][None])[0]
            leaks += unmasked_head_pixels(masks, matrix, np.stack(by_image[record.image])) > 0
            if aug == Augmentation():
                own_box = torch.from_numpy(np.concatenate(list(map(np.ravel, _own_box_in_crop(record, matrix)))))[None]
                own_mask = box_masks(own_box, *size, 0.0, reach=1.0)[0]
                own_only_leaks += unmasked_head_pixels(own_mask, matrix, np.stack(by_image[record.image])) > 0
    assert leaks == 0
    print(f"MPII val, 444 multi-person records: crops with an unmasked head pixel: all heads {leaks}, own head only {own_only_leaks}")
    assert own_only_leaks > 100  # masking only the record's own head (the old behaviour) leaks other faces


def _own_box_in_crop(record, matrix: np.ndarray) -> list[np.ndarray]:
    (x1, y1), (x2, y2) = record.headbox
    corners = affine_points(np.array([[x1, y1], [x2, y1], [x1, y2], [x2, y2]], np.float64), matrix)
    return [corners.min(0), corners.max(0)]


def test_no_real_multi_person_crop_shows_part_of_a_head_after_masking() -> None:
    raw = json.loads((SHARED_DATA / "coco-real" / "person_keypoints.json").read_text())
    heads: dict[str, list[np.ndarray]] = {}
    names = {img["id"]: img["file_name"] for img in raw["images"]}
    for ann in raw["annotations"]:  # every person of the image, recomputed from the raw file
        heads.setdefault(names[ann["image_id"]], []).append(private_head_box(np.asarray(ann["keypoints"]), ann["bbox"]))
    records, root = load_records(SHARED_DATA / "coco-real")
    for record in records:
        if record.headbox is not None:
            heads[record.image].append(np.asarray(record.headbox, np.float64))
    assert max(len(v) for v in heads.values()) >= 4  # the real images do hold several people
    size = (256, 192)
    cfg = PrivacyConfig(mechanism="maskdp", noise_multiplier=1.0, mask={"margin": 0.0})
    for train in (False, True):
        dataset = PoseDataset(records, root, input_size=size, train=train, seed=1, reduced_decode=False)
        for index, record in enumerate(records):
            sample = dataset[index]
            batch = {k: v[None] if isinstance(v, torch.Tensor) else v for k, v in sample.items()}
            public = mask_view(batch, cfg)[0]
            masked = (public == 0).all(0)  # fill 'mean' = 0 in normalized space
            aug = Augmentation(sample["scale"] / (record.scale * dataset.padding), sample["rotation"], sample["flipped"])
            matrix = crop_transform(record.center, record.scale * dataset.padding, size, aug)
            assert unmasked_head_pixels(masked, matrix, np.stack(heads[record.image])) == 0, (record.image, train)


def test_a_federated_site_round_with_fdp_trains_on_the_public_view(tmp_path: Path) -> None:
    from site_round_helpers import INPUT_SIZE, global_model, make_site_data, site_config

    from fedpose.federation.local_training import load_site_dataset, train_site_round

    data_root = make_site_data(tmp_path / "data")
    site = site_config(data_root, tmp_path / "state", mechanism="fdp", noise_multiplier=4.0)
    # a probe of the dataset writes its image-check cache into a state dir: not the site's own, which
    # would then hold state without a budget and be refused as lost
    dataset = load_site_dataset(site.model_copy(update={"state_dir": tmp_path / "probe"}), INPUT_SIZE)
    assert dataset.public_view is not None and dataset[0]["public_image"].shape == dataset[0]["image"].shape
    plain = load_site_dataset(site_config(data_root, tmp_path / "state2"), INPUT_SIZE)  # dpsgd: no ψ computed
    assert plain.public_view is None and "public_image" not in plain[0]
    weights, spec = global_model()
    result = train_site_round(site, "run", 1, weights, spec, local_steps=2)
    assert result.reply.status == "ok" and result.reply.privacy.guarantee == "FDP"


def test_the_public_view_picture_uses_the_block_size_a_site_of_that_size_uses() -> None:
    """public_view_demo.png of 128×96 data shows 8-px blocks (16 at 256×192), as the demo's sites use."""
    from fedpose.data.synthetic.preview import default_public_view, default_view_config

    assert default_view_config(256).factor == 16 and default_view_config(128).factor == 8
    image = np.random.default_rng(0).integers(0, 256, (128, 96, 3), dtype=np.uint8)
    from fedpose.config import PublicViewConfig
    from fedpose.privacy.public_views import ImagePublicView

    assert np.array_equal(default_public_view(image), ImagePublicView(PublicViewConfig(factor=8))(image))
