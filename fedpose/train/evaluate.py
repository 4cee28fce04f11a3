"""Evaluation: decode SimCC predictions, map them back to the original image, PCKh with head boxes."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from fedpose.data.transforms import crop_to_original
from fedpose.eval.pckh import pckh


@torch.no_grad()
def predict(
    model: Any, dataset: Dataset, batch_size: int = 32, max_samples: int | None = None, flip_test: bool = True,
) -> dict[str, np.ndarray]:
    """Run the model over ``dataset`` (in order) → arrays: ``preds`` (N,16,2) in the original
    frame, ``preds_crop`` (N,16,2) in the input frame, ``confidence`` (N,16), ``loss`` (N,), and
    the ground truth ``joints`` / ``joints_vis`` / ``headbox`` in the original frame. The model runs
    on its own device; the arrays are on the host. ``flip_test``: predict from the mean of each
    crop's and its mirror's distributions (:meth:`PoseModel.predict_crops`); the loss is the
    unmirrored crop's."""
    if max_samples is not None and max_samples < len(dataset):  # type: ignore[arg-type]
        dataset = Subset(dataset, range(max_samples))
    was_training = model.training
    device = next(model.parameters()).device
    model.eval()  # no_grad inference: TinyViT may cache its attention biases here
    out: dict[str, list[np.ndarray]] = {k: [] for k in ("preds", "preds_crop", "confidence", "loss", "joints", "joints_vis", "headbox")}
    try:
        for batch in DataLoader(dataset, batch_size=batch_size, shuffle=False):
            coords, confidence, logits_x, logits_y = model.predict_crops(batch["image"].to(device), flip_test=flip_test)
            coords, confidence = coords.cpu(), confidence.cpu()
            loss = model.loss(logits_x, logits_y, batch["joints"].to(device), batch["weight"].to(device)).cpu()
            rotation = batch.get("rotation", torch.zeros(len(coords)))
            original = crop_to_original(
                coords.numpy(), batch["center"].numpy(), np.asarray(batch["scale"], dtype=np.float64),
                model.input_size, np.asarray(rotation, dtype=np.float64),
            )
            out["preds"].append(original)
            out["preds_crop"].append(coords.numpy())
            out["confidence"].append(confidence.numpy())
            out["loss"].append(loss.numpy())
            out["joints"].append(batch["joints_original"].numpy())
            out["joints_vis"].append(batch["joints_vis"].numpy())
            out["headbox"].append(batch["headbox"].numpy())
    finally:
        model.train_mode() if was_training else model.eval()
    return {k: np.concatenate(v) if v else np.zeros((0,)) for k, v in out.items()}


def evaluate(
    model: Any, dataset: Dataset, batch_size: int = 32, max_samples: int | None = None, flip_test: bool = True,
) -> dict[str, float]:
    """PCKh@0.5 per group + "Mean" + "Mean@0.1" (percent, MPII convention) and the mean "loss";
    ``flip_test`` as in :func:`predict` (on by default, as pose benchmarks evaluate).

    Records without a head box (all-zero box) cannot be scored by PCKh and are excluded from it.
    """
    result = predict(model, dataset, batch_size, max_samples, flip_test=flip_test)
    if len(result["preds"]) == 0:
        raise ValueError("evaluation dataset is empty")
    has_box = np.abs(result["headbox"]).reshape(len(result["headbox"]), -1).sum(axis=1) > 0
    if not has_box.any():
        raise ValueError("no record in the evaluation dataset has a head box; PCKh needs head boxes")
    scores = pckh(result["preds"][has_box], result["joints"][has_box], result["joints_vis"][has_box], result["headbox"][has_box])
    scores = {k: float(v) for k, v in scores.items()}
    scores["loss"] = float(result["loss"].mean())
    scores["samples"] = int(has_box.sum())
    return scores
