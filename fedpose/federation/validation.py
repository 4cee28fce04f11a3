"""Reject malformed or out-of-bound site updates before they reach the aggregate.

An update Δ_k is a ``dict[str, np.ndarray]`` with exactly the global model's array names, shapes
and dtypes. Checks, in order: missing/unexpected arrays, shape, dtype, NaN/Inf, L2 norm above the
configured bound. The result names the site and the reason; logging it is the caller's job.

Note: the norm bound is a robustness filter on the *released* update, not a privacy mechanism —
the site's DP guarantee already holds for whatever it sends.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

RejectReason = Literal["missing_arrays", "unexpected_arrays", "shape", "dtype", "non_finite", "norm", "weight"]
REJECT_REASONS: tuple[str, ...] = ("missing_arrays", "unexpected_arrays", "shape", "dtype", "non_finite", "norm", "weight")


@dataclass(frozen=True)
class ArraySpec:
    shape: tuple[int, ...]
    dtype: str  #: numpy dtype name, e.g. "float32"


ModelSpec = Mapping[str, ArraySpec]


def spec_of(arrays: Mapping[str, np.ndarray]) -> dict[str, ArraySpec]:
    """The array spec (names, shapes, dtypes) of the global model's arrays."""
    return {name: ArraySpec(tuple(int(d) for d in a.shape), np.dtype(a.dtype).name) for name, a in arrays.items()}


def update_norm(update: Mapping[str, np.ndarray]) -> float:
    """Global L2 norm over all arrays, accumulated in float64 (no full-size float64 copy)."""
    total = 0.0
    for a in update.values():
        flat = np.asarray(a).reshape(-1)
        total += float(np.einsum("i,i->", flat, flat, dtype=np.float64))  # casts in buffered chunks
    return math.sqrt(total)


@dataclass(frozen=True)
class ValidationResult:
    site_id: str
    ok: bool
    reason: RejectReason | None = None
    detail: str = ""
    norm: float | None = None  #: L2 norm of the update (when it got that far)

    def __str__(self) -> str:
        if self.ok:
            return f"site '{self.site_id}': update accepted (‖Δ‖₂ = {self.norm:.4g})"
        return f"site '{self.site_id}': update rejected ({self.reason}): {self.detail}"


def validate_update(
    site_id: str,
    update: Mapping[str, np.ndarray],
    spec: ModelSpec,
    max_norm: float | None = None,
    weight: float | None = None,
) -> ValidationResult:
    """Check one site's update against the global model spec; never raises on bad content.

    ``weight`` (the site's aggregation weight, e.g. its number of examples) is checked too when
    given: it must be finite and > 0.
    """

    def reject(reason: RejectReason, detail: str, norm: float | None = None) -> ValidationResult:
        return ValidationResult(site_id, False, reason, detail, norm)

    if weight is not None and not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
        return reject("weight", f"aggregation weight must be finite and > 0, got {weight!r}")
    missing = [n for n in spec if n not in update]
    if missing:
        return reject("missing_arrays", f"{len(missing)} arrays missing, e.g. {missing[:3]}")
    unexpected = [n for n in update if n not in spec]
    if unexpected:
        return reject("unexpected_arrays", f"{len(unexpected)} unknown arrays, e.g. {unexpected[:3]}")
    for name, want in spec.items():
        got = update[name]
        if not isinstance(got, np.ndarray):
            return reject("dtype", f"'{name}' is a {type(got).__name__}, expected a numpy array")
        if tuple(got.shape) != want.shape:
            return reject("shape", f"'{name}' has shape {tuple(got.shape)}, expected {want.shape}")
        if got.dtype.name != want.dtype:
            return reject("dtype", f"'{name}' has dtype {got.dtype.name}, expected {want.dtype}")
        if not np.isfinite(got).all():
            return reject("non_finite", f"'{name}' contains NaN or Inf")
    norm = update_norm(update)
    if max_norm is not None and norm > max_norm:
        return reject("norm", f"‖Δ‖₂ = {norm:.4g} exceeds the bound {max_norm:.4g}", norm)
    return ValidationResult(site_id, True, None, "", norm)
