"""``PoseDataset``: PoseRecords → normalized input crops with joint targets (torch Dataset).

One sample is one person: the image is cropped around the record's ``center``/``scale``
(padded by ``padding``, HRNet's 1.25), optionally jittered, rotated and mirrored, resized to
``input_size`` (H, W), and ImageNet-normalized. Joints are mapped into the crop frame with the
same matrix; a joint gets ``weight`` 1 only if it is annotated *and* lands inside the crop, so
targets the network cannot see count in neither loss nor metric.

Keys of a sample (the CONTRACTS.md data contract, extended): ``image`` (3, H, W) float32;
``joints`` (16, 2) crop frame; ``weight`` (16,); ``index``; ``center`` (2,) and ``scale`` — the *effective* crop
parameters (after padding and jitter), so ``crop_to_original(pred, center, scale, input_size,
rotation)`` maps crop predictions back to the original image; ``rotation`` (degrees, 0 at
eval) and ``flipped``; ``headbox`` (2, 2) original frame (zeros if absent); ``face_box`` (4,)
x1, y1, x2, y2 in the crop frame (zeros if neither ``extra["face_box"]`` nor a headbox exists);
``joints_original`` (16, 2) and ``joints_vis`` (16,) in the original frame, for PCKh;
``head_boxes`` (K, 4) / ``head_count`` and ``face_boxes`` (K, 4) / ``face_count``: the private
boxes of *every* annotated person of the image, crop frame, padded to the dataset's K (see
:meth:`PoseDataset.private_boxes`); ``private_reach`` (2,): how far (crop pixels, x and y) the
pixels of a box reach beyond its crop-frame box in this crop (see below); with a ``public_view``,
``public_image`` (3, H, W): ψ of the record computed once, before augmentation, then warped with
this sample's augmentation.

**ψ before augmentation.** ψ (FDP's public view) must be a property of the record, not of an
augmented crop. The dataset takes the record's un-augmented crop frame (same centre and pixel
size as the eval crop) enlarged to a *context window* that contains every crop the augmentation
can draw (scale ×(1 + scale_jitter), rotation up to ``rotation_range``), a whole number of ψ's blocks
on each side, with the eval crop aligned to the block grid. ψ of that window is computed once
and cached (its compact form: for downsample_quantize the (H/f)·(W/f) block levels); each sample
warps it with the same matrix (crop ∘ augmentation, relative to the window) as the private crop.

**Every head.** MaskDP must hide all faces in the crop, not just the record's own. Private boxes
of an image: every record's ``headbox`` plus ``extra["image_head_boxes"]`` (COCO: one generous
box per person annotation of the image, see :mod:`fedpose.data.coco`). A person with no head
annotation contributes their whole padded person box (the region this dataset would crop for
them), which contains their head: conservative, never less private.

**Reach.** A crop pixel is a bilinear sample of the source image, so it depends on every source
pixel whose centre is less than 1 *source* pixel from its sample point, and a pixel that touches a
box has its centre up to half a pixel outside it: a box's pixels reach 1.5 source pixels past it,
which in the crop is 1.5 × the zoom (× |cos| + |sin| under rotation) — many crop pixels when a small
person is upsampled. ``private_reach`` is that distance for this sample's crop, flip and rotation
(MaskDP masks it around every box). A JPEG decoded at a reduced size (``reduced_decode``, the
speed-up for large people) mixes a whole 8×8 or 16×16 block of the file into each pixel, which no
box-shaped reach describes: such a sample's reach is infinite (its crop is masked entirely), and
MaskDP's datasets decode at full size (:func:`fedpose.privacy.public_views.dataset_view_options`).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from fedpose.data.annotations import PoseRecord
from fedpose.data.canonical import CanonicalWindows
from fedpose.data.loaders import ImageLoadError, load_records, resolve_image_or_raise
from fedpose.data.transforms import (
    Augmentation,
    PIXEL_STD,
    WARP_SUPPORT,
    affine_points,
    compose,
    crop_transform,
    invert,
    inside_crop,
    reach_in_crop,
    sample_augmentation,
    warp_affine,
)
from fedpose.joints import JOINT_INDEX, flip_permutation

log = logging.getLogger(__name__)

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

# HRNet enlarges the annotated person box by 25% so limbs at its border stay inside the crop.
DEFAULT_PADDING = 1.25

#: Source pixels a box's pixels reach past the box in a crop: half a pixel (a pixel touching the box
#: has its centre up to 0.5 px outside it) + the warp's bilinear support, + 1e-3 px so float rounding
#: (ours or PIL's) never puts a sample point that reads a box pixel outside the mask.
PRIVATE_PIXEL_REACH = 0.5 + WARP_SUPPORT + 1e-3

#: memory cap of a dataset's cache of compact public views (downsample_quantize at f 16: ~2 KB a record)
PUBLIC_CACHE_BYTES = 256 * 2**20


class PublicImageView(Protocol):
    """ψ of FDP (fedpose.privacy.public_views.ImagePublicView): compact on a block-aligned window, expand back."""

    @property
    def block(self) -> int: ...

    def compact(self, image: np.ndarray) -> np.ndarray: ...

    def expand(self, compact: np.ndarray, size: tuple[int, int]) -> np.ndarray: ...


def augmentation_extent(input_size: tuple[int, int], scale_jitter: float, rotation: float) -> tuple[float, float]:
    """(height, width), in input pixels of the un-augmented crop, of the smallest centred axis-aligned
    window holding every crop the augmentation can draw (scale ≤ 1 + jitter, |rotation| ≤ ``rotation``)."""
    height, width = input_size
    largest = 1.0 + scale_jitter
    angles = np.radians(np.linspace(0.0, min(abs(rotation), 180.0), 721))
    cos, sin = np.abs(np.cos(angles)), np.abs(np.sin(angles))
    return (float(largest * (height * cos + width * sin).max()), float(largest * (width * cos + height * sin).max()))


def context_window(input_size: tuple[int, int], block: int, extent: tuple[float, float]) -> tuple[int, int]:
    """Window (H_c, W_c) ≥ ``extent``, each side the input side plus a whole number of blocks on both
    ends, so the eval crop sits on ψ's block grid. Needs input sides that are multiples of ``block``."""
    if block < 1:
        raise ValueError(f"public view block must be >= 1, got {block}")
    height, width = input_size
    if height % block or width % block:
        raise ValueError(f"data.input_size {input_size} must be a multiple of the public view's block size {block}")
    pad_h = block * math.ceil(max(0.0, extent[0] - height) / (2 * block) - 1e-9)
    pad_w = block * math.ceil(max(0.0, extent[1] - width) / (2 * block) - 1e-9)
    return height + 2 * pad_h, width + 2 * pad_w


