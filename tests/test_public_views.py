"""Public feature maps ψ: Gaussian blur (FDP) and private-box masking (MaskDP)."""

from __future__ import annotations

import pytest
import torch

from fedpose.config import PrivacyConfig
from fedpose.privacy.public_views import (
    box_masks,
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
    masks = box_masks(torch.tensor([[4.0, 2.0, 8.0, 6.0]]), 12, 16, margin=0.25)  # +1 px each side
    expected = torch.zeros(12, 16, dtype=torch.bool)
    expected[1:7, 3:9] = True
    assert torch.equal(masks[0], expected)


def test_mask_removes_every_private_pixel_and_keeps_the_rest() -> None:
    images = torch.randn(2, 3, 20, 16)
    boxes = torch.tensor([[2.5, 3.0, 9.2, 11.0], [0.0, 0.0, 16.0, 5.0]])
    out = mask_boxes(images, boxes, margin=0.0, fill="mean")
    masks = box_masks(boxes, 20, 16, 0.0)
    assert torch.all(out.permute(0, 2, 3, 1)[masks] == 0)
    assert torch.equal(out.permute(0, 2, 3, 1)[~masks], images.permute(0, 2, 3, 1)[~masks])
    # the public view does not depend on the private pixels at all
    changed = images.clone()
    changed.permute(0, 2, 3, 1)[masks] = torch.randn(int(masks.sum()), 3)
    assert torch.equal(mask_boxes(changed, boxes, 0.0, "mean"), out)


def test_undeclared_region_masks_the_whole_image() -> None:
    out = mask_boxes(torch.randn(1, 3, 8, 8), torch.zeros(1, 4), margin=0.1, fill="zero")
    assert torch.allclose(out, fill_value("zero").view(1, 3, 1, 1).expand(1, 3, 8, 8))
    black = fill_value("zero") * torch.tensor([0.229, 0.224, 0.225]) + torch.tensor([0.485, 0.456, 0.406])
    assert torch.allclose(black, torch.zeros(3), atol=1e-6)  # 'zero' is a black pixel after un-normalising


def test_mask_view_reads_the_configured_region() -> None:
    batch = {
        "image": torch.randn(1, 3, 16, 16),
        "face_box": torch.tensor([[1.0, 1.0, 4.0, 4.0]]),
        "head_box": torch.tensor([[8.0, 8.0, 12.0, 12.0]]),
    }
    head = mask_view(batch, PrivacyConfig(mask={"region": "head", "margin": 0.0}))
    face = mask_view(batch, PrivacyConfig(mask={"region": "face", "margin": 0.0}))
    assert torch.all(head[0, :, 8:12, 8:12] == 0) and torch.equal(head[0, :, 1:4, 1:4], batch["image"][0, :, 1:4, 1:4])
    assert torch.all(face[0, :, 1:4, 1:4] == 0)
    with pytest.raises(KeyError, match="face_box"):
        private_region_boxes({"image": batch["image"]}, "face")
