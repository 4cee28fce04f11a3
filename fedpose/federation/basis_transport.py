"""Shipping the public-subspace basis V (p×k) from the coordinator to the sites (PDP-SGD / FP-DP).

The coordinator computes V from public data S_pub on the current global weights, every R rounds.
Because V depends only on public data and the (public) global weights, projecting onto it is
post-processing, and any site holding the same S_pub can rebuild it. Two transports:

* **full** — V itself, as one numpy array in float32, float16 or bfloat16 (bfloat16 travels as
  ``uint16`` bit patterns: numpy has no bfloat16). 2.88 M × 50 fp32 = 550 MiB per site.
* **compact** — a :class:`BasisRecipe`: the public sample ids, the m×k mixing matrix U Λ^-½ of the
  Gram eigendecomposition G Gᵀ = U Λ Uᵀ, and the digest of the global weights. The site recomputes
  G (m×p public per-sample gradients at those weights, in the recipe's sample order) and
  V = Gᵀ · mix — a few tens of KiB on the wire instead of hundreds of MiB, paid for with one
  public-gradient pass at the site.

Wire format (what the Flower wiring puts in the train message): :class:`BasisMessage` =
``arrays`` (``dict[str, np.ndarray]`` → an ``ArrayRecord``) + ``config`` (``dict[str, int | str]``
→ a ``ConfigRecord``). Versions are ints: the round at which the basis was computed. Sites report
the version they hold; :class:`fedpose.federation.server.basis_service.BasisService` sends a basis
only to sites that lack it.

The basis itself: V = Gᵀ U_k Λ_k^-½ with (U, Λ) the top-k eigenpairs of the m×m Gram matrix
G Gᵀ — the top-k eigenvectors of Gᵀ G (∝ the public second-moment matrix M), orthonormal, never
forming a p×p matrix (DESIGN.md, PDP-SGD).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fedpose.io import atomic_write, atomic_write_json

WireDtype = Literal["float32", "float16", "bfloat16"]
WIRE_DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16)}

# keys inside a BasisMessage
V_KEY = "basis.v"
IDS_KEY = "basis.public_ids"
MIX_KEY = "basis.mixing"


class BasisTransportError(ValueError):
    """A basis message is malformed, or a recipe cannot be rebuilt here (other weights / public set)."""


# -- digests --------------------------------------------------------------------------------------
def weights_digest(weights: Mapping[str, np.ndarray]) -> str:
    """sha256 over names, dtypes, shapes and bytes of the global weights (the weights' version id)."""
    h = hashlib.sha256()
    for name in sorted(weights):
        a = np.ascontiguousarray(weights[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


# -- the basis from public gradients --------------------------------------------------------------
def _as_numpy(matrix: Any) -> np.ndarray:
    if hasattr(matrix, "detach"):  # torch tensor
        matrix = matrix.detach().cpu().numpy()
    return np.asarray(matrix)


def basis_mixing(public_gradients: Any, k: int) -> np.ndarray:
    """The m×k' mixing matrix U_k Λ_k^-½ (float32) from G (m×p) — the engine's own
    eigendecomposition (:func:`fedpose.privacy.projection.basis_mixing`), transposed for the wire."""
    import torch

    from fedpose.privacy.projection import basis_mixing as engine_mixing

    mixing_t, _ = engine_mixing(torch.as_tensor(_as_numpy(public_gradients)), k)
    return mixing_t.T.contiguous().numpy()


def apply_mixing(public_gradients: Any, mixing: np.ndarray) -> np.ndarray:
    """V (p×k', float32, orthonormal) from G and an m×k' mixing matrix: the same function the
    engine builds its own basis with, so a shipped or rebuilt V matches a site's own."""
    import torch

    from fedpose.privacy.projection import apply_mixing as engine_apply

    g = torch.as_tensor(_as_numpy(public_gradients))
    if g.shape[0] != mixing.shape[0]:
        raise BasisTransportError(f"recipe mixes {mixing.shape[0]} public gradients, got {g.shape[0]}")
    return engine_apply(g, torch.as_tensor(np.ascontiguousarray(mixing, dtype=np.float32)).T).contiguous().numpy()


def basis_from_gradients(public_gradients: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(V p×k' float32 with orthonormal columns, mixing m×k') from public per-sample gradients G."""
    mixing = basis_mixing(public_gradients, k)
    return apply_mixing(public_gradients, mixing), mixing


# -- wire encoding --------------------------------------------------------------------------------
def _to_wire(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 → wire dtype; bfloat16 as its uint16 bit patterns (torch rounds to nearest even)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    if dtype == "bfloat16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return t.to(getattr(torch, dtype)).numpy()


def _from_wire(wire: np.ndarray, dtype: str) -> np.ndarray:
    import torch

    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(wire).view(np.int16)).view(torch.bfloat16).float().numpy()
    return torch.from_numpy(np.ascontiguousarray(wire)).float().numpy()


@dataclass(frozen=True)
class BasisMessage:
    """What travels: ``arrays`` for an ArrayRecord, ``config`` (str/int values) for a ConfigRecord."""

    arrays: dict[str, np.ndarray]
    config: dict[str, int | str]

    @property
    def nbytes(self) -> int:
        """Payload bytes on the wire (array data + config JSON), per site and refresh."""
        return sum(int(a.nbytes) for a in self.arrays.values()) + len(json.dumps(self.config).encode())

    @property
    def version(self) -> int:
        return int(self.config["basis.version"])

    @property
    def transport(self) -> str:
        return str(self.config["basis.transport"])


def encode_full(basis: Any, version: int, weights_version: str, dtype: WireDtype = "float32") -> BasisMessage:
    """V itself (p×k) in the wire dtype."""
    v = _as_numpy(basis).astype(np.float32, copy=False)
    if v.ndim != 2:
        raise ValueError(f"basis must be p×k, got shape {v.shape}")
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"basis wire dtype must be one of {sorted(WIRE_DTYPES)}, got {dtype!r}")
    wire = _to_wire(v, dtype)
    config = {"basis.transport": "full", "basis.version": int(version), "basis.weights": weights_version,
              "basis.dtype": dtype, "basis.shape": f"{v.shape[0]}x{v.shape[1]}"}
    return BasisMessage({V_KEY: wire}, config)


@dataclass(frozen=True)
class BasisRecipe:
    """Everything a site needs to rebuild V from its own copy of the public set."""

    version: int
    weights_version: str  #: :func:`weights_digest` of the global weights G is taken at
    public_ids: tuple[int, ...]  #: indices into the public set, in the row order of G
    mixing: np.ndarray  #: m×k float32, U_k Λ_k^-½
    public_set: str = ""  #: digest/name of the public set (checked when the site gives its own)

    def encode(self) -> BasisMessage:
        config = {"basis.transport": "compact", "basis.version": int(self.version), "basis.weights": self.weights_version,
                  "basis.public_set": self.public_set}
        return BasisMessage({IDS_KEY: np.asarray(self.public_ids, dtype=np.int64),
                             MIX_KEY: np.ascontiguousarray(self.mixing, dtype=np.float32)}, config)

    def rebuild(self, public_gradients: Any, weights_version: str, public_set: str | None = None) -> np.ndarray:
        """V from G recomputed at the site (rows in ``public_ids`` order, at the recipe's weights).

        ``weights_version`` is the digest of the weights the site computed G at; it must match.
        """
        if weights_version != self.weights_version:
            raise BasisTransportError(
                f"basis recipe v{self.version} is for global weights {self.weights_version[:12]}…, but the site "
                f"computed public gradients at {weights_version[:12]}…: the rebuilt basis would differ"
            )
        if public_set is not None and self.public_set and public_set != self.public_set:
            raise BasisTransportError(
                f"basis recipe v{self.version} needs public set '{self.public_set}', the site has '{public_set}'"
            )
        g = _as_numpy(public_gradients)
        if g.shape[0] != len(self.public_ids):
            raise BasisTransportError(f"recipe lists {len(self.public_ids)} public samples, got {g.shape[0]} gradients")
        return apply_mixing(g, self.mixing)


def make_recipe(
    public_gradients: Any, k: int, public_ids: Iterable[int], version: int, weights_version: str, public_set: str = ""
) -> tuple[np.ndarray, BasisRecipe]:
    """Coordinator side: (V, recipe) from G computed at the global weights on the listed public samples."""
    ids = tuple(int(i) for i in public_ids)
    g = _as_numpy(public_gradients)
    if len(ids) != g.shape[0]:
        raise ValueError(f"{len(ids)} public ids for {g.shape[0]} gradient rows")
    basis, mixing = basis_from_gradients(g, k)
    return basis, BasisRecipe(int(version), weights_version, ids, mixing, public_set)


def decode(message_arrays: Mapping[str, np.ndarray], config: Mapping[str, Any]) -> np.ndarray | BasisRecipe:
    """Full message → V (p×k float32); compact message → :class:`BasisRecipe` (call ``rebuild``)."""
    try:
        transport, version = str(config["basis.transport"]), int(config["basis.version"])
        weights_version = str(config["basis.weights"])
        if transport == "full":
            dtype, wire = str(config["basis.dtype"]), message_arrays[V_KEY]
            if dtype not in WIRE_DTYPES or wire.dtype != WIRE_DTYPES[dtype] or wire.ndim != 2:
                raise BasisTransportError(f"basis v{version}: array {wire.dtype}{wire.shape} does not match dtype {dtype!r}")
            if f"{wire.shape[0]}x{wire.shape[1]}" != config["basis.shape"]:
                raise BasisTransportError(f"basis v{version}: shape {wire.shape} != declared {config['basis.shape']}")
            return _from_wire(wire, dtype)
        if transport == "compact":
            ids, mixing = message_arrays[IDS_KEY], message_arrays[MIX_KEY]
            if ids.ndim != 1 or mixing.ndim != 2 or mixing.shape[0] != ids.shape[0]:
                raise BasisTransportError(f"basis recipe v{version}: {ids.shape[0]} ids but mixing {mixing.shape}")
            return BasisRecipe(version, weights_version, tuple(int(i) for i in ids), mixing.astype(np.float32),
                               str(config.get("basis.public_set", "")))
    except KeyError as exc:
        raise BasisTransportError(f"basis message lacks {exc}") from None
    raise BasisTransportError(f"unknown basis transport {transport!r}")


#: ``public_gradients(ids) -> G``: m×p per-sample gradients of the public loss at the current
#: weights, one row per id, in the given order (deterministic: no augmentation, no dropout).
PublicGradientFn = Callable[[Sequence[int]], Any]


def public_gradient_fn(model: Any, public_dataset: Any, chunk_size: int | None = None) -> PublicGradientFn:
    """``ids -> G``: unclipped per-sample gradients of ``model``'s trainable parameters on public samples.

    Uses the privacy engine's own gradient code (:func:`fedpose.privacy.per_sample.gradient_matrix`)
    so the coordinator and every site compute G identically. ``public_dataset`` must be
    deterministic (``PoseDataset(..., train=False)``: no augmentation); ``model`` must be in
    ``train_mode()`` (BatchNorm frozen) at the weights named in the recipe. G is computed on the
    model's device (``chunk_size`` samples at a time; None: sized for the device) and returned on the host.
    """
    import torch

    from fedpose.privacy.engine import batch_to_device, collate
    from fedpose.privacy.per_sample import auto_chunk_size, frozen_features, gradient_matrix
    from fedpose.runtime import model_device

    def gradients(ids: Sequence[int]) -> np.ndarray:
        device = model_device(model)
        batch = batch_to_device(collate([public_dataset[int(i)] for i in ids]), device)
        features = frozen_features(model, batch["image"])
        num_params = sum(p.numel() for p in model.trainable_parameters().values())
        chunk = chunk_size if chunk_size is not None else auto_chunk_size(device, num_params)
        with torch.enable_grad():
            g = gradient_matrix(model, features, batch["joints"], batch["weight"], chunk)
        return g.cpu().numpy()

    return gradients


def choose_public_ids(public_set_size: int, m: int, seed: int, version: int) -> list[int]:
    """The m public samples of refresh ``version``: a deterministic function of (seed, version)."""
    if not 0 < m <= public_set_size:
        raise ValueError(f"need 0 < m <= public set size, got m={m}, size={public_set_size}")
    rng = np.random.default_rng([int(seed), int(version)])
    return sorted(int(i) for i in rng.choice(public_set_size, size=m, replace=False))


def build_basis_message(
    public_gradients: PublicGradientFn,
    public_ids: Sequence[int],
    k: int,
    version: int,
    weights_version: str,
    transport: str = "compact",
    dtype: WireDtype = "float32",
    public_set: str = "",
) -> tuple[np.ndarray, BasisMessage]:
    """Coordinator: compute G once, then (V, the message for ``transport`` "full" or "compact")."""
    g = public_gradients(list(public_ids))
    basis, recipe = make_recipe(g, k, public_ids, version, weights_version, public_set)
    if transport == "full":
        return basis, encode_full(basis, version, weights_version, dtype)
    if transport == "compact":
        return basis, recipe.encode()
    raise ValueError(f"basis transport must be 'full' or 'compact', got {transport!r}")


def receive_basis(
    message_arrays: Mapping[str, np.ndarray],
    config: Mapping[str, Any],
    weights_version: str,
    public_gradients: PublicGradientFn | None = None,
    public_set: str | None = None,
) -> np.ndarray:
    """Site: V from a basis message. Compact messages need ``public_gradients`` at the site's copy of
    the global weights (digest ``weights_version``) over its copy of the public set."""
    decoded = decode(message_arrays, config)
    if isinstance(decoded, np.ndarray):
        if str(config["basis.weights"]) != weights_version:
            raise BasisTransportError(
                f"basis v{message_version(config)} was computed at weights {str(config['basis.weights'])[:12]}…, "
                f"this round's global weights are {weights_version[:12]}…"
            )
        return decoded
    if public_gradients is None:
        raise BasisTransportError("compact basis transport: this site has no public set to rebuild the basis from")
    if public_set is not None and decoded.public_set and public_set != decoded.public_set:
        raise BasisTransportError(f"basis recipe v{decoded.version} needs public set '{decoded.public_set}', the site has '{public_set}'")
    if weights_version != decoded.weights_version:
        decoded.rebuild(np.zeros((0, 0)), weights_version)  # raises the clear mismatch error
    return decoded.rebuild(public_gradients(list(decoded.public_ids)), weights_version, public_set)


def message_version(config: Mapping[str, Any]) -> int | None:
    """The basis version a message carries (None: no basis in it)."""
    return int(config["basis.version"]) if "basis.version" in config else None


# -- the site's cache -----------------------------------------------------------------------------
class BasisCache:
    """A site's on-disk copy of its current basis (survives the per-message ClientApp process)."""

    def __init__(self, state_dir: str | Path):
        self.dir = Path(state_dir)

    @property
    def _meta(self) -> Path:
        return self.dir / "basis.json"

    @property
    def _array(self) -> Path:
        return self.dir / "basis.npy"

    def version(self) -> int | None:
        if not self._meta.exists():
            return None
        return int(json.loads(self._meta.read_text())["version"])

    def store(self, version: int, basis: np.ndarray, weights_version: str = "") -> None:
        # Array first, then the meta that names it: a crash between leaves the old version number,
        # so the site re-requests the basis rather than using a mismatched one.
        self._meta.unlink(missing_ok=True)
        atomic_write(self._array, lambda fh: np.save(fh, np.ascontiguousarray(basis, dtype=np.float32)))
        atomic_write_json(self._meta, {"version": int(version), "weights": weights_version, "shape": list(basis.shape)})

    def load(self) -> tuple[int, np.ndarray] | None:
        if not self._meta.exists():
            return None
        meta = json.loads(self._meta.read_text())
        basis = np.load(self._array, mmap_mode="r")
        if list(basis.shape) != meta["shape"]:
            raise BasisTransportError(f"basis cache in {self.dir} is inconsistent: {basis.shape} vs {meta['shape']}")
        return int(meta["version"]), basis
