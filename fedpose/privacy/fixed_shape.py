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
* **Overflow.** K > U is possible. Such a batch is never truncated: it is laid out in ⌈K/U⌉·U
  slots (a whole multiple of the fixed shape, every sampled unit kept, the extra slots padded as
  above). The released update is therefore exactly the Poisson-subsampled Gaussian the accountant
  analyses, and the stated (ε, δ) is exact for every N, with no extra δ term. (Keeping a uniform U
  of the K units instead would not be: a unit joining a full batch displaces another, sensitivity
  2C.) What overflow costs is timing only: such a step does ⌈K/U⌉ times the usual work (and
  holds that many times the batch in memory) — a side channel outside the DP guarantee, which U
  makes negligible. Let η = :data:`OVERFLOW_PROBABILITY`. P(Binomial(n, q) > U) grows with n, so
  it is ≤ η per step for every n ≤ N_max(q, U) := the largest n with P(Binomial(n, q) > U) ≤ η, a
  public function of the declared q and U, reported as such: the timing protection covers
  training sets of at most N_max units. A site with more units still trains under the same
  guarantee; it is warned in its local log only (:func:`capacity_warning`), never in a reply, since
  a status that one unit more or less could flip would itself tell membership. Default U
  (``max_batch_units`` None): the smallest u with P(Poisson(B) > u) ≤ η; a binomial with mean ≤ B
  has a smaller upper tail there (Anderson & Samuels 1967), so N_max ≥ B/q: every site that
  declares q ≤ B/N (at most B units expected per batch) is covered.

* **Augmentation multiplicity** K (``privacy.augmentation_multiplicity``, De et al. 2022): every
  row of that U·R layout is repeated K times, each copy an independent augmentation of its record
  (padding rows too, so a padded slot still costs what a real one does): U·R·K rows per step. The
  engine clips each unit's sum over its records of the mean over their K copies — still one clip
  to C per unit, so the sensitivity, σ, q and ε do not change; a step costs K times the work.

Everything reported (U, R, K, η, N_max) is a function of public values (B, q, the configured caps),
never of N. What this costs: U·R·K rows per step instead of about B·K·(mean records per unit); U/B
is 3.6 at B = 16, 2.5 at B = 40, 1.8 at B = 128 (benchmarks/step_cost).

* **Fixed work per round** (a federation site; the section below): an observer of a site's
  replies times whole rounds, never a step, so a site's round fixes the round's work instead —
  its steps whole chunks of the per-sample chunk's shape, its last step also the round's spare.
  The same sampling and release, so the same (ε, δ); about 60 % of per-step padding's work at the
  main job's settings. Central training (``fedpose train``, audits) keeps per-step shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np
from scipy import stats

#: η, the bound on one step's overflow probability P(Binomial(n, q) > U) for every training set the
#: timing protection covers (n ≤ N_max): over 30 000 steps, a chance below 1e-10 that any step of
#: a run does more than the usual work. It bounds timing only (the DP guarantee is exact); reported
#: with every guarantee.
OVERFLOW_PROBABILITY = 1e-15


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


