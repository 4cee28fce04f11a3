"""Gaussian noise sources for DP-SGD and the sampling coin flips.

* :class:`SeededNoise` — ``torch.Generator`` (Philox/MT), seeded: reproducible runs and tests.
  Not cryptographically secure: someone who learns the seed can subtract the noise.
* :class:`SecureNoise` (``privacy.secure_rng = true``) — every random bit comes from the OS
  CSPRNG (``os.urandom``, i.e. getrandom(2)): 53-bit uniforms → Box–Muller in float64, cast to
  float32 at the end. No state to leak or to predict, at the cost of 8 bytes of kernel
  randomness per noise coordinate (p = 2.88 M → 23 MB per step; its cost is measured in
  ``benchmarks/step_cost``). Poisson sampling draws its uniforms from the same source.

Known limitation shared with Opacus and most DP-SGD libraries: floating-point Gaussian samples
are not exactly Gaussian (Mironov 2012-style attacks on the low-order bits); no discrete or
snapping mechanism is implemented.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from torch import Tensor


class SeededNoise:
    """Reproducible noise and uniforms from a seeded ``torch.Generator``.

    ``reseed(*keys)`` derives the stream from (seed, keys) — the engine passes (purpose, step) —
    so a resumed run never replays the noise of earlier steps: two releases sharing one noise
    vector would let their difference cancel it.
    """

    secure = False

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self.generator = torch.Generator().manual_seed(self.seed)

    def reseed(self, *keys: int) -> None:
        state = np.random.SeedSequence([self.seed & 0xFFFFFFFFFFFFFFFF, *map(int, keys)]).generate_state(2, np.uint32)
        self.generator.manual_seed(int(state[0]) << 32 | int(state[1]))

    def normal(self, size: int, std: float) -> Tensor:
        return torch.normal(0.0, float(std), (size,), generator=self.generator)

    def uniform(self, size: int) -> Tensor:
        return torch.rand(size, generator=self.generator, dtype=torch.float64)


def _urandom_uniform53(count: int) -> np.ndarray:
    """``count`` uniforms in [0, 1) with 53 random bits each, from os.urandom."""
    words = np.frombuffer(os.urandom(8 * count), dtype=np.uint64)
    return (words >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class SecureNoise:
    """Noise and uniforms from the OS CSPRNG (os.urandom) via Box–Muller."""

    secure = True

    def reseed(self, *keys: int) -> None:
        """No state: every draw is fresh kernel randomness."""

    def normal(self, size: int, std: float) -> Tensor:
        pairs = (size + 1) // 2
        u = _urandom_uniform53(2 * pairs)
        u1 = 1.0 - u[:pairs]  # (0, 1]: log is finite
        radius = np.sqrt(-2.0 * np.log(u1))
        angle = (2.0 * math.pi) * u[pairs:]
        z = np.empty(2 * pairs, dtype=np.float64)
        z[:pairs] = radius * np.cos(angle)
        z[pairs:] = radius * np.sin(angle)
        return torch.from_numpy((z[:size] * float(std)).astype(np.float32))

    def uniform(self, size: int) -> Tensor:
        return torch.from_numpy(_urandom_uniform53(size))


def make_noise(secure: bool, seed: int) -> SeededNoise | SecureNoise:
    return SecureNoise() if secure else SeededNoise(seed)
