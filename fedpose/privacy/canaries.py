"""White-box audit canaries: directions in gradient space, added as records' clipped gradients.

Canary i is a unit vector d_i in the space of the trainable parameters; while it is "in the
dataset" it behaves like a record whose clipped gradient is C·d_i: it joins each step's Poisson
sample with probability q (its own coin, as any record's) and, when it does, C·d_i is added to the
clipped sum before the noise (:attr:`GradientEngine.canary_gradients`). The score of canary i is
the projection of what is released on d_i.

Directions (:class:`BlockDirections`, :class:`BasisDirections`):

* Mechanisms that release the whole gradient get m exactly orthogonal directions and need no p × m
  matrix: a random permutation splits the coordinates into m disjoint blocks of ⌊p/m⌋, and d_i
  carries random signs on block i, scaled to unit norm. (Dense random directions would be only
  nearly orthogonal and cost m·p floats.)
* Projecting mechanisms (pdp, fpdp) release only V Vᵀ g, V a k-column basis from public data:
  a direction outside span(V) is removed by the projection and the audit sees nothing. Their
  canaries are the columns of V (orthonormal, and kept by the projection), so at most k canaries
  fit in one release. More canaries take turns: canary i belongs to release group ⌊i/k⌋, each group
  active during its own stretch of releases (a canary's gradient is 0 outside its stretch, which any
  record's may be). A group's directions are the basis in force at its first step; the scorer needs
  nothing but that basis, which is public (computed from public data and earlier releases).

What "excluded" means follows the guarantee's neighbouring relation (:data:`EXCLUDED_COEFFICIENT`):

* ``add_remove`` (DP): an excluded canary is absent (contributes 0 when its coin says "sampled");
* ``replace_one`` (FDP, MaskDP) and ``replace_public_membership``: neighbours replace a record's
  private part while the record stays, so an excluded canary is present with the opposite private
  gradient −C·d_i — the worst case of both relations (sensitivity 2C). Its coin is its own either
  way; the relations differ in what else the release shows about the coin, not in the canary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np
import torch
from torch import Tensor

from fedpose.privacy.accountants.base import ADD_REMOVE, REPLACE_ONE, REPLACE_PUBLIC_MEMBERSHIP

#: neighbouring relation → the coefficient of C·d_i for a sampled, excluded canary (included: +1)
EXCLUDED_COEFFICIENT: dict[str, float] = {ADD_REMOVE: 0.0, REPLACE_ONE: -1.0, REPLACE_PUBLIC_MEMBERSHIP: -1.0}


class Directions(Protocol):
    """K orthonormal directions (slots) for the canaries of one release group."""

    slots: int

    def fix(self) -> None:
        """Called at a group's first step: take the directions this group will use."""

    def combine(self, coefficients: np.ndarray) -> Tensor:
        """Σ_s coefficients[s] · d_s as a (p,) float32 tensor."""

    def project(self, vector: Tensor) -> np.ndarray:
        """⟨vector, d_s⟩ for every slot s (K float64 values)."""


@dataclass
class BlockDirections:
    """``slots`` exactly orthogonal sparse unit vectors over p coordinates (module docstring), fixed."""

    block_of: Tensor  #: (p,) int64: the slot whose block holds each coordinate, −1 for none
    signs: Tensor  #: (p,) float32 ±1
    block_size: int
    slots: int

    @classmethod
    def create(cls, slots: int, num_params: int, rng: np.random.Generator) -> "BlockDirections":
        if num_params < slots:
            raise ValueError(f"{slots} canaries need at least {slots} trainable parameters, the model has {num_params}")
        block_size = num_params // slots
        order = torch.from_numpy(rng.permutation(num_params))
        block_of = torch.full((num_params,), -1, dtype=torch.int64)
        block_of[order[: slots * block_size]] = torch.arange(slots).repeat_interleave(block_size)
        signs = torch.from_numpy(rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=num_params))
        return cls(block_of, signs, block_size, slots)

    def fix(self) -> None:
        pass

    def combine(self, coefficients: np.ndarray) -> Tensor:
        padded = torch.from_numpy(np.append(coefficients, 0.0).astype(np.float32))  # index −1 → the appended 0
        return padded[self.block_of] * self.signs / math.sqrt(self.block_size)

    def project(self, vector: Tensor) -> np.ndarray:
        flat = vector.detach().reshape(-1).to(torch.float64)
        mask = self.block_of >= 0
        sums = torch.zeros(self.slots, dtype=torch.float64)
        sums.index_add_(0, self.block_of[mask], (flat * self.signs.to(torch.float64))[mask])
        return (sums / math.sqrt(self.block_size)).numpy()


