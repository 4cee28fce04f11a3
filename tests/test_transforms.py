"""Affine crop transforms and PoseDataset geometry on real MPII / COCO files."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedpose.data.dataset import PoseDataset, denormalize, load_records, normalize
from fedpose.data.transforms import (
    Augmentation,
    affine_points,
    crop_to_original,
    crop_transform,
    flip_joints,
    get_affine_transform,
    sample_augmentation,
    warp_affine,
)
from fedpose.joints import FLIP_PAIRS, JOINT_INDEX, NUM_JOINTS

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
INPUT = (128, 96)


@pytest.fixture(scope="module")
def mpii():
    return load_records(DATA / "mpii-real")


@pytest.fixture(scope="module")
def coco():
    return load_records(DATA / "coco-real")


def hrnet_affine(center, scale_wh, rot, size_wh):
    """HRNet's three-point construction (cv2.getAffineTransform replaced by a linear solve)."""
    def get_dir(point, rot_rad):
        sn, cs = math.sin(rot_rad), math.cos(rot_rad)
        return np.array([point[0] * cs - point[1] * sn, point[0] * sn + point[1] * cs])

    def third(a, b):
        direct = a - b
        return b + np.array([-direct[1], direct[0]])

    src_w = scale_wh[0] * 200.0
    dst_w, dst_h = size_wh
    src_dir = get_dir([0, src_w * -0.5], math.radians(rot))
    dst_dir = np.array([0, dst_w * -0.5])
    src = np.zeros((3, 2))
    dst = np.zeros((3, 2))
    src[0] = center
    src[1] = center + src_dir
    dst[0] = [dst_w * 0.5, dst_h * 0.5]
    dst[1] = dst[0] + dst_dir
    src[2] = third(src[0], src[1])
    dst[2] = third(dst[0], dst[1])
    # Solve dst = M @ [src, 1]
    a = np.concatenate([src, np.ones((3, 1))], axis=1)
    return np.linalg.solve(a, dst).T


