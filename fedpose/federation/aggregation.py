"""Streaming weighted FedAvg and server optimizers (FedAvg, FedAvgM, FedAdam).

Representation: every set of weights or updates is an **ArrayDict** — ``dict[str, np.ndarray]``,
name → float32 array, keyed and ordered like the global model's arrays (Flower's
``ArrayRecord`` converts to/from it with ``to_numpy_ndarrays``/names at the wiring layer).

Sites send updates Δ_k = w_local − w_global. The coordinator forms the weighted mean
Δ = Σ_k n_k Δ_k / Σ_k n_k with :class:`StreamingMean` — a float64 running sum, one update in
memory at a time, so memory does not grow with the number of sites — and hands Δ (the
pseudo-gradient, pointing *uphill* of the loss decrease the sites found) to a server optimizer:

* ``fedavg``  w ← w + η Δ                         (η = 1: plain FedAvg, McMahan et al. 2017)
* ``fedavgm`` v ← β v + Δ;  w ← w + η v            (Hsu et al. 2019)
* ``fedadam`` m ← β₁ m + (1−β₁) Δ;  v ← β₂ v + (1−β₂) Δ²;
              w ← w + η_t m / (√v + τ),  η_t = η √(1−β₂ᵗ) / (1−β₁ᵗ)   (Reddi et al. 2021 with Adam's
              bias correction in the step size, as Flower's FedAdam does; t = server steps taken)

With ``lr_schedule = "cosine"`` η is the round's step size η_t = η (f + (1 − f) ½ (1 + cos π (t−1)/(T−1)))
over the T = ``coordinator.rounds`` server steps (f = ``final_lr_fraction``): a decaying step lowers
the floor at which noisy (DP) updates leave the model wandering.

Server-optimizer state (moments, step count, hyper-parameters) round-trips through
``state_dict()`` / :func:`build_server_optimizer` and :func:`save_array_checkpoint`, for
coordinator checkpoints and resume. Aggregating DP updates is post-processing: it spends nothing.
"""

from __future__ import annotations

import io
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from fedpose.federation.config import AggregationConfig
from fedpose.federation.validation import ModelSpec, ValidationResult, spec_of, validate_update
from fedpose.io import atomic_write

ArrayDict = dict[str, np.ndarray]


class StreamingMean:
    """Weighted mean of ArrayDicts added one at a time; memory independent of how many."""

    def __init__(self, spec: ModelSpec):
        self.spec = dict(spec)
        self._sum = {name: np.zeros(s.shape, dtype=np.float64) for name, s in self.spec.items()}
        largest = max((int(np.prod(s.shape)) for s in self.spec.values()), default=0)
        self._scratch = np.empty(largest, dtype=np.float64)  # reused for w·Δ: no per-add allocation
        self.count = 0
        self.total_weight = 0.0

    def add(self, update: Mapping[str, np.ndarray], weight: float) -> None:
        if not (np.isfinite(weight) and weight > 0):
            raise ValueError(f"aggregation weight must be finite and > 0, got {weight!r}")
        for name, acc in self._sum.items():
            src = update[name]
            if src.shape != acc.shape:
                raise ValueError(f"'{name}': shape {src.shape}, expected {acc.shape}")
            tmp = self._scratch[: acc.size].reshape(acc.shape)
            np.multiply(src, weight, out=tmp, casting="unsafe")
            acc += tmp
        self.count += 1
        self.total_weight += float(weight)

    def mean(self) -> ArrayDict:
        if self.count == 0:
            raise ValueError("no updates were added")
        return {name: (acc / self.total_weight).astype(np.float32) for name, acc in self._sum.items()}