@dataclass(frozen=True)
class StepShape:
    """The fixed shape of every DP step: ``unit_slots`` × ``rows_per_unit`` records × ``augmentations``
    copies of each."""

    unit_slots: int
    rows_per_unit: int
    sample_rate: float
    #: K: rows per record, each an independent augmentation (augmentation multiplicity)
    augmentations: int = 1

    @property
    def rows_per_slot(self) -> int:
        return self.rows_per_unit * self.augmentations

    @property
    def rows(self) -> int:
        return self.unit_slots * self.rows_per_slot

    @property
    def max_units(self) -> int:
        """N_max: the timing protection covers training sets of at most this many units."""
        return max_units(self.sample_rate, self.unit_slots)

    def slots_for(self, sampled_units: int) -> int:
        """Unit slots of a step that sampled this many units: U, or the smallest whole multiple of
        U that holds them all (never a truncation)."""
        return max(1, -(-int(sampled_units) // self.unit_slots)) * self.unit_slots

    def report(self, unit: str) -> dict:
        """The fixed-shape part of a privacy report: public values only."""
        copies = "" if self.augmentations == 1 else (
            f" × {self.augmentations} augmentations of each ({self.rows} rows, {self.augmentations}× the work of one; "
            "a unit's gradient averages each record's augmentations before its one clip, so ε is unchanged)")
        return {
            "max_batch_units": self.unit_slots,
            "rows_per_unit": self.rows_per_unit,
            "augmentations_per_record": self.augmentations,
            "rows_per_step": self.rows,
            "overflow_probability_per_step": OVERFLOW_PROBABILITY,
            "max_units": self.max_units,
            "statement": (
                f"every step computes {self.unit_slots} {unit} slots × {self.rows_per_unit} record rows{copies} "
                f"(zero-weight padding), the same rows whatever was sampled (at a site each warps a fixed-size canonical window); a batch of more than "
                f"{self.unit_slots} {unit}s keeps every one of them in a whole multiple of that shape, so the "
                f"(ε, δ) above is exact. The timing protection covers training sets of at most {self.max_units} "
                f"{unit}s; a larger batch, probability ≤ {OVERFLOW_PROBABILITY:g} per step, takes a multiple of "
                "the usual work (a timing side channel, outside the DP guarantee)"
            ),
        }


def step_shape(unit: str, batch_size: int, sample_rate: float, max_batch_units: int | None,
               max_records_per_unit: int, augmentations: int = 1) -> StepShape:
    """The step shape for these public settings (``unit``: the protection unit; ``augmentations``: K)."""
    if augmentations < 1:
        raise ValueError(f"augmentations per record must be >= 1, got {augmentations}")
    slots = default_max_batch_units(int(batch_size)) if max_batch_units is None else int(max_batch_units)
    rows_per_unit = 1 if unit == "record" else int(max_records_per_unit)
    return StepShape(slots, rows_per_unit, float(sample_rate), int(augmentations))


def capacity_warning(shape: StepShape, num_units: int, unit: str, where: str) -> str | None:
    """The warning for a training set larger than the timing protection covers (N > N_max), or None.

    Only for the local log: it names N, and a reply that changed with it would tell whether one
    more unit is in the data. The DP guarantee is unchanged either way (module docstring)."""
    if num_units <= shape.max_units:
        return None
    return (
        f"{where}: {num_units} {unit}s, but privacy.max_batch_units = {shape.unit_slots} at q = "
        f"{shape.sample_rate:g} keeps step timing independent of the data only up to {shape.max_units} "
        f"{unit}s: beyond that a step overflows its {shape.unit_slots} slots (and does a multiple of the usual "
        f"work) with probability > {OVERFLOW_PROBABILITY:g}. The (ε, δ) guarantee is unchanged; to restore the "
        "timing protection, raise privacy.max_batch_units or lower privacy.sample_rate"
    )


# -- fixed work per round --------------------------------------------------------------------------------
#
# What an observer of a site's replies can time is a whole round (its T steps), never one step: the
# site sends nothing between them. So a site's round fixes the round's work, not each step's: step t
# computes its K_t sampled units in s·max(1, ⌈K_t/s⌉) unit slots (s = unit slots per per-sample
# chunk, so a step is whole chunks of one shape) and the round's last step also computes what the
# earlier ones left of the round's W chunks: W is the smallest w with P(Σ_t max(1, ⌈K_t/s⌉) > w) ≤ η
# for K_t ~ Binomial(N_max, q), N_max the step shape's (so the round covers every training set the
# per-step shape would; a smaller one only samples fewer). A sum of T steps varies far less,
# relative to its mean, than one step does: at the main job's B = 32 (q = 1/15, U = 86, s = 4) a
# round of 8 steps computes 1.6 B·T slots where per-step padding computes 2.7 B·T — the same
# guarantee (nothing changes in what is sampled or released) and the same timing protection for
# what leaves the site, at 60 % of the work. A step of a round is never truncated either; the
# round's last step loads and runs its spare one chunk at a time (fedpose.privacy.engine.SpareRows),
# so no step holds more than its own rows and one chunk.

#: pmf entries below this are dropped while convolving; their total mass is added to the tail bound
_NEGLIGIBLE_MASS = 1e-30


def _chunk_count_pmf(unit_pmf, units_per_chunk: int):
    """pmf of max(1, ⌈K/s⌉) from the pmf of K (index = units)."""
    counts = np.maximum(1, -(-np.arange(len(unit_pmf)) // units_per_chunk))
    return np.bincount(counts, weights=unit_pmf)


def _trimmed(pmf, offset: int):
    """(pmf without negligible leading/trailing entries, its new offset, the dropped mass)."""
    keep = np.flatnonzero(pmf >= _NEGLIGIBLE_MASS)
    if keep.size == 0:
        return pmf[:1] * 0, offset, float(pmf.sum())
    first, last = int(keep[0]), int(keep[-1])
    dropped = float(pmf[:first].sum() + pmf[last + 1:].sum())
    return pmf[first: last + 1], offset + first, dropped


def _sum_tail(step_pmf, steps: int, threshold: int) -> float:
    """An upper bound on P(S > threshold) for S the sum of ``steps`` i.i.d. draws of ``step_pmf``
    (exact convolution by squaring; every dropped negligible entry counted as tail mass)."""
    base, base_offset, dropped = _trimmed(np.asarray(step_pmf, dtype=np.float64), 0)
    total, total_offset = np.ones(1), 0
    remaining = int(steps)
    while remaining:
        if remaining & 1:
            total, total_offset, lost = _trimmed(np.convolve(total, base), total_offset + base_offset)
            dropped += lost
        remaining >>= 1
        if remaining:
            base, base_offset, lost = _trimmed(np.convolve(base, base), 2 * base_offset)
            dropped += lost
    above = max(0, int(threshold) + 1 - total_offset)
    return float(total[above:].sum()) + dropped


def _unit_pmf(units: int, sample_rate: float):
    """pmf of K ~ Binomial(units, q), the far tail lumped at its top (so only ever more work)."""
    mean = units * sample_rate
    top = min(int(units), int(mean + 20 * mean ** 0.5 + 60))  # P(K > top) < 1e-40
    pmf = stats.binom.pmf(np.arange(top + 1), units, sample_rate)
    pmf[-1] += stats.binom.sf(top, units, sample_rate)
    return pmf


def _last_true(predicate: Callable[[int], bool], first: int) -> int:
    """The largest n ≥ ``first`` with ``predicate(n)``, for a predicate true from ``first`` up to some
    n and false beyond it: doubling, then bisection."""
    low, high = first, max(2 * first, first + 1)
    while predicate(high):
        low, high = high, max(2 * high, high + 1)
    while high - low > 1:  # invariant: predicate(low), not predicate(high)
        mid = (low + high) // 2
        if predicate(mid):
            low = mid
        else:
            high = mid
    return low


def round_overflow_probability(units: int, sample_rate: float, steps: int, units_per_chunk: int, chunks: int) -> float:
    """An upper bound on P(Σ_{t<T} max(1, ⌈K_t/s⌉) > W) for K_t ~ Binomial(units, q): a round's
    chance of more work than W chunks."""
    return _sum_tail(_chunk_count_pmf(_unit_pmf(units, sample_rate), units_per_chunk), steps, chunks)


@lru_cache(maxsize=256)
def round_chunks(sample_rate: float, step_max_units: int, steps: int, units_per_chunk: int) -> int:
    """W: the smallest w with P(Σ_{t<T} max(1, ⌈K_t/s⌉) > w) ≤ η for K_t ~ Binomial(N_max, q), N_max
    the step shape's (so the round covers every training set its steps' shape would)."""
    def passes(chunks: int) -> bool:
        return round_overflow_probability(step_max_units, sample_rate, steps, units_per_chunk, chunks) <= OVERFLOW_PROBABILITY

    # the last failing w, plus one; T − 1 chunks always fail (every step is at least one chunk)
    return _last_true(lambda chunks: not passes(chunks), steps - 1) + 1


@lru_cache(maxsize=256)
def round_max_units(sample_rate: float, steps: int, units_per_chunk: int, chunks: int) -> int:
    """N_max of a round: the most units for which its overflow probability stays ≤ η (monotone in
    n: ⌈Binomial(n, q)/s⌉ grows stochastically with n, and so does a sum of independent ones)."""
    def passes(n: int) -> bool:
        return round_overflow_probability(n, sample_rate, steps, units_per_chunk, chunks) <= OVERFLOW_PROBABILITY

    return _last_true(passes, 1) if passes(1) else 0


@dataclass(frozen=True)
class RoundWork:
    """The fixed work of a round of ``steps`` DP steps (see the section comment above): every step a
    whole number of chunks of ``units_per_chunk`` unit slots (one per-sample chunk each), the round
    ``chunks`` chunks in all."""

    steps: int
    units_per_chunk: int
    chunks: int
    shape: StepShape

    @property
    def slots(self) -> int:
        """Unit slots of a whole round."""
        return self.chunks * self.units_per_chunk

    @property
    def chunk_rows(self) -> int:
        """Rows of one chunk (the per-sample chunk of this round's steps)."""
        return self.units_per_chunk * self.shape.rows_per_slot

    @property
    def max_units(self) -> int:
        """N_max: the round's timing protection covers training sets of at most this many units."""
        return round_max_units(self.shape.sample_rate, self.steps, self.units_per_chunk, self.chunks)

    def slots_for(self, sampled_units: int, slots_used: int, last_step: bool) -> int:
        """Unit slots of a step that sampled this many units, after ``slots_used`` slots of this round's
        earlier steps: whole chunks holding every sampled unit (never a truncation), and on the
        round's last step at least the round's spare too."""
        slots = max(1, -(-int(sampled_units) // self.units_per_chunk)) * self.units_per_chunk
        return max(slots, self.slots - slots_used) if last_step else slots

    def report(self, unit: str) -> dict:
        """The fixed-work part of a privacy report: public values only."""
        return {
            "steps_per_round": self.steps,
            "unit_slots_per_chunk": self.units_per_chunk,
            "rows_per_chunk": self.chunk_rows,
            "chunks_per_round": self.chunks,
            "rows_per_round": self.chunks * self.chunk_rows,
            "rows_per_unit": self.shape.rows_per_unit,
            "augmentations_per_record": self.shape.augmentations,
            "overflow_probability_per_round": OVERFLOW_PROBABILITY,
            "max_units": self.max_units,
            "statement": (
                f"every round computes {self.chunks} chunks of {self.units_per_chunk} {unit} slots × "
                f"{self.shape.rows_per_slot} rows (zero-weight padding; the round's last step takes what its "
                f"steps left over), the same rows whatever was sampled (at a site each warps a fixed-size canonical window); a round that samples more keeps every "
                f"{unit} in more chunks, so the (ε, δ) above is exact. The timing protection covers training sets of "
                f"at most {self.max_units} {unit}s; a larger round, probability ≤ {OVERFLOW_PROBABILITY:g}, takes "
                "more work (a timing side channel, outside the DP guarantee)"
            ),
        }


def round_work(shape: StepShape, steps: int, chunk_rows: int) -> RoundWork:
    """The fixed work of a round of ``steps`` steps of ``shape`` whose per-sample chunk holds about
    ``chunk_rows`` rows (rounded down to whole unit slots, at least one). Public values only: W
    covers the training sets the step shape covers (its N_max, from q and U), never N itself."""
    if steps < 1:
        raise ValueError(f"a round has at least one step, got {steps}")
    units_per_chunk = max(1, int(chunk_rows) // shape.rows_per_slot)
    chunks = round_chunks(shape.sample_rate, shape.max_units, int(steps), units_per_chunk)
    return RoundWork(int(steps), units_per_chunk, chunks, shape)


def round_capacity_warning(work: RoundWork, num_units: int, unit: str, where: str) -> str | None:
    """:func:`capacity_warning` for a round of fixed work (N > its N_max), or None; local log only."""
    if num_units <= work.max_units:
        return None
    return (
        f"{where}: {num_units} {unit}s, but a round of {work.steps} steps at q = {work.shape.sample_rate:g} keeps its "
        f"timing independent of the data only up to {work.max_units} {unit}s: beyond that it takes more than its "
        f"{work.chunks} chunks with probability > {OVERFLOW_PROBABILITY:g}. The (ε, δ) guarantee is unchanged; to restore "
        "the timing protection, lower privacy.sample_rate or raise train.batch_size"
    )
