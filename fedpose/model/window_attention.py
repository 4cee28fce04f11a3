"""TinyViT's windowed attention without computing its padding: the same function, less work.

timm's ``TinyVitBlock`` pads a feature map with zeros up to a multiple of the window size and runs
attention over every slot of every window, padding included; only the real positions' outputs are
kept. At the product's 128×96 input that is most of the network's work: stage 2's 8×6 map is
padded to one 14×14 window (48 real tokens of 196), stage 1's 16×12 to 21×14 (192 of 294) and
stage 3's 4×3 to 7×7 (12 of 49). The padding cannot simply be dropped: the padded slots are *keys*
every real token attends to, and the public base was trained with them.

They can be computed exactly at the cost of one key. A padded slot is a zero vector, so the
attention's LayerNorm maps it to its shift β and every padded slot has the same key k_p and value
v_p. Real query i of a window with padded slots P gives them the weight

    Σ_{j∈P} exp(s·q_i·k_p + b_ij) = exp(s·q_i·k_p + log Σ_{j∈P} exp(b_ij)),

with b_ij the learned relative-position bias. So attention over the window's real tokens plus one
pseudo-key (k_p, v_p) whose bias is that log-sum-exp of the padded slots' biases is the same softmax
as timm's (the same numerator and the same denominator), up to float rounding. Outputs at padded
slots were discarded anyway. tests/test_window_attention.py checks outputs and gradients
against timm's block at several input sizes.

Windows of one map have at most four real shapes (full windows, the last row, the last column,
the corner); each shape's windows run as one batch, as timm runs all of them. The bias is indexed
afresh on every call (timm caches it in eval mode, which breaks a second backward under
``torch.func``; shared/FACTS.md) and everything is a pure function of parameters and input, so the
block works under ``vmap`` like the original.

Measured (tiny_vit_5m_224, 128×96, a 16-row chunk, biases_norms, 1 thread):
DP per-sample gradients 2.08× faster, a non-private step 1.86×; at 256×192 1.28× / 1.20×
(benchmarks/step_cost/window_attention.json).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.models.tiny_vit import Attention, TinyVitBlock
from torch import Tensor, nn


def _segments(length: int, window: int) -> list[tuple[int, int, int]]:
    """(start, windows, real extent) runs along one side: the full windows, then the partial one."""
    full, rest = divmod(length, window)
    runs = [(0, full, window)] if full else []
    if rest:
        runs.append((full * window, 1, rest))
    return runs


def _window_bias(attn: Attention, height: int, width: int, window: int) -> Tensor:
    """Additive attention bias of a window whose real tokens fill its top-left height × width:
    (heads, n, n) between real tokens, plus a last column for the padded slots' pseudo-key."""
    biases = attn.attention_biases[:, attn.attention_bias_idxs]  # (heads, window², window²)
    slots = torch.arange(window * window, device=biases.device).view(window, window)
    real = slots[:height, :width].reshape(-1)
    to_real = biases[:, real]
    real_bias = to_real[:, :, real]
    if real.numel() == window * window:
        return real_bias
    padded = torch.ones(window * window, dtype=torch.bool, device=biases.device)
    padded[real] = False
    pad_bias = torch.logsumexp(to_real[:, :, padded], dim=-1, keepdim=True)
    return torch.cat([real_bias, pad_bias], dim=-1)


def _attend(attn: Attention, tokens: Tensor, bias: Tensor) -> Tensor:
    """timm's Attention.forward on a window's real tokens (windows, n, C); one pseudo-key for its
    padded slots where ``bias`` has a column for it."""
    windows, n, channels = tokens.shape
    padded = bias.shape[-1] > n
    if padded:
        # A padded slot is a zero vector, which LayerNorm maps to its shift: every padded slot of a
        # window has one key and one value. Each window gets its own zero row (not one row shared by
        # all), so every row still belongs to one sample, as the DP engine's batched per-sample
        # gradients require (fedpose.privacy.per_sample).
        tokens = torch.cat([tokens, tokens.new_zeros(windows, 1, channels)], dim=1)
    split = [attn.key_dim, attn.key_dim, attn.val_dim]
    qkv = attn.qkv(attn.norm(tokens)).view(windows, tokens.shape[1], attn.num_heads, -1)
    q, k, v = (t.permute(0, 2, 1, 3) for t in qkv.split(split, dim=3))
    q = q[:, :, :n]  # the padded slots' query is discarded, as timm crops their outputs
    if attn.fused_attn:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    else:
        out = ((q * attn.scale) @ k.transpose(-2, -1) + bias).softmax(dim=-1) @ v
    return attn.proj(out.transpose(1, 2).reshape(windows, n, attn.out_dim))


def windowed_attention(attn: Attention, x: Tensor, window: int) -> Tensor:
    """What timm's block computes from (B, H, W, C) before its residual: windowed attention,
    cropped to H × W — without running the padding."""
    batch, height, width, channels = x.shape
    rows = []
    for row, row_windows, row_extent in _segments(height, window):
        cols = []
        for col, col_windows, col_extent in _segments(width, window):
            part = x[:, row:row + row_windows * row_extent, col:col + col_windows * col_extent]
            tokens = (part.reshape(batch, row_windows, row_extent, col_windows, col_extent, channels)
                      .transpose(2, 3).reshape(-1, row_extent * col_extent, channels))
            out = _attend(attn, tokens, _window_bias(attn, row_extent, col_extent, window))
            cols.append(out.view(batch, row_windows, col_windows, row_extent, col_extent, channels)
                        .transpose(2, 3).reshape(batch, row_windows * row_extent, col_windows * col_extent, channels))
        rows.append(torch.cat(cols, dim=2) if len(cols) > 1 else cols[0])
    return torch.cat(rows, dim=1) if len(rows) > 1 else rows[0]


class PaddingFreeBlock(TinyVitBlock):
    """A ``TinyVitBlock`` whose attention skips the padding (module docstring); the same
    parameters and state-dict keys, so timm and fedpose checkpoints load unchanged."""

    def forward(self, x: Tensor) -> Tensor:
        batch, height, width, channels = x.shape
        x = x + self.drop_path1(windowed_attention(self.attn, x, self.window_size))
        x = self.local_conv(x.permute(0, 3, 1, 2))
        x = x.reshape(batch, channels, height * width).transpose(1, 2)
        x = x + self.drop_path2(self.mlp(x))
        return x.view(batch, height, width, channels)


def skip_window_padding(model: nn.Module) -> nn.Module:
    """Make every attention block of ``model`` a :class:`PaddingFreeBlock`, in place."""
    return _swap_blocks(model, TinyVitBlock, PaddingFreeBlock)


def run_window_padding(model: nn.Module) -> nn.Module:
    """The reverse, in place: timm's own blocks, which run attention over the padding — the
    reference the tests and benchmarks/step_cost/window_attention.py compare against."""
    return _swap_blocks(model, PaddingFreeBlock, TinyVitBlock)


def _swap_blocks(model: nn.Module, old: type[nn.Module], new: type[nn.Module]) -> nn.Module:
    for module in model.modules():
        if type(module) is old:
            module.__class__ = new
    return model
