"""Randomness that privacy guarantees rest on: Gaussian noise and uniform coins.

* :class:`SecureNoise` — the default. An AES-256-CTR keystream (:class:`~fedpose.privacy.csprng.AesCtrBytes`)
  keyed with 32 bytes of ``os.urandom``, fresh in every instance and process; nothing in a config
  determines it and the key is never stored, so a resumed run draws fresh noise.
* :class:`InsecureSeededNoise` — a ``torch.Generator`` seeded from a config value: reproducible,
  for tests only, and NOT PRIVATE: whoever knows the seed regenerates and subtracts the noise.
  Selected only by ``privacy.insecure_seeded_noise`` (``make_noise(seed)``); every report of such
  a run says so, and a site refuses to federate with it.

Gaussians of :class:`SecureNoise` (Box–Muller, vectorised in torch, in chunks that stay in cache):
each pair of outputs takes 12 keystream bytes — 53 bits for the radius uniform u ∈ (0, 1]
(u = (m + 1)·2⁻⁵³, m the low 53 bits of a word) and 32 bits for the angle. r = √(−2 ln u) is
computed in float32 from float32(u): the conversion keeps u's *relative* precision all the way
down to 2⁻⁵³ (float32 reaches 1e-38), so the tail is that of a 53-bit uniform, not of float32's
24 bits: each pair has radius ≤ √(106 ln 2) ≈ 8.57σ (:data:`SECURE_TAIL_BOUND_SIGMAS`), i.e.
|z| ≤ 8.57σ; P(|Z| > 8.57) ≈ 1e-17. (A 24-bit uniform — most float32 samplers — cuts at 5.77σ, a
32-bit one at 6.66σ.) Rounding u to float32 near u = 1 only moves r by the float32 output's own
precision.

What the cut costs, not included in the reported δ: an output that only the neighbouring
dataset can produce needs some pair within one sensitivity of the cut, so a release of T steps
adds at most ≈ T·exp(−(8.57 − 1/σ)²/2) to δ (σ the noise multiplier; the worst case puts the
whole sensitivity into one pair): 4e-9 for σ = 1 and T = 10⁴, 8e-8 for σ = 0.7, but 4e-6 for
σ = 0.5 — comparable to δ = 1e-5 there.

Cost, p = 4.74 M at 256×192 (2 threads, shared 2-core Xeon): 25.8 ms median, 1.5 % of a 1.70 s
DP-SGD step, the same as the seeded torch generator (26.3 ms); AES is ≈ 7 ms of it
(``benchmarks/step_cost/run.py --noise-only`` → ``noise_cost.json``).

Known limitation shared with Opacus and most DP-SGD libraries: floating-point Gaussian samples are
not exactly Gaussian (Mironov 2012-style attacks on the low-order bits); no discrete or snapping
mechanism is implemented.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from fedpose.privacy.csprng import AesCtrBytes

#: Box–Muller pairs per chunk: the keystream (12 bytes a pair) and the temporaries stay in L2.
_PAIRS_PER_CHUNK = 1 << 16
_MASK_53 = (1 << 53) - 1
_ANGLE_PER_INT32 = 2.0 * math.pi / 2.0**32  # int32 k ↦ angle k·2π/2³² ∈ [−π, π)
#: the largest |z|/σ SecureNoise can produce: √(−2 ln 2⁻⁵³)
SECURE_TAIL_BOUND_SIGMAS = math.sqrt(2 * 53 * math.log(2))


class SecureNoise:
    """Noise and uniforms from an AES-256-CTR keystream keyed from OS entropy (see the module docstring)."""

    secure = True
    description = "AES-256-CTR keystream keyed from os.urandom, fresh per process (CSPRNG)"

    def __init__(self) -> None:
        self._keystream = AesCtrBytes()

    def reseed(self, *keys: int) -> None:
        """Nothing to reseed: the keystream never repeats, whatever the step or round."""

    def normal(self, size: int, std: float, dtype: torch.dtype = torch.float32) -> Tensor:
        """``size`` independent N(0, std²) samples (float32, or float64 for numpy users)."""
        pairs = (size + 1) // 2
        out = torch.empty(2 * pairs, dtype=dtype)
        chunk = max(1, min(pairs, _PAIRS_PER_CHUNK))
        raw = self._keystream.buffer(12 * chunk)
        raw_tensor = torch.from_numpy(raw)
        words = torch.empty(chunk, dtype=torch.int64)
        radius = torch.empty(chunk, dtype=dtype)
        angle = torch.empty(chunk, dtype=dtype)
        variance = float(std) ** 2
        for start in range(0, pairs, chunk):
            stop = min(pairs, start + chunk)
            n = stop - start
            self._keystream.fill(raw, 12 * n)
            r, a, m = radius[:n], angle[:n], words[:n]
            torch.bitwise_and(raw_tensor[: 8 * n].view(torch.int64), _MASK_53, out=m).add_(1)
            r.copy_(m).mul_(2.0**-53)  # u ∈ (0, 1], exact power-of-two scaling
            r.log_().mul_(-2.0 * variance).sqrt_()  # std · √(−2 ln u)
            torch.mul(raw_tensor[8 * n: 12 * n].view(torch.int32), _ANGLE_PER_INT32, out=a)
            torch.cos(a, out=out[start:stop]).mul_(r)
            torch.sin(a, out=out[pairs + start: pairs + stop]).mul_(r)
        return out[:size]

    def uniform(self, size: int) -> Tensor:
        """``size`` float64 uniforms in [0, 1) with 53 random bits each."""
        words = torch.from_numpy(self._keystream.uint8(8 * size).view(np.int64))
        return torch.bitwise_and(words, _MASK_53).to(torch.float64).mul_(2.0**-53)


class InsecureSeededNoise:
    """Reproducible noise and uniforms from a seeded ``torch.Generator`` — tests only, NOT PRIVATE.

    ``reseed(*keys)`` derives the stream from (seed, keys) — the engine passes (purpose, step) —
    so a resumed run never replays the noise of earlier steps within one seed.
    """

    secure = False

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self.description = f"seeded torch.Generator (seed {self.seed}): NOT PRIVATE, tests only"
        self.generator = torch.Generator().manual_seed(self.seed)

    def reseed(self, *keys: int) -> None:
        state = np.random.SeedSequence([self.seed & 0xFFFFFFFFFFFFFFFF, *map(int, keys)]).generate_state(2, np.uint32)
        self.generator.manual_seed(int(state[0]) << 32 | int(state[1]))

    def normal(self, size: int, std: float, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.normal(0.0, float(std), (size,), generator=self.generator, dtype=dtype)

    def uniform(self, size: int) -> Tensor:
        return torch.rand(size, generator=self.generator, dtype=torch.float64)


NoiseSource = SecureNoise | InsecureSeededNoise


def make_noise(insecure_seed: int | None) -> NoiseSource:
    """The secure source; a seeded, NOT PRIVATE one only when a test passes ``insecure_seed``."""
    return SecureNoise() if insecure_seed is None else InsecureSeededNoise(insecure_seed)
