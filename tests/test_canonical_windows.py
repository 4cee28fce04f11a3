"""A site's training rows come from canonical windows (fedpose/data/canonical.py): one fixed-size
array per record, built when the site loads its data, so a round's cost does not depend on the
image files — no file is opened once the windows exist — and the crops are those of the files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from site_round_helpers import INPUT_SIZE, make_site_data, site_config

from fedpose.data.canonical import WindowGeometry
from fedpose.data.dataset import DEFAULT_PADDING, PoseDataset
from fedpose.data.loaders import resolve_image_or_raise
from fedpose.data.transforms import affine_points, compose, crop_transform, invert, sample_augmentation
from fedpose.federation.local_training import CANONICAL_WINDOWS_DIR, load_site_dataset


def _draws(dataset: PoseDataset, seeds: range) -> list[dict]:
    return [dataset.load(index, np.random.default_rng([seed, index])) for seed in seeds for index in range(len(dataset))]


def test_once_built_a_site_reads_no_image_file(tmp_path: Path) -> None:
    """The image files are removed after the site built its windows: every row still loads, the
    same as before — a round's work is reading fixed-size arrays, whatever the files were."""
    data = make_site_data(tmp_path / "data")
    site = site_config(data, tmp_path / "state")
    dataset = load_site_dataset(site, INPUT_SIZE)
    assert dataset.windows is not None and len(dataset.windows) == len(dataset)
    assert len({w.shape for w in dataset.windows.windows}) == 1 and dataset.windows.windows.dtype == np.uint8
    before = _draws(dataset, range(3))
    for record in dataset.records:
        resolve_image_or_raise(dataset.root, record.image).unlink(missing_ok=True)
    after = _draws(dataset, range(3))
    for a, b in zip(before, after):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["joints"], b["joints"])


def test_windows_are_reused_and_rebuilt_when_a_file_changes(tmp_path: Path) -> None:
    data = make_site_data(tmp_path / "data")
    site = site_config(data, tmp_path / "state")
    load_site_dataset(site, INPUT_SIZE)
    folder = tmp_path / "state" / CANONICAL_WINDOWS_DIR
    (built,) = folder.glob("*.npy")
    stamp = built.stat().st_mtime_ns
    load_site_dataset(site, INPUT_SIZE)
    assert [p.name for p in folder.glob("*.npy")] == [built.name] and built.stat().st_mtime_ns == stamp
    first = load_site_dataset(site, INPUT_SIZE)
    image = resolve_image_or_raise(first.root, first.records[0].image)
    os.utime(image, ns=(stamp, stamp + 10**9))  # the file changed (a new modification time)
    load_site_dataset(site, INPUT_SIZE)
    (rebuilt,) = folder.glob("*.npy")
    assert rebuilt.name != built.name  # the old windows are gone: one set per input size


def test_an_image_rewritten_with_its_size_and_modification_time_kept_is_decoded_anew(tmp_path: Path) -> None:
    """A photograph redacted in place the way `cp -p`, `rsync -t` or `tar x` write it (new pixels, the
    same size and modification time): the site used to keep training from the old pixels, kept in
    its windows. The kernel's inode-change time says the file changed: the image is checked and its
    window built again from the new pixels, the old ones removed."""
    from PIL import Image

    data = make_site_data(tmp_path / "data")
    site = site_config(data, tmp_path / "state")
    first = load_site_dataset(site, INPUT_SIZE)
    folder = tmp_path / "state" / CANONICAL_WINDOWS_DIR
    (built,) = folder.glob("*.npy")
    path = resolve_image_or_raise(first.root, first.records[0].image)
    before = path.stat()
    redacted = tmp_path / "redacted.png"
    Image.new("RGB", Image.open(path).size).save(redacted)  # all black
    with open(path, "r+b") as fh:  # in place, padded to the old size, then its times set back
        fh.write(redacted.read_bytes().ljust(before.st_size, b"\0")[:before.st_size])
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    again = load_site_dataset(site, INPUT_SIZE)
    (rebuilt,) = folder.glob("*.npy")
    assert rebuilt.name != built.name
    assert again.windows.windows[0].max() == 0 and first.windows.windows[0].max() > 0


