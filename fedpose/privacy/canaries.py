"""White-box audit canaries: fixed directions in gradient space, added as records' clipped gradients.

Canary i is a unit vector d_i in the space of the trainable parameters; while it is "in the
dataset" it behaves like a record whose clipped gradient is always C·d_i: it joins each step's
Poisson sample with probability q (its own coin, as any record's) and, when it does, C·d_i is
added to the clipped sum before the noise (:attr:`GradientEngine.canary_gradients`). The score of
canary i is the projection of what is released on d_i.

The directions are exactly orthogonal and need no p × m matrix: a random permutation splits the
coordinates into m disjoint blocks of ⌊p/m⌋, and d_i carries random signs on block i, scaled to
unit norm. (Dense random directions would be only nearly orthogonal and cost m·p floats.)

What "excluded" means follows the guarantee's neighbouring relation (:data:`EXCLUDED_COEFFICIENT`):

* ``add_remove`` (DP): an excluded canary is absent (contributes 0 when its coin says "sampled");
* ``replace_public_membership`` (FDP, MaskDP): neighbours replace a record's private part while its
  membership stays visible, so an excluded canary is present with the opposite private gradient
  −C·d_i — the worst case of that relation (sensitivity 2C).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fedpose.privacy.accountants.base import ADD_REMOVE, REPLACE_PUBLIC_MEMBERSHIP

#: neighbouring relation → the coefficient of C·d_i for a sampled, excluded canary (included: +1)
EXCLUDED_COEFFICIENT: dict[str, float] = {ADD_REMOVE: 0.0, REPLACE_PUBLIC_MEMBERSHIP: -1.0}


@dataclass
class CanarySet:
    """m canaries over a p-dimensional gradient: directions, inclusion coins and per-step sampling."""

    block_of: Tensor  #: (p,) int64: the canary whose block holds each coordinate, −1 for none
    signs: Tensor  #: (p,) float32 ±1
    block_size: int
    included: np.ndarray  #: (m,) bool: each canary's fair coin
    relation: str
    clip: float  #: C: a canary's clipped gradient has exactly this norm
    sample_rate: float  #: q: each canary joins each step's batch with this probability
    rng: np.random.Generator  #: the audit's own coins (inclusion and sampling); not part of the mechanism

    @classmethod
    def create(cls, count: int, num_params: int, relation: str, clip: float, sample_rate: float, seed: int) -> "CanarySet":
        if count < 1:
            raise ValueError(f"need at least one canary, got {count}")
        if num_params < count:
            raise ValueError(f"{count} canaries need at least {count} trainable parameters, the model has {num_params}")
        if relation not in EXCLUDED_COEFFICIENT:
            raise ValueError(f"no canary design for the relation {relation!r}")
        rng = np.random.default_rng(seed)
        block_size = num_params // count
        order = torch.from_numpy(rng.permutation(num_params))
        block_of = torch.full((num_params,), -1, dtype=torch.int64)
        block_of[order[: count * block_size]] = torch.arange(count).repeat_interleave(block_size)
        signs = torch.from_numpy(rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=num_params))
        included = rng.random(count) < 0.5
        return cls(block_of, signs, block_size, included, relation, float(clip), float(sample_rate), rng)

    @property
    def count(self) -> int:
        return int(self.included.size)

    def _spread(self, coefficients: np.ndarray) -> Tensor:
        """Σ_i coefficients[i] · d_i as a (p,) tensor."""
        padded = torch.from_numpy(np.append(coefficients, 0.0).astype(np.float32))  # index −1 → the appended 0
        return padded[self.block_of] * self.signs / float(np.sqrt(self.block_size))

    def step_gradient(self, step: int) -> Tensor:
        """This step's sum of the canaries' clipped gradients (each of norm C when sampled)."""
        sampled = self.rng.random(self.count) < self.sample_rate
        coefficient = np.where(self.included, 1.0, EXCLUDED_COEFFICIENT[self.relation]) * sampled
        return self._spread(self.clip * coefficient)

    def scores(self, released: Tensor) -> np.ndarray:
        """⟨released, d_i⟩ for every canary i (m values)."""
        flat = released.detach().reshape(-1).to(torch.float64)
        mask = self.block_of >= 0
        sums = torch.zeros(self.count, dtype=torch.float64)
        sums.index_add_(0, self.block_of[mask], (flat * self.signs.to(torch.float64))[mask])
        return (sums / float(np.sqrt(self.block_size))).numpy()
