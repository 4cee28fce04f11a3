"""ChaCha20 keystream computed with torch ops on any device: the CSPRNG behind DP noise on a GPU.

Why not the CPU's AES-256-CTR (:class:`~fedpose.privacy.csprng.AesCtrBytes`) plus a copy, and why
not a seeded ``torch.Generator(device="cuda")``:

* a CUDA generator is Philox4x32-10 with a 64-bit seed: a fast statistical generator, not a
  cryptographic one (no security claim; seeding it per step from ``os.urandom`` still leaves the
  outputs of one step a function of 64 bits). DESIGN.md asks for a CSPRNG behind every draw a
  guarantee rests on;
* AES on the host costs a step ~25 ms of CPU for p = 4.7 M (benchmarks/step_cost/noise_cost.json)
  plus a 19 MB host-to-device copy, and the GPU waits for both: on a GPU a private step takes
  a fraction of a CPU step, so that share grows several-fold;
* ChaCha20 (RFC 8439) is add-rotate-xor on 32-bit words: it vectorises over blocks with
  elementwise torch ops, needs no tables and runs where the gradient lives, asynchronously.
  ``run.py --noise-only --device cuda`` times it against AES on the host plus the copy.

Words are held in int64 tensors (values 0 … 2³²−1, masked after every addition and shift): torch
has no unsigned 32-bit arithmetic on every device, and signed int32 overflow is undefined. The
output equals the RFC 8439 keystream with a 64-bit block counter in words 12–13 and a zero nonce
in words 14–15 (tests compare it with ``cryptography``'s ChaCha20 on the CPU); each call takes a
fresh 256-bit key, so the counter never wraps within one key.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
#: "expand 32-byte k"
_CONSTANTS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)
#: words per ChaCha20 block
BLOCK_WORDS = 16
#: blocks one key may produce before its 64-bit counter would wrap
_MAX_BLOCKS = 1 << 64


def _rotate_left(x: Tensor, bits: int) -> Tensor:
    return ((x << bits) & _MASK32) | (x >> (32 - bits))


def _quarter_rounds(a: Tensor, b: Tensor, c: Tensor, d: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Four quarter-rounds at once: rows i of a, b, c, d (each 4 × blocks) form one quarter-round."""
    a = (a + b) & _MASK32
    d = _rotate_left(d ^ a, 16)
    c = (c + d) & _MASK32
    b = _rotate_left(b ^ c, 12)
    a = (a + b) & _MASK32
    d = _rotate_left(d ^ a, 8)
    c = (c + d) & _MASK32
    b = _rotate_left(b ^ c, 7)
    return a, b, c, d


def keystream_words(key: bytes, blocks: int, device: torch.device | str, first_block: int = 0) -> Tensor:
    """``blocks`` ChaCha20 blocks as a flat int64 tensor of 16·blocks uint32 values, in keystream order
    (word j holds keystream bytes 4j … 4j+3, little-endian), computed on ``device``."""
    if len(key) != 32:
        raise ValueError(f"ChaCha20 needs a 32-byte key, got {len(key)} bytes")
    if blocks < 0 or first_block < 0 or first_block + blocks > _MAX_BLOCKS:
        raise ValueError(f"block range {first_block} + {blocks} is outside the 64-bit counter")
    key_words = [int.from_bytes(key[4 * i: 4 * i + 4], "little") for i in range(8)]
    header = torch.tensor([*_CONSTANTS, *key_words], dtype=torch.int64, device=device)
    counter = torch.arange(first_block, first_block + blocks, dtype=torch.int64, device=device)
    initial = torch.empty(BLOCK_WORDS, blocks, dtype=torch.int64, device=device)
    initial[:12] = header[:, None]
    initial[12] = counter & _MASK32
    initial[13] = counter >> 32
    initial[14:] = 0
    # state rows a = words 0–3, b = 4–7, c = 8–11, d = 12–15; column i of the 4 × 4 state is (a[i], b[i], c[i], d[i])
    a, b, c, d = (initial[4 * i: 4 * i + 4].clone() for i in range(4))
    for _ in range(10):  # 20 rounds: a column round, then a diagonal round (rows rotated into columns and back)
        a, b, c, d = _quarter_rounds(a, b, c, d)
        a, b, c, d = _quarter_rounds(a, b.roll(-1, 0), c.roll(-2, 0), d.roll(-3, 0))
        b, c, d = b.roll(1, 0), c.roll(2, 0), d.roll(3, 0)
    state = (torch.cat([a, b, c, d]) + initial) & _MASK32
    return state.T.reshape(-1)


def fresh_key() -> bytes:
    """A 256-bit key from OS entropy (never stored)."""
    return os.urandom(32)
