"""Write a synthetic federated pose dataset: public/, site-1 … site-N/, test/, manifest.json.

Each split directory holds ``images/NNNNNN.png`` and ``annotations.json`` (MPII/HRNet schema,
:mod:`fedpose.data.annotations`). Every image is a pure function of ``(seed, split, index)``
(a ``numpy.random.SeedSequence``), so the output is byte-identical for any worker count.

Site splits hold *patients*: images ``k·P … k·P + P − 1`` (P = :data:`IMAGES_PER_PATIENT`) show
patient k, whose identity — skin tone, face (eyes, hair, beard, glasses), clothing colours and
fabric patterns — comes from ``(seed, split, patient)`` and is the same in all their images, while
pose, view, placement, background and lighting differ per image. Body proportions are the
generator's one adult body model, shared by everyone. Each site record carries ``patient_id``
(e.g. ``site-2-patient-00017``), so the default protection unit of a synthetic site is the
patient. The public and test splits show a new person in every image and carry no patient_id.

Crash safety: images and annotation files are written atomically; a split's
``annotations.json`` is written only after all its images, and ``manifest.json`` only after all
splits, previews and demos. A directory without a manifest is an incomplete run: ``resume=True``
(or :func:`ensure_dataset`) continues it, skipping splits whose annotations already exist.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import multiprocessing as mp
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Iterator

import numpy as np

from fedpose.data.annotations import ANNOTATIONS_FILE, PoseRecord, read_annotations, write_annotations
from fedpose.data.synthetic.preview import save_public_view_demo, save_preview
from fedpose.data.synthetic.profiles import SiteProfile, public_profile, site_profile
from fedpose.data.synthetic.render import Identity, annotation_fields, render_scene, sample_identity, sample_scene
from fedpose.io import atomic_write_json
from fedpose.viz import save_png

GENERATOR_VERSION: Final = 3  # 2: site splits show patients (several images each, patient_id); 3: sites add patients in bed and infrared night images
#: images per synthetic patient at a site (the last patient of a split may have fewer)
IMAGES_PER_PATIENT: Final = 4
MANIFEST_FILE: Final = "manifest.json"
PROGRESS_FILE: Final = ".synth-params.json"  # present while a run is incomplete
SPLIT_CODES: Final = {"public": 0, "site": 1, "test": 2}
IMAGE_DIR: Final = "images"


class SyntheticDataError(ValueError):
    """Bad generator arguments or an output directory that cannot be used."""


@dataclass(frozen=True)
class SplitSpec:
    name: str  # "public", "site-3", "test"
    count: int
    kind: str  # key of SPLIT_CODES
    site_index: int = 0  # 1-based for sites; 0 otherwise


def parse_size(text: str) -> tuple[int, int]:
    """'256x192' → (256, 192) = (height, width)."""
    parts = text.lower().replace("×", "x").split("x")
    if len(parts) != 2:
        raise SyntheticDataError(f"--size must be HEIGHTxWIDTH, e.g. 256x192; got {text!r}")
    try:
        h, w = int(parts[0]), int(parts[1])
    except ValueError:
        raise SyntheticDataError(f"--size must be two integers HEIGHTxWIDTH, got {text!r}") from None
    return validate_size((h, w))


def validate_size(size: tuple[int, int]) -> tuple[int, int]:
    h, w = int(size[0]), int(size[1])
    if not (32 <= h <= 2048 and 32 <= w <= 2048):
        raise SyntheticDataError(f"image size must be between 32 and 2048 px per side, got {h}x{w} (HxW)")
    return h, w


def dataset_params(sites: int, per_site: int, public: int, test: int, size: tuple[int, int], seed: int) -> dict[str, Any]:
    for name, value in (("sites", sites), ("per_site", per_site), ("public", public), ("test", test)):
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise SyntheticDataError(f"{name} must be a non-negative integer, got {value!r}")
    if sites < 1:
        raise SyntheticDataError(f"sites must be at least 1, got {sites}")
    if test > 0 and sites < 1:
        raise SyntheticDataError("the test split mixes the sites' distributions: needs sites ≥ 1")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise SyntheticDataError(f"seed must be a non-negative integer, got {seed!r}")
    h, w = validate_size(size)
    return {
        "generator_version": GENERATOR_VERSION, "seed": int(seed), "size": [h, w], "images_per_patient": IMAGES_PER_PATIENT,
        "sites": int(sites), "per_site": int(per_site), "public": int(public), "test": int(test),
    }


def split_specs(params: dict[str, Any]) -> list[SplitSpec]:
    specs = [SplitSpec("public", params["public"], "public")]
    specs += [SplitSpec(f"site-{k}", params["per_site"], "site", k) for k in range(1, params["sites"] + 1)]
    specs.append(SplitSpec("test", params["test"], "test"))
    return specs


@functools.lru_cache(maxsize=64)
def profile_for(kind: str, site_index: int) -> SiteProfile:
    return public_profile() if kind == "public" else site_profile(site_index)


def example_rng(seed: int, spec: SplitSpec, index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, SPLIT_CODES[spec.kind], spec.site_index, index]))


def patient_of(spec: SplitSpec, index: int) -> int | None:
    """The patient number shown in image ``index`` of a site split; None outside site splits."""
    return index // IMAGES_PER_PATIENT if spec.kind == "site" else None


def patient_id(spec: SplitSpec, patient: int) -> str:
    return f"{spec.name}-patient-{patient:05d}"


def patient_identity(seed: int, spec: SplitSpec, patient: int, profile: SiteProfile) -> Identity:
    """A site patient's appearance: a pure function of (seed, split, patient), shared by their images.
    Its stream (five SeedSequence words) never coincides with an image's (four words)."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, SPLIT_CODES[spec.kind], spec.site_index, patient, 1]))
    identity = sample_identity(rng, profile)
    return dataclasses.replace(identity, texture_seed=int(rng.integers(2**63)))


