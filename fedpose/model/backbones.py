"""Backbone registry: timm TinyViT variants, built without downloading anything.

Every name in :func:`available_backbones` maps to a :class:`timm.models.tiny_vit.TinyVit`
with its classifier removed (``head`` is an ``nn.Identity``), so ``num_features`` channels at
stride 32 come out of ``forward_features``. Weights are always random here
(``pretrained=False``); start from a local file with ``model.init_checkpoint``.

TinyViT is resolution-agnostic: its blocks pad each feature map up to a multiple of the window
size and partition it into windows, so any input whose sides are multiples of 32 works and the
attention-bias tables keep their ImageNet shapes (a timm state dict loads unchanged). Every block
here computes that padding's share of the attention in closed form instead of running it
(:mod:`fedpose.model.window_attention`: the same function, 1.8× faster at 128×96).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

import timm
from timm.models.tiny_vit import TinyVit
from torch import nn

from fedpose.model.window_attention import skip_window_padding

# Small configurations that timm does not register, for fast tests and smoke runs.
CUSTOM_CONFIGS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "tiny_vit_test": MappingProxyType({
        "embed_dims": (32, 64, 96, 128),
        "depths": (1, 1, 1, 1),
        "num_heads": (1, 2, 3, 4),
        "window_sizes": (7, 7, 14, 7),
        "mbconv_expand_ratio": 2.0,
    }),
    # About a third of tiny_vit_5m_224 (1.8 M backbone parameters against 5.1 M, same window
    # sizes and head width 32): a candidate base for issue 26's sweep, where the product's model
    # does not fit the machine time (benchmarks/base_sizing: step times of both).
    "tiny_vit_mid": MappingProxyType({
        "embed_dims": (48, 96, 128, 256),
        "depths": (1, 2, 3, 1),
        "num_heads": (2, 3, 4, 8),
        "window_sizes": (7, 7, 14, 7),
    }),
})


def timm_tiny_vit_names() -> list[str]:
    return sorted(timm.list_models("tiny_vit_*"))


def available_backbones() -> list[str]:
    return sorted(CUSTOM_CONFIGS) + timm_tiny_vit_names()


def _strip_classifier(model: TinyVit) -> TinyVit:
    # The ImageNet classifier (norm + pooling + fc) is replaced by the SimCC head; keeping it
    # would add parameters that never receive a gradient (and count toward DP dimension).
    model.head = nn.Identity()
    skip_window_padding(model)
    return model


def create_backbone(name: str) -> TinyVit:
    """A randomly initialised TinyViT without its classifier. Stochastic depth is disabled:
    per-sample random masks would make forward_trainable non-deterministic under vmap."""
    if name in CUSTOM_CONFIGS:
        return _strip_classifier(TinyVit(num_classes=0, drop_path_rate=0.0, **CUSTOM_CONFIGS[name]))
    if name in timm_tiny_vit_names():
        model = timm.create_model(name, pretrained=False, num_classes=0, drop_path_rate=0.0)
        return _strip_classifier(model)
    raise ValueError(f"model.backbone: unknown backbone '{name}'; available: {', '.join(available_backbones())}")