def load_image(path: Path, min_zoom: float = 1.0) -> tuple[Image.Image, int]:
    """Open and fully decode an image as RGB → (image, reduction).

    If ``min_zoom`` < 1 the caller only needs the image at that zoom; JPEGs are then decoded at a
    reduced size (libjpeg's DCT scaling by 1/2, 1/4 or 1/8 — several times faster than a full
    decode, and it averages blocks instead of aliasing). ``reduction`` is the integer factor the
    decoded image is smaller by (1 = full size); original pixel ``x = r·x' + (r−1)/2``.
    Missing or corrupt files raise :class:`ImageLoadError` naming the file.
    """
    try:
        with Image.open(path) as img:
            full_width = img.size[0]
            if min_zoom < 0.5 and img.format == "JPEG":
                img.draft("RGB", (max(1, math.ceil(img.size[0] * min_zoom)), max(1, math.ceil(img.size[1] * min_zoom))))
            img.load()
            reduction = max(1, round(full_width / img.size[0]))
            return img.convert("RGB"), reduction
    except FileNotFoundError as exc:
        raise ImageLoadError(f"image file not found: {path}") from exc
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise ImageLoadError(f"cannot decode image {path}: {exc}") from exc


def reduction_matrix(reduction: int) -> np.ndarray:
    """2×3 map from full-resolution pixels to pixels of an image decoded ``reduction``× smaller."""
    r = float(reduction)
    return np.array([[1.0 / r, 0.0, -(r - 1.0) / (2.0 * r)], [0.0, 1.0 / r, -(r - 1.0) / (2.0 * r)]])


