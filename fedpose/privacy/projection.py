"""Public-subspace projection for PDP-SGD / FP-DP (paper 001; DESIGN.md "Key formulas").

V (p × k) spans the top-k eigenvectors of the second-moment matrix M = (1/m) Σ_j g_j g_jᵀ of m
PUBLIC samples' gradients at the current weights. M is p × p (p ≈ 2.9 M) and is never formed:
with G the m × p matrix of public gradients, G Gᵀ (m × m) has eigenpairs (λ, u) and
v = Gᵀ u / √λ are the matching orthonormal eigenvectors of GᵀG (= m·M). Cost: one m × p
gradient pass plus an m × m eigh (FACTS.md: ~1 s vs ~32 s for an SVD of G).

Privacy: V depends on public data and the current (already private) weights only, so
projecting the *noisy* gradient onto it is post-processing — the (ε, δ) guarantee is unchanged.
:func:`compute_basis` enforces the "public only" part: it refuses any batch not tagged
``provenance == "public"`` (the engine tags batches drawn from the public set).

Device: G, V and the projection live on the model's device (a GPU keeps V, ~1 GB at p = 4.7 M,
next to the gradient it projects); only the m × m and k × k eigen/Cholesky problems run on the
CPU in float64, so every device takes the same, deterministic decisions about rank and signs.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fedpose.privacy.per_sample import DEFAULT_CHUNK_SIZE, TrainableModel, buffer_view, frozen_features, gradient_matrix

PUBLIC = "public"
#: max |VᵀV − I| accepted before re-orthonormalising
ORTHONORMAL_TOLERANCE = 1e-5
#: columns of Vᵀ per block when projecting (a k × block slice stays in cache between the two products)
_PROJECTION_BLOCK = 1 << 18
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ProvenanceError(ValueError):
    """A batch that is not certified public reached a computation that must see public data only."""


@dataclass
class Basis:
    """Orthonormal columns V (p × k) and what they were computed from.

    V is kept column-major (Vᵀ contiguous, k × p), whatever layout it arrives in: projecting is
    memory-bound (two passes over p·k floats, ~950 MB at p = 4.7 M), and reading each basis vector
    as one contiguous row, in column blocks shared among torch's threads, runs at the machine's
    memory bandwidth; torch's own V.T @ g / V @ c on a row-major V is single-threaded and ~1.7×
    slower here (benchmarks/step_cost). Half-precision storage halves the memory but is not faster
    on CPUs without native half GEMV (each block is converted to float32).
    """

    vectors: Tensor
    eigenvalues: Tensor = field(default_factory=lambda: torch.zeros(0))
    version: int = 0
    public_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.vectors.dim() != 2:
            raise ValueError(f"basis must be a p × k matrix, got shape {tuple(self.vectors.shape)}")
        if not self.vectors.T.is_contiguous():
            self.vectors = self.vectors.T.contiguous().T

    @property
    def k(self) -> int:
        return int(self.vectors.shape[1])

    def to(self, device: torch.device) -> "Basis":
        """This basis with V on ``device`` (itself when it is already there)."""
        if self.vectors.device == device:
            return self
        return Basis(self.vectors.to(device), self.eigenvalues, self.version, self.public_ids)

    def project(self, gradient: Tensor) -> Tensor:
        """V (Vᵀ g) in float32 (accumulated per block), returned in g's dtype. On the CPU the blocks
        are shared among torch's threads; on a GPU one stream runs them (threads would not help)."""
        rows = self.vectors.T  # k × p, contiguous
        p = rows.shape[1]
        if gradient.shape != (p,):
            raise ValueError(f"gradient has shape {tuple(gradient.shape)}, the basis is for p = {p}")
        if gradient.device != rows.device:
            raise ValueError(f"gradient is on {gradient.device}, the basis on {rows.device}")
        g = gradient.to(torch.float32)
        on_cpu = rows.device.type == "cpu"
        workers = max(1, min(torch.get_num_threads(), -(-p // _PROJECTION_BLOCK))) if on_cpu else 1
        spans = [(start, min(start + _PROJECTION_BLOCK, p)) for start in range(0, p, _PROJECTION_BLOCK)]
        shares = [spans[i::workers] for i in range(workers)]

        def coefficients(share: list[tuple[int, int]]) -> Tensor:
            partial = torch.zeros(rows.shape[0], dtype=torch.float32, device=rows.device)
            for start, stop in share:
                partial.addmv_(rows[:, start:stop].float(), g[start:stop])
            return partial

        out = torch.empty(p, dtype=torch.float32, device=rows.device)

        def expand(share: list[tuple[int, int]], coefficients: Tensor) -> None:
            for start, stop in share:
                torch.mv(rows[:, start:stop].float().T, coefficients, out=out[start:stop])

        if workers == 1:
            expand(shares[0], coefficients(shares[0]))
        else:
            # One torch op per block and thread: torch releases the GIL inside each.
            with ThreadPoolExecutor(workers) as pool:
                total = sum(pool.map(coefficients, shares))
                list(pool.map(expand, shares, [total] * workers))
        return out.to(gradient.dtype)


def basis_mixing(gradients: Tensor, k: int, rel_tolerance: float = 1e-5) -> tuple[Tensor, Tensor]:
    """(mixing k' × m float32, eigenvalues k') with V = orthonormalize((mixing · G)ᵀ), k' ≤ k.

    The one eigendecomposition behind every basis (the engine's own, and the coordinator's shipped
    or recipe basis, :mod:`fedpose.federation.basis_transport`): mixing = (U_k Λ_k^-½)ᵀ from the
    top-k eigenpairs (U, Λ) of the m × m Gram matrix G Gᵀ. Directions with eigenvalue below
    ``rel_tolerance`` × the largest are dropped (rank < k). The Gram matrix is formed in float32,
    so a zero eigenvalue comes out as round-off of order eps_f32 · λ_max ≈ 1e-7 · λ_max, higher or
    lower depending on the CPU's kernels (AVX-512 or not); 1e-5 sits well above that noise, and
    directions that weak carry no usable signal. Eigenvector signs are fixed (largest-magnitude
    entry of u positive) so V is deterministic.
    """
    if gradients.dim() != 2:
        raise ValueError(f"expected an m × p gradient matrix, got shape {tuple(gradients.shape)}")
    if k < 1:
        raise ValueError(f"basis dimension k must be >= 1, got {k}")
    g = gradients.to(torch.float32)
    gram = (g @ g.T).to(torch.float64).cpu()  # m × m: the eigenproblem runs on the CPU, whatever G's device
    if not bool(torch.isfinite(gram).all()):
        raise ValueError("public gradients are not finite (the model's weights have diverged?): no basis can be computed")
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)  # ascending
    eigenvalues, eigenvectors = eigenvalues.flip(0), eigenvectors.flip(1)
    if not eigenvalues.numel() or eigenvalues[0] <= 0:
        raise ValueError("public gradients are all zero: no basis can be computed")
    keep = min(k, int((eigenvalues > rel_tolerance * eigenvalues[0]).sum()))
    eigenvalues, u = eigenvalues[:keep], eigenvectors[:, :keep]
    signs = torch.sign(u.gather(0, u.abs().argmax(0, keepdim=True)))
    u = u * signs
    return (u / eigenvalues.sqrt()).to(torch.float32).T.contiguous(), eigenvalues.to(torch.float32)


def apply_mixing(gradients: Tensor, mixing: Tensor, out: Tensor | None = None) -> Tensor:
    """V = orthonormalize((mixing · G)ᵀ), p × k' float32 (column-major, the layout Basis keeps), on
    G's device. ``out``: float32 storage of >= k'·p elements, not overlapping G, to build V in."""
    g = gradients.to(torch.float32)
    mixing = mixing.to(g.device)
    if mixing.shape[1] != g.shape[0]:
        raise ValueError(f"the mixing combines {mixing.shape[1]} public gradients, got {g.shape[0]}")
    if out is None:
        rows = mixing @ g
    else:
        rows = torch.matmul(mixing, g, out=buffer_view(out, (mixing.shape[0], g.shape[1]), "basis buffer"))
    return orthonormalize(rows.T)


def basis_from_gradients(
    gradients: Tensor, k: int, rel_tolerance: float = 1e-5, out: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(V p × k' float32 orthonormal, eigenvalues k') from a gradient matrix G (m × p), k' ≤ k
    (see :func:`basis_mixing`). ``out``: float32 storage of >= k·p elements, not overlapping G, to
    build V in (V is a view of it)."""
    mixing, eigenvalues = basis_mixing(gradients, k, rel_tolerance)
    return apply_mixing(gradients, mixing, out), eigenvalues


def orthonormalize(v: Tensor) -> Tensor:
    """Restore orthonormal columns of a p × k float32 V if round-off cost them, same column space.
    Works in place (returns ``v``), in blocks of rows, so no second p × k matrix is allocated.

    float32 round-off can cost orthonormality in small-eigenvalue directions. Check VᵀV (k × k,
    accumulated in float64) and, if needed, re-orthonormalise with Cholesky-QR (V ← V L⁻ᵀ,
    VᵀV = L Lᵀ): two p·k² products instead of a Householder QR of the p × k matrix (~10× slower
    here, and in float32 only good to ~1e-4 for p ≈ 10⁶). Column directions (signs) are kept.
    """
    gram_v = _gram_float64(v).cpu()  # k × k: decided and factorised on the CPU, whatever V's device
    if (gram_v - torch.eye(v.shape[1], dtype=torch.float64)).abs().max() > ORTHONORMAL_TOLERANCE:
        lower = torch.linalg.cholesky(gram_v)
        inverse_t = torch.linalg.inv(lower).T.to(dtype=torch.float32, device=v.device)
        for start in range(0, v.shape[0], _PROJECTION_BLOCK):
            block = v[start : start + _PROJECTION_BLOCK]
            block.copy_(block @ inverse_t)  # V ← V L⁻ᵀ
    return v


def _gram_float64(v: Tensor, block: int = 4096) -> Tensor:
    """VᵀV accumulated in float64 from float32 products of 4096-row blocks. A float32 inner product
    over all p ≈ 10⁶ rows is only good to ~1e-4, too coarse to decide (or achieve) orthonormality;
    over 4096 rows it is good to ~1e-7 (measured at p = 4.7 M, k = 50, also with the mass of V
    concentrated in a few rows) and 7× faster than converting V to float64."""
    rows = v.T  # k × p: contiguous slices when V is column-major (see Basis)
    gram = torch.zeros(v.shape[1], v.shape[1], dtype=torch.float64, device=v.device)
    for start in range(0, v.shape[0], block):
        part = rows[:, start : start + block].to(torch.float32)
        gram += (part @ part.T).to(torch.float64)
    return gram


def workspace_elements(m: int, k: int, p: int) -> int:
    """Size of a :func:`compute_basis` workspace: the m × p gradient matrix, then V (k × p)."""
    return (m + k) * p


def public_shortfall(public_images: int, public_samples: int, k: int) -> str | None:
    """Why every basis will come from fewer public samples (and perhaps fewer directions) than
    configured, or None: m = min(public_samples, public images), and m gradients span at most m
    directions. The public set's size is public, so this may go to any log."""
    if public_images >= public_samples:
        return None
    capped = f", so at most {public_images} of its k = {k} directions" if public_images < k else ""
    return (f"the public set holds {public_images} images, fewer than basis.public_samples = {public_samples}: every "
            f"basis is computed from those {public_images}{capped}; add public images or lower public_samples")


def check_public(batch: dict) -> None:
    if batch.get("provenance") != PUBLIC:
        raise ProvenanceError(
            "compute_basis received a batch not tagged provenance='public': the projection basis "
            "must be computed from public data only (post-processing argument)"
        )


def compute_basis(
    model: TrainableModel,
    public_batch: dict,
    k: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    dtype: str = "float32",
    version: int = 0,
    workspace: Tensor | None = None,
) -> Basis:
    """The projection basis from ``public_batch`` (m public samples) at the model's current weights.

    ``public_batch`` is a collated batch dict ("image", "joints", "weight", "index") that must carry
    ``provenance = "public"``. Per-sample gradients are unclipped (no privacy is spent on public data).

    ``workspace``: float32 storage of >= (m + k)·p elements, reused across refreshes: the m × p
    gradient matrix goes into its head and V into its tail, so a refresh maps no fresh memory
    (~2.8 GB at m = 100, p = 4.7 M, which costs seconds of page faults on these VMs). A float32
    basis is then a view of the workspace: the next refresh with it overwrites that basis.
    """
    check_public(public_batch)
    if dtype not in _DTYPES:
        raise ValueError(f"privacy.basis.dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    features = frozen_features(model, public_batch["image"])
    m = features.shape[0]
    gradient_buffer = basis_buffer = None
    if workspace is not None:
        p = sum(param.numel() for param in model.trainable_parameters().values())
        region = buffer_view(workspace, (m + k, p), "basis workspace").view(-1)  # (m + k)·p elements
        gradient_buffer, basis_buffer = region[: m * p], region[m * p :]
    gradients = gradient_matrix(model, features, public_batch["joints"], public_batch["weight"], chunk_size, gradient_buffer)
    vectors, eigenvalues = basis_from_gradients(gradients, k, out=basis_buffer)
    del gradients
    ids = tuple(int(i) for i in torch.as_tensor(public_batch.get("index", [])).reshape(-1).tolist())
    return Basis(vectors.to(_DTYPES[dtype]), eigenvalues, version, ids)
