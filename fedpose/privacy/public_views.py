"""Public feature maps ψ for feature-level DP (FDP, FP-DP) and MaskDP.

A public view ψ(x) is what the guarantee treats as public: its gradient is used without
clipping or noise. Both maps work on ImageNet-normalized batches (B, 3, H, W):

* :func:`gaussian_blur` — FDP's ψ (paper 000): a separable Gaussian blur. Blur is linear with
  a kernel summing to 1, so blurring the normalized image equals normalizing the blurred one.
  Borders use reflect padding (no dark frame that would itself carry a signal).
* :func:`mask_boxes` — MaskDP's ψ (paper 003, adapted to images): the declared private box of
  each sample is replaced by a constant, so no pixel inside it reaches the public path. The box
  comes from the annotation (``face_box``), never from the pixels. A sample with no declared box
  is masked entirely: when the private region is unknown, nothing of the image is public.

The ``*_view(batch, privacy_cfg)`` functions are what the mechanism registry calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fedpose.config import PrivacyConfig
from fedpose.data.dataset import IMAGENET_MEAN, IMAGENET_STD



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


def box_masks(boxes: Tensor, height: int, width: int, margin: float) -> Tensor:
    """(B, 4) x1, y1, x2, y2 boxes → (B, H, W) bool masks, True = private pixel.

    Each box is enlarged by ``margin`` × its width/height on every side and rounded outwards to
    whole pixels (a pixel is private if it touches the enlarged box). Degenerate boxes (zero
    area, e.g. no annotation) mark the whole image private.
    """
    if boxes.dim() != 2 or boxes.shape[1] != 4:
        raise ValueError(f"expected boxes (B, 4) as x1, y1, x2, y2, got shape {tuple(boxes.shape)}")
    if margin < 0:
        raise ValueError(f"mask margin must be >= 0, got {margin}")
    boxes = boxes.to(torch.float64)
    x1, y1, x2, y2 = boxes.unbind(1)
    box_w, box_h = (x2 - x1).clamp(min=0), (y2 - y1).clamp(min=0)
    x1, x2 = x1 - margin * box_w, x2 + margin * box_w
    y1, y2 = y1 - margin * box_h, y2 + margin * box_h
    # Pixel (i, j) covers [j, j+1) × [i, i+1): it is private if it overlaps the box.
    cols = torch.arange(width, dtype=torch.float64)
    rows = torch.arange(height, dtype=torch.float64)
    in_x = (cols[None, :] + 1 > x1[:, None]) & (cols[None, :] < x2[:, None])
    in_y = (rows[None, :] + 1 > y1[:, None]) & (rows[None, :] < y2[:, None])
    masks = in_y[:, :, None] & in_x[:, None, :]
    undeclared = (box_w * box_h <= 0) | ~torch.isfinite(boxes).all(1)
    masks[undeclared] = True
    return masks.to(boxes.device)


def mask_boxes(images: Tensor, boxes: Tensor, margin: float = 0.0, fill: str = "mean") -> Tensor:
    """``images`` with each sample's (enlarged) private box replaced by the ``fill`` value."""
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images (B, 3, H, W), got shape {tuple(images.shape)}")
    if boxes.shape[0] != images.shape[0]:
        raise ValueError(f"{boxes.shape[0]} boxes for {images.shape[0]} images")
    masks = box_masks(boxes, images.shape[2], images.shape[3], margin).to(images.device)
    value = fill_value(fill, images.dtype).to(images.device).view(1, 3, 1, 1)
    return torch.where(masks[:, None], value, images)


# -- views used by the mechanisms --------------------------------------------------------------

def blur_view(batch: dict, privacy: PrivacyConfig) -> Tensor:
    """FDP's ψ: Gaussian blur with ``privacy.blur.kernel_size`` / ``privacy.blur.sigma``."""
    return gaussian_blur(batch["image"], privacy.blur.kernel_size, privacy.blur.sigma)


def private_region_boxes(batch: dict, region: str) -> Tensor:
    """The declared private boxes (B, 4) in the crop frame for ``privacy.mask.region``.

    'face' and 'head' both read ``face_box`` — the data pipeline fills it with the annotated
    face box when one exists and otherwise with the head box mapped into the crop — unless the
    batch carries an explicit ``head_box`` (crop frame), which 'head' then prefers.
    """
    if region not in ("head", "face"):
        raise ValueError(f"privacy.mask.region must be 'head' or 'face', got {region!r}")
    key = "head_box" if region == "head" and "head_box" in batch else "face_box"
    if key not in batch:
        raise KeyError(f"MaskDP needs batch['{key}'] (x1, y1, x2, y2 in the crop frame) to know the private region")
    boxes = torch.as_tensor(batch[key])
    if boxes.dim() == 3 and boxes.shape[1:] == (2, 2):
        boxes = boxes.reshape(-1, 4)
    return boxes


def mask_view(batch: dict, privacy: PrivacyConfig) -> Tensor:
    """MaskDP's ψ: the private region (``privacy.mask``) masked out."""
    boxes = private_region_boxes(batch, privacy.mask.region)
    return mask_boxes(batch["image"], boxes, privacy.mask.margin, privacy.mask.fill)

