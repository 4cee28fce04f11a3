"""Public feature maps ψ for feature-level DP (FDP, FP-DP) and MaskDP.

A public view ψ(x) is what the guarantee treats as public: its gradient is used without
clipping or noise.

**FDP / FP-DP** (``privacy.public_view``) — one registry, :data:`PUBLIC_VIEWS`, of image maps on
uint8 RGB arrays. The dataset (:class:`fedpose.data.dataset.PoseDataset`) computes ψ **once per
record, from the original image, before augmentation**: it takes the record's un-augmented crop
frame enlarged to a context window that holds every augmented crop, applies ψ there, caches the
result, and warps it with the *same* random crop/scale/rotation/flip as the private crop. The
public gradient therefore depends only on ψ(x), the keypoints and data-independent randomness.
The batch carries it as ``public_image``; the engine's public path reads that key.

* ``downsample_quantize`` (default) — area-average each f×f block of input pixels, keep b bits of
  each block mean per colour channel, upsample bilinearly back. Many-to-one with a large null
  space: any change that keeps every block mean in the same b-bit bin — everything finer than an
  f-pixel block, and contrast below 256/2^b grey levels — leaves ψ(x) unchanged. Of
  H·W·3·8 input bits, at most (H/f)·(W/f)·3·b survive (default f = 16, b = 3: 1/683).
* ``gaussian_blur`` — a separable Gaussian blur. It is invertible (smallest 1-D singular value
  2.5e-4 at kernel 7, σ 1.5); deconvolution recovers the crop, so "neighbours share ψ(x)" means
  they are (almost) the same image: the FDP relation is degenerate. Kept only to compare against.

**MaskDP** — :func:`mask_boxes` replaces every declared private box of each sample (all
annotated heads of the image, mapped into the crop: ``head_boxes`` + ``head_count``), grown by
``privacy.mask.margin`` × its size and by the sample's ``private_reach`` (how far a source pixel's
value reaches in this crop: 1.5 *source* pixels × the zoom, see :mod:`fedpose.data.dataset`), by a
constant, so no crop pixel that any pixel of a box contributes to reaches the public path. The
boxes come from the annotations, never from the pixels. A sample whose boxes are unknown is
masked entirely.

The ``*_view(batch, privacy_cfg)`` functions are what the mechanism registry calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from fedpose.config import PrivacyConfig, PublicViewConfig
from fedpose.data.dataset import IMAGENET_MEAN, IMAGENET_STD

#: batch key of ψ(x): the public view computed before augmentation and augmented like ``image``
PUBLIC_IMAGE_KEY = "public_image"


# -- ψ of FDP / FP-DP on uint8 images ----------------------------------------------------------

def _check_rgb(image: np.ndarray) -> np.ndarray:
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise ValueError(f"public view: expected a uint8 (H, W, 3) RGB image, got {array.dtype} {array.shape}")
    return array


def area_downsample(image: np.ndarray, factor: int) -> np.ndarray:
    """Mean of each ``factor``×``factor`` block → float64 (H/f, W/f, 3). H and W must be multiples of f."""
    array = _check_rgb(image)
    height, width = array.shape[:2]
    if factor < 1 or height % factor or width % factor:
        raise ValueError(f"area_downsample: image {height}×{width} is not a whole number of {factor}×{factor} blocks")
    blocks = array.astype(np.float64).reshape(height // factor, factor, width // factor, factor, 3)
    return blocks.mean(axis=(1, 3))


def quantize(values: np.ndarray, bits: int) -> np.ndarray:
    """Grey levels 0..255 → the centre of their b-bit bin (uint8): 2^b levels of width 256/2^b."""
    if not 1 <= bits <= 8:
        raise ValueError(f"quantize: bits must be in 1..8, got {bits}")
    width = 256.0 / (1 << bits)
    index = np.clip(np.floor(np.asarray(values, dtype=np.float64) / width), 0, (1 << bits) - 1)
    return np.floor((index + 0.5) * width).astype(np.uint8)


def downsample_quantize(image: np.ndarray, factor: int, bits: int) -> np.ndarray:
    """ψ(x) = bilinear upsampling of quantize(area_downsample(x, f), b), same size as ``image``.

    The upsampling is a fixed function of the (H/f)·(W/f)·3 quantized block means, i.e.
    post-processing: two images with the same quantized block means get identical ψ(x).
    """
    array = _check_rgb(image)
    return _bilinear_upsample(quantize(area_downsample(array, factor), bits), array.shape[:2])


def gaussian_kernel1d(kernel_size: int, sigma: float, dtype: torch.dtype = torch.float32) -> Tensor:
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"blur kernel size must be a positive odd integer, got {kernel_size}")
    if not sigma > 0:
        raise ValueError(f"blur sigma must be > 0, got {sigma}")
    offsets = torch.arange(kernel_size, dtype=torch.float64) - kernel_size // 2
    kernel = torch.exp(-0.5 * (offsets / sigma) ** 2)
    return (kernel / kernel.sum()).to(dtype)


def gaussian_blur(images: Tensor, kernel_size: int, sigma: float) -> Tensor:
    """Separable Gaussian blur of a (B, C, H, W) batch, reflect padding."""
    if images.dim() != 4:
        raise ValueError(f"expected images (B, C, H, W), got shape {tuple(images.shape)}")
    channels, height, width = images.shape[1:]
    kernel = gaussian_kernel1d(kernel_size, sigma, images.dtype).to(images.device)
    half = kernel_size // 2
    if half >= min(height, width):
        raise ValueError(f"blur kernel {kernel_size} is too large for images of size {height}×{width}")
    out = F.pad(images, (half, half, 0, 0), mode="reflect")
    out = F.conv2d(out, kernel.view(1, 1, 1, -1).expand(channels, 1, 1, -1), groups=channels)
    out = F.pad(out, (0, 0, half, half), mode="reflect")
    return F.conv2d(out, kernel.view(1, 1, -1, 1).expand(channels, 1, -1, 1), groups=channels)


def fill_value(fill: str, dtype: torch.dtype = torch.float32) -> Tensor:
    """Per-channel value (3,) in normalized space: 'mean' = the ImageNet mean pixel (0), 'zero' = black."""
    if fill == "mean":
        return torch.zeros(3, dtype=dtype)
    if fill == "zero":
        return torch.tensor([-m / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)], dtype=dtype)
    raise ValueError(f"privacy.mask.fill must be 'mean' or 'zero', got {fill!r}")


def _reach_rows(reach: Tensor | float, batch: int) -> list[tuple[float, float]]:
    """``reach`` — a number, or (B, 2) per-sample (x, y) crop pixels — as B (x, y) pairs, checked."""
    rows = torch.as_tensor(reach, dtype=torch.float64).detach().cpu()
    if rows.dim() == 0:
        rows = rows.expand(batch, 2)
    if tuple(rows.shape) != (batch, 2):
        raise ValueError(f"expected a mask reach per sample (B, 2) = ({batch}, 2) as x, y crop pixels, got shape {tuple(rows.shape)}")
    if bool(torch.isnan(rows).any()) or bool((rows < 0).any()):
        raise ValueError(f"mask reach must be >= 0 crop pixels (inf: mask everything), got {rows.tolist()}")
    return [(float(x), float(y)) for x, y in rows.tolist()]


def box_masks(boxes: Tensor, height: int, width: int, margin: float, reach: Tensor | float) -> Tensor:
    """(B, 4) x1, y1, x2, y2 boxes → (B, H, W) bool masks, True = private pixel.

    Each box is enlarged by ``margin`` × its width/height on every side, then by the sample's
    ``reach`` (x, y crop pixels: how far the box's source pixels reach in the crop, the dataset's
    ``private_reach``). Pixel centres sit on integers (the convention of
    :mod:`fedpose.data.transforms`); a pixel is private if its centre lies in the enlarged box
    (boundary included). Degenerate boxes (zero area, e.g. no annotation) and an infinite reach
    mark the whole image private.
    """
    if boxes.dim() != 2 or boxes.shape[1] != 4:
        raise ValueError(f"expected boxes (B, 4) as x1, y1, x2, y2, got shape {tuple(boxes.shape)}")
    if margin < 0:
        raise ValueError(f"mask margin must be >= 0, got {margin}")
    reaches = _reach_rows(reach, boxes.shape[0])
    masks = torch.zeros(boxes.shape[0], height, width, dtype=torch.bool)
    for index, box in enumerate(boxes.detach().cpu().to(torch.float64).tolist()):
        _mark_box(masks[index], box, margin, reaches[index])
    return masks.to(boxes.device)


def _mark_box(mask: Tensor, box: list[float], margin: float, reach: tuple[float, float]) -> None:
    """Set the pixels of one (H, W) mask that :func:`box_masks` calls private for ``box``."""
    height, width = mask.shape
    x1, y1, x2, y2 = box
    if not all(math.isfinite(v) for v in (*box, *reach)) or x2 <= x1 or y2 <= y1:
        mask.fill_(True)  # undeclared or degenerate box, or an unbounded reach: the private region is unknown
        return
    box_w, box_h = x2 - x1, y2 - y1
    x1, x2 = x1 - margin * box_w - reach[0], x2 + margin * box_w + reach[0]
    y1, y2 = y1 - margin * box_h - reach[1], y2 + margin * box_h + reach[1]
    # Pixel j is private iff x1 <= j <= x2.
    c0, c1 = max(0, math.ceil(x1)), min(width, math.floor(x2) + 1)
    r0, r1 = max(0, math.ceil(y1)), min(height, math.floor(y2) + 1)
    if c0 < c1 and r0 < r1:
        mask[r0:r1, c0:c1] = True


def union_box_masks(
    boxes: Tensor, counts: Tensor, height: int, width: int, margin: float, reach: Tensor | float
) -> Tensor:
    """(B, K, 4) boxes of which the first ``counts[b]`` are real → (B, H, W) union masks.

    Each real box is handled as in :func:`box_masks` (a degenerate real box masks everything);
    a sample with ``count`` 0 has no declared region and is masked entirely.
    """
    if boxes.dim() != 3 or boxes.shape[2] != 4:
        raise ValueError(f"expected boxes (B, K, 4) as x1, y1, x2, y2, got shape {tuple(boxes.shape)}")
    counts = torch.as_tensor(counts).reshape(-1).to(torch.long)
    batch, slots = boxes.shape[:2]
    if counts.shape[0] != batch:
        raise ValueError(f"{counts.shape[0]} box counts for {batch} samples")
    if bool((counts < 0).any()) or bool((counts > slots).any()):
        raise ValueError(f"box counts must be in 0..{slots}, got {counts.tolist()}")
    if margin < 0:
        raise ValueError(f"mask margin must be >= 0, got {margin}")
    reaches = _reach_rows(reach, batch)
    masks = torch.zeros(batch, height, width, dtype=torch.bool)
    rows = boxes.detach().cpu().to(torch.float64).tolist()
    for index, count in enumerate(counts.tolist()):
        if count == 0:
            masks[index] = True  # no declared region: nothing of the image is public
        for box in rows[index][:count]:
            _mark_box(masks[index], box, margin, reaches[index])
    return masks.to(boxes.device)


def mask_boxes(
    images: Tensor, boxes: Tensor, margin: float = 0.0, fill: str = "mean", counts: Tensor | None = None,
    *, reach: Tensor | float,
) -> Tensor:
    """``images`` with every (enlarged) private box replaced by the ``fill`` value.

    ``boxes`` is (B, 4) — one box per sample — or (B, K, 4) with ``counts`` (B,) real boxes each;
    ``reach`` as in :func:`box_masks` (no default: it depends on how each crop was resampled).
    """
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images (B, 3, H, W), got shape {tuple(images.shape)}")
    if boxes.shape[0] != images.shape[0]:
        raise ValueError(f"{boxes.shape[0]} boxes for {images.shape[0]} images")
    height, width = images.shape[2], images.shape[3]
    if boxes.dim() == 2:
        masks = box_masks(boxes, height, width, margin, reach)
    else:
        if counts is None:
            raise ValueError("mask_boxes: (B, K, 4) boxes need counts (how many of the K are real)")
        masks = union_box_masks(boxes, counts, height, width, margin, reach)
    value = fill_value(fill, images.dtype).to(images.device).view(1, 3, 1, 1)
    return torch.where(masks.to(images.device)[:, None], value, images)


def gaussian_blur_uint8(image: np.ndarray, kernel_size: int, sigma: float) -> np.ndarray:
    """The Gaussian-blur ψ on a uint8 image, rounded back to uint8."""
    array = _check_rgb(image)
    chw = torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1))).to(torch.float32)[None]
    blurred = gaussian_blur(chw, kernel_size, sigma)[0].permute(1, 2, 0).numpy()
    return np.clip(np.round(blurred), 0, 255).astype(np.uint8)


@dataclass(frozen=True)
class PublicViewKind:
    """One entry of the ψ registry. ψ(x) = ``expand(compact(x))``: ``compact`` keeps what is
    public (what the dataset caches per record), ``expand`` is fixed post-processing back to the
    image size."""

    name: str
    many_to_one: bool  #: False: ψ is invertible and the FDP neighbour relation is degenerate
    compact: Callable[[np.ndarray, PublicViewConfig], np.ndarray]  #: uint8 (H, W, 3) → what is public
    expand: Callable[[np.ndarray, tuple[int, int], PublicViewConfig], np.ndarray]  #: → uint8 (H, W, 3)
    block: Callable[[PublicViewConfig], int]  #: the context window is a whole number of these pixels
    parameters: Callable[[PublicViewConfig], dict[str, Any]]  #: what privacy.json records
    protects: Callable[[PublicViewConfig], str]  #: the neighbour relation in plain words


def _bilinear_upsample(coarse: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    height, width = size
    return np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR))


PUBLIC_VIEWS: dict[str, PublicViewKind] = {
    kind.name: kind
    for kind in (
        PublicViewKind(
            name="downsample_quantize",
            many_to_one=True,
            compact=lambda image, cfg: quantize(area_downsample(image, cfg.factor), cfg.bits),
            expand=lambda coarse, size, cfg: _bilinear_upsample(coarse, size),
            block=lambda cfg: cfg.factor,
            parameters=lambda cfg: {"factor": cfg.factor, "bits": cfg.bits},
            protects=lambda cfg: (
                f"everything finer than a {cfg.factor}×{cfg.factor}-pixel block of the model input at {cfg.bits} bits "
                f"per colour ({1 << cfg.bits} levels): facial identity, skin and clothing texture, small marks, "
                f"print and fine shading; the coarse silhouette, body position and rough colours of each block are public"
            ),
        ),
        PublicViewKind(
            name="gaussian_blur",
            many_to_one=False,
            compact=lambda image, cfg: gaussian_blur_uint8(image, cfg.blur.kernel_size, cfg.blur.sigma),
            expand=lambda blurred, size, cfg: blurred,
            block=lambda cfg: 1,
            parameters=lambda cfg: {"kernel_size": cfg.blur.kernel_size, "sigma": cfg.blur.sigma},
            protects=lambda cfg: (
                "almost nothing: a Gaussian blur is invertible (deconvolution recovers the face), so neighbouring "
                "datasets that share the blurred image are (almost) the same image — the FDP neighbour relation is "
                "degenerate"
            ),
        ),
    )
}


def public_view_kind(cfg: PublicViewConfig) -> PublicViewKind:
    try:
        return PUBLIC_VIEWS[cfg.kind]
    except KeyError:
        raise ValueError(f"privacy.public_view.kind: unknown view {cfg.kind!r}; available: {', '.join(PUBLIC_VIEWS)}") from None


@dataclass(frozen=True)
class ImagePublicView:
    """ψ as the dataset uses it (the ``PublicImageView`` protocol of :mod:`fedpose.data.dataset`):
    ``compact`` on a context window whose sides are multiples of ``block`` pixels, cached per
    record; ``expand`` back to the window size when a sample is drawn."""

    config: PublicViewConfig

    @property
    def name(self) -> str:
        return self.config.kind

    @property
    def block(self) -> int:
        return public_view_kind(self.config).block(self.config)

    def compact(self, image: np.ndarray) -> np.ndarray:
        return public_view_kind(self.config).compact(image, self.config)

    def expand(self, compact: np.ndarray, size: tuple[int, int]) -> np.ndarray:
        return public_view_kind(self.config).expand(compact, size, self.config)

    def __call__(self, image: np.ndarray) -> np.ndarray:
        """ψ(image) at the image's own size."""
        return self.expand(self.compact(image), tuple(np.asarray(image).shape[:2]))  # type: ignore[arg-type]