@pytest.mark.parametrize("rot", [0.0, 17.0, -40.0])
def test_matches_hrnet_get_affine_transform(rot):
    height, width = 256, 192
    center, scale = np.array([966.0, 340.0]), 4.7
    ours = get_affine_transform(center, scale, rot, (height, width))
    theirs = hrnet_affine(center, [scale * width / height, scale], rot, (width, height))
    np.testing.assert_allclose(ours, theirs, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("source", ["mpii", "coco"])
@pytest.mark.parametrize("rot", [0.0, 25.0, -30.0])
def test_points_into_crop_and_back(source, rot, request):
    records, _ = request.getfixturevalue(source)
    for record in records:
        scale = record.scale * 1.25 * 0.9
        matrix = get_affine_transform(record.center, scale, rot, INPUT)
        in_crop = affine_points(record.joints, matrix)
        back = crop_to_original(in_crop, record.center, scale, INPUT, rot)
        np.testing.assert_allclose(back, record.joints, atol=1e-3)
    # batched form, as used for predictions of a whole batch
    joints = np.stack([r.joints for r in records])
    centers = np.stack([r.center for r in records])
    scales = np.array([r.scale for r in records])
    crops = np.stack([affine_points(j, get_affine_transform(c, s, 0.0, INPUT)) for j, c, s in zip(joints, centers, scales)])
    np.testing.assert_allclose(crop_to_original(crops, centers, scales, INPUT), joints, atol=1e-3)


def test_center_maps_to_crop_center_and_scale_sets_height():
    matrix = get_affine_transform((100.0, 50.0), 0.5, 0.0, (64, 48))
    # the crop is 200·0.5 = 100 px tall in the original → 64 px: factor 0.64
    np.testing.assert_allclose(affine_points(np.array([[100.0, 50.0], [100.0, 100.0]]), matrix),
                               [[24.0, 32.0], [24.0, 64.0]], atol=1e-5)


def test_positive_rotation_turns_content_counterclockwise():
    # A point straight above the centre moves to the left in the crop for rot > 0 (HRNet).
    matrix = get_affine_transform((0.0, 0.0), 1.0, 90.0, (200, 200))
    x, y = affine_points(np.array([[0.0, -50.0]]), matrix)[0]
    assert x == pytest.approx(50.0, abs=1e-4) and y == pytest.approx(100.0, abs=1e-4)


def _bilinear(image: np.ndarray, x: float, y: float) -> np.ndarray:
    x0, y0 = int(math.floor(x)), int(math.floor(y))
    fx, fy = x - x0, y - y0
    top = (1 - fx) * image[y0, x0] + fx * image[y0, x0 + 1]
    bottom = (1 - fx) * image[y0 + 1, x0] + fx * image[y0 + 1, x0 + 1]
    return (1 - fy) * top + fy * bottom


def test_warp_samples_the_mapped_source_location(mpii):
    """Each crop pixel equals the original image bilinearly sampled at the inverse-mapped point
    (cv2.warpAffine's integer-pixel-centre convention) — checks the half-pixel handling."""
    records, root = mpii
    record = records[0]
    image = Image.open(root / "images" / record.image).convert("RGB")
    original = np.asarray(image, dtype=np.float64)
    matrix = get_affine_transform(record.center, 0.4, 20.0, INPUT)  # upsampling crop
    crop = np.asarray(warp_affine(image, matrix, INPUT), dtype=np.float64)
    inverse = get_affine_transform(record.center, 0.4, 20.0, INPUT, inverse=True)
    rng = np.random.default_rng(0)
    errors = []
    for _ in range(200):
        cx, cy = rng.integers(0, INPUT[1]), rng.integers(0, INPUT[0])
        sx, sy = affine_points(np.array([[cx, cy]], dtype=np.float64), inverse)[0]
        errors.append(np.abs(crop[cy, cx] - _bilinear(original, sx, sy)).max())
    assert np.median(errors) <= 1.0 and np.max(errors) <= 3.0


def test_bright_dot_lands_on_its_mapped_point():
    image = np.zeros((100, 120, 3), np.uint8)
    image[40, 70] = 255
    matrix = get_affine_transform((60.0, 50.0), 0.2, 30.0, (64, 48))  # 40 px → 64 px
    crop = np.asarray(warp_affine(Image.fromarray(image), matrix, (64, 48)), dtype=np.float64)[..., 0]
    ys, xs = np.mgrid[:64, :48]
    weights = crop / crop.sum()
    expected = affine_points(np.array([[70.0, 40.0]]), matrix)[0]
    assert (xs * weights).sum() == pytest.approx(expected[0], abs=0.1)
    assert (ys * weights).sum() == pytest.approx(expected[1], abs=0.1)


def test_flip_twice_is_identity_and_swaps_labels(mpii):
    records, _ = mpii
    joints, vis = records[0].joints, records[0].joints_vis.copy()
    vis[JOINT_INDEX["l_wrist"]] = 0
    once, vis_once = flip_joints(joints, vis, 1280)
    twice, vis_twice = flip_joints(once, vis_once, 1280)
    np.testing.assert_allclose(twice, joints)
    np.testing.assert_array_equal(vis_twice, vis)
    # what was the right ankle is now the left ankle, mirrored
    r, l = JOINT_INDEX["r_ankle"], JOINT_INDEX["l_ankle"]
    assert once[l, 0] == pytest.approx(1279 - joints[r, 0]) and once[l, 1] == joints[r, 1]
    assert vis_once[JOINT_INDEX["r_wrist"]] == 0 and vis_once[JOINT_INDEX["l_wrist"]] == 1
    for a, b in FLIP_PAIRS:
        assert once[a, 0] == pytest.approx(1279 - joints[b, 0])


def _draw_until(dataset: PoseDataset, index: int, flipped: bool) -> dict:
    for _ in range(64):
        sample = dataset[index]
        if sample["flipped"] == flipped:
            return sample
    raise AssertionError("flip never drawn in 64 tries")


def test_dataset_flip_mirrors_image_and_swaps_joints(mpii):
    records, root = mpii
    dataset = PoseDataset(records, root, INPUT, train=True, flip=True, scale_jitter=0.0, rotation=0.0, seed=3)
    plain, mirrored = _draw_until(dataset, 1, False), _draw_until(dataset, 1, True)
    # Same source locations, mirrored: pixel x of the flipped crop = pixel W-1-x of the plain crop
    # (up to one grey level from PIL's fixed-point rounding).
    plain_pixels = denormalize(plain["image"]).astype(int)
    mirrored_pixels = denormalize(mirrored["image"]).astype(int)
    assert np.abs(mirrored_pixels - plain_pixels[:, ::-1]).max() <= 1
    assert np.abs(mirrored_pixels - plain_pixels).max() > 50  # and it is not the same picture
    plain_joints, mirrored_joints = plain["joints"].numpy(), mirrored["joints"].numpy()
    for a, b in FLIP_PAIRS:
        for src, dst in ((a, b), (b, a)):
            assert mirrored_joints[dst, 0] == pytest.approx(INPUT[1] - 1 - plain_joints[src, 0], abs=1e-3)
            assert mirrored_joints[dst, 1] == pytest.approx(plain_joints[src, 1], abs=1e-3)
    for centre in (JOINT_INDEX["pelvis"], JOINT_INDEX["head_top"]):
        assert mirrored_joints[centre, 0] == pytest.approx(INPUT[1] - 1 - plain_joints[centre, 0], abs=1e-3)
    # the right wrist is on the image's left for this person; after the flip the *left* wrist is there
    assert plain["joints"][JOINT_INDEX["r_wrist"], 0] < plain["joints"][JOINT_INDEX["l_wrist"], 0]
    assert mirrored["joints"][JOINT_INDEX["l_wrist"], 0] > mirrored["joints"][JOINT_INDEX["r_wrist"], 0]


def test_joints_outside_crop_and_invisible_joints_get_weight_zero(mpii):
    records, root = mpii
    record = records[0]
    moved = type(record)(record.image, record.joints.copy(), record.joints_vis.copy(), record.center,
                         record.scale, record.headbox, dict(record.extra))
    moved.joints[JOINT_INDEX["l_wrist"]] = moved.center + np.array([0.0, 300.0 * moved.scale])  # far below
    moved.joints_vis[JOINT_INDEX["r_knee"]] = 0
    sample = PoseDataset([moved], root, INPUT, train=False)[0]
    weight = sample["weight"].numpy()
    assert weight[JOINT_INDEX["l_wrist"]] == 0 and sample["joints"][JOINT_INDEX["l_wrist"], 1] > INPUT[0]
    assert weight[JOINT_INDEX["r_knee"]] == 0
    others = [j for j in range(NUM_JOINTS) if j not in (JOINT_INDEX["l_wrist"], JOINT_INDEX["r_knee"])]
    joints = sample["joints"].numpy()[others]
    inside = (joints[:, 0] >= 0) & (joints[:, 0] < INPUT[1]) & (joints[:, 1] >= 0) & (joints[:, 1] < INPUT[0])
    np.testing.assert_array_equal(weight[others], inside.astype(np.float32))
    assert weight[others].sum() >= 12


def test_dataset_sample_contract_and_default_collate(coco):
    records, root = coco
    dataset = PoseDataset(records, root, INPUT, train=True, seed=1)
    batch = next(iter(torch.utils.data.DataLoader(dataset, batch_size=4)))
    assert batch["image"].shape == (4, 3, *INPUT) and batch["image"].dtype == torch.float32
    assert batch["joints"].shape == (4, NUM_JOINTS, 2) and batch["weight"].shape == (4, NUM_JOINTS)
    assert batch["headbox"].shape == (4, 2, 2) and batch["face_box"].shape == (4, 4)
    assert batch["center"].shape == (4, 2) and batch["scale"].shape == (4,)
    # COCO has no head top / upper neck: never a training target
    assert batch["weight"][:, JOINT_INDEX["head_top"]].sum() == 0
    assert batch["weight"][:, JOINT_INDEX["upper_neck"]].sum() == 0
    # ImageNet normalization: roughly zero-mean, unit-ish spread on real photos
    assert abs(float(batch["image"].mean())) < 1.0 and 0.3 < float(batch["image"].std()) < 2.0


def test_eval_crop_roundtrip_through_dataset(mpii):
    """Crop-frame joints of an eval sample map back to the annotated joints with the returned
    center/scale — the path predictions take for PCKh."""
    records, root = mpii
    dataset = PoseDataset(records, root, INPUT, train=False)
    for i in range(len(dataset)):
        sample = dataset[i]
        back = crop_to_original(sample["joints"].numpy(), sample["center"].numpy(), sample["scale"], INPUT)
        np.testing.assert_allclose(back, records[i].joints, atol=1e-2)
        np.testing.assert_allclose(sample["joints_original"].numpy(), records[i].joints)


def test_augmented_roundtrip_with_rotation_and_jitter(coco):
    records, _ = coco
    rng = np.random.default_rng(0)
    for record in records:
        aug = sample_augmentation(rng, 0.25, 30.0, flip=False)
        matrix = crop_transform(record.center, record.scale * 1.25, INPUT, aug)
        crop = affine_points(record.joints, matrix)
        back = crop_to_original(crop, record.center, record.scale * 1.25 * aug.scale_factor, INPUT, aug.rotation)
        np.testing.assert_allclose(back, record.joints, atol=1e-3)


def test_face_box_follows_the_crop(mpii):
    records, root = mpii
    sample = PoseDataset(records[:1], root, INPUT, train=False)[0]
    matrix = crop_transform(records[0].center, records[0].scale * 1.25, INPUT, Augmentation())
    corners = affine_points(records[0].headbox, matrix)
    np.testing.assert_allclose(sample["face_box"].numpy(), corners.reshape(-1), atol=1e-3)
    # head top lies inside the face/head box in crop space
    x1, y1, x2, y2 = sample["face_box"].numpy()
    hx, hy = sample["joints"][JOINT_INDEX["head_top"]].numpy()
    assert x1 - 1 <= hx <= x2 + 1 and y1 - 1 <= hy <= y2 + 1


def test_augmentation_ranges():
    rng = np.random.default_rng(0)
    draws = [sample_augmentation(rng, 0.25, 30.0, True) for _ in range(2000)]
    factors = np.array([d.scale_factor for d in draws])
    angles = np.array([d.rotation for d in draws])
    assert factors.min() >= 0.75 and factors.max() <= 1.25 and factors.std() > 0.1
    assert np.abs(angles).max() <= 30.0
    assert 0.3 < np.mean(angles == 0.0) < 0.5  # rotation applied with probability 0.6
    assert 0.45 < np.mean([d.flip for d in draws]) < 0.55
    assert all(not d.flip for d in (sample_augmentation(rng, 0.25, 30.0, False) for _ in range(100)))


def test_hrnets_rotation_clip_draws_angles_past_one_std_up_to_two():
    """data.rotation_clip = 2 is HRNet's recipe: N(0, 30²) degrees clipped to ±60 (on 60 % of loads)."""
    rng = np.random.default_rng(0)
    angles = np.array([sample_augmentation(rng, 0.25, 30.0, False, rotation_range=60.0).rotation for _ in range(20000)])
    rotated = angles[angles != 0.0]
    assert np.abs(angles).max() <= 60.0 and np.abs(angles).max() > 55.0
    # P(|N(0, 1)| > 1) = 0.317 of the rotated draws lie beyond one std; P(|N| > 2) = 0.046 sit on the clip
    assert abs(np.mean(np.abs(rotated) > 30.0) - 0.317) < 0.015
    assert abs(np.mean(np.abs(rotated) == 60.0) - 0.046) < 0.006
    assert 0.38 < np.mean(angles == 0.0) < 0.42


def test_the_rotation_range_is_the_configs_and_the_datasets_hard_clip(mpii):
    from fedpose.config import AugmentationConfig

    assert AugmentationConfig().rotation_range == 30.0  # default: data.rotation is the range
    assert AugmentationConfig(rotation=30.0, rotation_clip=2.0).rotation_range == 60.0
    assert AugmentationConfig(rotation=120.0, rotation_clip=2.0).rotation_range == 180.0
    records, root = mpii
    narrow = PoseDataset(records, root, INPUT, train=True, seed=3)
    wide = PoseDataset(records, root, INPUT, train=True, seed=3, rotation_range=60.0)
    assert narrow.rotation_range == 30.0 and wide.rotation_range == 60.0
    narrow_angles = np.array([narrow.augmentation().rotation for _ in range(3000)])
    wide_angles = np.array([wide.augmentation().rotation for _ in range(3000)])
    assert np.abs(narrow_angles).max() <= 30.0 < np.abs(wide_angles).max() <= 60.0


def test_train_augmentation_is_seeded(mpii):
    records, root = mpii
    a = PoseDataset(records, root, INPUT, train=True, seed=7)
    b = PoseDataset(records, root, INPUT, train=True, seed=7)
    for i in range(3):
        torch.testing.assert_close(a[i]["joints"], b[i]["joints"])


def test_normalize_denormalize_roundtrip():
    pixels = np.random.default_rng(0).integers(0, 256, (16, 12, 3), dtype=np.uint8)
    np.testing.assert_array_equal(denormalize(normalize(pixels)), pixels)


def test_reduced_jpeg_decoding_matches_full_decode(mpii):
    """Large MPII crops decode the JPEG at 1/2–1/8 size; the crop must line up with the full decode."""
    records, root = mpii
    fast = PoseDataset(records, root, INPUT, train=False)
    full = PoseDataset(records, root, INPUT, train=False, cache_images=True)  # cache keeps full size
    reduced_somewhere = False
    for i in range(len(records)):
        _, reduction = fast._image(i, INPUT[0] / (200 * records[i].scale * 1.25))
        reduced_somewhere |= reduction > 1
        a = denormalize(fast[i]["image"]).astype(float)
        b = denormalize(full[i]["image"]).astype(float)
        aligned = np.abs(a - b).mean()
        shifted = np.abs(a[:, 1:] - b[:, :-1]).mean()
        # the full decode is point-sampled (aliased) at ~1/8 zoom, so expect a few grey levels of blur
        assert aligned < 8.0 and aligned < 0.8 * shifted, (i, aligned, shifted)
    assert reduced_somewhere


def test_weight_boundary_is_the_simcc_range(mpii):
    """A joint mapped to x = -0.01 or x = W is outside (weight 0); x = 0.001 or W - 0.01 is inside
    (0.001, not 0: the float32 round trip through the original frame is not exact)."""
    records, root = mpii
    record = records[2]
    crop_points = np.array([[-0.01, 50.0], [0.001, 50.0], [INPUT[1] - 0.01, 50.0], [INPUT[1], 50.0],
                            [40.0, -0.01], [40.0, INPUT[0] - 0.01]])
    joints = record.joints.copy()
    names = ["r_ankle", "r_knee", "l_knee", "l_ankle", "r_wrist", "l_wrist"]
    originals = crop_to_original(crop_points, record.center, record.scale * 1.25, INPUT)
    for name, point in zip(names, originals):
        joints[JOINT_INDEX[name]] = point
    moved = type(record)(record.image, joints, np.ones(NUM_JOINTS, np.float32), record.center, record.scale)
    weight = PoseDataset([moved], root, INPUT, train=False)[0]["weight"].numpy()
    assert [weight[JOINT_INDEX[n]] for n in names] == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def test_basis_view_turns_each_public_image_by_a_fixed_angle_about_the_crop_centre() -> None:
    """public_basis_dataset (privacy.basis.public_rotation): the same angle per image on every
    construction, within ±rotation; each labelled joint is the upright view's joint rotated about the
    crop centre by that angle (so only the view turns, not the labels' meaning); 0 is the plain view."""
    from fedpose.data.dataset import public_basis_dataset

    directory = DATA / "mpii-real"
    upright = public_basis_dataset(directory, (128, 96))
    plain = PoseDataset(*load_records(directory), input_size=(128, 96), train=False)
    turned, again = (public_basis_dataset(directory, (128, 96), public_rotation=60.0) for _ in range(2))
    centre = np.array([96 / 2, 128 / 2])  # (x, y) of the crop centre
    angles = []
    for i in range(len(upright)):
        assert torch.equal(upright[i]["image"], plain[i]["image"])
        a, b, u = turned[i], again[i], upright[i]
        assert a["rotation"] == b["rotation"] and torch.equal(a["image"], b["image"])
        theta = math.radians(a["rotation"])
        rotate = np.array([[math.cos(theta), math.sin(theta)], [-math.sin(theta), math.cos(theta)]])  # content turns by -rot
        expected = (u["joints"].numpy() - centre) @ rotate.T + centre
        labelled = u["weight"].numpy() > 0
        assert np.allclose(a["joints"].numpy()[labelled], expected[labelled], atol=1e-3)
        angles.append(a["rotation"])
    assert all(abs(x) <= 60.0 for x in angles) and len(set(angles)) == len(angles) and max(map(abs, angles)) > 10.0
    with pytest.raises(ValueError, match="fixed_rotations"):
        PoseDataset(*load_records(directory), input_size=(128, 96), train=True, fixed_rotations=[0.0] * len(upright))


def test_basis_view_shows_a_fixed_share_of_public_images_grey_and_leaves_the_rest_alone() -> None:
    """public_basis_dataset (privacy.basis.public_grey): the same images grey on every construction;
    a grey image is its colour view's luminance in all three channels (a night camera's one channel),
    with the same labels; the others are the colour view itself; the rotations are those of
    public_rotation alone (the grey draw does not move them); 0 is the plain view, 1 all grey."""
    from fedpose.data.dataset import IMAGENET_MEAN, IMAGENET_STD, public_basis_dataset

    directory = DATA / "mpii-real"
    mean, std = (torch.tensor(v, dtype=torch.float32)[:, None, None] for v in (IMAGENET_MEAN, IMAGENET_STD))

    def pixels(sample: dict) -> torch.Tensor:  # back to 0..255 RGB
        return (sample["image"] * std + mean) * 255

    turned = public_basis_dataset(directory, (128, 96), public_rotation=60.0)
    mixed, again = (public_basis_dataset(directory, (128, 96), public_rotation=60.0, public_grey=0.5) for _ in range(2))
    every = public_basis_dataset(directory, (128, 96), public_rotation=60.0, public_grey=1.0)
    assert mixed.fixed_grey == again.fixed_grey and every.fixed_grey == [True] * len(every)
    assert 0 < sum(mixed.fixed_grey) < len(mixed) and public_basis_dataset(directory, (128, 96)).fixed_grey is None
    for i in range(len(turned)):
        colour, grey = turned[i], every[i]
        assert grey["rotation"] == colour["rotation"] == mixed[i]["rotation"]
        assert torch.equal(grey["joints"], colour["joints"]) and torch.equal(grey["weight"], colour["weight"])
        rgb, g = pixels(colour), pixels(grey)
        assert torch.allclose(g[0], g[1], atol=1e-3) and torch.allclose(g[1], g[2], atol=1e-3)
        luminance = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]
        assert (g[0] - luminance).abs().max() <= 1.0 + 1e-3  # PIL rounds ITU-R 601 luma to whole levels
        assert not torch.allclose(rgb[0], rgb[1], atol=1.0)  # the public photo is in colour
        expected = grey if mixed.fixed_grey[i] else colour
        assert torch.equal(mixed[i]["image"], expected["image"])
    with pytest.raises(ValueError, match="fixed_grey"):
        PoseDataset(*load_records(directory), input_size=(128, 96), train=True, fixed_grey=[True] * len(turned))
