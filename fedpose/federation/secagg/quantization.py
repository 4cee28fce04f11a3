"""Fixed-point encoding of a site's update for the secure sum: clip, stochastic rounding, modulus.

A site's vector x (w·Δ flattened in the global model's parameter order) is clipped per coordinate
to [−R, R] and mapped onto the 2^b levels  −R + k·s,  k = 0 … L,  L = 2^b − 1,  step s = 2R / L.
Stochastic rounding picks the level above with probability equal to the fractional part, so
E[level] = clip(x) exactly (unbiased), and each coordinate errs by less than one step s.

The coordinator adds n such integer vectors modulo M = 2^m. Each lies in [0, L], so the true
integer sum lies in [0, n·L]; with n ≤ n_max and n_max·L < M (``SecureAggregationConfig`` refuses
anything else) the sum modulo M *is* the integer sum: no wrap-around, by construction. Dequantized,

    Σ x̂_i = s · Σ k_i − n·R,    |Σ x̂_i − Σ clip(x_i)| < n · s = n · 2R / (2^b − 1)   per coordinate.

(Nearest rounding would halve the bound, n · R / (2^b − 1), but is biased; the unbiased stochastic
rounding is what keeps the expected aggregate equal to FedAvg's.) Rounding coins come from the
project's CSPRNG (:class:`fedpose.privacy.csprng.AesCtrBytes`): a seeded generator would let whoever
knows the seed undo the rounding and learn the fractional parts of x.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedpose.privacy.csprng import AesCtrBytes

#: integer dtype the sums are computed in (M ≤ 2^62 fits; uint64 wrap-around is ≡ mod M)
WIRE_DTYPE = np.uint64


def wire_dtype(modulus_bits: int) -> type[np.unsignedinteger]:
    """The masked vector's dtype on the wire: the narrowest that holds every residue mod 2^m
    (uint32 for the default m = 32: no more bytes than a float32 Δ)."""
    return np.uint32 if modulus_bits <= 32 else np.uint64


@dataclass(frozen=True)
class Quantizer:
    """The public encoding settings of one secure sum."""

    clip_range: float  #: R, per coordinate
    bits: int  #: b: levels 0 … 2^b − 1
    modulus_bits: int  #: m: sums are modulo M = 2^m
    max_sites: int  #: n_max: the overflow proof's n

    def __post_init__(self) -> None:
        if not (self.clip_range > 0 and np.isfinite(self.clip_range)):
            raise ValueError(f"quantizer: clip range must be finite and > 0, got {self.clip_range!r}")
        if not 2 <= self.bits <= 30 or not 8 <= self.modulus_bits <= 62:
            raise ValueError(f"quantizer: bits {self.bits} must be in [2, 30] and modulus_bits {self.modulus_bits} in [8, 62]")
        if self.max_sites * self.levels >= self.modulus:
            raise ValueError(f"quantizer: {self.max_sites} sites · {self.levels} levels ≥ M = 2^{self.modulus_bits}: "
                             "the sum could wrap around")

    @property
    def levels(self) -> int:
        """L = 2^b − 1: the largest quantized value."""
        return 2**self.bits - 1

    @property
    def modulus(self) -> int:
        return 2**self.modulus_bits

    @property
    def step(self) -> float:
        """s = 2R / L: the gap between two levels."""
        return 2.0 * self.clip_range / self.levels

    def error_bound(self, sites: int) -> float:
        """Strict bound on |dequantize(Σ k_i) − Σ clip(x_i)| per coordinate for ``sites`` summands."""
        return sites * self.step

    def quantize(self, values: np.ndarray, coins: AesCtrBytes | None = None) -> np.ndarray:
        """clip(values) → levels in [0, L] (uint64), rounded stochastically with CSPRNG coins."""
        flat = np.asarray(values, dtype=np.float64).reshape(-1)
        if not np.isfinite(flat).all():
            raise ValueError("quantizer: the vector holds NaN or Inf (a site validates its update before quantizing)")
        scaled = (np.clip(flat, -self.clip_range, self.clip_range) + self.clip_range) / self.step
        np.clip(scaled, 0.0, float(self.levels), out=scaled)  # float round-off at ±R stays on the grid
        low = np.floor(scaled)
        up = _uniform(coins or AesCtrBytes(), flat.size) < (scaled - low)
        return (low.astype(WIRE_DTYPE) + up.astype(WIRE_DTYPE))

    def dequantize_sum(self, total: np.ndarray, sites: int) -> np.ndarray:
        """Σ x̂_i (float64) from the integer sum of ``sites`` quantized vectors (already reduced mod M)."""
        if not 1 <= sites <= self.max_sites:
            raise ValueError(f"quantizer: a sum of {sites} vectors is outside [1, {self.max_sites}] (the overflow proof's n_max)")
        total = np.asarray(total, dtype=WIRE_DTYPE)
        if total.size and int(total.max()) > sites * self.levels:
            raise ValueError(f"quantizer: a summed coordinate exceeds {sites} · {self.levels}: the vectors were not quantized "
                             "with these settings, or the masks did not cancel")
        return total.astype(np.float64) * self.step - sites * self.clip_range


def _uniform(coins: AesCtrBytes, count: int) -> np.ndarray:
    """``count`` uniform floats in [0, 1) with 53 random bits each, from the CSPRNG."""
    words = coins.uint8(8 * count).view(np.uint64) >> np.uint64(11)
    return words.astype(np.float64) * (1.0 / 2**53)
