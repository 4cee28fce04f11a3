"""The gradient engine: one training step's gradient for every privacy mechanism.

``build_engine(privacy_cfg, model, dataset_size, batch_size, planned_steps, public_dataset, seed)``
returns a :class:`GradientEngine`; the training loop asks it for batches and gradients::

    engine = build_engine(cfg.privacy, model, len(train_set), cfg.train.batch_size, cfg.train.steps, public_set, seed)
    for step, batch in zip(range(steps), engine.batches(train_set)):
        metrics = engine.step(model, batch)   # sets .grad on model.trainable_parameters()
        optimizer.step()
    privacy_json = engine.privacy_report()

DP mechanisms (see :mod:`fedpose.privacy.mechanisms` for the table):

* **Protection unit** — ``units`` (:class:`~fedpose.data.units.UnitIndex`) groups the records
  into the units the guarantee is about: records, images or patients (``privacy.unit``). Without
  it every record is its own unit. N, B and q below count units, not records.
* **Sampling** — Poisson over units: each unit joins each step's batch independently with
  probability q = B/N (the sampling the RDP analysis assumes), and then its records do (at most
  ``privacy.max_records_per_unit`` of them, chosen uniformly with the same CSPRNG: a fixed cap, so
  which records stand in for the unit never depends on other units). The sampled units vary in
  number and may be none (the step then releases noise only, and is still accounted). Records
  whose gradient is exactly zero under the trainable set (a colour image when only grey copies
  train: ``trainable_records``) never fill a row: the cap then takes the unit's records that
  teach, and a unit with none is sampled all the same, its slot padding only. Those flags are a
  function of the private image, so a public view's own sample (fdp, maskdp: a noise-free
  gradient) ignores them and fills its rows from all of a unit's records.
* **Fixed shape** — every DP step computes the same rows (:mod:`fedpose.privacy.fixed_shape`):
  ``max_batch_units`` unit slots × ``max_records_per_unit`` rows, the sampled units' records in
  their slots and zero-weight padding rows (uniformly drawn records, ``row_mask`` False) in every
  other. A batch of more units than slots keeps them all, in the smallest whole multiple of the
  shape that holds them (never truncated: the (ε, δ) stays exact; for N ≤ N_max this happens with
  probability ≤ η per step). So loading, the forward and the per-sample backward do the same work
  whatever was sampled, and the reply's timing tells nothing of N or of which unit joined. Each
  row's slot travels in the batch as ``unit_index``. A federation site's round (``round_steps``)
  fixes the round's work instead of each step's (:class:`~fedpose.privacy.fixed_shape.RoundWork`):
  each step's units in whole per-sample chunks, the round's last step padded with what the
  earlier ones left of the round's budget, so only the round's total — all an observer of the
  replies can time — is fixed; the frozen forward runs chunk by chunk too, so every chunk of a
  round has the same shape.
* **Augmentation multiplicity** (``privacy.augmentation_multiplicity`` K; De et al. 2022) — every
  row of that layout is loaded K times, each copy an independent draw of the dataset's random
  augmentation (the dataset augments per ``__getitem__``), so a step has U·R·K rows and costs K
  times the work. A unit's gradient is the sum over its records of the mean over their K copies,
  clipped to C once: the sensitivity, σ, q and ε are those of K = 1, while the clipped signal is
  less noisy. Batches of "none" hold each of their B records K times (the plain mean then
  averages each record's copies).
* **Private gradient** — per-sample gradients of the trainable parameters with ``torch.func``
  (:mod:`fedpose.privacy.per_sample` explains why not Opacus hooks), summed per unit, each
  unit's sum clipped to flat L2 norm C as one, summed, plus N(0, σ²C²I), divided by the
  *expected* number of units per batch B (dividing by the realised size would make the scale
  data-dependent). One unit therefore moves the noisy sum by at most C whatever its size.
* **Projection** (pdp, fpdp) — the noisy private gradient is replaced by V Vᵀ g with V from
  public data only (:mod:`fedpose.privacy.projection`), refreshed every
  ``privacy.basis.refresh_every`` steps or supplied by the coordinator (``set_basis``).
* **Public view** (fdp, fpdp, maskdp) — the plain mean gradient of l(ψ(x), y) is added without
  noise, over a public sample (``batch["public_sample"]``) that :meth:`GradientEngine.batches`
  draws with its own coins, independently of the private one — same rate, same fixed shape — so
  that noise-free gradient shows nothing about who is in the private sample (relation
  ``replace_one``). Its ψ(x) go through the frozen prefix in the same forward as the private x
  (one concatenated batch). FDP/FP-DP read ψ(x) from ``public_image``, which the dataset computed
  once per record from the original image before augmentation and then augmented exactly like
  ``image``.
* **Accounting** — every DP step records (σ, q) in a :class:`PrivacyLedger`, whose ε comes from
  ``privacy.accountant`` (default: the tightest accountant exact for the mechanism's relation).
* **σ** — ``privacy.noise_multiplier``, or calibrated so that ``planned_steps`` steps reach at
  most ``privacy.target_epsilon`` at ``privacy.delta``.
* **Device** — the engine works where the model's parameters are: each batch is moved there, the
  clipped sum, the noise (generated on that device, :mod:`fedpose.privacy.noise`), V and the
  projection live there. The caller places the model (``train.device``). The per-sample chunk is
  ``chunk_size``, or decided once when the engine is built, from the fixed step shape and, on
  CUDA, what a chunk of this model measurably costs against the device's free memory then
  (:func:`~fedpose.privacy.per_sample.measured_chunk_size`), never per step:
  every step has the same shapes and chunks, so whether a step runs out of device memory does
  not depend on which units were sampled (an overflowing step, ≤ η per step for N ≤ N_max, runs
  more chunks of the same size and holds a multiple of the batch). Running out raises
  :class:`~fedpose.runtime.DeviceOutOfMemory` naming the settings to lower.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, default_collate

from fedpose.config import PrivacyConfig, grey_copies_refuse_projection
from fedpose.data.units import UnitIndex
from fedpose.privacy import projection
from fedpose.privacy.accountant import PrivacyLedger, default_accountant, noise_multiplier_for, smallest_noise_multiplier
from fedpose.privacy.accountants import bounds
from fedpose.privacy.mechanisms import Mechanism, get_mechanism
from fedpose.privacy.public_views import PUBLIC_VIEW_FUNCTIONS, public_view_kind, public_view_report
from fedpose.privacy.csprng import SEEDED_NO_GUARANTEE
from fedpose.privacy.fixed_shape import RoundWork, StepShape, capacity_warning, round_capacity_warning, round_work, step_shape
from fedpose.model.grey_copies import is_grey_copy_key
from fedpose.privacy.noise import NoiseSource, make_noise
from fedpose.privacy.per_sample import (
    TrainableModel,
    auto_chunk_size,
    clipped_gradient_sum,
    clipped_unit_gradient_sum,
    frozen_features,
    mean_gradient,
    measured_chunk_size,
    unflatten,
)
from fedpose.privacy.report import format_epsilon, guarantee_sentence, protected_unit_text, public_view_statement
from fedpose.runtime import out_of_memory_hint, synchronize

#: the settings that size a training step's memory, named when the device runs out (central runs and sites)
STEP_MEMORY_SETTINGS = ("train.batch_size, privacy.max_batch_units, privacy.max_records_per_unit, "
                        "privacy.augmentation_multiplicity or train.chunk_size")


log = logging.getLogger(__name__)

#: keys separating the seeded (test-only) random streams, with the step index; see InsecureSeededNoise.reseed
_SAMPLING_STREAM, _NOISE_STREAM, _PUBLIC_SAMPLING_STREAM = 1, 2, 3
#: the batch key of a public-view mechanism's public sample (a batch of its own, see _poisson_batches)
PUBLIC_SAMPLE_KEY = "public_sample"
#: the batch key of a round's last step's spare rows (:class:`SpareRows`), in a batch and in its public sample
SPARE_ROWS_KEY = "spare_rows"


@dataclass(frozen=True)
class SpareRows:
    """The rows a round's last step computes beyond its own slots so that the round does its fixed
    work (:mod:`fedpose.privacy.fixed_shape`): padding only — each a record drawn uniformly with the
    CSPRNG, weight 0 — in whole chunks. The step loads, augments and runs them through the same
    forward and per-sample backward as its own rows, one chunk at a time, and discards them: it
    holds one chunk of them, never the whole spare (≈ 12 800 rows at 64 patients of 4 images a step
    and 50 steps a round: 7.5 GB of 256×192 images had the step collated them as one batch)."""

    records: tuple[int, ...]
    #: each row's unit slot (continuing the step's own), None for a public view's sample
    slots: tuple[int, ...] | None
    chunk_rows: int
    dataset: Dataset
    #: each row's augmentation seed (:func:`load_rows`), drawn with the step's own rows'
    augmentation_seeds: tuple[tuple[int, int], ...]

    def __len__(self) -> int:
        return len(self.records)

    def chunks(self) -> Iterator[dict]:
        """The spare, ``chunk_rows`` rows at a time, each part a batch like the step's own."""
        for start in range(0, len(self.records), self.chunk_rows):
            end = start + self.chunk_rows
            records = self.records[start:end]
            yield load_rows(self.dataset, records, None if self.slots is None else self.slots[start:end],
                            [False] * len(records), self.augmentation_seeds[start:end])


