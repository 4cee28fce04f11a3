"""An exponential moving average of the global model over rounds (coordinator.ema).

Under DP noise the global model wanders around the optimum at a distance set by the noise; an
average of its recent positions sits closer to it (De et al. 2022 average the private iterates).
The average is taken here, over the global models the coordinator already holds after each round
— the aggregate of the sites' privatized updates — so it is post-processing of what the sites
released: it reads no site data and changes no site's (ε, δ). It never feeds back into training:
the sites keep receiving the iterate w_r; the EMA is what the coordinator evaluates and what
``fedpose eval`` / ``predict`` / ``export`` read from the checkpoint directory
(:data:`EMA_CHECKPOINT`, beside the iterate's ``global.npz``, which resume continues from).

Why the coordinator and not each site's own iterates within a round: a round is a handful of local
steps from the global weights, so a site-side average would mostly lag (shrink Δ) rather than
smooth, and the noise that matters for the model people use is the one left after aggregation.
Measured on the main job's tuning data: sites releasing the mean of their last 8 of 16 iterates
moved the published model by +0.20 on average over three data sets, within run-to-run spread
(``benchmarks/federated_utility/tail_average_main_job.json``).

Start: the average begins at the first round's model and is the plain running mean of the rounds
so far until that mean's weight on the newest round, 1/n, falls to 1 − decay; from then on
``ema ← decay · ema + (1 − decay) · w_r``. So the public round-0 model, which no site improved, is
not averaged in, and a short run is not dominated by its first rounds (no bias correction needed).
Non-float arrays (integer buffers) are copied from the newest model. A round that left the global
model unchanged (no update accepted) adds nothing: folding its model in again would move the
published model towards an older one with no new site data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

#: the averaged global model in a coordinator's checkpoint directory (absent when the EMA is off)
EMA_CHECKPOINT = "global_ema.npz"

ArrayDict = dict[str, np.ndarray]


def ema_weight(decay: float, averaged: int) -> float:
    """The newest round's weight when it is the ``averaged``-th model in the average (1-based)."""
    return max(1.0 - decay, 1.0 / averaged)


def ema_step(ema: Mapping[str, np.ndarray] | None, weights: Mapping[str, np.ndarray], decay: float, averaged: int) -> ArrayDict:
    """The average after folding in ``weights`` as the ``averaged``-th model (``ema`` None at the first)."""
    if ema is None or averaged <= 1:
        return {name: np.array(value, copy=True) for name, value in weights.items()}
    if set(ema) != set(weights):
        raise ValueError(f"EMA and global model hold different arrays: {sorted(set(ema) ^ set(weights))[:3]}")
    newest = ema_weight(decay, averaged)
    out: ArrayDict = {}
    for name, value in weights.items():
        value = np.asarray(value)
        if np.issubdtype(value.dtype, np.floating):
            # accumulate in float64: hundreds of rounds of (1 − a)·x + a·y must not drift in float32
            out[name] = ((1.0 - newest) * ema[name].astype(np.float64) + newest * value.astype(np.float64)).astype(value.dtype)
        else:
            out[name] = np.array(value, copy=True)
    return out


class WeightEma:
    """The coordinator's average of the global models of the rounds ``first_round`` .. ``round``
    that changed it (``averaged`` of them)."""

    def __init__(self, decay: float, weights: ArrayDict | None = None, averaged: int = 0, round: int = 0,
                 first_round: int | None = None) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"coordinator.ema.decay must be in (0, 1), got {decay}")
        self.decay, self.weights, self.averaged, self.round = decay, weights, averaged, round
        #: averages saved before skipped rounds existed held consecutive rounds
        self.first = first_round if first_round is not None or not averaged else round - averaged + 1

    def update(self, global_weights: Mapping[str, np.ndarray], round_id: int) -> None:
        """Fold in round ``round_id``'s global model (called once per round that changed it)."""
        self.averaged += 1
        self.weights = ema_step(self.weights, global_weights, self.decay, self.averaged)
        self.round = round_id
        self.first = round_id if self.first is None else self.first

    @property
    def first_round(self) -> int | None:
        """The first round in the average (None before any)."""
        return self.first

    def meta(self) -> dict[str, Any]:
        return {"decay": self.decay, "averaged_rounds": self.averaged, "round": self.round, "first_round": self.first}

    def save(self, directory: Path, run_meta: Mapping[str, Any]) -> None:
        """Write :data:`EMA_CHECKPOINT` with the run's meta (model spec, round): a global model file
        like ``global.npz``, readable by :func:`fedpose.federation.global_model.load_global_model`."""
        from fedpose.federation.aggregation import save_array_checkpoint

        if self.weights is not None:
            save_array_checkpoint(Path(directory) / EMA_CHECKPOINT, self.weights, {**run_meta, "ema": self.meta()})

    @classmethod
    def resume(cls, directory: Path, decay: float, round_id: int, echo: Callable[[str], Any] = print) -> "WeightEma":
        """The average saved in ``directory`` (a run resumed after round ``round_id``); a fresh one
        when there is none (the EMA was off so far) — it then starts at the next round."""
        from fedpose.federation.aggregation import load_array_checkpoint

        path = Path(directory) / EMA_CHECKPOINT
        if not path.is_file():
            if round_id > 0:
                echo(f"coordinator.ema: no {EMA_CHECKPOINT} in {directory}: the average starts at round {round_id + 1}")
            return cls(decay)
        arrays, meta = load_array_checkpoint(path)
        saved = meta.get("ema") or {}
        # the run's round when the file was written (the average's own last round may be earlier: rounds
        # that changed no model are not in it); files from before the run's state was kept name only the latter
        if int((meta.get("state") or {}).get("round", saved.get("round", -1))) != round_id:
            # written just before a crash that lost global.npz's commit (or an older copy restored)
            echo(f"coordinator.ema: {path} holds the average up to round {saved.get('round')}, the model checkpoint "
                 f"round {round_id}: continuing from it")
        first = saved.get("first_round")
        return cls(decay, arrays, int(saved.get("averaged_rounds", 1)), int(saved.get("round", round_id)),
                   None if first is None else int(first))
