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

What the cut costs is part of every reported δ (:mod:`fedpose.privacy.accountants.sampler_cut`):
outputs that only one neighbour can produce (a pair within one sensitivity of the cut) and the
1/(1 − 2⁻⁵³)^pairs scaling of the densities. Per DP-SGD step that is ≈ 1.3e-11 at σ = 1 and
4.4e-10 at σ = 0.5 (≤ :data:`MAX_NOISE_COORDINATES` coordinates, the bound's assumption: larger
draws are refused); the ledger asks the accountant for ε at the δ that is left.

Cost, p = 4.74 M at 256×192 (2 threads, shared 2-core Xeon): 25.8 ms median, 1.5 % of a 1.70 s
DP-SGD step, the same as the seeded torch generator (26.3 ms); AES is ≈ 7 ms of it
(``benchmarks/step_cost/run.py --noise-only`` → ``noise_cost.json``).

On a GPU (``normal(..., device=cuda)``) the same Box–Muller transform, from the same 12 keystream
bytes per pair, runs on the device over a ChaCha20 keystream computed there
(:mod:`fedpose.privacy.chacha20`, which says why not AES plus a copy, nor torch's CUDA generator),
with a fresh 256-bit key from ``os.urandom`` per draw: noise is generated where the gradient
lives, never transferred, and no key is stored. Uniforms (Poisson coins) stay on the CPU, where
the batch is assembled. The seeded test source draws on the CPU and copies to the device, so a
seeded CPU and CUDA step add identical noise.

Known limitation shared with Opacus and most DP-SGD libraries: floating-point Gaussian samples are
not exactly Gaussian (Mironov 2012-style attacks on the low-order bits); no discrete or snapping
mechanism is implemented.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from fedpose.privacy.accountants.sampler_cut import MAX_NOISE_COORDINATES, SECURE_TAIL_BOUND_SIGMAS
from fedpose.privacy.chacha20 import BLOCK_WORDS, fresh_key, keystream_words
from fedpose.privacy.csprng import AesCtrBytes

#: Box–Muller pairs per chunk: the keystream (12 bytes a pair) and the temporaries stay in L2.
_PAIRS_PER_CHUNK = 1 << 16
#: pairs per chunk on a GPU: p = 4.7 M in one chunk (~0.4 GB of int64 keystream state and temporaries)
_DEVICE_PAIRS_PER_CHUNK = 1 << 22
_LOW_21 = (1 << 21) - 1
_MASK_53 = (1 << 53) - 1
_ANGLE_PER_INT32 = 2.0 * math.pi / 2.0**32  # int32 k ↦ angle k·2π/2³² ∈ [−π, π)
def _gaussian_pairs(
    low53: Tensor, angle_words: Tensor, variance: float, radius: Tensor, angle: Tensor, cos_out: Tensor, sin_out: Tensor
) -> None:
    """Box–Muller (module docstring): N(0, variance) pairs into ``cos_out`` / ``sin_out`` from 53-bit
    integers m (radius uniform u = (m + 1)·2⁻⁵³; ``low53`` is incremented in place) and signed 32-bit
    angle words; ``radius`` and ``angle`` are scratch of the output dtype."""
    radius.copy_(low53.add_(1)).mul_(2.0**-53)  # u ∈ (0, 1], exact power-of-two scaling
    radius.log_().mul_(-2.0 * variance).sqrt_()  # std · √(−2 ln u)
    torch.mul(angle_words, _ANGLE_PER_INT32, out=angle)
    torch.cos(angle, out=cos_out).mul_(radius)
    torch.sin(angle, out=sin_out).mul_(radius)


def chacha20_normal(
    size: int, std: float, device: torch.device | str, dtype: torch.dtype = torch.float32, key: bytes | None = None
) -> Tensor:
    """``size`` N(0, std²) samples computed on ``device`` from a ChaCha20 keystream (module docstring).

    The keystream's bytes are used exactly as :meth:`SecureNoise.normal` uses AES's: per chunk of n
    pairs, bytes [0, 8n) as n little-endian 64-bit words (low 53 bits: the radius uniform) and
    [8n, 12n) as n signed 32-bit angle words. ``key``: tests only (compare with a reference
    keystream); None draws a fresh key from ``os.urandom``, which is what every private draw does.
    """
    key = fresh_key() if key is None else key
    pairs = (size + 1) // 2
    out = torch.empty(2 * pairs, dtype=dtype, device=device)
    variance = float(std) ** 2
    first_block = 0
    for start in range(0, pairs, _DEVICE_PAIRS_PER_CHUNK):
        stop = min(pairs, start + _DEVICE_PAIRS_PER_CHUNK)
        n = stop - start
        blocks = -(-3 * n // BLOCK_WORDS)
        words = keystream_words(key, blocks, device, first_block)
        first_block += blocks
        low53 = words[: 2 * n: 2] | ((words[1: 2 * n: 2] & _LOW_21) << 32)  # 8 little-endian bytes, masked to 53 bits
        unsigned = words[2 * n: 3 * n]
        angle_words = unsigned - ((unsigned >> 31) << 32)  # as a signed 32-bit value
        radius, angle = torch.empty(n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device)
        _gaussian_pairs(low53, angle_words, variance, radius, angle, out[start:stop], out[pairs + start: pairs + stop])
    return out[:size]


def check_release_size(size: int) -> None:
    """Refuse a Gaussian release of more coordinates than the sampler's-cut accounting assumes."""
    if size > MAX_NOISE_COORDINATES:
        raise ValueError(f"a Gaussian release of {size:,} coordinates: the accounting of the sampler's cut assumes at "
                         f"most {MAX_NOISE_COORDINATES:,} (fedpose.privacy.accountants.sampler_cut); train fewer parameters")


class SecureNoise:
    """Noise and uniforms from a CSPRNG keyed from OS entropy: AES-256-CTR on the CPU, ChaCha20 on a
    GPU (see the module docstring)."""

    secure = True
    description = ("AES-256-CTR keystream keyed from os.urandom, fresh per process (CSPRNG); noise on a GPU: "
                   "ChaCha20 keystream computed on the device, keyed from os.urandom per draw")

    def __init__(self) -> None:
        self._keystream = AesCtrBytes()

    def reseed(self, *keys: int) -> None:
        """Nothing to reseed: the keystream never repeats, whatever the step or round."""

    def normal(self, size: int, std: float, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> Tensor:
        """``size`` independent N(0, std²) samples (float32, or float64 for numpy users), on ``device``
        (None: the CPU). Off the CPU they are generated on that device (:func:`chacha20_normal`)."""
        check_release_size(size)
        if device is not None and torch.device(device).type != "cpu":
            return chacha20_normal(size, std, device, dtype)
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
            m = torch.bitwise_and(raw_tensor[: 8 * n].view(torch.int64), _MASK_53, out=words[:n])
            _gaussian_pairs(m, raw_tensor[8 * n: 12 * n].view(torch.int32), variance, radius[:n], angle[:n],
                            out[start:stop], out[pairs + start: pairs + stop])
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

    def normal(self, size: int, std: float, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> Tensor:
        """Drawn on the CPU and copied to ``device``: the same seed gives the same noise on every device."""
        noise = torch.normal(0.0, float(std), (size,), generator=self.generator, dtype=dtype)
        return noise if device is None else noise.to(device)

    def uniform(self, size: int) -> Tensor:
        return torch.rand(size, generator=self.generator, dtype=torch.float64)


NoiseSource = SecureNoise | InsecureSeededNoise


def make_noise(insecure_seed: int | None) -> NoiseSource:
    """The secure source; a seeded, NOT PRIVATE one only when a test passes ``insecure_seed``."""
    return SecureNoise() if insecure_seed is None else InsecureSeededNoise(insecure_seed)
