"""Optimizer and learning-rate schedule for the trainable parameters (linear warm-up + cosine)."""

from __future__ import annotations

import math
from typing import Any

import torch

from fedpose.config import OptimConfig


def _no_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Norms, biases and TinyViT's attention-bias tables are not weight-decayed."""
    return param.ndim <= 1 or "attention_biases" in name


def build_optimizer(model: Any, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = model.trainable_parameters()
    decay = [p for n, p in params.items() if not _no_decay(n, p)]
    no_decay = [p for n, p in params.items() if _no_decay(n, p)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    return torch.optim.AdamW(groups, lr=cfg.lr)


def lr_factor(step: int, total_steps: int, warmup_steps: int, cosine: bool) -> float:
    """Multiplier of the base lr after ``step`` optimizer steps."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if not cosine:
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg.warmup_steps, cfg.cosine)
    )
