"""Amplified banded matrix-factorization noise (BandMF), priced for a site's round structure.

DP-SGD adds independent noise z_t to each step's clipped-gradient sum. A matrix-factorization
mechanism adds correlated noise C⁻¹z instead, with C lower-triangular, so that later steps cancel
part of earlier steps' noise (Denisov et al. 2022; Choquette-Choo et al. 2023). The released
gradients are then G + C⁻¹z, and what the noise does to the model is linear in it: the model after
step t is θ₀ − η·Σ_s A[t, s]·(noisy gradient)_s, with A the optimizer's workload matrix.

Its privacy, exactly (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization",
the cyclic-Poisson amplification theorem): let C be b-banded (C[t, s] = 0 unless 0 ≤ t − s < b)
with every column of unit norm; split the units (patients) into b equal groups, and at step t
sample each unit of group t mod b with probability p. Then releasing G + C⁻¹z with z ~ N(0, σ²C²I)
per step has the privacy of DP-SGD run for ⌈T/b⌉ steps at sampling rate p and noise multiplier σ.
Keeping the expected batch B of a dataset of N units means p = b·B/N = b·q: a wider band buys
noise cancellation and pays with less amplification (fewer, denser steps). b = 1 is DP-SGD.

So for a target ε the mean squared noise in the iterates is σ_b²·‖A C⁻¹‖²_F (times C²/B², the same
for every b), against DP-SGD's σ₁²·‖A‖²_F; ``best_banded_factor`` finds the C that minimizes
‖A C⁻¹‖_F among b-banded, unit-column ones. The ratio of the two root-mean-squares is what
correlated noise could save a site, at best, under an exact account.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fedpose.privacy.accountant import noise_multiplier_for


def iterate_workload(rounds: int, local_steps: int, momentum: float) -> np.ndarray:
    """A[t, s]: the weight of step s's gradient in the model after step t, in units of the site's lr.

    A site runs SGD with heavy-ball momentum (torch's: v ← βv + g; θ ← θ − ηv) from a fresh optimizer
    every round, and the coordinator adds the round's Δ (FedAvg, server step 1). So within a round
    a gradient keeps acting through the momentum buffer, Σ_{k=s}^{t} β^{k−s}; at the round's end the
    buffer is dropped and what it moved stays in the model.
    """
    steps = rounds * local_steps
    workload = np.zeros((steps, steps))
    for s in range(steps):
        round_end = (s // local_steps + 1) * local_steps - 1
        for t in range(s, steps):
            last = min(t, round_end)
            workload[t, s] = sum(momentum ** (k - s) for k in range(s, last + 1))
    return workload


def banded_mask(steps: int, bands: int) -> np.ndarray:
    rows, cols = np.indices((steps, steps))
    return (rows >= cols) & (rows - cols < bands)


def best_banded_factor(workload: np.ndarray, bands: int, start: np.ndarray | None = None,
                       max_iterations: int = 500) -> tuple[np.ndarray, float]:
    """(C, ‖A C⁻¹‖_F): the b-banded lower-triangular C with unit columns that minimizes ‖A C⁻¹‖_F.

    The columns are normalized inside the objective (C = M / ‖M_col‖), so the sensitivity stays 1
    and L-BFGS runs unconstrained on the band's entries, from ``start`` (a narrower band's optimum,
    so a wider band never ends worse) or the identity (DP-SGD). ``workload`` may have fewer rows
    than columns (e.g. only the final model).

    The optimum is global: X = CᵀC ranges over the unit-diagonal positive-definite matrices of
    bandwidth b − 1 (a convex set; Cholesky keeps the band, so each such X has one such C with a
    positive diagonal), and ‖A C⁻¹‖²_F = tr(A X⁻¹ Aᵀ) is convex in X. A stationary point is the minimum.
    """
    steps = workload.shape[1]
    mask = torch.from_numpy(banded_mask(steps, bands))
    target = torch.from_numpy(workload)
    initial = torch.eye(steps, dtype=torch.float64) if start is None else torch.from_numpy(start)
    entries = initial[mask].clone().requires_grad_(True)

    def factor(values: torch.Tensor) -> torch.Tensor:
        matrix = torch.zeros(steps, steps, dtype=torch.float64).masked_scatter(mask, values)
        return matrix / matrix.norm(dim=0, keepdim=True)

    def error(values: torch.Tensor) -> torch.Tensor:
        inverse = torch.linalg.solve_triangular(factor(values), torch.eye(steps, dtype=torch.float64), upper=False)
        return (target @ inverse).pow(2).sum()

    optimizer = torch.optim.LBFGS([entries], max_iter=max_iterations, tolerance_grad=1e-10, tolerance_change=1e-14,
                                  history_size=50, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        value = error(entries)
        value.backward()
        return value

    optimizer.step(closure)
    with torch.no_grad():
        return factor(entries).numpy(), math.sqrt(error(entries).item())


def cyclic_poisson_noise_multiplier(target_epsilon: float, sample_rate: float, steps: int, bands: int,
                                    delta: float) -> float:
    """σ of b-banded MF under cyclic Poisson sampling for (ε, δ) per unit: DP-SGD's PLD σ for ⌈T/b⌉
    steps at rate b·q (the amplification theorem above; b = 1 is DP-SGD itself)."""
    if bands * sample_rate > 1:
        raise ValueError(f"{bands} bands at q = {sample_rate:g}: a group's sampling rate b·q would exceed 1")
    return noise_multiplier_for(target_epsilon, bands * sample_rate, math.ceil(steps / bands), delta,
                                rel_tolerance=1e-4, accountant="pld")
