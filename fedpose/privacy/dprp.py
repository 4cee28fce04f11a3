"""Video-DPRP: a differentially private random-projection reconstruction of one video clip.

Paper 002 (Video-DPRP, Algorithm 1), for a clip of F frames flattened to X ∈ [0, 1]^{F×d},
d = H·W·3:

1. split (ε, δ) with the budget allocator b: (ε₁, δ₁) = (bε, bδ), (ε₂, δ₂) = ((1−b)ε, (1−b)δ);
2. Gaussian JL projection P ∈ R^{d×k}, entries N(0, 1/k); Y = X P;
3. Ỹ = Y + N(0, σ₁²) entry-wise — (ε₁, δ₁)-DP (paper's Theorem 3, the Gaussian-JL mechanism of
   Kenthapadi et al.): σ₁ = w₂ · √(2 (ln(1/(2δ₁)) + ε₁)) / ε₁;
4. C = Yᵀ Y (k×k), C̃ = C + N(0, σ₂²) entry-wise — (ε₂, δ₂)-DP (paper's Theorem 4, the classic
   Gaussian mechanism): σ₂ = Δ_C · √(2 ln(1.25/δ₂)) / ε₂, stated for ε₂ < 1;
5. SVD C̃ = U Σ Vᵀ; reconstruct X̂ = Ỹ V_r V_rᵀ P⁺ (P⁺ the Moore–Penrose pseudoinverse), clip to
   [0, 1] and reshape to F×H×W×3.

Neighbouring clips differ in one frame (one row of X), every pixel in [0, 1]. Sensitivities used
here (computed for the realised P, so no JL failure probability enters the guarantee):

* one row of Y changes by (x − x')P: ‖·‖₂ ≤ ‖x − x'‖₂ ‖P‖₂ ≤ √d ‖P‖₂ =: w₂;
* C changes by y yᵀ − y' y'ᵀ: ‖·‖_F ≤ √(‖y‖⁴ + ‖y'‖⁴) ≤ √2 · w₂² =: Δ_C.

The stored copy of paper 002 lost its formulas' symbols, so these constants are our derivation of
what the text states ("sensitivity … maximum change in X, scaled by the norm of P"); see
docs/input-privacy.md. Where the paper's Theorem 4 does not apply (ε₂ ≥ 1) we calibrate σ₂ with
the same tail bound as step 3, which holds for every ε > 0 (labelled in the guarantee).
By basic composition the clip release is (ε₁+ε₂, δ₁+δ₂) = (ε, δ)-DP; step 5 is post-processing.

P and both noises come from :class:`~fedpose.privacy.noise.SecureNoise` (AES-256-CTR keyed from
``os.urandom``) by default. ``insecure_seed`` (tests only) draws them from a seeded generator
instead: whoever knows the seed regenerates the noise, so the guarantee record is marked void.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch

from fedpose.privacy.csprng import SEEDED_NO_GUARANTEE
from fedpose.privacy.accountants.sampler_cut import SECURE_TAIL_BOUND_SIGMAS, tail_cut_delta
from fedpose.privacy.noise import make_noise


class DprpError(ValueError):
    """Invalid Video-DPRP parameters or input."""


@dataclass(frozen=True)
class BudgetSplit:
    epsilon_projection: float
    delta_projection: float
    epsilon_covariance: float
    delta_covariance: float


def proportional_split(epsilon: float, delta: float, split: float = 0.5) -> BudgetSplit:
    """The paper's allocator b: a fraction ``split`` of both ε and δ goes to the projection."""
    if not 0 < split < 1:
        raise DprpError(f"split must be in (0, 1), got {split}")
    return BudgetSplit(split * epsilon, split * delta, (1 - split) * epsilon, (1 - split) * delta)


BUDGET_ALLOCATORS: Mapping[str, Callable[..., BudgetSplit]] = {"proportional": proportional_split}