class ServerOptimizer(ABC):
    """Applies the aggregated pseudo-gradient Δ to the global weights; stateful, serializable."""

    name: ClassVar[str]

    def __init__(self, server_lr: float = 1.0):
        self.server_lr = float(server_lr)
        self.steps = 0
        self.lr_schedule = "constant"
        self.final_lr_fraction = 1.0
        self.rounds = 1  # the schedule's length T (set by build_server_optimizer)

    def scheduled_lr(self) -> float:
        """η for the step being taken (``steps`` already counts it)."""
        if self.lr_schedule == "constant" or self.rounds <= 1:
            return self.server_lr
        progress = min(max(self.steps - 1, 0) / (self.rounds - 1), 1.0)
        f = self.final_lr_fraction
        return self.server_lr * (f + (1 - f) * 0.5 * (1 + math.cos(math.pi * progress)))

    @abstractmethod
    def _direction(self, pseudo_gradient: ArrayDict) -> ArrayDict:
        """The step direction for this round (updates the optimizer state)."""

    def step(self, weights: Mapping[str, np.ndarray], pseudo_gradient: Mapping[str, np.ndarray]) -> ArrayDict:
        """New global weights (inputs are not modified)."""
        missing = set(weights) ^ set(pseudo_gradient)
        if missing:
            raise ValueError(f"weights and pseudo-gradient name different arrays: {sorted(missing)[:5]}")
        self.steps += 1
        direction = self._direction({k: np.asarray(v, dtype=np.float32) for k, v in pseudo_gradient.items()})
        return {k: (weights[k] + direction[k]).astype(weights[k].dtype, copy=False) for k in weights}

    def hyper_parameters(self) -> dict[str, Any]:
        return {"server_lr": self.server_lr, **self._schedule_parameters()}

    def _schedule_parameters(self) -> dict[str, Any]:
        # absent for a constant rate, so checkpoints written before schedules existed still resume
        if self.lr_schedule == "constant":
            return {}
        return {"lr_schedule": self.lr_schedule, "final_lr_fraction": self.final_lr_fraction}

    def _arrays(self) -> dict[str, ArrayDict]:
        return {}

    def _load_arrays(self, arrays: dict[str, ArrayDict]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        """``{"name", "hyper", "steps", "arrays": {slot: ArrayDict}}`` — JSON meta + numpy arrays."""
        return {"name": self.name, "hyper": self.hyper_parameters(), "steps": self.steps,
                "arrays": {slot: {k: v.copy() for k, v in arr.items()} for slot, arr in self._arrays().items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["name"] != self.name:
            raise ValueError(f"server-optimizer state is for '{state['name']}', this is '{self.name}'")
        self.steps = int(state["steps"])
        self._load_arrays({slot: {k: np.array(v, dtype=np.float32) for k, v in arr.items()} for slot, arr in state["arrays"].items()})


class FedAvgServer(ServerOptimizer):
    name = "fedavg"

    def _direction(self, pseudo_gradient: ArrayDict) -> ArrayDict:
        lr = self.scheduled_lr()
        return {k: lr * d for k, d in pseudo_gradient.items()}


class FedAvgM(ServerOptimizer):
    name = "fedavgm"

    def __init__(self, server_lr: float = 1.0, momentum: float = 0.9):
        super().__init__(server_lr)
        self.momentum = float(momentum)
        self.velocity: ArrayDict = {}

    def hyper_parameters(self) -> dict[str, Any]:
        return {"server_lr": self.server_lr, "momentum": self.momentum, **self._schedule_parameters()}

    def _direction(self, pseudo_gradient: ArrayDict) -> ArrayDict:
        for k, d in pseudo_gradient.items():
            v = self.velocity.get(k)
            self.velocity[k] = d.copy() if v is None else self.momentum * v + d
        lr = self.scheduled_lr()
        return {k: lr * self.velocity[k] for k in pseudo_gradient}

    def _arrays(self) -> dict[str, ArrayDict]:
        return {"velocity": self.velocity}

    def _load_arrays(self, arrays: dict[str, ArrayDict]) -> None:
        self.velocity = arrays.get("velocity", {})


class FedAdam(ServerOptimizer):
    name = "fedadam"

    def __init__(self, server_lr: float = 1e-2, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3):
        super().__init__(server_lr)
        self.beta1, self.beta2, self.tau = float(beta1), float(beta2), float(tau)
        self.m: ArrayDict = {}
        self.v: ArrayDict = {}

    def hyper_parameters(self) -> dict[str, Any]:
        return {"server_lr": self.server_lr, "beta1": self.beta1, "beta2": self.beta2, "tau": self.tau, **self._schedule_parameters()}

    def _direction(self, pseudo_gradient: ArrayDict) -> ArrayDict:
        t = self.steps
        lr_t = self.scheduled_lr() * np.sqrt(1 - self.beta2**t) / (1 - self.beta1**t)
        out = {}
        for k, d in pseudo_gradient.items():
            m = self.m.get(k, np.zeros_like(d))
            v = self.v.get(k, np.zeros_like(d))
            self.m[k] = self.beta1 * m + (1 - self.beta1) * d
            self.v[k] = self.beta2 * v + (1 - self.beta2) * d * d
            out[k] = (lr_t * self.m[k] / (np.sqrt(self.v[k]) + self.tau)).astype(np.float32)
        return out

    def _arrays(self) -> dict[str, ArrayDict]:
        return {"m": self.m, "v": self.v}

    def _load_arrays(self, arrays: dict[str, ArrayDict]) -> None:
        self.m, self.v = arrays.get("m", {}), arrays.get("v", {})


#: registry: config name → optimizer class
SERVER_OPTIMIZERS: dict[str, type[ServerOptimizer]] = {cls.name: cls for cls in (FedAvgServer, FedAvgM, FedAdam)}


def build_server_optimizer(cfg: AggregationConfig, state: Mapping[str, Any] | None = None, rounds: int = 1) -> ServerOptimizer:
    """The server optimizer named by ``cfg.strategy`` (restored from ``state`` when given); a
    ``cfg.lr_schedule`` runs over ``rounds`` server steps."""
    cls = SERVER_OPTIMIZERS[cfg.strategy]
    lr = {} if cfg.server_lr is None else {"server_lr": cfg.server_lr}  # None: the class default
    if cls is FedAdam:
        optimizer: ServerOptimizer = FedAdam(beta1=cfg.beta1, beta2=cfg.beta2, tau=cfg.tau, **lr)
    elif cls is FedAvgM:
        optimizer = FedAvgM(momentum=cfg.momentum, **lr)
    else:
        optimizer = FedAvgServer(**lr)
    optimizer.lr_schedule, optimizer.final_lr_fraction, optimizer.rounds = cfg.lr_schedule, cfg.final_lr_fraction, int(rounds)
    if state is not None:
        if state.get("hyper") and dict(state["hyper"]) != optimizer.hyper_parameters():
            raise ValueError(
                f"checkpointed server optimizer used {dict(state['hyper'])}, config asks {optimizer.hyper_parameters()}"
            )
        optimizer.load_state_dict(state)
    return optimizer


# -- one round ------------------------------------------------------------------------------------
@dataclass
class RoundAggregate:
    weights: ArrayDict | None  #: new global weights (None: nothing accepted, keep the old ones)
    accepted: list[ValidationResult] = field(default_factory=list)
    rejected: list[ValidationResult] = field(default_factory=list)
    total_weight: float = 0.0


def aggregate_round(
    global_weights: Mapping[str, np.ndarray],
    updates: Iterable[tuple[str, Mapping[str, np.ndarray], float]],
    optimizer: ServerOptimizer,
    max_norm: float | None = None,
) -> RoundAggregate:
    """Validate and fold ``(site_id, Δ_k, weight_k)`` one at a time, then take one server step.

    ``updates`` may be a generator that decodes each reply lazily, so only one update is in
    memory at a time. Rejected updates are returned (site, reason) for the caller to log/record.
    """
    spec = spec_of(global_weights)
    mean = StreamingMean(spec)
    result = RoundAggregate(None)
    for site_id, update, weight in updates:
        check = validate_update(site_id, update, spec, max_norm=max_norm, weight=weight)
        if check.ok:
            mean.add(update, weight)
            result.accepted.append(check)
        else:
            result.rejected.append(check)
    if mean.count:
        result.weights = optimizer.step(global_weights, mean.mean())
        result.total_weight = mean.total_weight
    return result


# -- checkpoints ----------------------------------------------------------------------------------
_META_KEY = "__meta_json__"


def save_array_checkpoint(path: str | Path, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None) -> None:
    """Atomically write named arrays + JSON meta to an ``.npz`` (no pickle)."""
    if _META_KEY in arrays:
        raise ValueError(f"array name {_META_KEY!r} is reserved")
    payload = dict(arrays)
    payload[_META_KEY] = np.frombuffer(json.dumps(dict(meta or {})).encode(), dtype=np.uint8)

    def write(fh: Any) -> None:
        buf = io.BytesIO()
        np.savez(buf, **payload)
        fh.write(buf.getbuffer())

    atomic_write(path, write)


def load_array_checkpoint(path: str | Path) -> tuple[ArrayDict, dict[str, Any]]:
    with np.load(Path(path), allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files if k != _META_KEY}
        meta = json.loads(bytes(data[_META_KEY]).decode()) if _META_KEY in data.files else {}
    return arrays, meta


def load_checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """Only the JSON meta of an array checkpoint (the arrays are not read)."""
    with np.load(Path(path), allow_pickle=False) as data:
        return json.loads(bytes(data[_META_KEY]).decode()) if _META_KEY in data.files else {}


def save_server_optimizer(path: str | Path, optimizer: ServerOptimizer, round_id: int | None = None) -> None:
    """``round_id``: the coordinator round whose global model this state goes with (in the meta)."""
    state = optimizer.state_dict()
    arrays = {f"{slot}/{name}": arr for slot, slot_arrays in state["arrays"].items() for name, arr in slot_arrays.items()}
    meta = {"name": state["name"], "hyper": state["hyper"], "steps": state["steps"], "slots": sorted(state["arrays"])}
    save_array_checkpoint(path, arrays, meta if round_id is None else {**meta, "round": int(round_id)})


def load_server_optimizer(path: str | Path, cfg: AggregationConfig, rounds: int = 1) -> ServerOptimizer:
    arrays, meta = load_array_checkpoint(path)
    slots: dict[str, ArrayDict] = {slot: {} for slot in meta.get("slots", [])}
    for key, arr in arrays.items():
        slot, name = key.split("/", 1)
        slots.setdefault(slot, {})[name] = arr
    return build_server_optimizer(cfg, {"name": meta["name"], "hyper": meta["hyper"], "steps": meta["steps"], "arrays": slots}, rounds)
