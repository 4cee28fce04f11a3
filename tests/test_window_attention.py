"""The padding-free windowed attention computes timm's TinyViT block exactly (up to round-off):
outputs and every parameter's gradient, at input sizes whose maps pad in one window, in several,
or not at all, with non-trivial attention biases and LayerNorm shifts (the padded slots' key)."""

from __future__ import annotations

import copy

import pytest
import torch
from timm.models.tiny_vit import TinyVitBlock
from torch.func import functional_call, grad, vmap

from fedpose.model.backbones import create_backbone
from fedpose.model.pose_model import PoseModel
from fedpose.model.window_attention import (PaddingFreeBlock, _attend, _segments, _window_bias, run_window_padding,
                                            windowed_attention)
from numerics import eps


def _timm_twin(model: PoseModel) -> PoseModel:
    """The same weights with timm's own block (which runs attention over the padding)."""
    twin = copy.deepcopy(model)
    run_window_padding(twin)
    return twin


def _model(backbone: str, size: tuple[int, int], scenario: str = "biases_norms") -> PoseModel:
    torch.manual_seed(0)
    model = PoseModel(create_backbone(backbone), size, scenario=scenario)
    with torch.no_grad():  # a fresh model's biases are zero: make the padded slots' terms matter
        for name, parameter in model.named_parameters():
            if "attention_biases" in name:
                parameter.normal_(0.0, 1.0)
            elif "attn.norm.bias" in name:
                parameter.normal_(0.0, 0.5)
    return model.train_mode()


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).detach())


# Round-off of a network's forward and backward in float32: far below any real difference (a padded
# slot dropped instead of folded moves outputs by ~1e-1 here).
TOLERANCE = 1e3 * eps(torch.float32)


def test_every_block_of_a_backbone_skips_the_padding() -> None:
    blocks = [m for m in create_backbone("tiny_vit_test").modules() if isinstance(m, TinyVitBlock)]
    assert blocks and all(type(m) is PaddingFreeBlock for m in blocks)


def test_segments_cover_a_side_with_full_windows_then_the_rest() -> None:
    assert _segments(16, 7) == [(0, 2, 7), (14, 1, 2)]
    assert _segments(6, 14) == [(0, 1, 6)]
    assert _segments(14, 7) == [(0, 2, 7)]


@pytest.mark.parametrize(("backbone", "size"), [
    ("tiny_vit_5m_224", (128, 96)),   # stage 2: one 14×14 window, 48 real slots; stage 1: 2×3 windows
    ("tiny_vit_test", (96, 160)),     # windows of every real shape (full, last row, last column, corner)
    ("tiny_vit_test", (224, 224)),    # no padding at all
])
def test_outputs_and_gradients_equal_timms_block(backbone: str, size: tuple[int, int]) -> None:
    model = _model(backbone, size)
    reference = _timm_twin(model)
    images = torch.randn(3, 3, *size)
    outputs, expected = model(images), reference(images)
    for got, want in zip(outputs, expected):
        assert _relative_error(got, want) < TOLERANCE
    # a loss that weighs every output differently, so no gradient cancels by symmetry
    weights = [torch.randn_like(o) for o in outputs]
    sum((w * o).sum() for w, o in zip(weights, outputs)).backward()
    sum((w * o).sum() for w, o in zip(weights, expected)).backward()
    references = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            assert _relative_error(parameter.grad, references[name].grad) < TOLERANCE, name


def test_the_padded_slots_matter() -> None:
    """Dropping the padded slots instead of folding them into one key is a different function: the
    equality above is not vacuous."""
    model = _model("tiny_vit_5m_224", (128, 96))
    block = next(m for m in model.modules() if isinstance(m, TinyVitBlock) and m.window_size == 14)
    x = torch.randn(2, 8, 6, block.dim)
    folded = windowed_attention(block.attn, x, 14).reshape(2, 48, block.dim)
    dropped = _attend(block.attn, x.reshape(2, 48, block.dim), _window_bias(block.attn, 8, 6, 14)[..., :48])
    assert _relative_error(dropped, folded) > 1e-2


def _per_sample_gradients(net: PoseModel, images: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {k: v.detach() for k, v in net.named_parameters() if v.requires_grad}
    buffers = dict(net.named_buffers())

    def loss(p: dict[str, torch.Tensor], image: torch.Tensor) -> torch.Tensor:
        logits_x, logits_y = functional_call(net, (p, buffers), (image.unsqueeze(0),))
        return logits_x.square().mean() + logits_y.square().mean()

    return vmap(grad(loss), in_dims=(None, 0))(params, images)


@pytest.mark.parametrize("fused", [True, False])
def test_per_sample_gradients_under_vmap_equal_timms_block(fused: bool) -> None:
    """Under ``finetune`` stage 3's blocks run inside the engine's vmap: per-sample gradients there
    must be timm's. On a GPU the engine runs them with the explicit softmax instead of SDPA
    (``fused_attn`` off, fedpose.privacy.per_sample): that branch is checked here too, on the CPU."""
    size = (128, 96)
    model = _model("tiny_vit_5m_224", size, scenario="finetune")
    reference = _timm_twin(model)
    for net in (model, reference):
        for module in net.modules():
            if hasattr(module, "fused_attn"):
                module.fused_attn = fused
    images = torch.randn(2, 3, *size)
    got, want = _per_sample_gradients(model, images), _per_sample_gradients(reference, images)
    assert got.keys() == want.keys()
    for name in got:
        assert _relative_error(got[name], want[name]) < TOLERANCE, name