@pytest.mark.parametrize("rotation_range,scale_jitter", [(30.0, 0.25), (60.0, 0.35), (180.0, 0.0)])
def test_every_crop_the_augmentation_can_draw_lies_inside_the_window(rotation_range: float, scale_jitter: float) -> None:
    geometry = WindowGeometry.for_crops(INPUT_SIZE, scale_jitter, rotation_range)
    center, scale = np.array([123.4, 87.6], np.float32), 0.83
    record = type("Record", (), {"center": center, "scale": scale})()
    window = geometry.matrix(record, INPUT_SIZE, DEFAULT_PADDING)  # type: ignore[arg-type]
    height, width = INPUT_SIZE
    corners = np.array([[-0.5, -0.5], [width - 0.5, -0.5], [-0.5, height - 0.5], [width - 0.5, height - 0.5]])
    rng = np.random.default_rng(0)
    for _ in range(2000):
        aug = sample_augmentation(rng, scale_jitter, rotation_range, True, rotation_range)
        crop = crop_transform(center, scale * DEFAULT_PADDING, INPUT_SIZE, aug)
        in_window = affine_points(corners, compose(window, invert(crop)))
        # bilinear reads reach one pixel past a sample point: every read stays inside the window
        assert in_window.min() >= 0 and (in_window.max(axis=0) <= np.array(geometry.size[::-1]) - 1).all()


def test_window_crops_are_the_file_crops_up_to_one_more_resampling(tmp_path: Path) -> None:
    data = make_site_data(tmp_path / "data")
    site = site_config(data, tmp_path / "state")
    windowed = load_site_dataset(site, INPUT_SIZE)
    from_files = PoseDataset(windowed.records, windowed.root, INPUT_SIZE, train=True, **site.data.augmentation_options())
    differences = []
    for a, b in zip(_draws(windowed, range(2)), _draws(from_files, range(2))):
        assert torch.equal(a["joints"], b["joints"]) and (a["rotation"], a["flipped"]) == (b["rotation"], b["flipped"])
        differences.append(float((a["image"] - b["image"]).abs().mean()))
    # ~1.5 grey levels of 255 on average (normalized units ≈ 1/(0.225·255) per level)
    assert np.mean(differences) < 0.06, np.mean(differences)


def test_site_prepare_builds_the_windows_the_first_round_then_reuses(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import json

    import tomli_w

    from fedpose.cli import main

    data = make_site_data(tmp_path / "data")
    site = site_config(data, tmp_path / "state")
    config = tmp_path / "site-1.toml"
    config.write_text(tomli_w.dumps(site.model_dump(mode="json", exclude_none=True)))
    assert main(["site", "prepare", "--site-config", str(config), "--input-size", *map(str, INPUT_SIZE)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["records"] == 16 and printed["window_size"] == list(load_site_dataset(site, INPUT_SIZE).windows.windows.shape[1:3])
    (built,) = (tmp_path / "state" / CANONICAL_WINDOWS_DIR).glob("*.npy")
    stamp = built.stat().st_mtime_ns
    assert load_site_dataset(site, INPUT_SIZE).windows is not None
    assert built.stat().st_mtime_ns == stamp  # the round's load reads them; nothing is decoded again
    assert main(["site", "prepare", "--site-config", str(config), "--input-size", "0", "64"]) == 2
    assert "--input-size must be positive" in capsys.readouterr().err
    moved = tmp_path / "site-1-moved.toml"  # a data path that is not there: the error names the key
    moved.write_text(tomli_w.dumps(site.model_dump(mode="json", exclude_none=True) | {"data": {"train": str(tmp_path / "nowhere")}}))
    assert main(["site", "prepare", "--site-config", str(moved), "--input-size", *map(str, INPUT_SIZE)]) == 2
    assert f"data.train = {tmp_path / 'nowhere'}: no such file or directory" in capsys.readouterr().err


def test_an_fdp_site_computes_every_records_public_view_before_its_first_step(tmp_path: Path) -> None:
    """ψ is cached per record: computed on a record's first load, a row's work would hang on whether
    an earlier step of the round had loaded that record — on which units were sampled. A site's
    training set computes ψ for every record when it is built; a load only reads it."""
    data = make_site_data(tmp_path / "data")
    dataset = load_site_dataset(site_config(data, tmp_path / "state", mechanism="fdp"), INPUT_SIZE)
    cached = dict(dataset._public_cache)
    assert sorted(cached) == list(range(len(dataset)))
    for sample in _draws(dataset, range(2)):
        assert sample["public_image"].shape == sample["image"].shape
    assert dataset._public_cache.keys() == cached.keys()
    assert all(dataset._public_cache[i] is cached[i] for i in cached)  # read, never recomputed