def dataset_public_view(privacy: PrivacyConfig) -> ImagePublicView | None:
    """The ψ a training dataset must compute for ``privacy.mechanism`` (None if it uses none)."""
    from fedpose.privacy.mechanisms import get_mechanism

    if not get_mechanism(privacy.mechanism).uses_dataset_public_view:
        return None
    return ImagePublicView(privacy.public_view)


def dataset_view_options(privacy: PrivacyConfig) -> dict[str, Any]:
    """The :class:`~fedpose.data.dataset.PoseDataset` arguments a training set needs for
    ``privacy.mechanism``'s public view: ψ (FDP / FP-DP), and a full-size decode for MaskDP (a
    reduced JPEG decode mixes whole 8×8 / 16×16 blocks of the file into each pixel, so a head's
    pixels would reach past any box-shaped mask; the dataset would mask such crops entirely)."""
    from fedpose.privacy.mechanisms import get_mechanism

    return {
        "public_view": dataset_public_view(privacy),
        "reduced_decode": get_mechanism(privacy.mechanism).public_view != "mask",
    }


def public_view_report(cfg: PublicViewConfig) -> dict[str, Any]:
    """privacy.json's ``public_view`` entry for FDP / FP-DP."""
    kind = public_view_kind(cfg)
    return {
        "map": kind.name,
        **kind.parameters(cfg),
        "many_to_one": kind.many_to_one,
        "computed": "once per record from the un-augmented crop, before augmentation; the same random "
                    "crop/scale/rotation/flip is applied to ψ(x) and x",
        "protects": kind.protects(cfg),
    }


