"""Input privatization of a whole dataset directory, exactly once.

A site that trains on LDP-sliced inputs must privatize every image *once*, before any training or
evaluation touches it. Drawing fresh randomized-response noise for the same image again would
release a second independent noisy copy and spend the budget again (two releases of an
ε-LDP mechanism are 2ε-LDP). So :func:`privatize_dataset`:

* writes a privatized copy of ``src_dir`` (``annotations.json`` + images, same schema) to
  ``dst_dir``, building it in ``<dst_dir>.partial`` and renaming it into place at the end;
* records the settings in ``<dst_dir>/ldp_manifest.json``; calling it again with the same
  settings is a no-op that returns the same guarantee record;
* refuses (``InputPrivacyError``) when ``dst_dir`` holds a copy made with different settings,
  or from a different source — it never silently re-randomizes;
* after a crash, resumes the ``.partial`` directory and keeps every image already privatized
  there (they are not drawn again).

The images are re-encoded as PNG (lossless; a JPEG input becomes ``<stem>.png`` and its records
are rewritten to point at it).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path, PurePosixPath
from typing import Any, Callable

import numpy as np

from fedpose.config import InputPrivacyConfig
from fedpose.data.annotations import ANNOTATIONS_FILE, read_annotations, refuse_image_aliases, resolve_image, write_annotations
from fedpose.io import atomic_write_json
from fedpose.privacy.ldp_slicing import LdpSlicer
from fedpose.viz import save_png

MANIFEST_FILE = "ldp_manifest.json"
PARTIAL_SUFFIX = ".partial"
#: beside a central run's copy (``<copy>.release.json``): deleting the copy leaves the record
CENTRAL_RELEASE_SUFFIX = ".release.json"
#: Default location of a site's privatized copy, beside its raw data.
PRIVATIZED_SUFFIX = ".ldp-sliced"


class InputPrivacyError(RuntimeError):
    """Privatized data cannot be produced or reused safely (message says why and what to do)."""


def load_rgb(path: Path) -> np.ndarray:
    """Decode an image file to (H, W, 3) uint8 RGB; a corrupt or unreadable file raises naming the file."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise InputPrivacyError(f"{path}: cannot decode image ({exc})") from exc


def settings_record(cfg: InputPrivacyConfig) -> dict[str, Any]:
    """The settings that determine the privatized copy (compared on re-use)."""
    return {
        "mechanism": cfg.mechanism,
        "epsilon": cfg.epsilon,
        "ll_prune": cfg.ll_prune,
        "ll_offset": cfg.ll_offset,
        "allocation": cfg.allocation,
        "insecure_seed": cfg.insecure_seed,
    }


def _slicer(cfg: InputPrivacyConfig) -> LdpSlicer:
    if cfg.mechanism != "ldp-slicing" or cfg.epsilon is None:
        raise InputPrivacyError(f"input_privacy.mechanism {cfg.mechanism!r} does not privatize images")
    return LdpSlicer(
        cfg.epsilon, ll_prune=cfg.ll_prune, ll_offset=cfg.ll_offset, allocation=cfg.allocation,
        insecure_seed=cfg.insecure_seed,
    )


def guarantee_record(cfg: InputPrivacyConfig) -> dict[str, Any]:
    """The privacy-report entry for these settings (no randomness drawn)."""
    return _slicer(cfg).guarantee()


