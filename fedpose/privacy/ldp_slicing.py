"""LDP-Slicing: pixel-wise ε-local differential privacy by bit-plane randomized response.

Pipeline for one RGB image (paper 004, LDP-Slicing, CVPR 2026)::

    RGB ─► YCbCr (full range, JPEG/BT.601) ─► [perceptual mask: 1-level Haar DWT per channel,
    LL band zeroed, inverse DWT, clamp to [0, 255], round] ─► 8 bit planes per channel
    ─► binary randomized response per bit with budget ε_{c,b} ─► reassemble ─► RGB

Guarantee (exact, see :meth:`LdpSlicer.guarantee`):

* Every bit of the *masked* pixel goes through an independent binary randomized response that
  keeps the bit with probability e^ε'/(e^ε'+1), with ε' ≤ ε_{c,b} (the flip probability is
  rounded *up* to a multiple of 2⁻³², so the realised per-plane budget never exceeds the
  allocated one). By sequential composition the 3 channel values of one masked pixel are
  pure ε_total-LDP, ε_total = Σ ε_{c,b}; reassembly and the YCbCr→RGB conversion are
  post-processing.
* The RGB→YCbCr conversion of the input is deterministic, per-pixel pre-processing: it does not
  widen the unit protected (one pixel's colour).
* With LL pruning on, a masked pixel is ``x − mean(its 2×2 Haar block)``, so one original pixel
  influences all 4 masked pixels of its block. W.r.t. the *original* image the guarantee is
  therefore 4·ε_total-LDP for one 2×2 block (and hence for one original pixel). Without
  pruning it is ε_total per original pixel.
* Nothing here says anything about a whole image: composing over all pixels is loose (the paper
  says so too).

Randomness comes from a cryptographically secure generator by default (AES-256-CTR keyed from
``os.urandom``); a seeded PCG64 is available for tests and is labelled as not secure.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

CHANNELS: tuple[str, str, str] = ("Y", "Cb", "Cr")
BITS_PER_CHANNEL = 8
DEFAULT_CHANNEL_WEIGHTS: Mapping[str, float] = {"Y": 4.0, "Cb": 1.0, "Cr": 1.0}
#: w_b = 2^(b-1), b = 1 is the least significant bit (index 0 in every array here).
DEFAULT_BIT_WEIGHTS: tuple[float, ...] = tuple(float(2 ** b) for b in range(BITS_PER_CHANNEL))

#: Flip probabilities are fixed-point numbers with this many bytes (2⁻³² resolution).
THRESHOLD_BYTES = 4
_THRESHOLD_SCALE = 256 ** THRESHOLD_BYTES

# Full-range YCbCr (JPEG / ITU-T T.871, BT.601 primaries).
_RGB_TO_YCBCR = np.array(
    [
        [0.299, 0.587, 0.114],
        [-0.168735892, -0.331264108, 0.5],
        [0.5, -0.418687589, -0.081312411],
    ],
    dtype=np.float64,
)
_YCBCR_OFFSET = np.array([0.0, 128.0, 128.0])
_YCBCR_TO_RGB = np.linalg.inv(_RGB_TO_YCBCR)


class LdpSlicingError(ValueError):
    """Invalid LDP-Slicing parameters or input."""


# ----------------------------------------------------------------------------- budget allocation


def _validate_epsilon(epsilon_total: float) -> float:
    epsilon_total = float(epsilon_total)
    if not math.isfinite(epsilon_total) or epsilon_total <= 0:
        raise LdpSlicingError(f"epsilon_total must be a finite number > 0, got {epsilon_total}")
    return epsilon_total


def sqrt_allocation(
    epsilon_total: float,
    channel_weights: Mapping[str, float] = DEFAULT_CHANNEL_WEIGHTS,
    bit_weights: Sequence[float] = DEFAULT_BIT_WEIGHTS,
) -> np.ndarray:
    """Closed-form optimum of min Σ W/ε s.t. Σ ε = ε_total: ε_{c,b} ∝ √(w_c·w_b). Shape (3, 8), LSB first."""
    epsilon_total = _validate_epsilon(epsilon_total)
    missing = set(CHANNELS) - set(channel_weights)
    if missing:
        raise LdpSlicingError(f"channel_weights lacks {sorted(missing)}")
    w_c = np.array([float(channel_weights[c]) for c in CHANNELS])
    w_b = np.asarray(bit_weights, dtype=np.float64)
    if w_b.shape != (BITS_PER_CHANNEL,):
        raise LdpSlicingError(f"bit_weights must have {BITS_PER_CHANNEL} entries, got {w_b.shape}")
    if (w_c < 0).any() or (w_b < 0).any() or not (np.isfinite(w_c).all() and np.isfinite(w_b).all()):
        raise LdpSlicingError("weights must be finite and >= 0")
    root = np.sqrt(np.outer(w_c, w_b))
    if root.sum() <= 0:
        raise LdpSlicingError("at least one weight must be positive")
    return epsilon_total * root / root.sum()


def uniform_allocation(epsilon_total: float, **_: object) -> np.ndarray:
    """Ablation: ε_total / 24 for every bit plane."""
    epsilon_total = _validate_epsilon(epsilon_total)
    return np.full((len(CHANNELS), BITS_PER_CHANNEL), epsilon_total / (len(CHANNELS) * BITS_PER_CHANNEL))


ALLOCATIONS: Mapping[str, Callable[..., np.ndarray]] = {"sqrt": sqrt_allocation, "uniform": uniform_allocation}


def allocate_budget(epsilon_total: float, allocation: str = "sqrt", **weights: object) -> np.ndarray:
    """Per-plane budgets ε_{c,b}, shape (3, 8): rows Y, Cb, Cr; columns bit 1 (LSB) … bit 8 (MSB)."""
    try:
        allocator = ALLOCATIONS[allocation]
    except KeyError:
        raise LdpSlicingError(f"unknown allocation {allocation!r}; choose from {sorted(ALLOCATIONS)}") from None
    return allocator(epsilon_total, **weights)


def budgets_as_dict(budgets: np.ndarray) -> dict[str, list[float]]:
    return {c: [float(v) for v in budgets[i]] for i, c in enumerate(CHANNELS)}


# ----------------------------------------------------------------------------- randomized response


def flip_thresholds(budgets: np.ndarray) -> np.ndarray:
    """Integer thresholds T (uint64) with flip probability T / 2³² ≥ 1/(e^ε+1), i.e. rounded towards more noise."""
    flip = np.exp(-np.logaddexp(0.0, np.asarray(budgets, dtype=np.float64)))  # 1/(e^ε+1), no overflow
    thresholds = np.ceil(flip * _THRESHOLD_SCALE).astype(np.uint64)
    # Never more than 1/2 (ε' ≥ 0), never 0 (ε' finite).
    return np.clip(thresholds, 1, _THRESHOLD_SCALE // 2).astype(np.uint64)


def realized_flip_probabilities(thresholds: np.ndarray) -> np.ndarray:
    return np.asarray(thresholds, dtype=np.float64) / _THRESHOLD_SCALE


def realized_budgets(thresholds: np.ndarray) -> np.ndarray:
    """ε' = ln((1−q')/q') actually delivered per plane (≤ the allocated ε_{c,b})."""
    q = realized_flip_probabilities(thresholds)
    return np.log1p(-q) - np.log(q)