# -- views used by the mechanisms --------------------------------------------------------------

def precomputed_view(batch: dict, privacy: PrivacyConfig) -> Tensor:
    """FDP's ψ(x): the dataset's ``public_image`` (ψ of the original record, then augmented)."""
    if PUBLIC_IMAGE_KEY not in batch:
        raise KeyError(
            f"FDP / FP-DP need batch['{PUBLIC_IMAGE_KEY}']: ψ(x) computed by the dataset before augmentation "
            "(build the PoseDataset with public_view=dataset_public_view(privacy))"
        )
    public = torch.as_tensor(batch[PUBLIC_IMAGE_KEY])
    if public.shape != batch["image"].shape:
        raise ValueError(f"batch['{PUBLIC_IMAGE_KEY}'] has shape {tuple(public.shape)}, the images {tuple(batch['image'].shape)}")
    return public


#: batch keys of each MaskDP region: all annotated boxes of the image in the crop frame, and how many are real
REGION_KEYS: dict[str, tuple[str, str]] = {"head": ("head_boxes", "head_count"), "face": ("face_boxes", "face_count")}


#: batch key of how far (x, y crop pixels) a box's source pixels reach past it in each crop
REACH_KEY = "private_reach"


def private_region_boxes(batch: dict, region: str) -> tuple[Tensor, Tensor, Tensor]:
    """(boxes (B, K, 4), counts (B,), reach (B, 2)) of ``privacy.mask.region`` for every person of each image.

    'head': every annotated head box of the image; 'face': every face box (a person without one
    contributes their head box). Both in the crop frame, as the dataset maps them, with the crop's
    ``private_reach``.
    """
    if region not in REGION_KEYS:
        raise ValueError(f"privacy.mask.region must be one of {sorted(REGION_KEYS)}, got {region!r}")
    boxes_key, count_key = REGION_KEYS[region]
    for key, what in ((boxes_key, f"every person's {region} box in the crop frame"), (count_key, f"how many {region} boxes are real"),
                      (REACH_KEY, "how far a source pixel reaches in each crop")):
        if key not in batch:
            raise KeyError(f"MaskDP needs batch['{key}'] ({what}, from PoseDataset) to know the private region")
    return torch.as_tensor(batch[boxes_key]), torch.as_tensor(batch[count_key]), torch.as_tensor(batch[REACH_KEY])


def mask_view(batch: dict, privacy: PrivacyConfig) -> Tensor:
    """MaskDP's ψ: every person's private region (``privacy.mask``) masked out."""
    boxes, counts, reach = private_region_boxes(batch, privacy.mask.region)
    return mask_boxes(batch["image"], boxes, privacy.mask.margin, privacy.mask.fill, counts, reach=reach)


#: the noise-free public input of each :data:`fedpose.privacy.mechanisms.PublicViewSource`
PUBLIC_VIEW_FUNCTIONS: dict[str, Callable[[dict, PrivacyConfig], Tensor]] = {
    "dataset": precomputed_view,
    "mask": mask_view,
}