def render_example(seed: int, spec: SplitSpec, index: int, size: tuple[int, int], n_sites: int) -> tuple[np.ndarray, dict[str, Any]]:
    """One image (uint8 H×W×3) and its record fields — a pure function of its arguments."""
    rng = example_rng(seed, spec, index)
    site_index = spec.site_index
    if spec.kind == "test":  # the test split mixes all sites' distributions
        site_index = int(rng.integers(1, n_sites + 1))
    kind = "public" if spec.kind == "public" else "site"
    profile = profile_for(kind, site_index)
    patient = patient_of(spec, index)
    identity = patient_identity(seed, spec, patient, profile) if patient is not None else None
    scene = sample_scene(rng, profile, size, identity=identity)
    image = render_scene(scene, rng, profile)
    fields = annotation_fields(scene, profile.name)
    if spec.kind == "test":
        fields["extra"]["split"] = "test"
    if patient is not None:
        fields["patient_id"] = patient_id(spec, patient)
    return image, fields


def _image_name(index: int) -> str:
    return f"{IMAGE_DIR}/{index:06d}.png"


def _task(args: tuple[int, SplitSpec, int, tuple[int, int], int, str]) -> PoseRecord:
    seed, spec, index, size, n_sites, split_dir = args
    image, fields = render_example(seed, spec, index, size, n_sites)
    name = _image_name(index)
    save_png(image, Path(split_dir) / name, compress_level=1)
    return PoseRecord(image=name, **fields)


def _status(out: Path, params: dict[str, Any]) -> str:
    """'empty' | 'complete' (same params) | 'partial' (same params) | 'other' (ours, different) | 'foreign'."""
    if not out.exists() or not any(out.iterdir()):
        return "empty"
    for marker, state in ((MANIFEST_FILE, "complete"), (PROGRESS_FILE, "partial")):
        path = out / marker
        if path.exists():
            try:
                stored = json.loads(path.read_text())
            except json.JSONDecodeError:
                return "other"
            stored = stored.get("params", stored)
            return state if stored == params else "other"
    return "foreign"


def interrupted_dataset(out: str | Path) -> bool:
    """``out`` holds a generation that stopped before it finished (e.g. Ctrl-C on a first run): its
    directories exist, some annotations do not; :func:`ensure_dataset` completes it."""
    out = Path(out)
    return (out / PROGRESS_FILE).exists() and not (out / MANIFEST_FILE).exists()