def load_rows(dataset: Dataset, records: Sequence[int], slots: Sequence[int] | None, real: Sequence[bool],
              augmentation_seeds: Sequence[tuple[int, int]]) -> dict:
    """The batch of laid-out rows: the records collated, each row's unit slot (``unit_index``; None
    for a public view's sample) and whether it is a sampled record (``row_mask``) or padding.

    Each row draws its augmentation from a generator of its own, seeded by its entry of
    ``augmentation_seeds`` (106 CSPRNG bits: :func:`augmentation_seeds`), never from the dataset's
    stream: there the k-th row loaded gets the k-th draw, so adding one sampled unit would shift the
    augmentation — and the clipped gradient — of every unit loaded after it, and the neighbouring
    sums would differ by more than one unit's C. A dataset without ``load(index, rng)`` draws
    nothing (a tensor set)."""
    load = getattr(dataset, "load", None)
    if len(augmentation_seeds) != len(records):
        raise ValueError(f"{len(augmentation_seeds)} augmentation seeds for {len(records)} rows")
    samples = ([load(i, np.random.default_rng(list(seed))) for i, seed in zip(records, augmentation_seeds)]
               if load is not None else [dataset[i] for i in records])
    batch = collate(samples)
    if slots is not None:
        batch["unit_index"] = torch.as_tensor(slots, dtype=torch.long)
    batch["row_mask"] = torch.as_tensor(real, dtype=torch.bool)
    return batch


def augmentation_seeds(noise: NoiseSource, rows: int) -> list[tuple[int, int]]:
    """A seed for each of ``rows`` rows' augmentation: two 53-bit words of ``noise`` (the CSPRNG;
    the seeded test source in tests), drawn per row whatever record it holds — so a row's
    augmentation is a fresh draw, independent of the other rows and of every config value."""
    words = noise.uniform(2 * rows).mul_(2.0**53).long().tolist()
    return list(zip(words[0::2], words[1::2]))


def collate(samples: Sequence[dict], template: dict | None = None) -> dict:
    """Collate samples; an empty list gives ``template`` sliced to zero rows (an empty batch)."""
    if samples:
        return default_collate(list(samples))
    if template is None:
        raise ValueError("cannot build an empty batch without a template")
    return {key: value[:0] if isinstance(value, Tensor) else collate([], value) if isinstance(value, dict) else []
            for key, value in template.items()}


def batch_to_device(batch: dict, device: torch.device) -> dict:
    """The batch (and its public sample) with every tensor on ``device`` (the same tensors when they are already there)."""
    return {key: value.to(device) if isinstance(value, Tensor) else batch_to_device(value, device)
            if key == PUBLIC_SAMPLE_KEY else value for key, value in batch.items()}


def resolve_accountant(privacy: PrivacyConfig) -> str:
    """``privacy.accountant``, or the tightest accountant exact for the mechanism's relation."""
    relation = get_mechanism(privacy.mechanism).guarantee.relation
    return privacy.accountant if privacy.accountant is not None else default_accountant(relation)


def resolve_noise_multiplier(privacy: PrivacyConfig, sample_rate: float, planned_steps: int,
                             relation: str | None = None, spent: PrivacyLedger | None = None, unit: str | None = None) -> float:
    """σ: ``privacy.noise_multiplier``, or the smallest σ whose ``planned_steps`` steps at rate q
    stay within ``privacy.target_epsilon`` (under ``relation``, by default the mechanism's, at
    ``privacy.delta``, by the resolved accountant). ``spent``: the ledger a resumed run continues —
    its steps count towards ``planned_steps`` and its ε towards the target, so the whole run stays
    within it (calibrating the remaining steps alone ended a resumed run above its target). ``unit``:
    the protection unit the spent ε is stated per in an error."""
    if privacy.noise_multiplier is not None:
        return float(privacy.noise_multiplier)
    if privacy.target_epsilon is None:  # PrivacyConfig's validator already forbids this
        raise ValueError(f"privacy: mechanism '{privacy.mechanism}' needs privacy.noise_multiplier or privacy.target_epsilon")
    relation = relation if relation is not None else get_mechanism(privacy.mechanism).guarantee.relation
    accountant = resolve_accountant(privacy)
    def calibrated() -> float:
        return noise_multiplier_for(privacy.target_epsilon, sample_rate, planned_steps, privacy.delta, relation=relation,
                                    accountant=accountant)

    if spent is None or spent.steps == 0:
        return calibrated()
    # before the whole run's calibration: a target the resumed run already spent is refused at once, saying so
    already = spent.get_epsilon(privacy.delta)[0]
    remaining = max(1, planned_steps - spent.steps)
    spent_text = format_epsilon(already, privacy.delta, get_mechanism(privacy.mechanism).guarantee, spent.accountant,
                                unit=unit, relation=relation)
    where = (f" for the {remaining} steps left after the {spent.steps} the resumed run spent ({spent_text}); "
             "raise privacy.target_epsilon or train fewer steps")
    if already >= privacy.target_epsilon:
        raise ValueError(f"target ε = {privacy.target_epsilon} is unreachable{where}")
    whole_run = calibrated()
    if spent.epsilon_if(whole_run, sample_rate, remaining, privacy.delta) <= privacy.target_epsilon:
        return whole_run  # an interrupted run resumed as planned keeps its σ
    return smallest_noise_multiplier(lambda sigma: spent.epsilon_if(sigma, sample_rate, remaining, privacy.delta),
                                     privacy.target_epsilon, low=whole_run, high=2 * whole_run, where=where)


