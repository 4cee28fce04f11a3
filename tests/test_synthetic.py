"""The synthetic pose generator: determinism, schema, anatomy, truncation, site shift, blur split."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from scipy.ndimage import binary_dilation, gaussian_filter

from fedpose.cli import main as cli_main
from fedpose.data.annotations import read_annotations
from fedpose.data.synthetic import (
    SplitSpec, SyntheticDataError, ensure_dataset, gaussian_blur, generate_dataset, parse_size,
    render_example, site_profile,
)
from fedpose.data.synthetic import body
from fedpose.data.synthetic.generate import IMAGES_PER_PATIENT, PROGRESS_FILE
from fedpose.data.synthetic.profiles import public_profile
from fedpose.data.synthetic.render import RADII, person_mask, render_scene, sample_scene
from fedpose.joints import JOINT_INDEX, NUM_JOINTS
from file_trees import tree_bytes

SMALL = (96, 64)
SITE1 = SplitSpec("site-1", 0, "site", 1)


def _small_dataset(out: Path, seed: int = 0, workers: int = 1, **kw) -> dict:
    args = dict(sites=2, per_site=3, public=3, test=2, size=SMALL, seed=seed, workers=workers, progress=False)
    args.update(kw)
    return generate_dataset(out, **args)


# --- determinism ---------------------------------------------------------------------------------

def test_render_is_a_pure_function_of_seed_split_index():
    a, fa = render_example(3, SITE1, 5, SMALL, n_sites=3)
    b, fb = render_example(3, SITE1, 5, SMALL, n_sites=3)
    assert np.array_equal(a, b)
    assert np.array_equal(fa["joints"], fb["joints"]) and fa["extra"] == fb["extra"]
    c, fc = render_example(4, SITE1, 5, SMALL, n_sites=3)
    d, _ = render_example(3, SITE1, 6, SMALL, n_sites=3)
    assert not np.array_equal(a, c) and not np.array_equal(fa["joints"], fc["joints"])
    assert not np.array_equal(a, d)


def test_dataset_identical_for_any_worker_count_and_differs_by_seed(tmp_path):
    one = _small_dataset(tmp_path / "w1", workers=1)
    two = _small_dataset(tmp_path / "w2", workers=2)
    assert one == two
    assert tree_bytes(tmp_path / "w1") == tree_bytes(tmp_path / "w2")
    _small_dataset(tmp_path / "s1", seed=1)
    a = (tmp_path / "w1" / "site-1" / "annotations.json").read_text()
    assert a != (tmp_path / "s1" / "site-1" / "annotations.json").read_text()


# --- schema and layout ---------------------------------------------------------------------------

def test_layout_schema_and_manifest(tmp_path):
    out = tmp_path / "ds"
    manifest = _small_dataset(out)
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json", "preview.png", "public", "public_view_demo.png", "site-1", "site-2", "test",
    ]
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert manifest["params"]["size"] == list(SMALL) and manifest["params"]["seed"] == 0
    assert not (out / PROGRESS_FILE).exists()
    from PIL import Image

    for split, count in (("public", 3), ("site-1", 3), ("site-2", 3), ("test", 2)):
        records = read_annotations(out / split)
        assert len(records) == count == manifest["splits"][split]["images"]
        for r in records:
            with Image.open(out / split / r.image) as im:
                assert im.size == (SMALL[1], SMALL[0]) and im.mode == "RGB"  # --size is H×W
            assert r.joints.shape == (NUM_JOINTS, 2) and r.headbox.shape == (2, 2)
            assert r.scale > 0 and set(np.unique(r.joints_vis)) <= {0.0, 1.0}
            assert len(r.extra["face_box"]) == 4 and len(r.extra["occluded"]) == NUM_JOINTS
            expected_site = split if split.startswith("site") else ("public" if split == "public" else r.extra["site"])
            assert r.extra["site"] == expected_site
            # The head box contains head top and upper neck, like MPII's.
            (x1, y1), (x2, y2) = r.headbox
            for j in (JOINT_INDEX["head_top"], JOINT_INDEX["upper_neck"]):
                assert x1 - 1 <= r.joints[j, 0] <= x2 + 1 and y1 - 1 <= r.joints[j, 1] <= y2 + 1
    assert {r.extra["site"] for r in read_annotations(out / "test")} <= {"site-1", "site-2"}


# --- anatomy -------------------------------------------------------------------------------------

BONES = {
    ("r_shoulder", "r_elbow"): body.UPPER_ARM, ("l_shoulder", "l_elbow"): body.UPPER_ARM,
    ("r_elbow", "r_wrist"): body.FOREARM, ("l_elbow", "l_wrist"): body.FOREARM,
    ("r_hip", "r_knee"): body.THIGH, ("l_hip", "l_knee"): body.THIGH,
    ("r_knee", "r_ankle"): body.SHIN, ("l_knee", "l_ankle"): body.SHIN,
    ("upper_neck", "head_top"): body.HEAD_LENGTH, ("pelvis", "thorax"): body.TORSO_LENGTH,
}


def _angle(u: np.ndarray, v: np.ndarray) -> float:
    return float(np.degrees(np.arccos(np.clip(u @ v / np.linalg.norm(u) / np.linalg.norm(v), -1, 1))))


@pytest.mark.parametrize("family", sorted(body.POSE_FAMILIES))
def test_sampled_poses_respect_bone_lengths_and_joint_limits(family):
    rng = np.random.default_rng(0)
    J = JOINT_INDEX
    for _ in range(60):
        skel = body.sample_pose(family, rng)
        for (a, b), length in BONES.items():
            assert np.linalg.norm(skel.joints[J[b]] - skel.joints[J[a]]) == pytest.approx(length, abs=1e-9)
        for key, value in skel.angles.items():
            lo, hi = body.LIMITS[key[2:] if key[:2] in ("r_", "l_") else key]
            assert lo <= value <= hi, key
        for s in ("r", "l"):
            # Elbow/knee flexion ∈ [0°, 150°]: the angle between consecutive bones equals the flexion.
            upper = skel.joints[J[f"{s}_elbow"]] - skel.joints[J[f"{s}_shoulder"]]
            fore = skel.joints[J[f"{s}_wrist"]] - skel.joints[J[f"{s}_elbow"]]
            assert _angle(upper, fore) == pytest.approx(skel.angles[f"{s}_elbow_flexion"], abs=1e-6)
            thigh = skel.joints[J[f"{s}_knee"]] - skel.joints[J[f"{s}_hip"]]
            shin = skel.joints[J[f"{s}_ankle"]] - skel.joints[J[f"{s}_knee"]]
            assert _angle(thigh, shin) == pytest.approx(skel.angles[f"{s}_knee_flexion"], abs=1e-6)
        # Left/right: the person's right hip and shoulder sit at −x in the body frame.
        assert skel.joints[J["r_hip"], 0] < skel.joints[J["l_hip"], 0]


def test_elbows_and_knees_bend_one_way_only():
    base = body.clip_angles(body._base(np.random.default_rng(0)) | {
        "torso_pitch": 0, "torso_lean": 0, "torso_twist": 0, "pelvis_roll": 0,
        **{f"{s}_{k}": 0 for s in "rl" for k in ("shoulder_abduction", "shoulder_flexion", "shoulder_rotation", "hip_flexion", "hip_abduction", "hip_rotation")},
    })
    J = JOINT_INDEX
    bent = body.pose_skeleton(base | {"r_elbow_flexion": 90.0, "r_knee_flexion": 90.0})
    assert bent.joints[J["r_wrist"], 2] > bent.joints[J["r_elbow"], 2] + 0.1  # forearm goes forward
    assert bent.joints[J["r_ankle"], 2] < bent.joints[J["r_knee"], 2] - 0.1  # shin goes backward
    clipped = body.clip_angles({"r_elbow_flexion": -40.0, "l_knee_flexion": 200.0, "torso_pitch": 500.0})
    assert clipped == {"r_elbow_flexion": 0.0, "l_knee_flexion": 150.0, "torso_pitch": body.LIMITS["torso_pitch"][1]}


def test_projected_bones_only_foreshorten():
    rng = np.random.default_rng(1)
    profile = site_profile(1)
    for _ in range(40):
        scene = sample_scene(rng, profile, (256, 192))
        for (a, b), length in BONES.items():
            d = np.linalg.norm(scene.joints[JOINT_INDEX[b]] - scene.joints[JOINT_INDEX[a]])
            assert d <= length * scene.pixels_per_unit + 1e-3
        # MPII-like framing: person box is a large fraction of the frame, scale = box / 200.
        assert 0.3 * 256 <= scene.scale * 200 <= 1.2 * 256


# --- truncation and visibility -------------------------------------------------------------------

def test_truncated_joints_outside_the_image_have_vis_zero():
    profile = dataclasses.replace(site_profile(2), truncation_probability=1.0)
    rng = np.random.default_rng(7)
    h, w = 128, 96
    outside_total = 0
    for _ in range(40):
        scene = sample_scene(rng, profile, (h, w))
        x, y = scene.joints[:, 0], scene.joints[:, 1]
        outside = (x < 0) | (x > w - 1) | (y < 0) | (y > h - 1)
        assert np.array_equal(scene.joints_vis, (~outside).astype(np.float32))
        assert scene.truncated
        outside_total += int(outside.sum())
    assert outside_total >= 40  # truncation really cuts joints off (≈ 1/5 of them)


def test_untruncated_people_are_fully_inside_the_frame():
    profile = dataclasses.replace(site_profile(1), truncation_probability=0.0)
    rng = np.random.default_rng(3)
    for _ in range(40):
        scene = sample_scene(rng, profile, (128, 96))
        assert scene.joints_vis.all()


def test_occluded_joints_stay_annotated():
    profile = dataclasses.replace(site_profile(1), occlusion_probability=1.0, truncation_probability=0.0)
    rng = np.random.default_rng(2)
    flagged = 0
    for _ in range(12):
        scene = sample_scene(rng, profile, (128, 96))
        render_scene(scene, rng, profile)
        occluded = np.asarray(scene.extra["occluded"], bool)
        assert scene.joints_vis[occluded].all()  # MPII convention: occluded joints are still annotated
        flagged += int(occluded.sum())
    assert flagged > 0


# --- sites are non-IID ---------------------------------------------------------------------------

def _family_fraction(site: int, family: str, n: int = 150) -> float:
    rng = np.random.default_rng(11)
    profile = site_profile(site)
    return float(np.mean([sample_scene(rng, profile, SMALL).family == family for _ in range(n)]))


def test_sites_differ_in_pose_distribution():
    assert _family_fraction(1, "standing") > 0.5 > _family_fraction(3, "standing") + 0.3
    assert _family_fraction(3, "sitting") > 0.5 > _family_fraction(1, "sitting") + 0.3
    assert _family_fraction(2, "arms_raised") > 0.5
    profiles = [site_profile(k) for k in range(1, 13)]
    assert len({json.dumps(p.to_dict(), sort_keys=True) for p in profiles}) == 12  # any N sites all differ


def _grey(pixels: np.ndarray) -> bool:
    return bool((pixels[:, 0] == pixels[:, 1]).all() and (pixels[:, 1] == pixels[:, 2]).all())


def test_sites_differ_in_image_statistics():
    def mean_colours(site: int) -> np.ndarray:
        spec = SplitSpec(f"site-{site}", 0, "site", site)
        # one image per patient: a patient's images share skin and clothing, so only patients are independent draws
        images = [render_example(0, spec, i, (64, 48), 3)[0].reshape(-1, 3)
                  for i in range(0, 100 * IMAGES_PER_PATIENT, IMAGES_PER_PATIENT)]
        # colour statistics of the colour images (the infrared ones are grey at every site)
        return np.stack([im.mean(0) for im in images if not _grey(im)])

    a, b = mean_colours(1), mean_colours(3)
    diff = np.abs(a.mean(0) - b.mean(0))
    stderr = np.sqrt(a.var(0, ddof=1) / len(a) + b.var(0, ddof=1) / len(b))
    assert (diff / stderr).max() > 4  # some channel differs by > 4 standard errors


def test_only_sites_show_patients_in_bed_and_infrared_images():
    """What public data lacks (profiles' docstring): every site has patients lying across the frame
    and grey infrared images, each in its own proportion; the public split has neither."""
    public = public_profile()
    assert public.lying_probability == 0 and public.infrared_probability == 0
    for k in range(1, 11):
        profile = site_profile(k)
        assert 0.3 <= profile.lying_probability <= 0.6 and 0.15 <= profile.infrared_probability <= 0.45
        assert 40 <= abs(profile.lying_roll) <= 60
        assert "in bed" in profile.describe() and "infrared" in profile.describe()
    rng = np.random.default_rng(5)
    site = site_profile(2)
    lying = [sample_scene(rng, site, SMALL).extra.get("lying", False) for _ in range(400)]
    assert abs(np.mean(lying) - site.lying_probability) < 0.08
    assert not any(sample_scene(rng, public, SMALL).extra.get("lying", False) for _ in range(200))

    def grey_fraction(spec: SplitSpec) -> float:
        return float(np.mean([_grey(render_example(0, spec, i, (64, 48), 3)[0].reshape(-1, 3)) for i in range(60)]))

    assert grey_fraction(SplitSpec("public", 0, "public")) == 0
    assert grey_fraction(SplitSpec("site-2", 0, "site", 2)) > 0.1


def test_a_patient_in_bed_is_tilted_beyond_what_public_images_show():
    """Head-to-pelvis axis: public images stay near upright (roll ≤ 30°), a patient in bed is tilted
    by the site's 40–60° (± 20° jitter; the pose itself bends the axis a little)."""
    def tilt(scene) -> float:
        J = JOINT_INDEX
        dx, dy = scene.joints[J["head_top"]] - scene.joints[[J["r_hip"], J["l_hip"]]].mean(0)
        return float(np.degrees(np.arctan2(abs(dx), abs(dy))))

    rng = np.random.default_rng(9)
    site = site_profile(3)
    in_bed = [tilt(s) for s in (sample_scene(rng, site, SMALL, family="standing") for _ in range(300)) if s.extra.get("lying")]
    upright = [tilt(sample_scene(rng, public_profile(), SMALL, family="standing")) for _ in range(100)]
    assert len(in_bed) > 50
    assert np.median(in_bed) > abs(site.lying_roll) - 12 and np.median(upright) < 12


# --- the FDP blur split: identity detail goes, pose stays ----------------------------------------

def test_blur_removes_face_detail_but_keeps_the_silhouette():
    profile = dataclasses.replace(
        site_profile(1), background_weights={"gradient": 1.0}, occlusion_probability=0.0, noise_std=(0.0, 0.0),
        jpeg_probability=0.0, blur_sigma=(0.0, 0.0), truncation_probability=0.0, back_facing_probability=0.0,
        lying_probability=0.0, infrared_probability=0.0,
    )

    def fine_energy(a: np.ndarray) -> float:  # detail at ≤ 2-px scale
        return float(((a - gaussian_filter(a, (1, 1, 0))) ** 2).mean())

    for seed in range(3):
        rng = np.random.default_rng(seed)
        scene = sample_scene(rng, profile, (256, 192), family="standing")
        image = render_scene(scene, rng, profile).astype(np.float32)
        blurred = gaussian_blur(image)  # σ = 6, 21 taps: the FDP default ψ
        x1, y1, x2, y2 = (int(round(v)) for v in scene.face_box)
        assert fine_energy(blurred[y1:y2, x1:x2]) < 0.01 * fine_energy(image[y1:y2, x1:x2])

        # Silhouette: distance of each pixel from a plane fitted to the background correlates with
        # the (blurred) person mask — before and after the blur.
        mask = person_mask(scene)
        yy, xx = np.nonzero(~binary_dilation(mask, iterations=15))
        h, w = mask.shape
        gy, gx = np.mgrid[0:h, 0:w]
        design = np.stack([gx.ravel(), gy.ravel(), np.ones(h * w)], 1)

        def foreground(a: np.ndarray) -> np.ndarray:
            coef, *_ = np.linalg.lstsq(design.reshape(h, w, 3)[yy, xx], a[yy, xx], rcond=None)
            return np.linalg.norm(a.reshape(-1, 3) - design @ coef, axis=1)

        assert np.corrcoef(foreground(image), mask.ravel())[0, 1] > 0.7
        assert np.corrcoef(foreground(blurred), gaussian_blur(mask.astype(np.float32)).ravel())[0, 1] > 0.7


def test_limbs_are_thick_enough_to_survive_blur():
    rng = np.random.default_rng(5)
    for _ in range(30):
        scene = sample_scene(rng, site_profile(1), (256, 192))
        thinnest = 2 * min(min(r) for name, r in RADII.items() if name != "hand") * scene.pixels_per_unit
        assert thinnest >= 6.0  # px at 256×192: wider than the blur's detail scale, so limbs survive


# --- restart, ensure, CLI ------------------------------------------------------------------------

def test_resume_and_ensure_dataset(tmp_path):
    out = tmp_path / "ds"
    manifest = _small_dataset(out)
    reference = tree_bytes(out)
    # Simulate a crash after the public split: no manifest, later splits incomplete.
    (out / "manifest.json").unlink()
    (out / "site-2" / "annotations.json").unlink()
    (out / "test" / "annotations.json").unlink()
    (out / PROGRESS_FILE).write_text(json.dumps(manifest["params"]))
    with pytest.raises(SyntheticDataError, match="not empty"):
        _small_dataset(out)
    assert ensure_dataset(out, sites=2, per_site=3, public=3, test=2, size=SMALL, seed=0, workers=1, progress=False) == manifest
    assert tree_bytes(out) == reference
    stamp = (out / "public" / "images" / "000000.png").stat().st_mtime_ns
    ensure_dataset(out, sites=2, per_site=3, public=3, test=2, size=SMALL, seed=0, workers=1, progress=False)
    assert (out / "public" / "images" / "000000.png").stat().st_mtime_ns == stamp  # up to date: untouched
    changed = ensure_dataset(out, sites=2, per_site=3, public=3, test=2, size=SMALL, seed=9, workers=1, progress=False)
    assert changed["params"]["seed"] == 9 and json.loads((out / "manifest.json").read_text()) == changed


def test_ensure_dataset_without_replace_never_deletes(tmp_path):
    """Federation runs (replace=False): a different or damaged dataset is named, never regenerated
    (sites of a running federation may be reading it)."""
    out = tmp_path / "ds"
    _small_dataset(out)
    reference = tree_bytes(out)
    with pytest.raises(SyntheticDataError, match=r"different synthetic dataset \(sites: 2 → 3\)"):
        ensure_dataset(out, sites=3, per_site=3, public=3, test=2, size=SMALL, seed=0, workers=1, progress=False, replace=False)
    assert tree_bytes(out) == reference
    (out / "site-2" / "annotations.json").unlink()
    with pytest.raises(SyntheticDataError, match=r"splits missing \(site-2\)"):
        ensure_dataset(out, sites=2, per_site=3, public=3, test=2, size=SMALL, seed=0, workers=1, progress=False, replace=False)
    assert tree_bytes(out) == {k: v for k, v in reference.items() if k != "site-2/annotations.json"}


def test_ensure_dataset_refuses_foreign_directories(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SyntheticDataError, match="not a fedpose synthetic dataset"):
        ensure_dataset(tmp_path, sites=1, per_site=1, public=1, test=1, size=SMALL, progress=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("text", ["256", "0x192", "256x", "abcx12", "256x192x3", "20x20", "5000x100"])
def test_parse_size_rejects_bad_sizes(text):
    with pytest.raises(SyntheticDataError):
        parse_size(text)


def test_parse_size_is_height_by_width():
    assert parse_size("256x192") == (256, 192)


@pytest.mark.parametrize("argv, message", [
    (["--size", "256by192"], "HEIGHTxWIDTH"),
    (["--per-site", "-1"], "per_site must be a non-negative integer"),
    (["--public", "-5"], "public must be a non-negative integer"),
    (["--sites", "0"], "sites must be at least 1"),
    (["--workers", "0"], "--workers"),
])
def test_cli_rejects_bad_arguments(tmp_path, capsys, argv, message):
    code = cli_main(["data", "synth", "--out", str(tmp_path / "x"), *argv])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_cli_generates_and_refuses_non_empty_dir(tmp_path, capsys):
    out = tmp_path / "ds"
    args = ["data", "synth", "--out", str(out), "--sites", "1", "--per-site", "2", "--public", "2",
            "--test", "1", "--size", "64x48", "--seed", "2", "--workers", "1", "--quiet"]
    assert cli_main(args + ["--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["splits"] == {"public": 2, "site-1": 2, "test": 1} and summary["size"] == [64, 48]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--overwrite" in err
    before = (out / "manifest.json").read_text()
    assert cli_main(args + ["--overwrite"]) == 0
    assert (out / "manifest.json").read_text() == before  # same seed → same dataset


# --- patients: several images per person, for patient-level DP -----------------------------------

def test_site_patients_have_several_images_with_one_identity_and_different_scenes():
    from fedpose.data.synthetic.generate import patient_of
    from fedpose.data.synthetic.render import sample_scene as scene_of
    from fedpose.data.synthetic.generate import example_rng, patient_identity, profile_for

    count = 3 * IMAGES_PER_PATIENT
    fields = [render_example(0, SITE1, i, SMALL, 3)[1] for i in range(count)]
    ids = [f["patient_id"] for f in fields]
    assert len(set(ids)) == 3 and all(ids.count(pid) == IMAGES_PER_PATIENT for pid in set(ids))
    assert ids == sorted(ids) and ids[0] == "site-1-patient-00000"
    profile = profile_for("site", 1)
    scenes = []
    for i in range(count):
        patient = patient_of(SITE1, i)
        scenes.append(scene_of(example_rng(0, SITE1, i), profile, SMALL, identity=patient_identity(0, SITE1, patient, profile)))
    for p in range(3):
        same = scenes[p * IMAGES_PER_PATIENT: (p + 1) * IMAGES_PER_PATIENT]
        first = same[0].identity
        for scene in same[1:]:  # skin, face, hair, clothing colours and fabric seed: one person
            assert all(np.array_equal(getattr(scene.identity, k), getattr(first, k)) for k in vars(first))
        # ... in different poses and places
        assert len({tuple(np.round(s.joints.ravel(), 1)) for s in same}) == IMAGES_PER_PATIENT
    others = [scenes[p * IMAGES_PER_PATIENT].identity for p in range(3)]
    assert len({o.texture_seed for o in others}) == 3 and not np.array_equal(others[0].shirt, others[1].shirt)


def test_site_records_carry_patient_ids_so_the_default_unit_is_the_patient(tmp_path):
    from fedpose.data.loaders import load_records
    from fedpose.data.units import resolve_unit

    manifest = generate_dataset(tmp_path / "d", sites=1, per_site=6, public=2, test=2, size=SMALL, workers=1, progress=False)
    records, _ = load_records(tmp_path / "d" / "site-1")
    assert [r.patient_id for r in records] == ["site-1-patient-00000"] * 4 + ["site-1-patient-00001"] * 2
    assert resolve_unit("auto", records, "site-1").unit == "patient"
    public, _ = load_records(tmp_path / "d" / "public")
    assert all(r.patient_id is None for r in public)  # a new person per public image
    assert manifest["params"]["images_per_patient"] == IMAGES_PER_PATIENT