@dataclass
class BasisDirections:
    """The first ``slots`` columns of the projection basis in force when a group starts (a copy: the
    engine rebuilds its basis in place). A basis of rank k' < ``slots`` leaves slots ≥ k' without a
    direction: those canaries add and score nothing in that group."""

    current_basis: Callable[[], Any]  #: → the engine's :class:`~fedpose.privacy.projection.Basis` (or None)
    slots: int
    vectors: Tensor | None = field(default=None, init=False)  #: p × k' float32

    def fix(self) -> None:
        basis = self.current_basis()
        if basis is None:
            raise RuntimeError("a projecting mechanism's canaries need the basis, and the engine has none yet")
        self.vectors = basis.vectors[:, : self.slots].to(torch.float32).clone()

    def combine(self, coefficients: np.ndarray) -> Tensor:
        assert self.vectors is not None, "fix() first"
        used = torch.from_numpy(coefficients[: self.vectors.shape[1]].astype(np.float32))
        return self.vectors @ used

    def project(self, vector: Tensor) -> np.ndarray:
        assert self.vectors is not None, "fix() first"
        values = np.zeros(self.slots)
        values[: self.vectors.shape[1]] = (self.vectors.T @ vector.detach().reshape(-1).to(torch.float32)).double().numpy()
        return values


def canary_capacity(slots: int | None, releases: int) -> int | None:
    """How many canaries fit: ``slots`` directions per release (None: unlimited, one fixed direction each)."""
    return None if slots is None else slots * releases


@dataclass
class CanarySet:
    """m canaries over a p-dimensional gradient: inclusion coins, directions, release groups, per-step sampling.

    A run's releases are what the scorer sees: every step's gradient in central training
    (``steps_per_release`` = 1), or a site round's one update Δ (``steps_per_release`` = its steps).
    """

    directions: Directions
    included: np.ndarray  #: (m,) bool: each canary's fair coin
    relation: str
    clip: float  #: C: a canary's clipped gradient has exactly this norm
    sample_rate: float  #: q: each canary joins each step's batch with this probability
    steps_per_release: int
    releases: int
    groups: int  #: release groups: the canaries take turns, ``directions.slots`` at a time
    rng: np.random.Generator  #: the audit's own coins (inclusion and sampling); not part of the mechanism
    _fixed_group: int = field(default=-1, init=False)

    @classmethod
    def create(
        cls,
        count: int,
        num_params: int,
        relation: str,
        clip: float,
        sample_rate: float,
        seed: int,
        releases: int = 1,
        steps_per_release: int = 1,
        basis: Callable[[], Any] | None = None,
        basis_size: int | None = None,
    ) -> "CanarySet":
        """``basis`` (with ``basis_size`` = k) for projecting mechanisms: → the engine's current basis."""
        if count < 1:
            raise ValueError(f"need at least one canary, got {count}")
        if relation not in EXCLUDED_COEFFICIENT:
            raise ValueError(f"no canary design for the relation {relation!r}")
        if releases < 1 or steps_per_release < 1:
            raise ValueError(f"need releases ≥ 1 and steps per release ≥ 1, got {releases}, {steps_per_release}")
        rng = np.random.default_rng(seed)
        directions: Directions
        if basis is None:
            directions = BlockDirections.create(count, num_params, rng)
        else:
            if basis_size is None or basis_size < 1:
                raise ValueError("canaries in the basis need its size k")
            capacity = canary_capacity(basis_size, releases)
            if count > capacity:
                raise ValueError(
                    f"{count} canaries do not fit a projecting mechanism's releases: k = {basis_size} directions in each "
                    f"of {releases} release(s) hold at most {capacity} (fewer canaries, more steps or a larger basis.k)"
                )
            directions = BasisDirections(basis, min(basis_size, count))
        groups = -(-count // directions.slots)
        included = rng.random(count) < 0.5
        return cls(directions, included, relation, float(clip), float(sample_rate), int(steps_per_release),
                   int(releases), groups, rng)

    @property
    def count(self) -> int:
        return int(self.included.size)

    def _group(self, release: int) -> int:
        """Groups take consecutive stretches of the releases, as equal as the counts allow (each ≥ 1)."""
        return min(release, self.releases - 1) * self.groups // self.releases

    def _members(self, group: int) -> slice:
        slots = self.directions.slots
        return slice(group * slots, min((group + 1) * slots, self.count))

    def step_gradient(self, step: int) -> Tensor:
        """This step's sum of the active canaries' clipped gradients (each of norm C when sampled)."""
        group = self._group(step // self.steps_per_release)
        if group != self._fixed_group:
            self.directions.fix()
            self._fixed_group = group
        members = self._members(group)
        included = self.included[members]
        sampled = self.rng.random(included.size) < self.sample_rate
        coefficients = np.zeros(self.directions.slots)
        coefficients[: included.size] = np.where(included, 1.0, EXCLUDED_COEFFICIENT[self.relation]) * sampled
        return self.directions.combine(self.clip * coefficients)

    def scores(self, released: Tensor, release: int = 0) -> np.ndarray:
        """⟨released, d_i⟩ for the canaries active in ``release`` (the others: 0), m values."""
        group = self._group(release)
        if group != self._fixed_group:
            raise RuntimeError(f"release {release} is scored with the directions of group {self._fixed_group}, not {group}")
        members = self._members(group)
        out = np.zeros(self.count)
        out[members] = self.directions.project(released)[: members.stop - members.start]
        return out
