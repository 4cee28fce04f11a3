"""Dataset privatization: once, idempotent, refuses different settings, resumes without redrawing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

import fedpose.privacy.input_privacy as input_privacy
from fedpose.config import InputPrivacyConfig
from fedpose.data.annotations import PoseRecord, read_annotations, resolve_image, write_annotations
from fedpose.privacy.input_privacy import (
    MANIFEST_FILE,
    InputPrivacyError,
    guarantee_record,
    prepare_site_dataset,
    privatize_dataset,
)


def _dataset(root, n=3):
    root.mkdir()
    records = []
    for i in range(n):
        name = f"img{i}.png" if i else "img0.jpg"  # one JPEG: becomes img0.png
        rgb = np.random.default_rng(i).integers(0, 256, (48, 64, 3), dtype=np.uint8)
        Image.fromarray(rgb).save(root / name)
        joints = np.random.default_rng(10 + i).uniform(0, 48, (16, 2)).astype(np.float32)
        records.append(PoseRecord(name, joints, np.ones(16, np.float32), np.array([32, 24], np.float32), 0.2))
    records.append(PoseRecord("img1.png", records[1].joints + 1, np.ones(16, np.float32), np.array([30, 20], np.float32), 0.2))
    write_annotations(root / "annotations.json", records)
    return root


def _snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


CFG = InputPrivacyConfig(mechanism="ldp-slicing", epsilon=20.0, insecure_seed=5)  # reproducible, NOT PRIVATE


def test_privatized_copy_has_same_schema_and_guarantee(tmp_path):
    src = _dataset(tmp_path / "site")
    guarantee = privatize_dataset(src, tmp_path / "private", CFG)
    assert guarantee["mechanism"] == "ldp-slicing"
    # the seeded test source voids the guarantee, and says so first
    assert guarantee["guarantee_statement"].startswith("NO PRIVACY GUARANTEE (seeded test noise): pure ε-LDP per pixel")
    assert guarantee["guarantee_void"] is True and guarantee["cryptographically_secure"] is False
    assert guarantee["epsilon_total"] == 20.0 and guarantee["delta"] == 0.0
    assert "2×2" in guarantee["block_note"]
    original, private = read_annotations(src), read_annotations(tmp_path / "private")
    assert [r.image for r in private] == ["img0.png", "img1.png", "img2.png", "img1.png"]
    for a, b in zip(original, private):
        np.testing.assert_array_equal(a.joints, b.joints)
        raw = np.asarray(Image.open(resolve_image(src, a.image)).convert("RGB"))
        noisy = np.asarray(Image.open(resolve_image(tmp_path / "private", b.image)))
        assert noisy.shape == raw.shape and not np.array_equal(noisy, raw)
    manifest = json.loads((tmp_path / "private" / MANIFEST_FILE).read_text())
    assert manifest["complete"] and manifest["images"] == 3
    assert not (tmp_path / "private.partial").exists()


def test_rerun_is_a_noop_and_other_settings_are_refused(tmp_path):
    src = _dataset(tmp_path / "site")
    dst = tmp_path / "private"
    first = privatize_dataset(src, dst, CFG)
    before = _snapshot(dst)
    assert privatize_dataset(src, dst, CFG) == first
    assert _snapshot(dst) == before  # no image was randomized again
    with pytest.raises(InputPrivacyError, match="spend the privacy budget again"):
        privatize_dataset(src, dst, CFG.model_copy(update={"epsilon": 5.0}))
    with pytest.raises(InputPrivacyError, match="privatized copy of"):
        privatize_dataset(_dataset(tmp_path / "other"), dst, CFG)
    assert _snapshot(dst) == before


def _crash_on_second_image(monkeypatch):
    """Make the second PNG write raise, as a power cut would; returns the real writer."""
    real_save = input_privacy.save_png
    calls = {"n": 0}

    def crash_on_second(path, rgb):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("power cut")
        real_save(path, rgb)

    monkeypatch.setattr(input_privacy, "save_png", crash_on_second)
    return real_save


def test_crash_resumes_without_redrawing(tmp_path, monkeypatch):
    src = _dataset(tmp_path / "site")
    dst = tmp_path / "private"
    real_save = _crash_on_second_image(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        privatize_dataset(src, dst, InputPrivacyConfig(mechanism="ldp-slicing", epsilon=20.0))  # CSPRNG
    partial = tmp_path / "private.partial"
    kept = (partial / "img0.png").read_bytes()
    assert not dst.exists()
    monkeypatch.setattr(input_privacy, "save_png", real_save)
    with pytest.raises(InputPrivacyError):  # resuming with other settings is refused too
        privatize_dataset(src, dst, InputPrivacyConfig(mechanism="ldp-slicing", epsilon=3.0))
    privatize_dataset(src, dst, InputPrivacyConfig(mechanism="ldp-slicing", epsilon=20.0))
    assert (dst / "img0.png").read_bytes() == kept  # the released image was not drawn again
    assert len(read_annotations(dst)) == 4


def test_prepare_site_dataset(tmp_path):
    src = _dataset(tmp_path / "site")
    path, guarantee = prepare_site_dataset(src, InputPrivacyConfig())
    assert path == src and guarantee is None
    path, guarantee = prepare_site_dataset(src, CFG)
    assert path == tmp_path / "site.ldp-sliced" and guarantee["mechanism"] == "ldp-slicing"
    assert prepare_site_dataset(src, CFG) == (path, guarantee)


def test_a_lost_central_copy_is_refused_not_privatized_again(tmp_path):
    """Central training kept no release record: deleting <data>.ldp-sliced made the next run draw a
    second, independent copy of the same images (2ε spent, ε reported; an attacker review)."""
    import shutil

    src = _dataset(tmp_path / "site")
    path, _ = prepare_site_dataset(src, CFG)
    record = tmp_path / "site.ldp-sliced.release.json"
    assert json.loads(record.read_text())["settings"]["epsilon"] == CFG.epsilon
    shutil.rmtree(path)
    with pytest.raises(InputPrivacyError, match="is missing"):
        prepare_site_dataset(src, CFG)
    assert not path.exists()
    with pytest.raises(InputPrivacyError, match="keep the recorded settings"):
        prepare_site_dataset(src, CFG.model_copy(update={"epsilon": 2 * CFG.epsilon}))


def test_corrupt_image_is_named_and_nothing_is_published(tmp_path):
    src = _dataset(tmp_path / "site")
    (src / "img2.png").write_bytes(b"garbage")
    with pytest.raises(InputPrivacyError, match="img2.png"):
        privatize_dataset(src, tmp_path / "private", CFG)
    assert not (tmp_path / "private").exists()
    with pytest.raises(InputPrivacyError, match="destination"):
        privatize_dataset(src, src, CFG)


def test_default_config_uses_the_csprng_and_keeps_the_guarantee():
    guarantee = guarantee_record(InputPrivacyConfig(mechanism="ldp-slicing", epsilon=20.0))
    assert guarantee["guarantee_statement"].startswith("pure ε-LDP per pixel")
    assert guarantee["guarantee_void"] is False and guarantee["cryptographically_secure"] is True
    assert guarantee["randomness"].startswith("aes-256-ctr")


def test_manifest_written_before_the_insecure_seed_rename_is_reused(tmp_path):
    src, dst = _dataset(tmp_path / "site"), tmp_path / "private"
    first = privatize_dataset(src, dst, CFG)
    manifest = json.loads((dst / MANIFEST_FILE).read_text())
    settings = manifest["settings"]
    settings["seed"] = settings.pop("insecure_seed")
    (dst / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert privatize_dataset(src, dst, CFG) == first  # same settings under the old key: no second release


def test_a_site_keeps_its_copy_and_release_record_in_its_state_dir(tmp_path):
    from fedpose.privacy.input_privacy import RELEASE_RECORD, prepare_site_input, site_ldp_copy_dir

    src, state = _dataset(tmp_path / "site"), tmp_path / "state"
    path, guarantee = prepare_site_input(src, CFG, state)
    assert path == site_ldp_copy_dir(state) and guarantee["mechanism"] == "ldp-slicing"
    assert not (tmp_path / "site.ldp-sliced").exists()  # never beside the raw data (a container's writable layer)
    record = json.loads((state / RELEASE_RECORD).read_text())
    assert record["settings"]["epsilon"] == CFG.epsilon
    images = {p.name: p.read_bytes() for p in path.glob("*.png")}
    assert prepare_site_input(src, CFG, state) == (path, guarantee)  # reused: nothing drawn again
    assert {p.name: p.read_bytes() for p in path.glob("*.png")} == images


def test_a_lost_site_copy_is_not_privatized_again(tmp_path):
    import shutil

    from fedpose.privacy.input_privacy import RELEASE_RECORD, prepare_site_input, site_ldp_copy_dir

    src, state = _dataset(tmp_path / "site"), tmp_path / "state"
    prepare_site_input(src, CFG, state)
    shutil.rmtree(site_ldp_copy_dir(state))  # a lost volume, a careless cleanup
    with pytest.raises(InputPrivacyError, match=r"is missing.*2ε spent.*delete .*ldp_release\.json deliberately"):
        prepare_site_input(src, CFG, state)
    assert not site_ldp_copy_dir(state).exists()
    with pytest.raises(InputPrivacyError, match="spends the budget again"):  # other settings: refused too
        prepare_site_input(src, InputPrivacyConfig(mechanism="ldp-slicing", epsilon=3.0), state)
    (state / RELEASE_RECORD).unlink()  # the operator's explicit decision
    path, _ = prepare_site_input(src, CFG, state)
    assert (path / "img0.png").exists()


def test_a_legacy_copy_beside_the_data_must_be_moved_not_redrawn(tmp_path):
    from fedpose.privacy.input_privacy import prepare_site_input

    src = _dataset(tmp_path / "site")
    prepare_site_dataset(src, CFG)  # the old default location
    with pytest.raises(InputPrivacyError, match="move it to"):
        prepare_site_input(src, CFG, tmp_path / "state")


def test_a_site_refuses_other_settings_while_its_copy_exists_and_changes_nothing(tmp_path):
    from fedpose.privacy.input_privacy import RELEASE_RECORD, prepare_site_input, site_ldp_copy_dir

    src, state = _dataset(tmp_path / "site"), tmp_path / "state"
    prepare_site_input(src, CFG, state)
    copy, record = _snapshot(site_ldp_copy_dir(state)), (state / RELEASE_RECORD).read_bytes()
    with pytest.raises(InputPrivacyError, match=r"ldp_release\.json.*spends the budget again"):
        prepare_site_input(src, InputPrivacyConfig(mechanism="ldp-slicing", epsilon=3.0, insecure_seed=5), state)
    assert _snapshot(site_ldp_copy_dir(state)) == copy and (state / RELEASE_RECORD).read_bytes() == record


def test_a_site_copy_interrupted_mid_build_resumes_under_its_release_record(tmp_path, monkeypatch):
    """The release record exists from the start; a crash leaves <state_dir>/ldp-sliced.partial, which is
    resumed (images already drawn are kept), not refused and not redrawn."""
    from fedpose.privacy.input_privacy import RELEASE_RECORD, prepare_site_input, site_ldp_copy_dir

    src, state = _dataset(tmp_path / "site"), tmp_path / "state"
    cfg = InputPrivacyConfig(mechanism="ldp-slicing", epsilon=20.0)  # CSPRNG: a redraw would differ
    real_save = _crash_on_second_image(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        prepare_site_input(src, cfg, state)
    assert (state / RELEASE_RECORD).exists() and not site_ldp_copy_dir(state).exists()
    kept = (state / "ldp-sliced.partial" / "img0.png").read_bytes()
    monkeypatch.setattr(input_privacy, "save_png", real_save)
    path, _ = prepare_site_input(src, cfg, state)
    assert (path / "img0.png").read_bytes() == kept and len(read_annotations(path)) == 4