class RandomBytes(Protocol):
    """A source of independent uniform bytes."""

    name: str
    cryptographically_secure: bool

    def uint8(self, count: int) -> np.ndarray: ...


class AesCtrBytes:
    """AES-256 in counter mode keyed from ``os.urandom``: a CSPRNG (the CTR_DRBG construction)
    that runs at GB/s with AES-NI, where ``os.urandom`` itself manages ~150 MB/s here."""

    name = "aes-256-ctr (os.urandom key)"
    cryptographically_secure = True

    def __init__(self) -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        self._encryptor = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(os.urandom(16))).encryptor()
        self._zeros = np.zeros(0, dtype=np.uint8)  # plaintext: the keystream is AES_k(counter) XOR 0

    def uint8(self, count: int) -> np.ndarray:
        if self._zeros.size < count:
            self._zeros = np.zeros(count, dtype=np.uint8)
        out = np.empty(count + 15, dtype=np.uint8)  # update_into wants block_size - 1 bytes of slack
        written = self._encryptor.update_into(memoryview(self._zeros)[:count], out)
        if written != count:  # CTR is a stream cipher: cannot happen, but never return unfilled memory
            raise RuntimeError(f"AES-CTR produced {written} of {count} bytes")
        return out[:count]


class UrandomBytes:
    """The kernel CSPRNG directly (slower; kept for comparison and for systems without AES)."""

    name = "os.urandom"
    cryptographically_secure = True

    def uint8(self, count: int) -> np.ndarray:
        return np.frombuffer(os.urandom(count), dtype=np.uint8)


