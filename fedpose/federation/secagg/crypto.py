"""The one place fedpose crosses into Flower: SecAgg+'s cryptographic primitives, reused, not rewritten.

From ``flwr.common.secure_aggregation`` (pure functions over bytes; no Flower runtime, messages or
Context) fedpose takes:

* Shamir secret sharing over GF(2^128) in 16-byte chunks (``crypto.shamir``: PyCryptodome's Shamir);
* the pairwise key agreement ECDH + HKDF-SHA256 and authenticated encryption with Fernet
  (AES-128-CBC + HMAC-SHA256) (``crypto.symmetric_encryption``);
* the plaintext layout of an encrypted share pair, src ‖ dst ‖ len ‖ seed share ‖ key share
  (``secaggplus_utils.share_keys_plaintext_concat`` / ``_separate``).

Key pairs are made the way Flower's own ``secaggplus_mod`` makes them (P-384, PEM), with the
``cryptography`` calls its ``supercore.primitives.asymmetric`` wraps: that module sits outside the
crypto package, so this adapter calls ``cryptography`` directly rather than pull in more of Flower.

**Not reused: Flower's mask generator** ``secaggplus_utils.pseudo_rand_gen``: it folds the seed to
32 bits by XOR and expands it with numpy's Mersenne Twister (``RandomState``), so each mask has at
most 2^32 possibilities — a brute-force search away from a masked update — and its
``randint(0, M − 1)`` never draws M − 1. :func:`mask` expands the full 256-bit seed with
AES-256-CTR (the construction of :class:`fedpose.privacy.csprng.AesCtrBytes`, keyed by the seed's
SHA-256 instead of OS entropy): every word uniform on [0, 2^64), reduced mod M = 2^m exactly.
Flower's ``quantization`` is not reused either (numpy's default RNG for the rounding coins):
:mod:`fedpose.federation.secagg.quantization` rounds with the CSPRNG.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives import serialization
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
# Flower's primitives load on first use, not at import: the library (training, the round runner)
# stays importable where Flower is not installed (a GPU machine that only trains); secure
# aggregation itself needs it.
def combine_shares(*args, **kwargs):  # type: ignore[no-untyped-def]
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares as flower_combine

    return flower_combine(*args, **kwargs)


def create_shares(*args, **kwargs):  # type: ignore[no-untyped-def]
    from flwr.common.secure_aggregation.crypto.shamir import create_shares as flower_create

    return flower_create(*args, **kwargs)


def encrypt(*args, **kwargs):  # type: ignore[no-untyped-def]
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import encrypt as flower_encrypt

    return flower_encrypt(*args, **kwargs)


def decrypt(*args, **kwargs):  # type: ignore[no-untyped-def]
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt as flower_decrypt

    return flower_decrypt(*args, **kwargs)


def generate_shared_key(*args, **kwargs):  # type: ignore[no-untyped-def]
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key as flower_key

    return flower_key(*args, **kwargs)


def share_keys_plaintext_concat(*args, **kwargs):  # type: ignore[no-untyped-def]
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat as flower_concat

    return flower_concat(*args, **kwargs)


def share_keys_plaintext_separate(*args, **kwargs):  # type: ignore[no-untyped-def]
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate as flower_separate

    return flower_separate(*args, **kwargs)


__all__ = ["KeyPair", "combine_shares", "create_shares", "decrypt", "encrypt", "identity_public_key", "key_statement",
           "load_identity", "mask", "new_identity", "new_key_pair", "new_seed", "open_share_pair", "seal_share_pair",
           "shared_key", "sign_keys", "verify_keys"]

SEED_BYTES = 32


class KeyPair:
    """An EC key pair (P-384) held in memory; only the public half is ever serialized for the wire."""

    def __init__(self, private: ec.EllipticCurvePrivateKey):
        self._private = private
        self.public = private.public_key().public_bytes(serialization.Encoding.PEM,
                                                        serialization.PublicFormat.SubjectPublicKeyInfo)

    def private_bytes(self) -> bytes:
        """The secret key as bytes: only to be Shamir-shared (the pairwise-mask key, SecAgg's s^SK)."""
        return self._private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption())

    def agree(self, peer_public: bytes) -> bytes:
        """The 32-byte key this pair shares with ``peer_public`` (ECDH + HKDF, Flower's function)."""
        return shared_key(self._private, peer_public)


def new_key_pair() -> KeyPair:
    return KeyPair(ec.generate_private_key(ec.SECP384R1()))


def key_pair_from_private(private_pem: bytes) -> KeyPair:
    """A pair rebuilt from Shamir-reconstructed secret-key bytes (the coordinator, for a dropped site)."""
    key = serialization.load_pem_private_key(private_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("reconstructed secret key is not an EC private key")
    return KeyPair(key)


def check_public_key(public: bytes) -> None:
    """Raise ValueError unless ``public`` is a PEM P-384 public key."""
    key = serialization.load_pem_public_key(public)
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP384R1):
        raise ValueError("not a P-384 public key")


