"""Warm start: train the initial global model on the coordinator's public data, before round 1.

The coordinator holds S_pub (the basis service needs it anyway). Training on it is non-private
training on public data: it reads no site's data and spends no site's budget, so the sites'
guarantees are unchanged (the global model they receive is still independent of their data).
It is the federated form of the papers' recipe — pre-train on public data, then fine-tune
privately — which is where DP costs the least accuracy (paper 001, §4).

A model trained from random weights first gets its frozen BatchNorm statistics from public
images (see :meth:`fedpose.model.PoseModel.calibrate_batch_norm`); those statistics ship with
the global model, which is why they must come from public data only.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from fedpose.config import OptimConfig, PrivacyConfig


def warm_start(
    model: Any,
    public_data: Path,
    steps: int,
    optim: OptimConfig,
    batch_size: int,
    seed: int,
    calibrate: bool,
    echo: Callable[[str], None] = print,
) -> dict[str, float]:
    """Calibrate BatchNorm on public images (``calibrate``) and train ``steps`` non-private steps
    on ``public_data``, on the model's device (the caller places it: ``coordinator.device``);
    returns {"steps", "final_loss", "seconds"}."""
    from fedpose.data.dataset import PoseDataset, load_records
    from fedpose.privacy.engine import build_engine
    from fedpose.runtime import configure_device, model_device
    from fedpose.train import build_optimizer, build_scheduler, calibrate_batch_norm, train_steps

    configure_device(model_device(model))
    started = time.perf_counter()
    records, root = load_records(public_data)
    if not records:
        raise ValueError(f"coordinator.public_data {public_data}: no records to warm-start on")
    size = tuple(model.input_size)
    if calibrate:
        calibrate_batch_norm(model, PoseDataset(records, root, input_size=size, train=False))
    result = {"steps": 0.0, "final_loss": float("nan"), "seconds": 0.0}
    if steps > 0:
        dataset = PoseDataset(records, root, input_size=size, train=True, seed=seed, cache_images=True)
        optimizer = build_optimizer(model, optim)
        engine = build_engine(PrivacyConfig(), model, len(dataset), batch_size, steps, seed=seed,
                              memory_settings="coordinator.warm_start.batch_size")
        every = max(1, steps // 5)

        def report(step: int, record: dict[str, Any]) -> None:
            if step % every == 0 or step == steps:
                echo(f"warm start on public data: step {step}/{steps}, loss {record['loss']:.4f}")

        history = train_steps(model, engine, dataset, optimizer, steps, build_scheduler(optimizer, optim, steps),
                              on_step=report, progress=False, description="warm start")
        result.update(steps=float(steps), final_loss=float(history[-1]["loss"]))
    result["seconds"] = time.perf_counter() - started
    return result
