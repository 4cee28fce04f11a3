"""The federation's model as a file people use: the coordinator's ``global.npz``.

The coordinator checkpoints the global model every round as named float arrays plus JSON meta
(:func:`fedpose.federation.aggregation.save_array_checkpoint`; no pickle), with the model's
architecture (its :class:`~fedpose.config.ModelSpec`) and the round in the meta. ``fedpose eval``,
``fedpose predict`` and ``fedpose export`` read it through :func:`load_global_model`, given the file
or the coordinator's checkpoint directory. With ``coordinator.ema`` on, the directory's model is the
moving average (``global_ema.npz``, :mod:`fedpose.federation.weight_ema`); ``global.npz`` itself
is the training iterate the sites receive and a resume continues from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the global model's file in a coordinator's checkpoint directory
GLOBAL_CHECKPOINT = "global.npz"


class GlobalModelError(ValueError):
    """Not a readable federated model (names the file and what is wrong)."""


@dataclass(frozen=True)
class GlobalModel:
    model: Any  #: the PoseModel with the global weights
    path: Path  #: the global.npz it was read from
    round: int  #: the last round folded into these weights (0: the initial model)
    run_id: str
    ema: dict[str, Any] | None = None  #: {decay, averaged_rounds, round} when this is the moving average (global_ema.npz)

    def describe(self) -> str:
        """Which model this is, for reports: the round's global model or the average up to it."""
        if self.ema:
            return (f"moving average (decay {self.ema['decay']:g}) of the global models of the last "
                    f"{self.ema['averaged_rounds']} rounds up to round {self.ema.get('round', self.round)}")
        return f"global model after round {self.round}"


def global_checkpoint_path(path: str | Path) -> Path | None:
    """``path`` itself when it is a coordinator's global model file, the one inside it when it is a
    coordinator's checkpoint directory (its moving average when the run keeps one), else None (not a
    federated model)."""
    from fedpose.federation.weight_ema import EMA_CHECKPOINT

    path = Path(path)
    if path.is_dir():
        for name in (EMA_CHECKPOINT, GLOBAL_CHECKPOINT):
            if (path / name).is_file():
                return path / name
        return None
    return path if path.suffix == ".npz" else None


def load_global_model(path: str | Path) -> GlobalModel:
    """The federated model in ``path`` (a global.npz or the directory holding it), on the CPU."""
    import numpy as np
    import torch

    from fedpose.federation.aggregation import load_array_checkpoint
    from fedpose.model import model_with_weights

    file = global_checkpoint_path(path)
    if file is None or not file.is_file():
        raise GlobalModelError(f"{path}: no coordinator model here (expected {GLOBAL_CHECKPOINT} or the directory holding it)")
    try:
        arrays, meta = load_array_checkpoint(file)
    except (OSError, ValueError, KeyError) as exc:  # numpy raises ValueError/OSError for a damaged archive
        raise GlobalModelError(f"{file}: not a readable coordinator checkpoint ({type(exc).__name__}: {exc})") from None
    state = meta.get("state") or {}
    if not state.get("model_spec"):
        raise GlobalModelError(f"{file}: holds no model spec (not written by a fedpose coordinator)")
    weights = {name: torch.from_numpy(np.array(value)) for name, value in arrays.items()}
    model = model_with_weights(state["model_spec"], weights, file, error=GlobalModelError)
    return GlobalModel(model, file, int(state.get("round") or 0), str(meta.get("run_id") or ""), meta.get("ema"))