def _check_manifest(manifest_path: Path, expected: dict[str, Any], src_dir: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputPrivacyError(f"{manifest_path}: unreadable manifest ({exc}); refusing to overwrite privatized data") from exc
    recorded = manifest.get("settings")
    if isinstance(recorded, dict) and "seed" in recorded:  # manifests written before the rename to insecure_seed
        recorded = {("insecure_seed" if key == "seed" else key): value for key, value in recorded.items()}
    if recorded != expected:
        raise InputPrivacyError(
            f"{manifest_path.parent} was privatized with {manifest.get('settings')}, not {expected}. "
            "Re-randomizing the same images would spend the privacy budget again; keep the old settings, "
            "or delete that directory deliberately (its release already counts) and choose a new destination."
        )
    if manifest.get("source") != str(src_dir):
        raise InputPrivacyError(
            f"{manifest_path.parent} is a privatized copy of {manifest.get('source')}, not of {src_dir}"
        )
    return manifest


def privatize_dataset(
    src_dir: str | Path,
    dst_dir: str | Path,
    cfg: InputPrivacyConfig,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Write an LDP-sliced copy of the dataset in ``src_dir`` to ``dst_dir`` once; return its guarantee."""
    src_dir = Path(src_dir).resolve()
    dst_dir = Path(dst_dir).resolve()
    if src_dir == dst_dir:
        raise InputPrivacyError(f"{dst_dir}: destination must differ from the source dataset")
    expected = settings_record(cfg)
    manifest_path = dst_dir / MANIFEST_FILE
    if manifest_path.exists():
        return _check_manifest(manifest_path, expected, src_dir)["guarantee"]
    if dst_dir.exists() and any(dst_dir.iterdir()):
        raise InputPrivacyError(f"{dst_dir}: exists, is not empty and has no {MANIFEST_FILE}; refusing to write into it")

    slicer = _slicer(cfg)
    guarantee = slicer.guarantee()
    partial = dst_dir.with_name(dst_dir.name + PARTIAL_SUFFIX)
    partial_manifest = partial / MANIFEST_FILE
    if partial_manifest.exists():
        _check_manifest(partial_manifest, expected, src_dir)  # resume only with identical settings
    manifest = {"settings": expected, "source": str(src_dir), "guarantee": guarantee}
    atomic_write_json(partial_manifest, {**manifest, "complete": False})

    records = read_annotations(src_dir)
    sources = {}
    for record in records:
        if record.image not in sources:
            sources[record.image] = resolve_image(src_dir, _copy_name(src_dir, record.image))
    refuse_image_aliases(src_dir, sources)  # one file, one release
    renamed = {name: str(Path(name).with_suffix(".png")) for name in sources}
    if len(set(renamed.values())) != len(renamed):
        raise InputPrivacyError(f"{src_dir}: two images map to the same PNG name; rename them first")

    for index, (name, path) in enumerate(sources.items()):
        target = partial / renamed[name]
        if not target.resolve().is_relative_to(partial.resolve()):  # resolve_image keeps names inside; never trust it alone
            raise InputPrivacyError(f"{src_dir}: image '{name}' would be written outside the privatized copy ({target})")
        if not target.exists():  # already privatized in an interrupted run: never draw again
            save_png(slicer(load_rgb(path)).rgb, target)
        if progress is not None:
            progress(index + 1, len(sources))
    for record in records:
        record.image = renamed[record.image]
    write_annotations(partial / ANNOTATIONS_FILE, records)
    atomic_write_json(partial_manifest, {**manifest, "complete": True, "images": len(sources)})

    if dst_dir.exists():
        dst_dir.rmdir()  # empty (checked above)
    os.replace(partial, dst_dir)
    return guarantee


def _copy_name(src_dir: Path, image: str) -> str:
    """An image name the copy can mirror: relative and inside the dataset. The copy is written at
    ``<copy>/<name>``, so an absolute name would point it at the raw file itself (whose existing PNG
    was then taken for a privatized one, and trained on raw) and ".." would climb out of the copy."""
    parts = PurePosixPath(image.replace("\\", "/")).parts
    if not image or PurePosixPath(image).is_absolute() or Path(image).is_absolute() or ".." in parts:
        raise InputPrivacyError(f"{src_dir}: image name '{image}' must be a relative path inside the dataset directory "
                                "(beside annotations.json or under images/), without '..', for its privatized copy")
    return image


def prepare_site_dataset(
    data_dir: str | Path, cfg: InputPrivacyConfig, privatized_dir: str | Path | None = None
) -> tuple[Path, dict[str, Any] | None]:
    """What central training calls when it loads its data: returns (directory to train/evaluate on, guarantee or None).

    With ``mechanism = "none"`` the raw directory is returned unchanged. Otherwise the privatized
    copy (default ``<data_dir>.ldp-sliced``) is created once and reused on every later call; its
    release is recorded beside it (``<copy>.release.json``) before any image is drawn, so a lost copy
    is refused, never privatized a second time (:func:`prepare_site_input` says why)."""
    data_dir = Path(data_dir).resolve()
    if cfg.mechanism == "none":
        return data_dir, None
    target = Path(privatized_dir) if privatized_dir is not None else data_dir.with_name(data_dir.name + PRIVATIZED_SUFFIX)
    record = target.with_name(target.name + CENTRAL_RELEASE_SUFFIX)
    return _privatize_once(data_dir, target, record, cfg, f"restore {target} from a backup")


def _privatize_once(data_dir: Path, copy: Path, record: Path, cfg: InputPrivacyConfig, restore: str) -> tuple[Path, dict[str, Any]]:
    """The LDP-sliced ``copy`` of ``data_dir``, its release recorded in ``record`` before any draw:
    once recorded the release is final, and a lost copy is refused (``restore`` says how to get it
    back) instead of privatized again — two independent ε-LDP releases are 2ε-LDP, reported as ε."""
    partial = copy.with_name(copy.name + PARTIAL_SUFFIX)
    expected = settings_record(cfg)
    if record.exists():
        try:
            release = json.loads(record.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InputPrivacyError(f"{record}: unreadable LDP release record ({exc}); refusing to privatize the images again") from None
        if release.get("settings") != expected or release.get("source") != str(data_dir):
            raise InputPrivacyError(
                f"{record}: these images were privatized from {release.get('source')} with {release.get('settings')}; "
                f"the config now asks for {data_dir} with {expected}. A second randomization spends the budget again: "
                "keep the recorded settings."
            )
        if not (copy / MANIFEST_FILE).exists() and not (partial / MANIFEST_FILE).exists():
            raise InputPrivacyError(
                f"the LDP-sliced copy {copy} recorded in {record} (ε_total = {release['settings'].get('epsilon')}) is missing. "
                f"Privatizing the images again would release a second independent copy (2ε spent, ε reported): {restore}. "
                f"Only if you accept the doubled spend, delete {record} deliberately."
            )
        return copy, privatize_dataset(data_dir, copy, cfg)  # reuses the copy, or resumes its .partial build
    if (copy / MANIFEST_FILE).exists():  # a copy made before release records existed: check it, record it, draw nothing
        guarantee = privatize_dataset(data_dir, copy, cfg)
        atomic_write_json(record, {"settings": expected, "source": str(data_dir), "guarantee": guarantee,
                                   "recorded_at": time.time(), "adopted": True})
        return copy, guarantee
    atomic_write_json(record, {"settings": expected, "source": str(data_dir), "guarantee": guarantee_record(cfg),
                               "recorded_at": time.time()})
    return copy, privatize_dataset(data_dir, copy, cfg)


#: A federation site's privatized copy and its release record live in its state_dir (a durable
#: volume), never beside the raw data: a recreated container must find them, not privatize again.
SITE_COPY_DIR = "ldp-sliced"
RELEASE_RECORD = "ldp_release.json"


def site_ldp_copy_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / SITE_COPY_DIR


def prepare_site_input(data_dir: str | Path, cfg: InputPrivacyConfig, state_dir: str | Path) -> tuple[Path, dict[str, Any] | None]:
    """:func:`prepare_site_dataset` for a federation site: the copy goes to ``<state_dir>/ldp-sliced``,
    and the release is recorded in ``<state_dir>/ldp_release.json`` *before* any image is drawn.

    Once recorded, the release is final: if the copy is later lost (and no interrupted ``.partial``
    build is left to resume), the site refuses instead of privatizing its images a second time —
    two independent ε-LDP releases of the same images are 2ε-LDP while fedpose would report ε.
    Only an operator who deletes the release record deliberately can make the site privatize again.
    """
    data_dir, state_dir = Path(data_dir).resolve(), Path(state_dir)
    if cfg.mechanism == "none":
        return data_dir, None
    copy, record = site_ldp_copy_dir(state_dir), state_dir / RELEASE_RECORD
    legacy = data_dir.with_name(data_dir.name + PRIVATIZED_SUFFIX)
    if not record.exists() and (legacy / MANIFEST_FILE).exists() and not (copy / MANIFEST_FILE).exists():
        raise InputPrivacyError(
            f"{legacy} holds an LDP-sliced copy made before sites kept it in their state_dir; move it to {copy} "
            "(privatizing again would spend the budget a second time)"
        )
    return _privatize_once(data_dir, copy, record, cfg, f"restore the copy from a backup of {state_dir}")