def shared_key(private: ec.EllipticCurvePrivateKey, peer_public: bytes) -> bytes:
    peer = serialization.load_pem_public_key(peer_public)
    if not isinstance(peer, ec.EllipticCurvePublicKey):
        raise ValueError("peer key is not an EC public key")
    return generate_shared_key(private, peer)


def new_seed() -> bytes:
    """A self-mask seed (SecAgg's b_u) from OS entropy."""
    return os.urandom(SEED_BYTES)


def seal_share_pair(key: bytes, src: int, dst: int, seed_share: bytes, key_share: bytes) -> bytes:
    """Encrypt (src, dst, seed share, secret-key share) for ``dst`` under the pair's agreed key."""
    return encrypt(key, share_keys_plaintext_concat(src, dst, seed_share, key_share))


def open_share_pair(key: bytes, ciphertext: bytes) -> tuple[int, int, bytes, bytes]:
    """Decrypt and authenticate a share pair → (src, dst, seed share, secret-key share)."""
    return share_keys_plaintext_separate(decrypt(key, ciphertext))


def mask(seed: bytes, length: int, modulus_bits: int) -> np.ndarray:
    """``length`` words uniform modulo 2^modulus_bits: AES-256-CTR keyed by SHA-256(seed), zero IV
    (one key per seed and purpose, so the counter never repeats under one key)."""
    encryptor = Cipher(algorithms.AES(hashlib.sha256(b"fedpose-secagg-mask" + seed).digest()), modes.CTR(bytes(16))).encryptor()
    words = np.frombuffer(encryptor.update(bytes(8 * length)), dtype=np.uint64)
    return words & np.uint64(2**modulus_bits - 1)


# -- the sites' long-term identities: signed round keys ------------------------------------------------
# A site signs its two round public keys with its Ed25519 identity key; its peers check the signature
# against the identity keys they were given out of band, so a coordinator that substitutes keys or
# invents a site is refused (otherwise it could collect enough shares to unmask one site's Δ).


def new_identity() -> bytes:
    """A fresh Ed25519 identity key, PEM (PKCS#8): it stays at the site."""
    return ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def load_identity(path: str | Path) -> ed25519.Ed25519PrivateKey:
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ValueError(f"{path}: not an Ed25519 private key (make one with `fedpose site identity`)")
    return key


def identity_public_key(key: ed25519.Ed25519PrivateKey) -> str:
    """The identity's public half as peers list it: base64 of its 32 raw bytes."""
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def key_statement(run_id: str, round_id: int, node: int, site_id: str, mask_key: bytes, share_key: bytes,
                  settings: str) -> bytes:
    """What a site signs: its round keys bound to the run, the round, its node slot, its site id and
    ``settings``, the digest of the round's setup as the site received it (:func:`settings_digest`).
    A peer verifies against the digest of *its own* setup, so every site in a round must have been
    given the same participants, threshold and encoding: a coordinator that gives one site a higher
    threshold than its peers (which lets that site accept a mask set small enough to unmask it
    alone) fails every signature check."""
    return json.dumps({"what": "fedpose secure-aggregation round keys/2", "run_id": run_id, "round": round_id, "node": node,
                       "site_id": site_id, "mask_key": base64.b64encode(mask_key).decode(),
                       "share_key": base64.b64encode(share_key).decode(), "settings": settings}, sort_keys=True).encode()


def view_statement(run_id: str, round_id: int, settings: str, survivors: list[int], dropped: list[int]) -> bytes:
    """What a site signs in the consistency check: the view of who survived it was shown, for this
    run, round and setup (``settings``: :func:`settings_digest`)."""
    return json.dumps({"what": "fedpose secure-aggregation view/1", "run_id": run_id, "round": round_id, "settings": settings,
                       "survivors": sorted(survivors), "dropped": sorted(dropped)}, sort_keys=True).encode()


def reply_statement(unsigned_reply_json: str, released_sha256: str | None) -> bytes:
    """What a site signs for a train reply (:mod:`fedpose.federation.reply_signature`): the reply as
    JSON without its signature, and the digest of the update that leaves with it (None: none)."""
    return json.dumps({"what": "fedpose site reply/1", "reply": unsigned_reply_json, "released_sha256": released_sha256},
                      sort_keys=True).encode()


def settings_digest(shared_settings: dict) -> str:
    """SHA-256 (hex) of a round's shared settings (canonical JSON): what every site of the round must agree on."""
    return hashlib.sha256(json.dumps(shared_settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sign_keys(key: ed25519.Ed25519PrivateKey, statement: bytes) -> bytes:
    return key.sign(statement)


def verify_keys(public_key: str, signature: bytes, statement: bytes) -> bool:
    """True when ``signature`` over ``statement`` is by the identity whose public key is ``public_key``."""
    try:
        ed25519.Ed25519PublicKey.from_public_bytes(base64.b64decode(public_key, validate=True)).verify(signature, statement)
    except (InvalidSignature, ValueError):
        return False
    return True
