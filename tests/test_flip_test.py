"""Flip test: a crop's and its mirror's SimCC distributions averaged, the mirror's mapped back."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from fedpose.config import ModelConfig
from fedpose.data.transforms import flip_matrix
from fedpose.joints import NUM_JOINTS, flip_permutation
from fedpose.model import build_model
from fedpose.model.simcc import SimCCCodec

SIZE = (64, 48)  # (H, W): a portrait crop, so x and y bins differ in number


@pytest.mark.parametrize("split_factor", [1, 2, 3])
def test_unmirror_puts_each_bin_where_the_mirror_maps_its_pixel(split_factor: int) -> None:
    """A mirrored crop's joint j certain at x' comes back as joint swap(j), certain at W − 1 − x'
    (the mirror of transforms.flip_matrix), for every bin; y is untouched."""
    codec = SimCCCodec(SIZE, split_factor=split_factor, refine_radius=0)
    bins_y, bins_x = codec.bins
    swap = flip_permutation()
    mirror = flip_matrix(SIZE[1])
    for b in range(bins_x):
        prob_x = torch.zeros(1, NUM_JOINTS, bins_x)
        prob_x[0, :, b] = 1.0
        prob_y = torch.rand(1, NUM_JOINTS, bins_y)
        back_x, back_y = codec.unmirror(prob_x, prob_y)
        x_mirrored = b / split_factor
        x_back = (mirror @ np.array([x_mirrored, 0.0, 1.0]))[0]
        if b <= split_factor * (SIZE[1] - 1):  # the mirror of a pixel coordinate inside the crop
            assert torch.equal(back_x.argmax(-1), torch.full((1, NUM_JOINTS), round(x_back * split_factor)))
            assert torch.equal(back_x.sum(-1), torch.ones(1, NUM_JOINTS))
        else:  # between the last pixel and the crop's edge: no bin on the other side to come back to
            assert torch.equal(back_x, torch.zeros_like(back_x))
        assert torch.equal(back_y, prob_y[:, swap])


@pytest.mark.parametrize("split_factor", [1, 2])
def test_flip_test_is_mirror_equivariant(split_factor: int) -> None:
    """Decoding (crop, mirror) and (mirror, crop) gives the same joints, mirrored: the flip test's
    prediction does not depend on which of the two views the model is called the original."""
    codec = SimCCCodec(SIZE, split_factor=split_factor)
    bins_y, bins_x = codec.bins
    g = torch.Generator().manual_seed(0)
    crop_x, crop_y = torch.randn(4, NUM_JOINTS, bins_x, generator=g) * 3, torch.randn(4, NUM_JOINTS, bins_y, generator=g) * 3
    mirror_x, mirror_y = torch.randn(4, NUM_JOINTS, bins_x, generator=g) * 3, torch.randn(4, NUM_JOINTS, bins_y, generator=g) * 3
    # no mass beyond the last pixel's bin, which has no mirror image inside the crop
    edge = split_factor * (SIZE[1] - 1) + 1
    crop_x[..., edge:] = -1e4
    mirror_x[..., edge:] = -1e4
    coords, confidence = codec.decode(crop_x, crop_y, mirrored=(mirror_x, mirror_y))
    coords_m, confidence_m = codec.decode(mirror_x, mirror_y, mirrored=(crop_x, crop_y))
    swap = flip_permutation()
    torch.testing.assert_close(coords_m[:, swap, 0], SIZE[1] - 1 - coords[..., 0], atol=1e-4, rtol=0)
    torch.testing.assert_close(coords_m[:, swap, 1], coords[..., 1], atol=1e-4, rtol=0)
    torch.testing.assert_close(confidence_m[:, swap], confidence)


def test_flip_test_of_two_equal_views_is_the_view_itself() -> None:
    """When the mirror's distribution, mapped back, equals the crop's, flip test changes nothing."""
    codec = SimCCCodec(SIZE)
    bins_y, bins_x = codec.bins
    g = torch.Generator().manual_seed(1)
    logits_x, logits_y = torch.randn(2, NUM_JOINTS, bins_x, generator=g), torch.randn(2, NUM_JOINTS, bins_y, generator=g)
    logits_x[..., bins_x - 1:] = -1e4  # the bin with no mirror image (k = 2: one)
    swap = flip_permutation()
    # the mirror's logits: what unmirror maps back onto the crop's (bin b ← k(W − 1) − b, joints swapped)
    mirror_x = torch.full_like(logits_x, -1e4)
    mirror_x[..., : bins_x - 1] = logits_x[:, swap, : bins_x - 1].flip(-1)
    plain = codec.decode(logits_x, logits_y)
    flipped = codec.decode(logits_x, logits_y, mirrored=(mirror_x, logits_y[:, swap]))
    torch.testing.assert_close(flipped[0], plain[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(flipped[1], plain[1])


def test_predict_crops_runs_the_mirror_only_under_flip_test() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = build_model(ModelConfig(backbone="tiny_vit_test", scenario="finetune"), (64, 64)).eval()
    images = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    calls: list[torch.Tensor] = []
    hook = model.register_forward_pre_hook(lambda _module, args: calls.append(args[0]))
    with torch.no_grad():
        plain = model.predict_crops(images, flip_test=False)
        assert len(calls) == 1
        flipped = model.predict_crops(images, flip_test=True)
    hook.remove()
    assert len(calls) == 3 and torch.equal(calls[2], images.flip(-1))
    torch.testing.assert_close(flipped[2], plain[2])  # the logits (and so the loss) are the crop's own
    expected = model.decode(*model(images), mirrored=model(images.flip(-1)))
    torch.testing.assert_close(flipped[0], expected[0])
