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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from fedpose.privacy.per_sample import DEFAULT_CHUNK_SIZE, TrainableModel, frozen_features, gradient_matrix

PUBLIC = "public"
#: max |VᵀV − I| accepted before re-orthonormalising
ORTHONORMAL_TOLERANCE = 1e-5
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ProvenanceError(ValueError):
    """A batch that is not certified public reached a computation that must see public data only."""


@dataclass
class Basis:
    """Orthonormal columns V (p × k) and what they were computed from."""

    vectors: Tensor
    eigenvalues: Tensor = field(default_factory=lambda: torch.zeros(0))
    version: int = 0
    public_ids: tuple[int, ...] = ()

    @property
    def k(self) -> int:
        return int(self.vectors.shape[1])

    def project(self, gradient: Tensor) -> Tensor:
        """V (Vᵀ g), computed in V's dtype, returned in g's dtype."""
        v = self.vectors
        if gradient.shape != (v.shape[0],):
            raise ValueError(f"gradient has shape {tuple(gradient.shape)}, the basis is for p = {v.shape[0]}")
        coefficients = v.T @ gradient.to(v.dtype)
        return (v @ coefficients).to(gradient.dtype)


def basis_from_gradients(gradients: Tensor, k: int, rel_tolerance: float = 1e-7) -> tuple[Tensor, Tensor]:
    """(V p × k' float32 orthonormal, eigenvalues k') from a gradient matrix G (m × p), k' ≤ k.

    Directions with eigenvalue below ``rel_tolerance`` × the largest are dropped (rank < k).
    Eigenvector signs are fixed (largest-magnitude entry of u positive) so V is deterministic.
    """
    if gradients.dim() != 2:
        raise ValueError(f"expected an m × p gradient matrix, got shape {tuple(gradients.shape)}")
    if k < 1:
        raise ValueError(f"basis dimension k must be >= 1, got {k}")
    g = gradients.to(torch.float32)
    gram = (g @ g.T).to(torch.float64)
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)  # ascending
    eigenvalues, eigenvectors = eigenvalues.flip(0), eigenvectors.flip(1)
    if not eigenvalues.numel() or eigenvalues[0] <= 0:
        raise ValueError("public gradients are all zero: no basis can be computed")
    keep = min(k, int((eigenvalues > rel_tolerance * eigenvalues[0]).sum()))
    eigenvalues, u = eigenvalues[:keep], eigenvectors[:, :keep]
    signs = torch.sign(u.gather(0, u.abs().argmax(0, keepdim=True)))
    u = u * signs
    v = g.T @ (u / eigenvalues.sqrt()).to(torch.float32)
    return orthonormalize(v), eigenvalues.to(torch.float32)


def orthonormalize(v: Tensor) -> Tensor:
    """Restore orthonormal columns of a p × k float32 V if round-off cost them, same column space.

    float32 round-off can cost orthonormality in small-eigenvalue directions. Check VᵀV (k × k,
    accumulated in float64) and, if needed, re-orthonormalise with Cholesky-QR (V ← V L⁻ᵀ,
    VᵀV = L Lᵀ): two p·k² products instead of a Householder QR of the p × k matrix (~10× slower
    here, and in float32 only good to ~1e-4 for p ≈ 10⁶). Column directions (signs) are kept.
    """
    gram_v = _gram_float64(v)
    if (gram_v - torch.eye(v.shape[1], dtype=torch.float64)).abs().max() > ORTHONORMAL_TOLERANCE:
        lower = torch.linalg.cholesky(gram_v)
        v = v @ torch.linalg.inv(lower).T.to(torch.float32)
    return v


def _gram_float64(v: Tensor, rows: int = 4096) -> Tensor:
    """VᵀV accumulated in float64 from float32 products of 4096-row blocks. A float32 inner product
    over all p ≈ 10⁶ rows is only good to ~1e-4, too coarse to decide (or achieve) orthonormality;
    over 4096 rows it is good to ~1e-7 (measured at p = 4.7 M, k = 50, also with the mass of V
    concentrated in a few rows) and 7× faster than converting V to float64."""
    gram = torch.zeros(v.shape[1], v.shape[1], dtype=torch.float64)
    for start in range(0, v.shape[0], rows):
        block = v[start : start + rows].to(torch.float32)
        gram += (block.T @ block).to(torch.float64)
    return gram


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
) -> Basis:
    """The projection basis from ``public_batch`` (m public samples) at the model's current weights.

    ``public_batch`` is a collated batch dict ("image", "joints", "weight", "index") that must carry
    ``provenance = "public"``. Per-sample gradients are unclipped (no privacy is spent on public data).
    """
    check_public(public_batch)
    if dtype not in _DTYPES:
        raise ValueError(f"privacy.basis.dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    features = frozen_features(model, public_batch["image"])
    gradients = gradient_matrix(model, features, public_batch["joints"], public_batch["weight"], chunk_size)
    vectors, eigenvalues = basis_from_gradients(gradients, k)
    del gradients
    ids = tuple(int(i) for i in torch.as_tensor(public_batch.get("index", [])).reshape(-1).tolist())
    return Basis(vectors.to(_DTYPES[dtype]), eigenvalues, version, ids)