class SeededBytes:
    """numpy PCG64 from a seed: reproducible, fast, NOT cryptographically secure (tests, demos)."""

    cryptographically_secure = False

    def __init__(self, seed: int) -> None:
        self.name = f"pcg64 (seed {seed}; not cryptographically secure)"
        self._bits = np.random.PCG64(seed)

    def uint8(self, count: int) -> np.ndarray:
        words = self._bits.random_raw((count + 7) // 8)
        return words.view(np.uint8)[:count]


RANDOM_SOURCES: Mapping[str, Callable[[], RandomBytes]] = {"aes-ctr": AesCtrBytes, "urandom": UrandomBytes}


def make_random_source(seed: int | None = None, secure_source: str = "aes-ctr") -> RandomBytes:
    """Seeded PCG64 when ``seed`` is given (tests), otherwise a CSPRNG from :data:`RANDOM_SOURCES`."""
    if seed is not None:
        return SeededBytes(int(seed))
    try:
        return RANDOM_SOURCES[secure_source]()
    except KeyError:
        raise LdpSlicingError(f"unknown random source {secure_source!r}; choose from {sorted(RANDOM_SOURCES)}") from None


def _threshold_digits(thresholds: np.ndarray) -> np.ndarray:
    """Base-256 digits of each threshold, most significant first: shape (THRESHOLD_BYTES, *thresholds.shape)."""
    t = np.asarray(thresholds, dtype=np.uint64)
    shifts = np.array([8 * (THRESHOLD_BYTES - 1 - i) for i in range(THRESHOLD_BYTES)], dtype=np.uint64)
    return ((t[None, ...] >> shifts.reshape((-1,) + (1,) * t.ndim)) & np.uint64(0xFF)).astype(np.uint8)


def bernoulli_flips(source: RandomBytes, count: int, thresholds: np.ndarray) -> np.ndarray:
    """``count`` × thresholds.shape i.i.d. booleans; entry [..., j] is True with probability exactly
    ``thresholds[j] / 2³²``.

    A uniform 32-bit number U is compared with T byte by byte, most significant first; the next
    byte is drawn only where all previous bytes tied (1 in 256). That costs ≈1 random byte per
    sample instead of 4 and is still exactly P(U < T)."""
    digits = _threshold_digits(thresholds)
    plane_shape = digits.shape[1:]
    plane_size = int(np.prod(plane_shape))
    draw = source.uint8(count * plane_size).reshape((count,) + plane_shape)
    result = draw < digits[0]
    pending = np.flatnonzero(draw == digits[0])
    flat_result = result.reshape(-1)
    for level in range(1, THRESHOLD_BYTES):
        if pending.size == 0:
            break
        digit = digits[level].reshape(-1)[pending % plane_size]
        draw = source.uint8(pending.size)
        flat_result[pending[draw < digit]] = True
        pending = pending[draw == digit]
    return result


def randomize_bit_planes(values: np.ndarray, thresholds: np.ndarray, source: RandomBytes) -> np.ndarray:
    """Binary randomized response on every bit of a (..., 3) uint8 YCbCr array, independently.

    One flip decision per (pixel, channel, bit) is drawn in bulk, packed into a flip byte per
    channel value (bit b of the byte flips bit plane b) and XORed in."""
    if values.dtype != np.uint8 or values.shape[-1] != len(CHANNELS):
        raise LdpSlicingError(f"expected a (..., 3) uint8 array, got {values.dtype} {values.shape}")
    flat = values.reshape(-1)
    flips = bernoulli_flips(source, flat.size // len(CHANNELS), thresholds)  # (pixels, 3, 8) bool
    return (flat ^ pack_bit_flags(flips.reshape(-1, BITS_PER_CHANNEL))).reshape(values.shape)


def pack_bit_flags(flags: np.ndarray) -> np.ndarray:
    """(n, 8) bool → (n,) uint8 with flags[:, j] as bit j (LSB first).

    Same result as ``np.packbits(flags, axis=-1, bitorder="little")`` but ~10× faster: the 8 flag
    bytes are read as one little-endian uint64 and a multiply gathers byte j's low bit into bit
    56 + j (no carries: all partial products land on distinct bits)."""
    if sys.byteorder != "little":  # the multiply trick reads the 8 flags as a little-endian word
        return np.packbits(flags, axis=-1, bitorder="little").reshape(-1)
    words = np.ascontiguousarray(flags).view(np.uint64).reshape(-1)
    return ((words * np.uint64(0x0102040810204080)) >> np.uint64(56)).astype(np.uint8)


def channel_output_distribution(value: int, channel: int, thresholds: np.ndarray) -> np.ndarray:
    """Exact distribution over the 256 outputs of one channel value (product of 8 keep/flip probabilities)."""
    q = realized_flip_probabilities(thresholds[channel])
    outputs = np.arange(256)
    differs = ((outputs[:, None] ^ int(value)) >> np.arange(BITS_PER_CHANNEL)) & 1  # (256, 8)
    return np.prod(np.where(differs == 1, q, 1.0 - q), axis=1)


def max_log_likelihood_ratio(x: np.ndarray, x_prime: np.ndarray, thresholds: np.ndarray) -> float:
    """max over outputs of ln P(out | x)/P(out | x') for masked pixels x, x' (..., 3) uint8.

    Bits are independent, so the maximum is the product of per-bit maxima: ε'_{c,b} for every
    bit that differs, 0 for the others."""
    eps = realized_budgets(thresholds)  # (3, 8)
    diff = np.bitwise_xor(np.asarray(x, dtype=np.uint8), np.asarray(x_prime, dtype=np.uint8))
    bits = (diff[..., None] >> np.arange(BITS_PER_CHANNEL, dtype=np.uint8)) & 1  # (..., 3, 8)
    return float((bits * eps).sum())


# ----------------------------------------------------------------------------- colour and masking


def rgb_to_ycbcr(rgb: np.ndarray) -> np.ndarray:
    """(..., 3) RGB in [0, 255] → float YCbCr, full range."""
    return np.asarray(rgb, dtype=np.float32) @ _RGB_TO_YCBCR.T.astype(np.float32) + _YCBCR_OFFSET.astype(np.float32)


def ycbcr_to_rgb(ycbcr: np.ndarray) -> np.ndarray:
    """(..., 3) YCbCr → uint8 RGB (rounded, clipped: out-of-gamut YCbCr triples lose information)."""
    centered = np.asarray(ycbcr, dtype=np.float32) - _YCBCR_OFFSET.astype(np.float32)
    return to_uint8(centered @ _YCBCR_TO_RGB.T.astype(np.float32))


def to_uint8(values: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(values), 0, 255).astype(np.uint8)


def remove_low_frequency(channels: np.ndarray) -> np.ndarray:
    """Perceptual masking: 1-level Haar DWT over the two spatial axes of (..., H, W, C), LL band set to
    zero, inverse DWT. Returns floats (not yet clamped). Equals ``x − mean(2×2 block)``."""
    import pywt

    height, width = channels.shape[-3], channels.shape[-2]
    planar = np.moveaxis(np.asarray(channels, dtype=np.float32), -1, -3)  # (..., C, H, W): pywt is faster on contiguous rows
    low, details = pywt.dwt2(np.ascontiguousarray(planar), "haar")
    restored = pywt.idwt2((np.zeros_like(low), details), "haar")
    return np.moveaxis(restored[..., :height, :width], -3, -1)  # odd sizes: pywt pads one row/column


def perceptual_mask(ycbcr: np.ndarray, ll_prune: bool, ll_offset: float = 0.0) -> np.ndarray:
    """The masked uint8 YCbCr image whose bits are randomized (deterministic, no budget).

    After LL pruning the values are ``x − block mean`` ∈ [−191.25, 191.25]; clamping to [0, 255]
    (``ll_offset = 0``, the specified pipeline) discards every negative detail coefficient.
    ``ll_offset = 128`` re-centres them first (an alternative, still deterministic)."""
    return to_uint8(remove_low_frequency(ycbcr) + ll_offset if ll_prune else ycbcr)


# ----------------------------------------------------------------------------- the mechanism


@dataclass(frozen=True)
class SlicedImages:
    ycbcr: np.ndarray  #: privatized YCbCr uint8, (..., H, W, 3): what the randomized response released
    rgb: np.ndarray  #: the same converted to RGB uint8 (post-processing)


class LdpSlicer:
    """Configured LDP-Slicing mechanism; vectorized over an image or a batch (N, H, W, 3)."""

    def __init__(
        self,
        epsilon_total: float,
        *,
        ll_prune: bool = True,
        allocation: str = "sqrt",
        channel_weights: Mapping[str, float] | None = None,
        bit_weights: Sequence[float] | None = None,
        ll_offset: float = 0.0,
        seed: int | None = None,
        secure_source: str = "aes-ctr",
    ) -> None:
        weights: dict[str, object] = {}
        if channel_weights is not None:
            weights["channel_weights"] = channel_weights
        if bit_weights is not None:
            weights["bit_weights"] = bit_weights
        if weights and allocation != "sqrt":
            raise LdpSlicingError("channel/bit weights only apply to the 'sqrt' allocation")
        self.epsilon_total = _validate_epsilon(epsilon_total)
        self.ll_prune = bool(ll_prune)
        self.ll_offset = float(ll_offset)
        if not 0 <= self.ll_offset <= 255:
            raise LdpSlicingError(f"ll_offset must be in [0, 255], got {ll_offset}")
        self.allocation = allocation
        self.budgets = allocate_budget(self.epsilon_total, allocation, **weights)
        self.thresholds = flip_thresholds(self.budgets)
        self.source = make_random_source(seed, secure_source)

    def privatize_ycbcr(self, ycbcr_masked: np.ndarray) -> np.ndarray:
        """Randomized response on already-masked uint8 YCbCr (the part that spends the budget)."""
        return randomize_bit_planes(ycbcr_masked, self.thresholds, self.source)

    def __call__(self, rgb: np.ndarray) -> SlicedImages:
        rgb = np.asarray(rgb)
        if rgb.ndim < 3 or rgb.shape[-1] != 3:
            raise LdpSlicingError(f"expected RGB images (..., H, W, 3), got shape {rgb.shape}")
        if rgb.dtype != np.uint8:
            raise LdpSlicingError(f"expected uint8 RGB, got {rgb.dtype}")
        masked = perceptual_mask(rgb_to_ycbcr(rgb), self.ll_prune, self.ll_offset)
        private = self.privatize_ycbcr(masked)
        return SlicedImages(ycbcr=private, rgb=ycbcr_to_rgb(private))

    def guarantee(self) -> dict[str, object]:
        """The formal statement, for privacy reports. δ = 0: this is pure LDP."""
        realized = realized_budgets(self.thresholds)
        per_original_pixel = 4 * self.epsilon_total if self.ll_prune else self.epsilon_total
        unit = (
            "one 2×2 Haar block of original pixels (LL pruning makes every masked pixel depend on its whole block)"
            if self.ll_prune
            else "one pixel (its Y, Cb, Cr values)"
        )
        return {
            "mechanism": "ldp-slicing",
            "guarantee": "LDP",
            "guarantee_statement": (
                f"pure ε-LDP per pixel: each masked pixel's 3 channel values are ε_total = {self.epsilon_total:g}-LDP "
                "(24 independent binary randomized responses, sequential composition)"
            ),
            "epsilon_total": self.epsilon_total,
            "epsilon_realized": float(realized.sum()),
            "delta": 0.0,
            "accountant": "pure composition",
            "unit_protected": unit,
            "epsilon_per_original_pixel": per_original_pixel,
            "block_note": (
                f"with LL pruning one original pixel influences the 4 masked pixels of its 2×2 block: "
                f"{per_original_pixel:g}-LDP per 2×2 block of the original image (and per original pixel)"
                if self.ll_prune
                else "no LL pruning: the guarantee holds per original pixel"
            ),
            "public": "nothing; the RGB→YCbCr conversion and LL pruning are deterministic pre-processing",
            "ll_prune": self.ll_prune,
            "ll_offset": self.ll_offset,
            "allocation": self.allocation,
            "budgets": budgets_as_dict(self.budgets),
            "randomness": self.source.name,
            "cryptographically_secure": self.source.cryptographically_secure,
            "scope": "per pixel / per block only; no image-level guarantee is claimed",
        }