def params_differ(out: str | Path, params: dict[str, Any], more_sites_serve: bool = False) -> str:
    """'key: stored → wanted' for each parameter in which ``out``'s dataset differs from ``params``
    ('' for none). ``more_sites_serve``: a dataset with more sites than asked is no difference
    (a federation of fewer sites uses the first ones)."""
    for marker in (MANIFEST_FILE, PROGRESS_FILE):
        try:
            stored = json.loads((Path(out) / marker).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        stored = stored.get("params", stored)

        def same(key: str, wanted: Any) -> bool:
            have = stored.get(key)
            return have == wanted or (more_sites_serve and key == "sites" and isinstance(have, int) and have >= wanted)

        return ", ".join(f"{k}: {stored.get(k)!r} → {v!r}" for k, v in params.items() if not same(k, v))
    return "unreadable manifest"


def _our_outputs(out: Path) -> Iterator[Path]:
    for child in out.iterdir():
        if child.name in (MANIFEST_FILE, PROGRESS_FILE, "public", "test", "preview.png", "public_view_demo.png", "blur_demo.png") or child.name.startswith("site-"):
            yield child


def _clear(out: Path) -> None:
    (out / MANIFEST_FILE).unlink(missing_ok=True)  # first: the directory is now visibly incomplete
    for child in list(_our_outputs(out)):
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()


def generate_dataset(
    out_dir: str | Path,
    sites: int = 3,
    per_site: int = 500,
    public: int = 1000,
    test: int = 500,
    size: tuple[int, int] = (256, 192),
    seed: int = 0,
    workers: int | None = None,
    overwrite: bool = False,
    resume: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Generate the dataset and return its manifest (also written to ``out_dir/manifest.json``).

    An existing non-empty ``out_dir`` is an error unless ``overwrite`` (our previous outputs are
    removed; unrelated files are left alone) or ``resume`` with identical parameters.
    """
    params = dataset_params(sites, per_site, public, test, size, seed)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise SyntheticDataError(f"{out} exists and is not a directory")
    status = _status(out, params)
    if status != "empty":
        if overwrite:
            _clear(out)
        elif resume and status in ("partial", "complete"):
            pass
        elif resume:
            raise SyntheticDataError(f"{out} holds a different dataset (or other files): cannot resume; use overwrite")
        else:
            raise SyntheticDataError(f"output directory {out} is not empty; pass --overwrite to replace it (or --resume to continue an interrupted run with the same parameters)")
    out.mkdir(parents=True, exist_ok=True)
    if status == "complete" and resume:
        return json.loads((out / MANIFEST_FILE).read_text())
    atomic_write_json(out / PROGRESS_FILE, params)

    workers = max(1, min(workers or min(2, os.cpu_count() or 1), 64))
    specs = split_specs(params)
    todo = [s for s in specs if not (out / s.name / ANNOTATIONS_FILE).exists()]
    total = sum(s.count for s in todo)
    from fedpose.progress import progress_bar

    bar = progress_bar(total, "synth", unit="img", disable=not progress)
    pool = mp.get_context("spawn").Pool(workers) if workers > 1 and total > 1 else None
    try:
        # One ordered stream over all pending splits keeps both workers busy across split boundaries.
        tasks = [
            (params["seed"], spec, i, tuple(params["size"]), params["sites"], str(out / spec.name))
            for spec in todo for i in range(spec.count)
        ]
        for spec in todo:
            (out / spec.name / IMAGE_DIR).mkdir(parents=True, exist_ok=True)
        results = pool.imap(_task, tasks, chunksize=8) if pool else map(_task, tasks)
        pending = iter(todo)
        spec = next(pending, None)
        records: list[PoseRecord] = []
        while spec is not None:
            if len(records) == spec.count:
                write_annotations(out / spec.name / ANNOTATIONS_FILE, records)  # last: marks the split complete
                records, spec = [], next(pending, None)
                continue
            records.append(next(results))
            bar.set_postfix_str(spec.name, refresh=False)
            bar.update(1)
    finally:
        bar.close()
        if pool is not None:
            pool.close()
            pool.join()

    split_records = {s.name: read_annotations(out / s.name) for s in specs}
    save_preview(out / "preview.png", out, split_records)
    save_public_view_demo(out / "public_view_demo.png", out, split_records)
    manifest = {
        "format": "fedpose-synthetic",
        "params": params,
        "image_size": {"height": params["size"][0], "width": params["size"][1]},
        "splits": {
            s.name: {
                "dir": s.name, "images": s.count,
                "profile": (public_profile() if s.kind == "public" else site_profile(s.site_index)).to_dict() if s.kind != "test" else None,
                "description": _describe(s, params),
            }
            for s in specs
        },
        "conventions": {
            "joints": "16 MPII joints, pixel coordinates in the image; joints outside the image have joints_vis 0",
            "occluded": "occluded joints keep joints_vis 1 (MPII convention); extra.occluded flags them",
            "scale": "max(person box height, width·H/W) / 200",
            "face_box": "extra.face_box = [x1, y1, x2, y2] of the visible face (head box when facing away)",
            "patient_id": f"site records: the patient shown; {IMAGES_PER_PATIENT} consecutive images per patient with "
                          "the same identity (skin, face, clothing), different poses and scenes",
        },
    }
    manifest = json.loads(json.dumps(manifest))  # plain JSON types: what a later reader will see
    atomic_write_json(out / MANIFEST_FILE, manifest)  # last: the dataset is complete
    (out / PROGRESS_FILE).unlink(missing_ok=True)
    return manifest


def _describe(spec: SplitSpec, params: dict[str, Any]) -> str:
    if spec.kind == "test":
        return f"test: {spec.count} images drawn from a uniform mixture of the {params['sites']} site distributions"
    if spec.kind == "public":
        return "public: " + public_profile().describe().split(": ", 1)[1]
    patients = -(-spec.count // IMAGES_PER_PATIENT)
    return f"{site_profile(spec.site_index).describe()}; {patients} patients, up to {IMAGES_PER_PATIENT} images each"


def ensure_dataset(
    out_dir: str | Path,
    sites: int = 3,
    per_site: int = 500,
    public: int = 1000,
    test: int = 500,
    size: tuple[int, int] = (256, 192),
    seed: int = 0,
    workers: int | None = None,
    progress: bool = True,
    replace: bool = True,
) -> dict[str, Any]:
    """Return the manifest of ``out_dir`` if it already holds exactly this dataset; else (re)generate.

    A directory holding a *different* synthetic dataset is regenerated; one holding unrelated
    files is an error (nothing is deleted). ``replace=False`` never deletes anything: only an
    absent, empty or interrupted (same parameters) dataset is generated, anything else is a
    :class:`SyntheticDataError` (federation runs: sites may be training on that data). Concurrent
    callers (e.g. several simulated sites starting at once) are serialized by a lock file beside
    ``out_dir``.
    """
    params = dataset_params(sites, per_site, public, test, size, seed)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.synth-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _ensure_locked(out, params, sites, per_site, public, test, size, seed, workers, progress, replace)


def _ensure_locked(out: Path, params: dict[str, Any], sites: int, per_site: int, public: int, test: int,
                   size: tuple[int, int], seed: int, workers: int | None, progress: bool, replace: bool) -> dict[str, Any]:
    status = _status(out, params)
    kwargs = dict(sites=sites, per_site=per_site, public=public, test=test, size=size, seed=seed, workers=workers, progress=progress)
    if status == "complete":
        manifest = json.loads((out / MANIFEST_FILE).read_text())
        missing = [s.name for s in split_specs(params) if not (out / s.name / ANNOTATIONS_FILE).exists()]
        if not missing:
            return manifest
        if not replace:
            raise SyntheticDataError(f"{out} is a synthetic dataset with splits missing ({', '.join(missing)}); not regenerating it")
        return generate_dataset(out, overwrite=True, **kwargs)
    if status == "foreign":
        raise SyntheticDataError(f"{out} contains files that are not a fedpose synthetic dataset; refusing to touch it")
    if status == "other" and not replace:
        raise SyntheticDataError(f"{out} holds a different synthetic dataset ({params_differ(out, params)}); not replacing it")
    if status == "partial":
        return generate_dataset(out, resume=True, **kwargs)
    return generate_dataset(out, overwrite=status == "other", **kwargs)
