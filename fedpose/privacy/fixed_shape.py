"""Fixed-shape DP steps: a step's work is a function of public settings, never of the data.

Poisson sampling over units makes the number of sampled units K ~ Binomial(N, q) and a unit's
record count is the data's; a step that computes exactly the sampled rows takes time (and device
memory) that tells an observer of the reply's timing N and whether a large unit (a patient with
48 records) was sampled — outside any ε. So every DP step has the same shape:

* **U unit slots** (``privacy.max_batch_units``) × **R record slots** (``privacy.max_records_per_unit``;
  1 for unit "record", which is one record by definition) = U·R rows, always. Sampled unit j
  fills slot j; a unit with more than R records is represented by R of them chosen uniformly with
  the CSPRNG (its summed gradient is still clipped to C as one, so the sensitivity stays C, and
  which records stand in for it never depends on other units); every remaining row holds a record
  drawn uniformly from the training set with row weight 0. Padded rows are loaded, augmented and
  run through the same forward and per-sample backward as real ones, and their gradients are set
  to exactly 0 before any sum (so they contribute exactly zero, even if non-finite).
* **Overflow.** K > U is possible; such a batch keeps a uniformly random U of its K units (CSPRNG).
  Truncation is not covered by the subsampled-Gaussian accounting (a unit that joins a full batch
  displaces another: sensitivity 2C), so U is chosen so that it essentially never happens and its
  probability is added to δ. Let M be the untruncated mechanism (what the accountant analyses)
  and M' the truncated one; they differ only on the event E that some step of the run overflows,
  so P[M'(D) ∈ S] ≤ P[M(D) ∈ S] + P(E_D) for every S, and for neighbours D, D'

      P[M'(D) ∈ S] ≤ P[M(D) ∈ S] + η_T ≤ e^ε P[M(D') ∈ S] + δ + η_T ≤ e^ε P[M'(D') ∈ S] + δ + (1 + e^ε) η_T,

  with η_T ≤ T·η (union bound over the T steps) and η ≥ P(Binomial(n, q) > U) for both datasets'
  sizes n. So M' is (ε, δ + δ_overflow)-DP with **δ_overflow = (1 + e^ε) · T · η**.
  η is bounded without N (which stays secret, :data:`OVERFLOW_PROBABILITY`): P(Binomial(n, q) > U)
  grows with n, so it is ≤ η for every n ≤ N_max(q, U) := the largest n with
  P(Binomial(n, q) > U) ≤ η. The guarantee is stated for datasets of at most N_max units — a public
  function of the declared q and U, reported as such — and a site whose data has more units refuses
  before any spend (:func:`check_capacity`). Default U (``max_batch_units`` None): the smallest u
  with P(Poisson(B) > u) ≤ η; a binomial with mean ≤ B has a smaller upper tail there (Anderson &
  Samuels 1967), so N_max ≥ B/q: every site that declares q ≤ B/N (at most B units expected per
  batch) is covered.

Everything reported (U, R, η, N_max, δ_overflow) is a function of public values (B, q, the
configured caps, T, ε), never of N. What this costs: U·R rows per step instead of about B·(mean
records per unit); U/B is 3.6 at B = 16, 2.5 at B = 40, 1.8 at B = 128 (benchmarks/step_cost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from scipy import stats

#: η, the bound on one step's overflow probability P(Binomial(n, q) > U) for every dataset the
#: guarantee covers. Small enough that δ_overflow = (1 + e^ε)·T·η stays below 1 % of δ = 1e-5 up
#: to ε = 8 and T = 30 000 steps; it is reported with every guarantee.
OVERFLOW_PROBABILITY = 1e-15


class BatchCapacityError(ValueError):
    """The training set has more units than the fixed step shape covers (names the setting)."""


@lru_cache(maxsize=256)
def default_max_batch_units(batch_size: int) -> int:
    """U for ``max_batch_units = None``: the smallest u with P(Poisson(B) > u) ≤ η."""
    u = max(1, int(stats.poisson.isf(OVERFLOW_PROBABILITY, batch_size)))
    while stats.poisson.sf(u, batch_size) > OVERFLOW_PROBABILITY:
        u += 1
    while u > 1 and stats.poisson.sf(u - 1, batch_size) <= OVERFLOW_PROBABILITY:
        u -= 1
    return u


def overflow_probability(units: int, sample_rate: float, max_batch_units: int) -> float:
    """P(Binomial(units, q) > U): one step's chance that more units are sampled than there are slots."""
    return float(stats.binom.sf(max_batch_units, units, sample_rate))


