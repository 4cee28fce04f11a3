"""The one cryptographically secure byte stream behind every privacy draw (numpy only, no torch).

:class:`AesCtrBytes` is AES-256 in counter mode over zeros, keyed with 32 bytes of ``os.urandom``
(the NIST CTR_DRBG construction without reseeding): a CSPRNG that runs at GB/s with AES-NI,
where ``os.urandom`` itself manages ~150 MB/s here. Every instance draws a fresh key and counter
from the OS, so no two instances or processes share a stream and nothing in a config determines
it; the key lives only in the cipher context and is never stored.

Users: DP-SGD noise, Poisson coins and the seeds of a private step's augmentations
(:mod:`fedpose.privacy.noise`, :func:`fedpose.privacy.engine.augmentation_seeds`), LDP-Slicing flips
(:mod:`fedpose.privacy.ldp_slicing`), Video-DPRP (:mod:`fedpose.privacy.dprp`, via ``noise``).
DP noise on a GPU comes from a ChaCha20 keystream computed there (:mod:`fedpose.privacy.chacha20`).
"""

from __future__ import annotations

import os

import numpy as np

#: Leads every report whose randomness came from a seed (tests only): whoever knows the seed can
#: regenerate the noise or flips and remove them, so no privacy guarantee holds.
SEEDED_NO_GUARANTEE = "NO PRIVACY GUARANTEE (seeded test noise)"

#: AES block size; ``update_into`` wants this many bytes minus one of slack in its output buffer.
AES_BLOCK_BYTES = 16


class AesCtrBytes:
    """AES-256-CTR keystream keyed from ``os.urandom`` (see the module docstring)."""

    name = "aes-256-ctr (os.urandom key)"
    cryptographically_secure = True

    def __init__(self) -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        self._encryptor = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(os.urandom(16))).encryptor()
        self._zeros = np.zeros(0, dtype=np.uint8)  # plaintext: the keystream is AES_k(counter) XOR 0

    @staticmethod
    def buffer(count: int) -> np.ndarray:
        """A buffer :meth:`fill` can write ``count`` bytes into (the cipher wants block slack)."""
        return np.empty(count + AES_BLOCK_BYTES - 1, dtype=np.uint8)

    def fill(self, out: np.ndarray, count: int) -> np.ndarray:
        """Write the next ``count`` keystream bytes into ``out`` (from :meth:`buffer`, reusable
        between calls); returns the view ``out[:count]``."""
        if out.dtype != np.uint8 or out.size < count + AES_BLOCK_BYTES - 1:
            raise ValueError(f"keystream buffer must be uint8 with >= {count + AES_BLOCK_BYTES - 1} bytes")
        if self._zeros.size < count:
            self._zeros = np.zeros(count, dtype=np.uint8)
        written = self._encryptor.update_into(memoryview(self._zeros)[:count], out)
        if written != count:  # CTR is a stream cipher: cannot happen, but never return unfilled memory
            raise RuntimeError(f"AES-CTR produced {written} of {count} bytes")
        return out[:count]

    def uint8(self, count: int) -> np.ndarray:
        """The next ``count`` keystream bytes in a new array."""
        return self.fill(self.buffer(count), count)