class GradientEngine:
    """Computes each step's (private) gradient and keeps the privacy ledger. See the module docstring."""

    def __init__(
        self,
        privacy: PrivacyConfig,
        mechanism: Mechanism,
        dataset_size: int,
        batch_size: int,
        planned_steps: int,
        public_dataset: Dataset | None = None,
        seed: int = 0,
        chunk_size: int | None = None,
        units: UnitIndex | None = None,
        memory_settings: str = STEP_MEMORY_SETTINGS,
        ledger: PrivacyLedger | None = None,
        round_steps: int | None = None,
        trainable_records: Sequence[bool] | None = None,
    ) -> None:
        if dataset_size < 1:
            raise ValueError(f"the training set is empty (dataset_size = {dataset_size})")
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        if planned_steps < 1:
            raise ValueError(f"planned steps must be >= 1, got {planned_steps}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk size must be >= 1, got {chunk_size}")
        if round_steps is not None and round_steps < 1:
            raise ValueError(f"a round has at least one step, got round_steps = {round_steps}")
        self.units = units if units is not None else UnitIndex.per_record(dataset_size)
        if self.units.num_records != dataset_size:
            raise ValueError(
                f"the unit index covers {self.units.num_records} records, the training set has {dataset_size}"
            )
        if trainable_records is not None and len(trainable_records) != dataset_size:
            raise ValueError(f"{len(trainable_records)} trainable-record flags for a training set of {dataset_size} records")
        self.privacy = privacy
        self.mechanism = mechanism
        #: records in the training set (the batches' row source)
        self.num_records = int(dataset_size)
        #: each unit's records that can carry a gradient (all of them unless ``trainable_records`` says
        #: otherwise): the records a sampled unit's row slots are filled from (:meth:`sample_units`)
        self.unit_rows: tuple[tuple[int, ...], ...] = self.units.members if trainable_records is None else tuple(
            tuple(r for r in members if trainable_records[r]) for members in self.units.members)
        #: N of the guarantee: the number of protection units (= records for unit "record")
        self.dataset_size = self.units.num_units
        self.batch_size = int(batch_size)
        self.planned_steps = int(planned_steps)
        #: K: rows per record in every batch, each an independent augmentation (augmentation multiplicity)
        self.augmentations = int(privacy.augmentation_multiplicity)
        self.public_dataset = public_dataset
        if mechanism.projects and public_dataset is not None:
            shortfall = projection.public_shortfall(len(public_dataset), privacy.basis.public_samples, privacy.basis.k)  # type: ignore[arg-type]
            if shortfall is not None:
                log.warning(shortfall)
        self.seed = int(seed)
        #: samples per chunk of per-sample gradients; None: per device (:func:`auto_chunk_size`)
        self.chunk_size = None if chunk_size is None else int(chunk_size)
        #: named by the out-of-memory error
        self.memory_settings = memory_settings
        self.steps_done = 0
        #: AUDIT ONLY (``fedpose audit``): step index → the clipped gradients of audit canaries, added to the
        #: clipped sum before the noise as records of the dataset would be (:mod:`fedpose.privacy.canaries`)
        self.canary_gradients: Callable[[int], Tensor] | None = None
        #: AUDIT ONLY: set each step while ``canary_gradients`` is: what the step would have released
        #: from the dataset alone (no canaries, no noise). The auditor knows every record but the
        #: canaries (the DP threat model), so it scores the canaries on the release minus this.
        self.audit_data_release: Tensor | None = None
        self._batches_drawn = 0
        self._shuffle = torch.Generator().manual_seed(self.seed + 1)
        self._public_rng = np.random.default_rng([self.seed, 2])
        self.basis: projection.Basis | None = None
        self._basis_computed_at = -1
        self._basis_external = False
        self.basis_seconds: list[float] = []
        # Storage for the public gradient matrix and V, reused by every refresh (see compute_basis).
        self._basis_workspace: Tensor | None = None
        #: per-sample chunk per (device, p), decided once from the fixed step shape (chunk_for)
        self._chunks: dict[tuple[str, int], int] = {}
        #: the fixed shape of every DP step (None for mechanism "none", whose batches are B records)
        self.shape: StepShape | None = None
        #: the local-log warning for a training set beyond the timing protection's N_max (None: within it)
        self.capacity_warning: str | None = None
        #: T of a site's round: its steps' work is fixed per round, not per step (None: per step)
        self.round_steps = None if round_steps is None else int(round_steps)
        #: the fixed work of a round (None: per step), decided with the per-sample chunk (:meth:`decide_round`)
        self.round: RoundWork | None = None
        #: unit slots this round's steps have taken so far, private sample and public sample
        self._round_slots_used = [0, 0]

        if not mechanism.noisy:
            self.dataset_size_public = True
            self.sample_rate = min(1.0, self.batch_size / self.dataset_size)
            self.noise_multiplier = 0.0
            self.accountant: PrivacyLedger | None = None
            self.noise = None
            return
        # A declared q keeps N secret: under add/remove adjacency neighbouring datasets differ in
        # N, so q = B/N (and every ε or RDP value computed from it) would release N.
        self.dataset_size_public = privacy.sample_rate is None
        if privacy.sample_rate is not None:
            self.sample_rate = float(privacy.sample_rate)
        elif self.batch_size > self.dataset_size:
            raise ValueError(
                f"expected batch size {batch_size} exceeds the training set ({self.dataset_size} "
                f"{self.units.unit}s): the sampling rate q = B/N over units must be <= 1"
            )
        else:
            self.sample_rate = self.batch_size / self.dataset_size
        # The guarantee's neighbouring relation decides the analysis (FDP family: replace-one, see accountant);
        # a relation the configured accountant cannot handle fails here, before any step.
        self.shape = step_shape(self.units.unit, self.batch_size, self.sample_rate, privacy.max_batch_units,
                                privacy.max_records_per_unit, self.augmentations)
        # Beyond N_max the guarantee is unchanged and only timing may vary: a warning, never a refusal
        # (a refusal one more unit could trigger would tell membership); it names N, so local log only.
        # (a round's fixed work has its own N_max, known once the chunk is: decide_round)
        if self.round_steps is None:
            self.capacity_warning = capacity_warning(self.shape, self.dataset_size, self.units.unit, "the training set")
            if self.capacity_warning is not None:
                log.warning(self.capacity_warning)
        self.accountant = self._continued_ledger(ledger) if ledger is not None else PrivacyLedger(
            relation=mechanism.guarantee.relation, accountant=resolve_accountant(privacy))
        # σ for a target ε is calibrated under the ledger's relation: a ledger that continues an older,
        # looser relation composes this run's steps under it, so σ must hold the target there.
        self.noise_multiplier = resolve_noise_multiplier(privacy, self.sample_rate, self.planned_steps,
                                                         self.accountant.relation, spent=self.accountant, unit=self.units.unit)
        self._spent_before = list(self.accountant.history)  # a resumed run's steps: the plan continues them
        # The CSPRNG unless a test asks for seeded noise, which voids the guarantee (see privacy_report).
        self.noise = make_noise(self.seed if privacy.insecure_seeded_noise else None)
        if mechanism.projects and privacy.basis.k < 1:
            raise ValueError("privacy.basis.k must be >= 1")

    def _continued_ledger(self, ledger: PrivacyLedger) -> PrivacyLedger:
        """``ledger`` (a resumed run's events), accounted by the resolved accountant — refused when its
        relation does not bound this mechanism's (its ε would not be a guarantee for these steps)."""
        if not bounds(ledger.relation, self.mechanism.guarantee.relation):
            raise ValueError(
                f"the privacy ledger being continued was accounted under the '{ledger.relation}' relation, which does "
                f"not bound mechanism '{self.mechanism.name}' ('{self.mechanism.guarantee.relation}'); start a new run"
            )
        return ledger.with_accountant(resolve_accountant(self.privacy))

    # -- sampling -------------------------------------------------------------------------------
    @property
    def expected_batch_size(self) -> float:
        """B, the declared batch size (expected units per batch) the noisy sum is divided by.
        Dividing by the realised size (or by q·N) would make the scale depend on the data."""
        return float(self.batch_size)

    def batches(self, dataset: Dataset) -> Iterator[dict]:
        """Endless batches: Poisson-sampled at rate q for DP mechanisms, shuffled epochs for "none".

        Take as many as you need (``zip(range(steps), engine.batches(ds))``). For DP mechanisms a
        batch can be empty (every tensor has 0 rows); pass it to :meth:`step` anyway.
        """
        size = len(dataset)  # type: ignore[arg-type]
        if size != self.num_records:
            raise ValueError(f"engine was built for {self.num_records} records, the dataset has {size}")
        if self.mechanism.noisy:
            yield from self._poisson_batches(dataset)
        else:
            yield from self._shuffled_batches(dataset)

    def _poisson_batches(self, dataset: Dataset) -> Iterator[dict]:
        if self.round_steps is not None and self.round is None:  # an engine not built by build_engine: the CPU's chunk decides
            self.chunk_for(torch.device("cpu"), 0)
        while True:
            assert self.noise is not None
            # Coins of the upcoming step: indexed by step (≥ steps_done, so a resumed run never
            # replays earlier coins) and advancing even when batches are drawn without stepping.
            draw = max(self._batches_drawn, self.steps_done)
            self._batches_drawn = draw + 1
            self.noise.reseed(_SAMPLING_STREAM, draw)
            batch = self._load(dataset, *self._laid_out_sample(draw, 0))
            if self.mechanism.public_view is not None:
                # The public gradient is released without noise: were it taken on the private sample,
                # it would show who was sampled. Its own draw (own stream, same q and shape) shows
                # only itself; the records' public parts are shared by both neighbours anyway.
                self.noise.reseed(_PUBLIC_SAMPLING_STREAM, draw)
                records, _, real, own = self._laid_out_sample(draw, 1)
                batch[PUBLIC_SAMPLE_KEY] = self._load(dataset, records, None, real, own)
            yield batch

    def _load(self, dataset: Dataset, records: list[int], slots: list[int] | None, real: list[bool], own: int) -> dict:
        """The batch of a laid-out draw's first ``own`` rows (never empty: a step has whole chunks);
        the rest, a round's spare, stay unloaded in :class:`SpareRows` until the step runs them."""
        assert self.noise is not None
        seeds = augmentation_seeds(self.noise, len(records))
        batch = load_rows(dataset, records[:own], None if slots is None else slots[:own], real[:own], seeds[:own])
        if own < len(records):
            assert self.round is not None and not any(real[own:])  # only a round's spare follows the step's own rows
            batch[SPARE_ROWS_KEY] = SpareRows(tuple(records[own:]), None if slots is None else tuple(slots[own:]),
                                              self.round.chunk_rows, dataset, tuple(seeds[own:]))
        return batch

    def _laid_out_sample(self, draw: int, sample: int) -> tuple[list[int], list[int], list[bool], int]:
        """Step ``draw``'s Poisson draw (``sample`` 0: the private one, 1: a public view's) laid out in
        the step's fixed shape or, in a round of fixed work, in whole chunks — the round's last step
        also taking the slots its earlier steps left (:meth:`RoundWork.slots_for`) — and how many of
        its rows are the step's own: the rest, padding only, are that spare (:class:`SpareRows`)."""
        # A public view's sample takes each unit's rows from all of its records: the flags that
        # narrow the private sample (trainable_records: grey copies) are computed on the private
        # image, and the noise-free public gradient must depend on public views only.
        rows, unit_of_row = self.sample_units(self.unit_rows if sample == 0 else self.units.members)
        if self.round is None:
            records, slots, real = self.fixed_shape_rows(rows, unit_of_row)
            return records, slots, real, len(records)
        position = draw % self.round.steps
        if position == 0:
            self._round_slots_used[sample] = 0
        sampled, used = max(unit_of_row, default=-1) + 1, self._round_slots_used[sample]
        num_slots = self.round.slots_for(sampled, used, last_step=position == self.round.steps - 1)
        own_slots = self.round.slots_for(sampled, used, last_step=False)
        self._round_slots_used[sample] += num_slots
        records, slots, real = self.fixed_shape_rows(rows, unit_of_row, num_slots)
        return records, slots, real, own_slots * self.shape.rows_per_slot

    def sample_units(self, unit_members: Sequence[Sequence[int]] | None = None) -> tuple[list[int], list[int]]:
        """One step's Poisson draw over units: (record indices, position of each row's unit among
        the sampled units). Every record of a sampled unit that can carry a gradient
        (``unit_members``, default :attr:`unit_rows`) is in, up to the fixed cap; none of an unsampled one; every sampled unit
        is kept, however many (more than the step's slots take more slots,
        :meth:`fixed_shape_rows`), so the draw is exactly the Poisson sampling the accountant
        analyses. Coins come from the engine's noise source (the CSPRNG unless seeded
        for tests)."""
        assert self.noise is not None and self.shape is not None
        chosen = torch.nonzero(self.noise.uniform(self.dataset_size) < self.sample_rate).flatten().tolist()
        cap = self.shape.rows_per_unit
        member_table = self.unit_rows if unit_members is None else unit_members
        rows: list[int] = []
        unit_of_row: list[int] = []
        for position, unit in enumerate(chosen):
            members = member_table[unit]
            if len(members) > cap:
                # uniform subset of size cap: the cap smallest of i.i.d. CSPRNG uniforms
                keep = torch.argsort(self.noise.uniform(len(members)))[:cap].sort().values.tolist()
                members = tuple(members[k] for k in keep)
            rows.extend(members)
            unit_of_row.extend([position] * len(members))
        return rows, unit_of_row

    def fixed_shape_rows(self, rows: Sequence[int], unit_of_row: Sequence[int],
                         num_slots: int | None = None) -> tuple[list[int], list[int], list[bool]]:
        """Lay a draw of :meth:`sample_units` out in the step's fixed shape: (record of each row, its
        unit slot, real or padding), ``shape.rows`` long — or, when more units were sampled than
        the shape has slots, the smallest whole multiple of it that holds them all
        (:meth:`StepShape.slots_for`). Slot s holds rows [s·R, (s+1)·R): sampled unit s's records
        first, then padding. A padding row holds a record drawn uniformly from the training set
        (CSPRNG), so loading it costs what loading a sampled one does (at a site, a warp of one fixed-size
        canonical window: :mod:`fedpose.data.canonical`); its gradient is zeroed
        before any sum. With augmentation multiplicity K every row is then repeated K times
        (adjacent: slot s holds rows [s·R·K, (s+1)·R·K)); loading each copy draws its own
        augmentation. ``num_slots``: a round's step's slots instead (:meth:`_laid_out_sample`)."""
        assert self.noise is not None and self.shape is not None
        per_unit = self.shape.rows_per_unit
        if num_slots is None:
            num_slots = self.shape.slots_for(max(unit_of_row, default=-1) + 1)
        num_rows = num_slots * per_unit
        padding = (self.noise.uniform(num_rows) * self.num_records).long().clamp_(max=self.num_records - 1).tolist()
        records, real = list(padding), [False] * num_rows
        filled = [0] * num_slots
        for record, position in zip(rows, unit_of_row):
            row = position * per_unit + filled[position]
            filled[position] += 1
            records[row], real[row] = int(record), True
        slots = [row // per_unit for row in range(num_rows)]
        if self.shape.augmentations == 1:
            return records, slots, real
        copies = self.shape.augmentations
        return ([r for r in records for _ in range(copies)], [s for s in slots for _ in range(copies)],
                [m for m in real for _ in range(copies)])

    def _shuffled_batches(self, dataset: Dataset) -> Iterator[dict]:
        batch = min(self.batch_size, self.num_records)
        while True:
            order = torch.randperm(self.num_records, generator=self._shuffle).tolist()
            for start in range(0, self.num_records - batch + 1, batch):
                yield collate([dataset[i] for i in order[start: start + batch] for _ in range(self.augmentations)])

    # -- projection basis -------------------------------------------------------------------------
    def set_basis(self, basis: Any, version: int = 0) -> None:
        """Use a basis computed elsewhere (the coordinator's basis service): p × k array/tensor,
        a :class:`~fedpose.privacy.projection.Basis`, or a mapping holding one 2-D array."""
        if not self.mechanism.projects:
            raise ValueError(f"mechanism '{self.mechanism.name}' does not project; it takes no basis")
        if isinstance(basis, projection.Basis):
            self.basis = basis
        else:
            if isinstance(basis, Mapping):
                arrays = [v for v in basis.values() if getattr(v, "ndim", 0) == 2]
                if len(arrays) != 1:
                    raise ValueError(f"basis mapping must hold exactly one 2-D array, got keys {list(basis)}")
                basis = arrays[0]
            # a copy: a received or cached basis may be a read-only buffer (torch warns on those)
            vectors = torch.as_tensor(np.array(basis) if not isinstance(basis, Tensor) else basis)
            if vectors.dim() != 2 or vectors.shape[1] < 1:
                raise ValueError(f"basis must be a p × k matrix, got shape {tuple(vectors.shape)}")
            self.basis = projection.Basis(vectors.to(torch.float32), version=int(version))
        self.basis.version = int(version)
        self._basis_external = True
        self._basis_computed_at = self.steps_done

    def public_batch(self) -> dict:
        """m samples of the public set, tagged ``provenance = "public"``."""
        if self.public_dataset is None:
            raise ValueError("no public dataset: set privacy.basis.public_data (or let the coordinator ship a basis)")
        size = len(self.public_dataset)  # type: ignore[arg-type]
        m = min(self.privacy.basis.public_samples, size)
        ids = sorted(int(i) for i in self._public_rng.choice(size, size=m, replace=False))
        batch = collate([self.public_dataset[i] for i in ids])
        batch["index"] = torch.as_tensor(ids)
        batch["provenance"] = projection.PUBLIC
        return batch

    @property
    def augmentation_cost(self) -> str | None:
        """What augmentation multiplicity costs, for the run's log (None at K = 1): public settings only."""
        if self.augmentations == 1:
            return None
        if self.round is not None:
            work = self.round
            layout = (f"{work.chunks} chunks of {work.units_per_chunk} {self.units.unit} slots × {self.shape.rows_per_unit} "
                      f"records × {self.augmentations} augmentations")
            steps = f"{work.steps} step" + ("s" if work.steps != 1 else "")
            return (f"augmentation multiplicity K = {self.augmentations}: every round of {steps} computes "
                    f"{work.chunks * work.chunk_rows} rows ({layout}), {self.augmentations}× the work of K = 1; σ, q and ε "
                    "are unchanged")
        layout = (f"{self.shape.unit_slots} {self.units.unit} slots × {self.shape.rows_per_unit} records × "
                  f"{self.augmentations} augmentations" if self.shape is not None
                  else f"{self.batch_size} records × {self.augmentations} augmentations")
        return (f"augmentation multiplicity K = {self.augmentations}: every step computes {self.step_rows} rows ({layout}), "
                f"{self.augmentations}× the work and activation memory of K = 1; σ, q and ε are unchanged")

    @property
    def step_rows(self) -> int:
        """Rows of every step: the fixed shape's for DP mechanisms, B·K for "none"."""
        return self.shape.rows if self.shape is not None else self.batch_size * self.augmentations

    def chunk_for(self, device: torch.device, num_params: int) -> int:
        """Samples per chunk of per-sample gradients on ``device``: ``chunk_size``, or decided once per
        device from the step's fixed row count and the memory available at that moment
        (:func:`~fedpose.privacy.per_sample.auto_chunk_size`; :meth:`decide_chunk`, which
        :func:`build_engine` calls for the model's device before any step, measures it on the model
        instead), so no step's chunk (nor whether it fits) depends on what was sampled."""
        if self.round is not None:  # a round's steps are whole chunks of one size
            return self.round.chunk_rows
        if self.chunk_size is not None:
            return self.decide_round(self.chunk_size)
        key = (str(device), int(num_params))
        if key not in self._chunks:
            self._chunks[key] = auto_chunk_size(device, num_params, self.step_rows)
        return self.decide_round(self._chunks[key])

    def decide_round(self, chunk_rows: int) -> int:
        """For a round of fixed work (``round_steps``), decide it once from the first chunk decided
        (whole unit slots of it: :func:`~fedpose.privacy.fixed_shape.round_work`) and check the
        training set against its N_max (local log only); returns the chunk the steps use."""
        if self.round_steps is None or self.shape is None:
            return chunk_rows
        if self.round is None:
            self.round = round_work(self.shape, self.round_steps, chunk_rows)
            self.capacity_warning = round_capacity_warning(self.round, self.dataset_size, self.units.unit, "the training set")
            if self.capacity_warning is not None:
                log.warning(self.capacity_warning)
        return self.round.chunk_rows

    def decide_chunk(self, model: TrainableModel) -> int:
        """Decide the chunk for the model's device before any step (see :meth:`chunk_for`): on CUDA
        with ``chunk_size`` unset, measured on the model (:func:`~fedpose.privacy.per_sample.measured_chunk_size`:
        zero images, no record); the step's inputs are its rows, twice over with a public view."""
        params = model.trainable_parameters()
        device = next(iter(params.values())).device
        num_params = sum(p.numel() for p in params.values())
        key = (str(device), int(num_params))
        if self.chunk_size is None and device.type == "cuda" and key not in self._chunks:
            input_rows = self.step_rows * (2 if self.mechanism.public_view is not None else 1)
            with out_of_memory_hint(f"measuring a per-sample chunk on {device} (p = {num_params:,})", self.memory_settings):
                self._chunks[key] = measured_chunk_size(model, device, self.step_rows, input_rows)
        return self.chunk_for(device, num_params)

    def refresh_basis(self, model: TrainableModel) -> float:
        """Recompute V from the public set at the model's current weights, on the model's device;
        returns seconds taken."""
        started = time.perf_counter()
        version = len(self.basis_seconds)
        params = model.trainable_parameters()
        device = next(iter(params.values())).device
        batch = batch_to_device(self.public_batch(), device)
        self.basis = None  # the new basis is built in the old one's storage
        k = self.privacy.basis.k
        p = sum(param.numel() for param in params.values())
        needed = projection.workspace_elements(len(batch["index"]), k, p)
        if self._basis_workspace is None or self._basis_workspace.numel() < needed or self._basis_workspace.device != device:
            self._basis_workspace = None  # free the old one before allocating the new one
            self._basis_workspace = torch.empty(needed, dtype=torch.float32, device=device)
        with out_of_memory_hint(f"the projection basis (m = {len(batch['index'])} public samples, k = {k}, p = {p:,}) on {device}",
                                "privacy.basis.public_samples, privacy.basis.k or train.chunk_size"):
            self.basis = projection.compute_basis(
                model, batch, k, self.chunk_for(device, p), self.privacy.basis.dtype, version, self._basis_workspace
            )
        self._basis_computed_at = self.steps_done
        self._basis_external = False
        synchronize(device)
        seconds = time.perf_counter() - started
        self.basis_seconds.append(seconds)
        return seconds

    def _basis_due(self) -> bool:
        if self.basis is None:
            return True
        if self._basis_external and self.public_dataset is None:
            return False  # the coordinator decides when a new basis comes
        return self.steps_done - self._basis_computed_at >= self.privacy.basis.refresh_every

    # -- one step ---------------------------------------------------------------------------------
    def step(self, model: TrainableModel, batch: dict) -> dict[str, float]:
        """Set ``.grad`` of ``model.trainable_parameters()`` for this batch; return step metrics.
        Runs on the parameters' device; the batch is moved there."""
        params = model.trainable_parameters()
        device = next(iter(params.values())).device
        batch = batch_to_device(batch, device)
        num_params = sum(p.numel() for p in params.values())
        rows = int(batch["image"].shape[0])
        chunk = f", per-sample gradients {self.chunk_for(device, num_params)} at a time" if self.mechanism.noisy else ""
        with out_of_memory_hint(f"a '{self.mechanism.name}' step on {device} ({rows} samples{chunk}, p = {num_params:,})",
                                self.memory_settings):
            return self._step(model, batch, params, num_params)

    def _step(self, model: TrainableModel, batch: dict, params: dict[str, Tensor], num_params: int) -> dict[str, float]:
        images, joints, weight = batch["image"], batch["joints"], batch["weight"]
        size = int(images.shape[0])
        metrics: dict[str, float] = {"batch_size": float(size)}

        if not self.mechanism.noisy:
            if size == 0:
                raise ValueError("empty batch for non-private training")
            features = frozen_features(model, images)
            gradient, losses = mean_gradient(model, features, joints, weight)
            metrics["loss"] = float(losses.mean())
        else:
            gradient = self._private_step(model, batch, size, num_params, metrics)

        if gradient.numel() != num_params:
            raise RuntimeError(f"gradient has {gradient.numel()} entries for {num_params} parameters")
        for param, grad in zip(params.values(), unflatten(gradient, params).values()):
            param.grad = grad
        self.steps_done += 1
        return metrics

    def _private_step(self, model: TrainableModel, batch: dict, size: int, num_params: int, metrics: dict) -> Tensor:
        assert self.noise is not None and self.accountant is not None
        mechanism, clip = self.mechanism, self.privacy.max_grad_norm
        if mechanism.projects and self._basis_due():
            metrics["basis_seconds"] = self.refresh_basis(model)

        public_sample = None
        if mechanism.public_view is not None and size:
            public_sample = batch.get(PUBLIC_SAMPLE_KEY)
            if public_sample is None:  # never the private batch's own rows: that would show who was sampled
                raise ValueError(f"a '{mechanism.name}' step needs batch['{PUBLIC_SAMPLE_KEY}'], its public sample "
                                 "drawn independently of the private one (engine.batches draws both)")
        public_images = (PUBLIC_VIEW_FUNCTIONS[mechanism.public_view](public_sample, self.privacy)
                         if public_sample is not None else None)
        device = batch["image"].device
        chunk = self.chunk_for(device, num_params)
        clipped_sum = torch.zeros(num_params, device=device)
        public_gradient = None
        if size:
            inputs = batch["image"] if public_images is None else torch.cat([batch["image"], public_images])
            features = frozen_features(model, inputs, chunk)
            unit_index = batch.get("unit_index")
            if unit_index is None:  # a batch built by the caller: every row is its own unit
                if self.augmentations != 1:
                    raise ValueError(f"privacy.augmentation_multiplicity = {self.augmentations}: a batch needs unit_index "
                                     "with each record's copies in its unit (use engine.batches)")
                unit_index = torch.arange(size)
            if len(unit_index) != size:
                raise ValueError(f"batch has {size} rows but {len(unit_index)} unit_index entries")
            if self.augmentations != 1 and bool((torch.unique(unit_index, return_counts=True)[1] % self.augmentations).any()):
                raise ValueError(f"privacy.augmentation_multiplicity = {self.augmentations}: every unit of the batch must "
                                 "hold a whole multiple of that many rows (each record once per augmentation)")
            real = _real_rows(batch, size, device)
            metrics["batch_size"] = float(real.sum())
            clipped_sum, norms, losses, sample_nonfinite, unit_real = self._clipped_sum(
                model, features[:size], batch["joints"], batch["weight"], unit_index, real, chunk)
            # diagnostics over real rows and units only; site-local (rounds.jsonl), never sent
            norms = norms[unit_real]
            finite = torch.isfinite(norms)
            metrics["batch_units"] = float(norms.numel())
            metrics["nonfinite_samples"] = float(sample_nonfinite.sum())  # zeroed before clipping
            sample_finite = real & ~sample_nonfinite
            metrics["loss"] = float(losses[sample_finite].mean()) if bool(sample_finite.any()) else float("nan")
            metrics["grad_norm_median"] = float(norms[finite].median()) if bool(finite.any()) else float("nan")
            metrics["clipped_fraction"] = float((norms > clip).float().mean()) if norms.numel() else 0.0  # over units
            if public_sample is not None:
                public_real = _real_rows(public_sample, len(public_images), device)
                public_gradient, public_losses = mean_gradient(model, features[size:], public_sample["joints"],
                                                               public_sample["weight"], row_mask=public_real, chunk_size=chunk,
                                                               drop_nonfinite_rows=True)
                metrics["public_loss"] = (float(public_losses[public_real].mean()) if bool(public_real.any())
                                          else float("nan"))
            self._run_spare(model, batch.get(SPARE_ROWS_KEY), public_sample, chunk, device)

        if self.canary_gradients is not None:
            self.audit_data_release = self._release(clipped_sum, public_gradient)
            clipped_sum = clipped_sum + self.canary_gradients(self.steps_done).to(device)
        noise_std = self.noise_multiplier * clip
        self.noise.reseed(_NOISE_STREAM, self.steps_done)
        noisy_sum = clipped_sum + self.noise.normal(num_params, noise_std, device=device)
        synchronize(device)  # time the projection alone (CUDA queues work asynchronously)
        started = time.perf_counter()
        gradient = self._release(noisy_sum, public_gradient)
        synchronize(device)
        if mechanism.projects:
            metrics["projection_seconds"] = time.perf_counter() - started
        self.accountant.step(self.noise_multiplier, self.sample_rate)
        metrics["noise_std"] = noise_std / self.expected_batch_size
        return gradient

    def _clipped_sum(self, model: TrainableModel, features: Tensor, joints: Tensor, weight: Tensor, unit_index: Tensor,
                     real: Tensor, chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(clipped sum, units' norms, per-sample losses, non-finite real samples, which units are real)."""
        clip, device = self.privacy.max_grad_norm, features.device
        if int(torch.unique(unit_index).numel()) == len(unit_index):  # one record per unit: the per-sample path
            clipped_sum, norms, losses = clipped_gradient_sum(model, features, joints, weight, clip, chunk, row_mask=real)
            return clipped_sum, norms, losses, ~torch.isfinite(norms) & real, real
        clipped_sum, norms, losses, sample_nonfinite = clipped_unit_gradient_sum(
            model, features, joints, weight, unit_index, clip, chunk, row_mask=real, augmentations=self.augmentations)
        labels = torch.unique(unit_index.to(device))  # ascending, like the returned norms
        return clipped_sum, norms, losses, sample_nonfinite, torch.isin(labels, unit_index.to(device)[real])

    def _run_spare(self, model: TrainableModel, spare: SpareRows | None, public_sample: dict | None, chunk: int,
                   device: torch.device) -> None:
        """A round's last step's spare (:class:`SpareRows`), of the private sample and of a public
        view's: the work its own rows do, chunk by chunk — load, ψ, the frozen forward, the
        per-sample or public gradient — every result discarded (each row has weight 0 anyway)."""
        if spare is not None:
            for part in spare.chunks():
                part = batch_to_device(part, device)
                features = frozen_features(model, part["image"], chunk)
                self._clipped_sum(model, features, part["joints"], part["weight"], part["unit_index"], part["row_mask"], chunk)
        public_spare = None if public_sample is None else public_sample.get(SPARE_ROWS_KEY)
        if public_spare is not None:
            view = PUBLIC_VIEW_FUNCTIONS[self.mechanism.public_view]
            for part in public_spare.chunks():
                part = batch_to_device(part, device)
                features = frozen_features(model, view(part, self.privacy), chunk)
                mean_gradient(model, features, part["joints"], part["weight"], row_mask=part["row_mask"], chunk_size=chunk,
                              drop_nonfinite_rows=True)

    def _release(self, noisy_sum: Tensor, public_gradient: Tensor | None) -> Tensor:
        """The step's gradient from its noisy clipped sum: ÷ B, projected onto V (pdp, fpdp), plus the
        noise-free public-view gradient (fdp, fpdp, maskdp) times privacy.public_gradient_weight."""
        gradient = noisy_sum / self.expected_batch_size
        if self.mechanism.projects:
            assert self.basis is not None
            self.basis = self.basis.to(gradient.device)  # a basis set from the coordinator arrives on the CPU
            gradient = self.basis.project(gradient)
        return gradient if public_gradient is None else gradient + self.privacy.public_gradient_weight * public_gradient

    # -- reporting --------------------------------------------------------------------------------
    def epsilon(self) -> float:
        """ε spent so far (guarantee of this mechanism, at privacy.delta); ∞ for "none"."""
        if self.accountant is None:
            return math.inf
        return self.accountant.get_epsilon(self.privacy.delta)[0]

    def privacy_report(self) -> dict[str, Any]:
        """Everything privacy.json records: what is guaranteed, about what, and how it was computed."""
        mechanism, guarantee = self.mechanism, self.mechanism.guarantee
        report: dict[str, Any] = {
            "mechanism": mechanism.name,
            "guarantee": guarantee.name,
            "guarantee_statement": guarantee.statement,
            "protection_unit": self.units.unit,
            "unit_protected": protected_unit_text(guarantee, self.units.unit),
            "max_records_per_unit": self.shape.rows_per_unit if self.shape is not None else self.privacy.max_records_per_unit,
            "public": guarantee.public,
            "steps": self.steps_done,
            "planned_steps": self.planned_steps,
        }
        if mechanism.uses_dataset_public_view:
            view = public_view_kind(self.privacy.public_view)
            report["guarantee_statement"], report["unit_protected"] = public_view_statement(
                guarantee, view.name, view.many_to_one, view.protects(self.privacy.public_view), self.units.unit)
        if self.dataset_size_public:
            report["dataset_size"] = self.dataset_size
        if self.accountant is None:
            report.update({"epsilon": None, "delta": None, "accountant": None, "epsilon_text": format_epsilon(math.inf, 0.0, "none")})
            return report
        assert self.noise is not None  # every noisy mechanism has both a ledger and a noise source
        epsilon, order = self.accountant.get_epsilon(self.privacy.delta)
        unit = self.units.unit
        epsilon_text = format_epsilon(epsilon, self.privacy.delta, guarantee, self.accountant.accountant, unit=unit,
                                      relation=self.accountant.relation)
        rdp = self.accountant.rdp()
        # the whole run as planned: what a resumed run spent before, then the rest of its steps at σ
        planned = PrivacyLedger(list(self._spent_before), self.accountant.orders, self.accountant.relation, self.accountant.accountant)
        spent_steps = sum(steps for _, _, steps in self._spent_before)
        planned.step(self.noise_multiplier, self.sample_rate, max(0, self.planned_steps - spent_steps))
        report.update({
            "epsilon": _finite_or_none(epsilon),
            "delta": self.privacy.delta,
            "optimal_order": _finite_or_none(order),
            "epsilon_text": epsilon_text if self.noise.secure else f"{SEEDED_NO_GUARANTEE}: {epsilon_text}",
            "guarantee_sentence": guarantee_sentence(
                _finite_or_none(epsilon), self.privacy.delta, guarantee.name, unit, self.accountant.relation,
                self.accountant.accountant,
            ),
            "guarantee_void": not self.noise.secure,
            "planned_epsilon": _finite_or_none(planned.get_epsilon(self.privacy.delta)[0]),
            "target_epsilon": self.privacy.target_epsilon,
            "accountant": self.accountant.accountant,
            "neighbouring_relation": self.accountant.relation,
            "noise_multiplier": self.noise_multiplier,
            "max_grad_norm": self.privacy.max_grad_norm,
            "sample_rate": self.sample_rate,
            "expected_batch_size": self.expected_batch_size,
            "sampling": f"poisson over {unit}s (the records of a sampled {unit} are in the batch, at most "
            f"{self.shape.rows_per_unit}, chosen uniformly; " + (
                f"padded to a fixed {self.shape.unit_slots} {unit} slots)" if self.round is None else
                f"in whole chunks of {self.round.units_per_chunk} {unit} slots, padded to a fixed "
                f"{self.round.slots} {unit} slots a round of {self.round.steps} steps)"),
            "fixed_shape": self.shape.report(unit) if self.round is None else self.round.report(unit),
            "normalisation": f"declared batch size B (train.batch_size, expected {unit}s per batch)",
            "clipping": (f"the summed gradient of each {unit}'s records clipped to C as one" if self.augmentations == 1 else
                         f"the sum over each {unit}'s records of each record's mean gradient over its {self.augmentations} "
                         "augmentations, clipped to C as one (augmentation multiplicity: the sensitivity stays C)"),
            "dataset_size_public": self.dataset_size_public,
            "adjacency": _adjacency_text(self.accountant.relation, self.dataset_size_public, unit),
            "randomness": self.noise.description,
            "reproducible_noise": not self.noise.secure,
            "accountant_state": self.accountant.to_dict(),
            "rdp_curve": {"orders": list(self.accountant.orders), "rdp": [_finite_or_none(float(r)) for r in rdp]},
        })
        if mechanism.projects:
            basis = self.privacy.basis
            report["basis"] = {
                "k": basis.k, "public_samples": basis.public_samples, "refresh_every": basis.refresh_every,
                "dtype": basis.dtype, "source": "coordinator" if self._basis_external else "public set",
                "refreshes": len(self.basis_seconds),
                "current_k": self.basis.k if self.basis is not None else None,
                "current_version": self.basis.version if self.basis is not None else None,
            }
        if mechanism.uses_dataset_public_view:
            report["public_view"] = public_view_report(self.privacy.public_view)
        elif mechanism.public_view is not None:
            mask = self.privacy.mask
            report["public_view"] = {
                "map": "mask", "region": mask.region, "margin": mask.margin, "fill": mask.fill,
                "covers": f"every annotated {mask.region} of the image inside the crop (all people, not only the record's own)",
                "reach": "every crop pixel that any source pixel touching a box (grown by the margin) contributes to: "
                         "1.5 source pixels past the box (bilinear support + half a pixel) × the crop's zoom, rotation and flip "
                         "included; images decoded at full size",
            }
        return report


def _real_rows(batch: dict, rows: int, device: torch.device) -> Tensor:
    """Which of the batch's ``rows`` are real: its ``row_mask`` (the padding rows of a fixed-shape step
    are computed, weighted 0), or all of them in a batch built without one."""
    row_mask = batch.get("row_mask")
    return torch.ones(rows, dtype=torch.bool, device=device) if row_mask is None else row_mask.to(device, torch.bool)


def _adjacency_text(relation: str, dataset_size_public: bool, unit: str) -> str:
    """The neighbouring relation in words, and whether N (counted in units) is part of what is released."""
    if relation == "add_remove":
        base = f"add/remove one {unit}"
        return base + (f" (number of {unit}s N treated as public: q = B/N)" if dataset_size_public else " (N secret: q declared)")
    if relation == "replace_one":
        return f"replace one {unit}'s protected part (public parts shared; batch membership hidden)"
    return f"replace one {unit}'s protected part (public parts and batch membership shared)"


def _finite_or_none(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def build_engine(
    privacy_cfg: PrivacyConfig,
    model: TrainableModel,
    dataset_size: int,
    batch_size: int,
    planned_steps: int,
    public_dataset: Dataset | None = None,
    seed: int = 0,
    chunk_size: int | None = None,
    units: UnitIndex | None = None,
    memory_settings: str = STEP_MEMORY_SETTINGS,
    ledger: PrivacyLedger | None = None,
    round_steps: int | None = None,
    trainable_records: Sequence[bool] | None = None,
) -> GradientEngine:
    """The engine for ``privacy_cfg.mechanism`` (see the module docstring).

    Gradients are taken on the model passed to :meth:`GradientEngine.step`; ``model`` here is
    only checked. Projecting mechanisms need ``public_dataset`` or a basis via ``set_basis``
    before the first step (a federated site gets it from the coordinator). ``units`` groups the
    ``dataset_size`` records into protection units (None: every record is one unit).
    ``chunk_size``: samples per chunk of per-sample gradients (None: 16 on the CPU, from free memory
    on CUDA); ``memory_settings``: what the out-of-memory error tells the user to lower.
    ``ledger``: the privacy ledger a resumed run continues — its relation governs the accounting and
    σ's calibration (it must bound the mechanism's relation). ``round_steps``: the steps of a site's
    round, whose work is then fixed per round instead of per step (:mod:`fedpose.privacy.fixed_shape`).
    ``trainable_records``: one flag per record, False where the record's gradient is exactly zero
    under the model's trainable set (:func:`fedpose.model.grey_copies.records_with_gradient`; None:
    every record trains): a sampled unit's rows in the private sample are its flagged records only.
    """
    mechanism = get_mechanism(privacy_cfg.mechanism)
    params = model.trainable_parameters()
    if not params:
        raise ValueError("the model has no trainable parameters (check model.scenario)")
    if mechanism.projects and any(is_grey_copy_key(name) for name in params):
        raise ValueError(grey_copies_refuse_projection(f"privacy.mechanism '{mechanism.name}'"))
    engine = GradientEngine(privacy_cfg, mechanism, dataset_size, batch_size, planned_steps, public_dataset, seed, chunk_size,
                            units, memory_settings, ledger, round_steps, trainable_records)
    if mechanism.noisy:  # the chunk, from the fixed step shape, before any step (see chunk_for)
        engine.decide_chunk(model)
    return engine