@lru_cache(maxsize=256)
def max_units(sample_rate: float, max_batch_units: int) -> int:
    """N_max: the most units a site may have for its overflow probability to stay ≤ η (monotone in n)."""
    if overflow_probability(max_batch_units + 1, sample_rate, max_batch_units) > OVERFLOW_PROBABILITY:
        return max_batch_units  # q so close to 1 that any unit beyond U may overflow
    low, high = max_batch_units + 1, 2 * (max_batch_units + 1)
    while overflow_probability(high, sample_rate, max_batch_units) <= OVERFLOW_PROBABILITY:
        low, high = high, 2 * high
    while high - low > 1:  # invariant: low passes, high fails
        mid = (low + high) // 2
        if overflow_probability(mid, sample_rate, max_batch_units) <= OVERFLOW_PROBABILITY:
            low = mid
        else:
            high = mid
    return low


def overflow_delta(steps: int, epsilon: float) -> float:
    """δ_overflow = (1 + e^ε)·T·η, added to the accountant's δ (module docstring); ∞ stays ∞."""
    if steps <= 0:
        return 0.0
    if not math.isfinite(epsilon) or epsilon > 700:
        return math.inf
    return (1.0 + math.exp(epsilon)) * steps * OVERFLOW_PROBABILITY


@dataclass(frozen=True)
class StepShape:
    """The fixed shape of every DP step: ``unit_slots`` × ``rows_per_unit`` rows."""

    unit_slots: int
    rows_per_unit: int
    sample_rate: float

    @property
    def rows(self) -> int:
        return self.unit_slots * self.rows_per_unit

    @property
    def max_units(self) -> int:
        """N_max: the guarantee covers datasets of at most this many units."""
        return max_units(self.sample_rate, self.unit_slots)

    def report(self, unit: str, steps: int, epsilon: float, delta: float) -> dict:
        """The fixed-shape part of a privacy report: public values only."""
        extra = overflow_delta(steps, epsilon)
        return {
            "max_batch_units": self.unit_slots,
            "rows_per_unit": self.rows_per_unit,
            "rows_per_step": self.rows,
            "overflow_probability_per_step": OVERFLOW_PROBABILITY,
            "max_units": self.max_units,
            "delta_overflow": extra if math.isfinite(extra) else None,
            "delta_total": delta + extra if math.isfinite(extra) else None,
            "statement": (
                f"every step computes {self.unit_slots} {unit} slots × {self.rows_per_unit} record rows "
                f"(zero-weight padding); a batch of more than {self.unit_slots} {unit}s keeps a uniform "
                f"{self.unit_slots} of them, which happens with probability ≤ {OVERFLOW_PROBABILITY:g} per step "
                f"for any training set of at most {self.max_units} {unit}s (the guarantee's domain); "
                f"δ_overflow = (1 + e^ε)·T·{OVERFLOW_PROBABILITY:g} is added to δ"
            ),
        }


def step_shape(unit: str, batch_size: int, sample_rate: float, max_batch_units: int | None,
               max_records_per_unit: int) -> StepShape:
    """The step shape for these public settings (``unit``: the protection unit)."""
    slots = default_max_batch_units(int(batch_size)) if max_batch_units is None else int(max_batch_units)
    rows_per_unit = 1 if unit == "record" else int(max_records_per_unit)
    return StepShape(slots, rows_per_unit, float(sample_rate))


def check_capacity(shape: StepShape, num_units: int, unit: str, where: str) -> None:
    """Refuse a training set with more units than the step shape covers (before any spend).

    The message goes to the site's log only (a reply carries the error class): it names N."""
    if num_units > shape.max_units:
        raise BatchCapacityError(
            f"{where}: {num_units} {unit}s, but privacy.max_batch_units = {shape.unit_slots} at q = "
            f"{shape.sample_rate:g} covers at most {shape.max_units} (beyond that a batch would overflow its "
            f"{shape.unit_slots} slots with probability > {OVERFLOW_PROBABILITY:g} per step); raise "
            "privacy.max_batch_units or lower privacy.sample_rate"
        )