def jl_gaussian_sigma(sensitivity: float, epsilon: float, delta: float) -> float:
    """σ = Δ · √(2 (ln(1/(2δ)) + ε)) / ε: (ε, δ)-DP for every ε > 0 (Kenthapadi et al.; paper 002 Thm 3)."""
    return sensitivity * math.sqrt(2 * (math.log(1 / (2 * delta)) + epsilon)) / epsilon


def classic_gaussian_sigma(sensitivity: float, epsilon: float, delta: float) -> float:
    """σ = Δ · √(2 ln(1.25/δ)) / ε: (ε, δ)-DP for ε < 1 (Dwork & Roth Thm A.1; paper 002 Thm 4)."""
    if not epsilon < 1:
        raise DprpError(f"the classic Gaussian mechanism needs ε < 1, got {epsilon}")
    return sensitivity * math.sqrt(2 * math.log(1.25 / delta)) / epsilon


def covariance_sigma(sensitivity: float, epsilon: float, delta: float) -> tuple[float, str]:
    """Paper's Theorem 4 when it applies (ε < 1), otherwise the tail bound valid for all ε."""
    if epsilon < 1:
        return classic_gaussian_sigma(sensitivity, epsilon, delta), "classic Gaussian (ε < 1)"
    return jl_gaussian_sigma(sensitivity, epsilon, delta), "Gaussian tail bound (ε ≥ 1)"


def _validate(epsilon: float, delta: float, projection_dim: int, frame_dim: int) -> None:
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise DprpError(f"epsilon must be a finite number > 0, got {epsilon}")
    if not 0 < delta < 1:
        raise DprpError(f"delta must be in (0, 1), got {delta}")
    if int(projection_dim) != projection_dim or projection_dim < 1:
        raise DprpError(f"proj-dim must be a positive integer, got {projection_dim}")
    if projection_dim > frame_dim:
        raise DprpError(f"proj-dim {projection_dim} exceeds the frame dimension H·W·3 = {frame_dim}")


@dataclass(frozen=True)
class DprpResult:
    frames: np.ndarray  #: F×H×W×3 float32 in [0, 1]
    guarantee: dict[str, object]