def normalize(image_uint8: np.ndarray) -> torch.Tensor:
    """uint8 HWC RGB → float32 CHW tensor, ImageNet-normalized."""
    # One fused multiply-add in numpy: ~10× faster than the same arithmetic as torch ops
    # on a 256×192 image (it runs once per sample per step).
    gain = (1.0 / (255.0 * np.asarray(IMAGENET_STD, dtype=np.float32)))
    bias = -np.asarray(IMAGENET_MEAN, dtype=np.float32) / np.asarray(IMAGENET_STD, dtype=np.float32)
    chw = np.asarray(image_uint8, dtype=np.float32).transpose(2, 0, 1)
    out = chw * gain[:, None, None] + bias[:, None, None]
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def denormalize(image_tensor: torch.Tensor) -> np.ndarray:
    """Inverse of :func:`normalize`: (3, H, W) tensor → uint8 (H, W, 3) array for overlays."""
    if image_tensor.ndim != 3 or image_tensor.shape[0] != 3:
        raise ValueError(f"expected a (3, H, W) image tensor, got shape {tuple(image_tensor.shape)}")
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    pixels = (image_tensor.detach().cpu().float() * std + mean).clamp_(0, 1).mul_(255.0).round_()
    return pixels.to(torch.uint8).permute(1, 2, 0).numpy()


