"""The inner training loop shared by central training, federated sites and benchmarks.

The gradient engine (:mod:`fedpose.privacy.engine`) owns batching and gradients — plain
autograd for mechanism "none", clipped + noised per-sample gradients for the DP mechanisms —
so this loop is the same for every mechanism::

    for each step: batch = next(batches); engine.step(model, batch) sets .grad;
                   optimizer.step(); scheduler.step()
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import Dataset

from fedpose.config import ConfigError
from fedpose.train.evaluate import evaluate

StepCallback = Callable[[int, dict[str, Any]], None]

#: images used to calibrate a from-scratch model's frozen BatchNorm statistics
CALIBRATION_IMAGES = 64


class TrainingDiverged(ConfigError):
    """An optimizer step left non-finite weights. A configuration problem (step size against the
    gradient and noise scale), so the CLI reports it like one; the weights of the step before are
    what any checkpoint holds (the failing step is never handed to ``on_step``)."""


def _check_finite(model: Any, step: int, metrics: dict[str, Any]) -> None:
    # one device-to-host read for all parameters (on a GPU each bool() would wait for the device)
    if bool(torch.stack([torch.isfinite(param).all() for param in model.trainable_parameters().values()]).all()):
        return
    noise = f", noise std per coordinate {metrics['noise_std']:.3g}" if "noise_std" in metrics else ""
    raise TrainingDiverged(
        f"optim.lr: training diverged at step {step}: the weights are no longer finite "
        f"(loss {metrics.get('loss', math.nan):.4g}{noise}). Lower optim.lr, or for a private run "
        "lower privacy.max_grad_norm or use a projecting mechanism (pdp, fpdp)"
    )


class DivergenceMonitor:
    """Flags a training loss that blows up while the weights are still finite (a non-finite weight
    stops training: :class:`TrainingDiverged`).

    Diverging means: the step's loss is not finite, or the mean loss over the last ``window`` steps
    exceeds ``factor`` × the lowest such mean seen so far (judged once ``window`` steps are in, so the
    noisy first steps of a private run are not compared with themselves). A warning is raised once
    on entering that state and again only after the loss has come back below the threshold.
    (A run whose loss went 3.19 → 3718 — the case that motivated it — crosses 10× within its window.)
    """

    def __init__(self, window: int = 10, factor: float = 10.0) -> None:
        if window < 1 or not factor > 1:
            raise ValueError(f"window must be >= 1 and factor > 1, got {window}, {factor}")
        self.window, self.factor = int(window), float(factor)
        self._recent: list[float] = []
        self.best_mean = math.inf
        self.diverged = False

    def update(self, step: int, loss: float) -> dict[str, Any] | None:
        """Feed one step's loss; returns a record of the divergence when this step enters it, else None."""
        if not math.isfinite(loss):
            was, self.diverged = self.diverged, True
            return None if was else {"step": step, "reason": "non-finite loss", "loss": None}
        self._recent = (self._recent + [float(loss)])[-self.window:]
        if len(self._recent) < self.window:
            return None
        mean = sum(self._recent) / self.window
        if mean <= self.factor * self.best_mean:
            self.best_mean = min(self.best_mean, mean)
            self.diverged = False
            return None
        if self.diverged:
            return None
        self.diverged = True
        return {"step": step, "reason": f"mean loss over the last {self.window} steps is more than {self.factor:g}× its "
                f"lowest so far", "loss_window_mean": mean, "lowest_window_mean": self.best_mean,
                "ratio": mean / self.best_mean}


def describe_divergence(event: dict[str, Any]) -> str:
    """One warning line for a :class:`DivergenceMonitor` event."""
    if event.get("loss") is None and "loss_window_mean" not in event:
        what = "the loss is not finite"
    else:
        what = (f"mean loss {event['loss_window_mean']:.4g} over the last steps, {event['ratio']:.3g}× its lowest "
                f"({event['lowest_window_mean']:.4g})")
    return (f"WARNING: training is diverging at step {event['step']}: {what}. The model is likely useless from here; "
            "lower optim.lr, or for a private run lower privacy.max_grad_norm or raise train.batch_size")


def calibrate_batch_norm(model: Any, dataset: Dataset | None, images: int = CALIBRATION_IMAGES) -> None:
    """Frozen BatchNorm statistics for a from-scratch model, from the first ``images`` of ``dataset``
    (see :meth:`fedpose.model.PoseModel.calibrate_batch_norm`).

    BatchNorm statistics ship with the model, so a private run passes public data only; with
    ``dataset=None`` the model keeps its data-independent (noise) calibration.
    """
    if dataset is None:
        return
    model.calibrate_batch_norm(torch.stack([dataset[i]["image"] for i in range(min(images, len(dataset)))]))  # type: ignore[arg-type]


def train_steps(
    model: Any,
    engine: Any,
    dataset: Dataset,
    optimizer: torch.optim.Optimizer,
    steps: int,
    scheduler: Any = None,
    on_step: StepCallback | None = None,
    progress: bool = True,
    batches: Iterator[dict] | None = None,
    first_step: int = 0,
    description: str = "train",
) -> list[dict[str, Any]]:
    """Run ``steps`` optimizer steps; returns one metrics dict per step.

    ``batches`` lets a caller keep one batch stream across several calls (central training
    validates between calls; a fresh ``engine.batches(dataset)`` would restart the epoch).
    ``first_step`` only numbers the records (``"step"`` = first_step + i + 1). ``on_step(step,
    record)`` is called after each optimizer step (checkpointing, logging).
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if batches is None:
        batches = engine.batches(dataset)
    model.train_mode()
    history: list[dict[str, Any]] = []
    bar = None
    if progress:
        from fedpose.progress import progress_bar

        bar = progress_bar(steps, description, unit="step")
    try:
        for i in range(steps):
            started = time.perf_counter()
            batch = next(batches)
            optimizer.zero_grad(set_to_none=True)
            metrics = engine.step(model, batch)
            optimizer.step()
            _check_finite(model, first_step + i + 1, metrics)
            if scheduler is not None:
                scheduler.step()
            record: dict[str, Any] = {"step": first_step + i + 1}
            record.update({k: float(v) for k, v in metrics.items()})
            record["lr"] = float(optimizer.param_groups[0]["lr"])
            record["seconds"] = time.perf_counter() - started
            history.append(record)
            if bar is not None:
                loss = record.get("loss", math.nan)
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{record['lr']:.2e}", refresh=False)
                bar.update(1)
            if on_step is not None:
                on_step(record["step"], record)
    finally:
        if bar is not None:
            bar.close()
    return history


__all__ = ["DivergenceMonitor", "StepCallback", "TrainingDiverged", "describe_divergence", "evaluate", "train_steps"]