def video_dprp(
    clip: np.ndarray,
    epsilon: float,
    delta: float,
    projection_dim: int,
    *,
    split: float = 0.5,
    rank: int | None = None,
    insecure_seed: int | None = None,
) -> DprpResult:
    """Privatize one clip (F×H×W×3, values in [0, 1]) with Video-DPRP. ``rank``: how many right
    singular vectors of the noisy covariance to keep (default min(F, k): Y has rank ≤ F).
    ``insecure_seed``: TESTS ONLY, reproducible and NOT PRIVATE (see the module docstring)."""
    clip = np.asarray(clip, dtype=np.float64)
    if clip.ndim != 4 or clip.shape[-1] != 3:
        raise DprpError(f"expected a clip F×H×W×3, got shape {clip.shape}")
    if clip.size == 0 or not np.isfinite(clip).all() or clip.min() < 0 or clip.max() > 1:
        raise DprpError("clip values must be finite and in [0, 1] (the sensitivity assumes it)")
    frames, frame_dim = clip.shape[0], int(np.prod(clip.shape[1:]))
    _validate(epsilon, delta, projection_dim, frame_dim)
    k = int(projection_dim)
    rank = min(frames, k) if rank is None else int(rank)
    if not 1 <= rank <= k:
        raise DprpError(f"rank must be in [1, {k}], got {rank}")
    budget = proportional_split(epsilon, delta, split)
    noise = make_noise(insecure_seed)

    def gaussian(shape: tuple[int, int], std: float) -> np.ndarray:
        return noise.normal(shape[0] * shape[1], std, torch.float64).numpy().reshape(shape)

    x = clip.reshape(frames, frame_dim)
    projection = gaussian((frame_dim, k), 1.0 / math.sqrt(k))
    gram = projection.T @ projection  # k×k; ‖P‖₂² = its largest eigenvalue
    projection_norm = math.sqrt(float(np.linalg.eigvalsh(gram)[-1]))
    row_sensitivity = math.sqrt(frame_dim) * projection_norm  # w₂
    covariance_sensitivity = math.sqrt(2.0) * row_sensitivity**2  # Δ_C
    sigma_projection = jl_gaussian_sigma(row_sensitivity, budget.epsilon_projection, budget.delta_projection)
    sigma_covariance, covariance_rule = covariance_sigma(
        covariance_sensitivity, budget.epsilon_covariance, budget.delta_covariance
    )

    projected = x @ projection
    noisy_projected = projected + gaussian(projected.shape, sigma_projection)
    covariance = projected.T @ projected
    noisy_covariance = covariance + gaussian(covariance.shape, sigma_covariance)
    _, _, right_t = np.linalg.svd(noisy_covariance)
    basis = right_t[:rank].T  # k×r
    coords = noisy_projected @ basis @ basis.T  # F×k, post-processing of the two releases
    # X̂ = coords · P⁺ with P⁺ = (PᵀP)⁻¹Pᵀ (P has full column rank k ≤ d almost surely)
    reconstruction = np.linalg.solve(gram, coords.T).T @ projection.T
    out = np.clip(reconstruction, 0.0, 1.0).reshape(clip.shape).astype(np.float32)

    # The sampler stops at 8.57σ: at a large ε a frame moves a coordinate by several σ, and outputs
    # that only one clip can produce gain real probability (at ε 1000, ~0.4); it is part of δ.
    shift_projection, shift_covariance = row_sensitivity / sigma_projection, covariance_sensitivity / sigma_covariance
    cut = min(1.0, tail_cut_delta(k, shift_projection) + tail_cut_delta(k * k, shift_covariance))
    delta_total = min(1.0, float(delta) + cut)
    statement = "(ε, δ)-DP for one clip w.r.t. changing any one frame (pixels in [0, 1])"
    if cut > 0.01 * delta:
        statement += (f"; δ = {delta_total:.3g}, not the {delta:g} asked for: the noise sampler stops at "
                      f"{SECURE_TAIL_BOUND_SIGMAS:.2f}σ and at this ε a frame moves the release by "
                      f"{max(shift_projection, shift_covariance):.2f}σ (lower ε)")
    guarantee: dict[str, object] = {
        "mechanism": "video-dprp",
        "guarantee": "DP",
        "guarantee_statement": statement if noise.secure else f"{SEEDED_NO_GUARANTEE}: {statement}",
        "guarantee_void": not noise.secure,
        "randomness": noise.description,
        "cryptographically_secure": noise.secure,
        "epsilon": float(epsilon),
        "delta": delta_total,
        "delta_requested": float(delta),
        "delta_sampler_cut": cut,
        "accountant": "basic composition of two Gaussian mechanisms (δ includes the sampler's cut at 8.57σ)",
        "unit_protected": "one frame of the clip",
        "neighbouring_relation": "replace_one",  # neighbouring clips differ in one frame (a row of X)
        "public": "nothing (P is data-independent; the guarantee holds for the realised P)",
        "split": split,
        "epsilon_projection": budget.epsilon_projection,
        "delta_projection": budget.delta_projection,
        "epsilon_covariance": budget.epsilon_covariance,
        "delta_covariance": budget.delta_covariance,
        "projection_dim": k,
        "rank": rank,
        "sensitivity_projection": row_sensitivity,
        "sensitivity_covariance": covariance_sensitivity,
        "sigma_projection": sigma_projection,
        "sigma_covariance": sigma_covariance,
        "covariance_calibration": covariance_rule,
        "scope": "per clip and per frame; m changed frames are covered only by group privacy (mε, m·e^{(m−1)ε}·δ)",
    }
    return DprpResult(frames=out, guarantee=guarantee)