def _box_in_crop(corners: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """Axis-aligned box (x1, y1, x2, y2) around the 4 transformed corners of an original-frame box,
    rounded outwards to float32 (a private box never shrinks by rounding)."""
    (x1, y1), (x2, y2) = np.asarray(corners, dtype=np.float64)
    quad = np.array([[x1, y1], [x2, y1], [x1, y2], [x2, y2]], dtype=np.float64)
    mapped = quad @ np.asarray(matrix, dtype=np.float64)[:, :2].T + np.asarray(matrix, dtype=np.float64)[:, 2]
    low, high = mapped.min(axis=0), mapped.max(axis=0)
    return np.concatenate([_round_down_f32(low), _round_up_f32(high)])


def _round_up_f32(values: np.ndarray) -> np.ndarray:
    rounded = np.asarray(values, dtype=np.float64).astype(np.float32)
    return np.where(rounded < values, np.nextafter(rounded, np.float32(np.inf)), rounded).astype(np.float32)


def _round_down_f32(values: np.ndarray) -> np.ndarray:
    rounded = np.asarray(values, dtype=np.float64).astype(np.float32)
    return np.where(rounded > values, np.nextafter(rounded, np.float32(-np.inf)), rounded).astype(np.float32)


#: the fixed seed of the basis view's rotations (:func:`public_basis_dataset`): a public choice, so
#: every run and every site sees the same tilted public images
BASIS_VIEW_SEED = 0


def public_basis_dataset(path: str | Path, input_size: tuple[int, int], public_rotation: float = 0.0,
                         public_grey: float = 0.0) -> "PoseDataset":
    """S_pub as the projection basis sees it (``privacy.basis``): un-augmented crops, each image turned
    by a fixed angle drawn uniformly in ±``public_rotation`` degrees (0: upright).

    Why: the basis spans the gradients of the public images at the current weights. Patients in a
    hospital bed lie tilted beyond what public photo collections show (the synthetic sites 40–60°,
    the public split within ±30°), and upright public gradients keep less of their gradient: at
    k = 4, 30 % of a site's clipped mean gradient upright, 35 % turned within ±60°, 40 % for a basis
    from the site's own records (benchmarks/federated_utility/basis_capture.json). Public images
    and a fixed seed: V stays a function of public data only, so it costs no privacy.
    """
    records, root = load_records(path)
    rotations = None
    if public_rotation > 0:
        rotations = np.random.default_rng(BASIS_VIEW_SEED).uniform(-public_rotation, public_rotation, len(records))
    grey = None
    if public_grey > 0:  # a share of the images seen as a night camera does: one grey channel
        grey = np.random.default_rng([BASIS_VIEW_SEED, 1]).random(len(records)) < public_grey
    return PoseDataset(records, root, input_size=input_size, train=False, fixed_rotations=rotations, fixed_grey=grey)


#: head joints a head box must hold (MPII order): upper neck and head top
_HEAD_JOINTS = (JOINT_INDEX["upper_neck"], JOINT_INDEX["head_top"])


def head_box_holds_head(record: PoseRecord, slack: float = 0.25) -> bool:
    """Whether a record's head box can stand for its head where MaskDP masks it: a positive area
    holding the visible upper-neck and head-top joints (the box grown by ``slack`` of its size on
    each side: annotators draw the head top on the box's edge). A degenerate, tiny or misplaced box
    (a placeholder, an exporter's bug) would leave the real head in the noise-free public view; the
    person box then masks instead, which can only protect more. On MPII's validation split 6 of
    2 958 boxes fail it."""
    box = np.asarray(record.headbox, dtype=np.float64).reshape(2, 2)
    (x1, y1), (x2, y2) = box
    if not (x2 > x1 and y2 > y1):
        return False
    grow_x, grow_y = slack * (x2 - x1), slack * (y2 - y1)
    for joint in _HEAD_JOINTS:
        if record.joints_vis[joint] > 0:
            x, y = record.joints[joint]
            if not (x1 - grow_x <= x <= x2 + grow_x and y1 - grow_y <= y <= y2 + grow_y):
                return False
    return True


class PoseDataset(Dataset):
    """Torch dataset of person crops; see the module docstring for the sample dict."""

    def __init__(
        self,
        records: Sequence[PoseRecord],
        root: str | Path,
        input_size: tuple[int, int] = (256, 192),
        train: bool = False,
        flip: bool = True,
        scale_jitter: float = 0.25,
        rotation: float = 30.0,
        seed: int = 0,
        padding: float = DEFAULT_PADDING,
        cache_images: bool = False,
        public_view: PublicImageView | None = None,
        reduced_decode: bool = True,
        fixed_rotations: Sequence[float] | None = None,
        rotation_range: float | None = None,
        fixed_grey: Sequence[bool] | None = None,
        windows: CanonicalWindows | None = None,
    ) -> None:
        if len(input_size) != 2 or min(input_size) <= 0:
            raise ValueError(f"input_size must be (H, W) with positive sides, got {input_size}")
        if not 0 <= scale_jitter < 1:
            raise ValueError(f"scale_jitter must be in [0, 1), got {scale_jitter}")
        if padding <= 0:
            raise ValueError(f"padding must be positive, got {padding}")
        if fixed_rotations is not None and (train or len(fixed_rotations) != len(records)):
            raise ValueError("fixed_rotations: one angle per record, for a deterministic view (train=False) only")
        self.records = list(records)
        self.root = Path(root)
        #: a deterministic view's per-record rotation in degrees (privacy.basis.public_rotation)
        self.fixed_rotations = None if fixed_rotations is None else [float(a) for a in fixed_rotations]
        if fixed_grey is not None and (train or len(fixed_grey) != len(records)):
            raise ValueError("fixed_grey: one flag per record, for a deterministic view (train=False) only")
        #: a deterministic view's per-record grey flag (privacy.basis.public_grey)
        self.fixed_grey = None if fixed_grey is None else [bool(g) for g in fixed_grey]
        self.input_size = (int(input_size[0]), int(input_size[1]))
        self.train = train
        self.flip = flip
        self.scale_jitter = scale_jitter
        self.rotation = rotation
        #: the hard clip of a drawn angle (data.rotation_range: rotation × data.rotation_clip)
        self.rotation_range = rotation if rotation_range is None else rotation_range
        self.seed = seed
        self.padding = padding
        self.cache_images = cache_images
        # Decode JPEGs of large people at a reduced size (faster); MaskDP turns it off (see "Reach").
        self.reduced_decode = reduced_decode
        if windows is not None and len(windows) != len(self.records):
            raise ValueError(f"{len(windows)} canonical windows for {len(self.records)} records")
        #: each record's crop source at one fixed size (a site's training set: fedpose.data.canonical)
        self.windows = windows
        self._cache: dict[str, Image.Image] = {}
        # Augmentation RNG per process: DataLoader workers re-seed from their own torch seed.
        self._rng: np.random.Generator = np.random.default_rng(seed)
        self._rng_pid = os.getpid()
        self.public_view = public_view
        self._public_cache: dict[int, np.ndarray] = {}  # record index → compact ψ of its context window
        self._public_cache_bytes = 0
        self._keep_public_views = True  # False once a site's training set found they do not all fit
        if public_view is not None:
            extent = augmentation_extent(self.input_size, scale_jitter, self.rotation_range) if train else (0.0, 0.0)
            self.context_size = context_window(self.input_size, public_view.block, extent)
        self._build_private_boxes()
        if public_view is not None and windows is not None:
            self._public_view_of_every_record()

    def _build_private_boxes(self) -> None:
        """Per image: every person's head box and face box (original frame), see the module docstring."""
        heads: dict[str, list[np.ndarray]] = {}
        faces: dict[str, list[np.ndarray]] = {}
        self.head_boxes_replaced = 0  #: head boxes that did not hold their head: the person box masks instead
        for record in self.records:
            usable = record.headbox is not None and head_box_holds_head(record)
            self.head_boxes_replaced += record.headbox is not None and not usable
            head = record.headbox if usable else self._person_box(record)
            head = np.asarray(head, dtype=np.float64).reshape(2, 2)
            face = record.extra.get("face_box")
            face = np.asarray(face, dtype=np.float64).reshape(2, 2) if face is not None else head
            heads.setdefault(record.image, []).append(head)
            faces.setdefault(record.image, []).append(face)
            for other in record.extra.get("image_head_boxes", ()):
                box = np.asarray(other, dtype=np.float64).reshape(2, 2)
                heads[record.image].append(box)
                faces[record.image].append(box)
        self._image_heads = {name: np.unique(np.stack(boxes), axis=0) for name, boxes in heads.items()}
        self._image_faces = {name: np.unique(np.stack(boxes), axis=0) for name, boxes in faces.items()}
        self.max_private_boxes = max([len(b) for b in self._image_heads.values()] + [len(b) for b in self._image_faces.values()] + [1])
        if self.head_boxes_replaced:  # the operator's log only: a count over the private annotations
            log.warning("%d head box(es) do not hold their record's head (upper neck, head top): the person box is masked "
                        "instead (fedpose.data.dataset.head_box_holds_head)", self.head_boxes_replaced)

    def _person_box(self, record: PoseRecord) -> np.ndarray:
        """The padded crop region of a person with no head annotation: it contains their head."""
        height = PIXEL_STD * float(record.scale) * self.padding
        width = height * self.input_size[1] / self.input_size[0]
        cx, cy = (float(v) for v in record.center)
        return np.array([[cx - width / 2, cy - height / 2], [cx + width / 2, cy + height / 2]])

    def private_boxes(self, index: int, matrix: np.ndarray, source_reach: float = PRIVATE_PIXEL_REACH) -> dict[str, torch.Tensor]:
        """Every person's head and face box of record ``index``'s image mapped by the original→crop
        ``matrix`` (axis-aligned hulls of the mapped corners), padded to ``max_private_boxes``, and
        ``private_reach``: how far their pixels reach past those boxes in the crop, for a crop whose
        pixels reach ``source_reach`` source pixels (module docstring; infinite for an image decoded
        at a reduced size)."""
        name = self.records[index].image
        reach = reach_in_crop(matrix, source_reach) if math.isfinite(source_reach) else np.full(2, np.inf)
        out: dict[str, torch.Tensor] = {"private_reach": torch.from_numpy(_round_up_f32(reach))}
        for key, boxes in (("head", self._image_heads[name]), ("face", self._image_faces[name])):
            padded = np.zeros((self.max_private_boxes, 4), np.float32)
            for slot, box in enumerate(boxes):
                padded[slot] = _box_in_crop(box, matrix)
            out[f"{key}_boxes"] = torch.from_numpy(padded)
            out[f"{key}_count"] = torch.tensor(len(boxes), dtype=torch.long)
        return out

    def public_context(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(ψ of record ``index``'s context window (uint8 H_c×W_c×3), original→window matrix).

        Computed from the original image without augmentation, once (the compact form is cached)."""
        if self.public_view is None:
            raise ValueError("this dataset computes no public view (build it with public_view=...)")
        record = self.records[index]
        context_h, context_w = self.context_size
        # Same centre and pixel size as the eval crop, only a larger window.
        context_scale = float(record.scale) * self.padding * context_h / self.input_size[0]
        matrix = crop_transform(np.asarray(record.center, dtype=np.float32), context_scale, self.context_size)
        compact = self._public_cache.get(index)
        if compact is None:
            # A fixed decode resolution (the un-augmented zoom), so ψ never depends on the augmentation draw.
            image, image_matrix, _ = self._source(index, matrix, self.input_size[0] / (PIXEL_STD * float(record.scale) * self.padding))
            window = np.asarray(warp_affine(image, image_matrix, self.context_size))
            compact = self.public_view.compact(window)
            # ψ is a deterministic function of the record, so a record that does not fit the cache
            # (e.g. the full-size compact form of the comparison-only blur) just gets the same ψ again.
            if self._keep_public_views and self._public_cache_bytes + compact.nbytes <= PUBLIC_CACHE_BYTES:
                self._public_cache[index] = compact
                self._public_cache_bytes += compact.nbytes
        return self.public_view.expand(compact, self.context_size), matrix

    def _public_view_of_every_record(self) -> None:
        """ψ of every record now (a site's training set): a load then never computes one, so its
        work does not hang on which records were loaded before it — at a site, on which units earlier
        steps sampled. If they do not all fit the cache, none is kept: every load computes its own."""
        for index in range(len(self.records)):
            self.public_context(index)
        if len(self._public_cache) < len(self.records):
            self._public_cache.clear()
            self._public_cache_bytes = 0
            self._keep_public_views = False

    def __len__(self) -> int:
        return len(self.records)

    def image_path(self, index: int) -> Path:
        return resolve_image_or_raise(self.root, self.records[index].image)

    def _image(self, index: int, zoom: float = 1.0) -> tuple[Image.Image, int]:
        """The record's image (and its reduction factor), decoded at no less than ``zoom``."""
        name = self.records[index].image
        cached = self._cache.get(name)
        if cached is not None:
            return cached, 1
        if self.cache_images:
            image, _ = load_image(self.image_path(index))
            self._cache[name] = image
            return image, 1
        return load_image(self.image_path(index), min_zoom=zoom)

    def _source(self, index: int, matrix: np.ndarray, zoom: float) -> tuple[Image.Image, np.ndarray, float]:
        """(the image to warp for record ``index``, ``matrix`` (original → output) made relative to it,
        how far a source pixel reaches in it, in source pixels): the record's canonical window when
        the dataset has them, else its file decoded at no less than ``zoom``."""
        if self.windows is not None:
            window_to_output = compose(matrix, invert(self.windows.matrix(index)))
            return (Image.fromarray(self.windows.window(index)), window_to_output,
                    self.windows.reach(index, PRIVATE_PIXEL_REACH))
        image, reduction = self._image(index, zoom)
        if reduction == 1:
            return image, matrix, PRIVATE_PIXEL_REACH
        return image, compose(matrix, invert(reduction_matrix(reduction))), math.inf

    def _generator(self) -> np.random.Generator:
        worker = torch.utils.data.get_worker_info()
        if os.getpid() != self._rng_pid:
            seed = worker.seed if worker is not None else torch.initial_seed()
            self._rng = np.random.default_rng([self.seed, seed % (2**63)])
            self._rng_pid = os.getpid()
        return self._rng

    def augmentation(self, rng: np.random.Generator | None = None) -> Augmentation:
        """A draw of the training augmentation (none for a deterministic view) from ``rng``, or else
        the next from the dataset's own stream; resuming a run replays that stream's draws to
        restore it (fedpose.train.central)."""
        if not self.train:
            return Augmentation()
        rng = self._generator() if rng is None else rng
        return sample_augmentation(rng, self.scale_jitter, self.rotation, self.flip, self.rotation_range)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.load(index)

    def load(self, index: int, rng: np.random.Generator | None = None, plain: bool = False) -> dict[str, Any]:
        """Record ``index``'s sample, its augmentation drawn from ``rng`` — or, without one, from the
        dataset's own stream, where the k-th load gets the k-th draw whatever the record. A private
        step passes each row a generator of its own from the CSPRNG
        (:func:`fedpose.privacy.engine.load_rows`): in the stream a unit's augmentation would hang
        on how many rows were loaded before it, so on which other units were sampled. ``plain``:
        the record's un-augmented crop, drawing nothing (a property of the record alone, such as
        whether it is grey: :func:`fedpose.model.grey_copies.records_with_gradient`)."""
        if not 0 <= index < len(self.records):
            raise IndexError(f"index {index} out of range for a dataset of {len(self.records)}")
        record = self.records[index]
        if plain:
            aug = Augmentation()
        else:
            aug = self.augmentation(rng) if self.fixed_rotations is None else Augmentation(rotation=self.fixed_rotations[index])
        scale = float(record.scale) * self.padding
        center = np.asarray(record.center, dtype=np.float32)
        matrix = crop_transform(center, scale, self.input_size, aug)

        # The crop's zoom (output px per original px) lets JPEGs decode at a reduced size.
        zoom = self.input_size[0] / (PIXEL_STD * scale * aug.scale_factor)
        image, image_matrix, source_reach = self._source(index, matrix, zoom if self.reduced_decode else 1.0)
        crop = warp_affine(image, image_matrix, self.input_size)
        if self.fixed_grey is not None and self.fixed_grey[index]:
            crop = crop.convert("L").convert("RGB")
        joints = affine_points(record.joints, matrix)
        vis = np.asarray(record.joints_vis, dtype=np.float32)
        if aug.flip:
            # The matrix already mirrored x; only the left/right labels remain to swap.
            perm = flip_permutation()
            joints, vis = joints[perm], vis[perm]
        weight = vis * inside_crop(joints, self.input_size).astype(np.float32)

        headbox = record.headbox if record.headbox is not None else np.zeros((2, 2), np.float32)
        face_source = record.extra.get("face_box")
        if face_source is not None:
            face_box = _box_in_crop(np.asarray(face_source, dtype=np.float64).reshape(2, 2), matrix)
        elif record.headbox is not None:
            face_box = _box_in_crop(np.asarray(record.headbox, dtype=np.float64), matrix)
        else:
            face_box = np.zeros(4, np.float32)

        sample: dict[str, Any] = {
            "image": normalize(np.asarray(crop)),
            "joints": torch.from_numpy(joints.astype(np.float32)),
            "weight": torch.from_numpy(weight.astype(np.float32)),
            "index": int(index),
            "center": torch.from_numpy(center.copy()),
            "scale": scale * aug.scale_factor,
            "rotation": aug.rotation,
            "flipped": aug.flip,
            "headbox": torch.from_numpy(np.asarray(headbox, dtype=np.float32).copy()),
            "face_box": torch.from_numpy(face_box),
            "joints_original": torch.from_numpy(np.asarray(record.joints, dtype=np.float32).copy()),
            "joints_vis": torch.from_numpy(np.asarray(record.joints_vis, dtype=np.float32).copy()),
            **self.private_boxes(index, matrix, source_reach),
        }
        if self.public_view is not None:
            public_window, window_matrix = self.public_context(index)
            # window → crop: the same crop, scale, rotation and flip as the private image.
            public_matrix = compose(matrix, invert(window_matrix))
            public_crop = warp_affine(Image.fromarray(public_window), public_matrix, self.input_size)
            sample["public_image"] = normalize(np.asarray(public_crop))
        return sample


__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "DEFAULT_PADDING",
    "ImageLoadError",
    "PoseDataset",
    "PublicImageView",
    "augmentation_extent",
    "context_window",
    "denormalize",
    "load_records",
    "load_image",
    "reduction_matrix",
    "normalize",
]
