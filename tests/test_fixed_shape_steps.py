"""Fixed-shape DP steps (fedpose.privacy.fixed_shape): every step computes the same rows whatever
was sampled, padding contributes exactly zero, a large unit still moves the sum by at most C, the
overflow bound and the timing protection's domain are functions of public values, an overflowing
batch keeps every sampled unit (so the accountant's (ε, δ) is exact, with no extra δ term) and a
training set beyond the domain trains, warned in the log only, and the per-sample chunk is decided
once, from the fixed shape, before any step (issue 24, items 3 and 8)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from scipy import stats

from fedpose.config import PrivacyConfig
from fedpose.data.units import UnitIndex
from fedpose.privacy import engine as engine_module
from fedpose.privacy import fixed_shape
from fedpose.privacy import per_sample as per_sample_module
from fedpose.privacy.engine import build_engine
from fedpose.privacy.fixed_shape import (
    OVERFLOW_PROBABILITY,
    StepShape,
    capacity_warning,
    default_max_batch_units,
    max_units,
)
from fedpose.privacy.per_sample import (
    chunk_size_for,
    clipped_gradient_sum,
    clipped_unit_gradient_sum,
    frozen_features,
    mean_gradient,
)
from test_dp_engine import TensorPoseSet, batch_of, make_model


@pytest.fixture(scope="module")
def model():
    return make_model()


def patients(sizes: list[int]) -> UnitIndex:
    members, start = [], 0
    for size in sizes:
        members.append(tuple(range(start, start + size)))
        start += size
    return UnitIndex("patient", tuple(members))


def dp(**kwargs) -> PrivacyConfig:
    base = {"mechanism": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0, "sample_rate": 0.25,
            "insecure_seeded_noise": True}
    return PrivacyConfig(**{**base, **kwargs})


# -- the overflow bound and the guarantee's domain ------------------------------------------------------
@pytest.mark.parametrize("batch_size", [1, 2, 4, 16, 40, 128])
def test_default_slots_are_the_smallest_with_a_negligible_overflow(batch_size: int) -> None:
    slots = default_max_batch_units(batch_size)
    assert stats.poisson.sf(slots, batch_size) <= OVERFLOW_PROBABILITY < stats.poisson.sf(slots - 1, batch_size)


@pytest.mark.parametrize("batch_size, rate", [(2, 1 / 12), (4, 0.25), (16, 0.1), (40, 1 / 12), (16, 0.9)])
def test_the_domain_is_every_n_whose_overflow_stays_below_eta(batch_size: int, rate: float) -> None:
    slots = default_max_batch_units(batch_size)
    n_max = max_units(rate, slots)
    assert stats.binom.sf(slots, n_max, rate) <= OVERFLOW_PROBABILITY
    assert stats.binom.sf(slots, n_max + 1, rate) > OVERFLOW_PROBABILITY
    assert n_max >= math.floor(batch_size / rate)  # a site declaring q ≤ B/N is always covered


def test_an_overflowing_step_takes_the_smallest_whole_multiple_of_the_slots() -> None:
    shape = StepShape(5, 2, 0.5)
    assert [shape.slots_for(k) for k in (0, 1, 5, 6, 10, 11, 23)] == [5, 5, 5, 10, 10, 15, 25]


@pytest.mark.parametrize("dataset_size", [4, 16, 17])
def test_the_reported_shape_is_a_function_of_public_values_only(model, dataset_size: int) -> None:
    engine = build_engine(dp(insecure_seeded_noise=False), model, dataset_size, 4, 10)
    reference = build_engine(dp(insecure_seeded_noise=False), model, 16, 4, 10)
    report, expected = engine.privacy_report(), reference.privacy_report()
    assert report["fixed_shape"] == expected["fixed_shape"]
    assert report["fixed_shape"]["max_batch_units"] == default_max_batch_units(4) == 28
    assert report["fixed_shape"]["rows_per_step"] == 28  # unit "record": one row per slot
    assert report["fixed_shape"]["max_units"] == max_units(0.25, 28) >= 16  # q = 0.25, B = 4: N ≤ N_max, public


def test_the_report_states_the_accountants_delta_with_no_overflow_term(model) -> None:
    engine = build_engine(dp(insecure_seeded_noise=False), model, 16, 4, 10)
    dataset = TensorPoseSet(16)
    for _, batch in zip(range(2), engine.batches(dataset)):
        engine.step(model, batch)
    report = engine.privacy_report()
    assert report["delta"] == engine.privacy.delta
    assert report["epsilon"] == engine.accountant.get_epsilon(engine.privacy.delta)[0]  # the accountant's, exactly
    block = report["fixed_shape"]
    assert not {key for key in block if key.startswith("delta")}  # no δ term of its own
    assert "exact" in block["statement"] and "δ_overflow" not in block["statement"]
    assert f"at most {block['max_units']} records" in block["statement"]


def test_a_training_set_beyond_the_timing_domain_trains_warned_in_the_log_only(model, caplog) -> None:
    shape = StepShape(3, 1, 0.25)
    assert capacity_warning(shape, shape.max_units, "record", "here") is None  # N = N_max: covered, silent
    with caplog.at_level(logging.WARNING, logger="fedpose.privacy.engine"):
        within = build_engine(dp(max_batch_units=3), model, shape.max_units, 2, 10)
    assert within.capacity_warning is None and not caplog.records
    with caplog.at_level(logging.WARNING, logger="fedpose.privacy.engine"):
        beyond = build_engine(dp(max_batch_units=3), model, 40, 2, 10)
    assert beyond.capacity_warning == caplog.records[-1].getMessage()
    assert "40 records" in beyond.capacity_warning and f"up to {shape.max_units}" in beyond.capacity_warning
    assert "privacy.max_batch_units = 3" in beyond.capacity_warning and "privacy.sample_rate" in beyond.capacity_warning
    assert "guarantee is unchanged" in beyond.capacity_warning
    # the same guarantee, the same report: nothing that is released says the set is beyond N_max
    assert (beyond.noise_multiplier, beyond.sample_rate) == (within.noise_multiplier, within.sample_rate)
    assert beyond.privacy_report()["fixed_shape"] == within.privacy_report()["fixed_shape"]
    dataset = TensorPoseSet(40)
    for _, batch in zip(range(3), beyond.batches(dataset)):
        beyond.step(model, batch)
    assert beyond.steps_done == 3


# -- every step does the same work -------------------------------------------------------------------------
def test_every_batch_has_the_fixed_shape_whatever_was_sampled(model) -> None:
    sizes = [48, 1, 3, 2, 4, 1, 2, 5]  # one large patient among small ones
    units = patients(sizes)
    dataset = TensorPoseSet(units.num_records)
    engine = build_engine(dp(unit="patient", max_records_per_unit=3), model, len(dataset), 2, 10, units=units)
    shape = engine.shape
    assert (shape.unit_slots, shape.rows_per_unit) == (default_max_batch_units(2), 3)
    unit_of_record = {r: u for u, members in enumerate(units.members) for r in members}
    real_counts, large_seen, shapes = set(), 0, None
    for _, batch in zip(range(40), engine.batches(dataset)):
        current = {k: tuple(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        shapes = shapes or current
        assert current == shapes
        assert batch["image"].shape[0] == shape.rows == len(batch["row_mask"]) == len(batch["unit_index"])
        assert batch["unit_index"].tolist() == [row // 3 for row in range(shape.rows)]
        real = batch["row_mask"]
        real_counts.add(int(real.sum()))
        # a slot's real rows come first and are records of one unit; at most 3 of the large patient
        for slot in range(shape.unit_slots):
            rows = real[slot * 3: slot * 3 + 3].tolist()
            assert rows == sorted(rows, reverse=True)
            records = batch["index"][slot * 3: slot * 3 + 3][real[slot * 3: slot * 3 + 3]].tolist()
            assert len({unit_of_record[r] for r in records}) <= 1
            large_seen += bool(records) and unit_of_record[records[0]] == 0
    assert len(real_counts) > 1 and large_seen > 0  # the draws differ; the shape does not


def test_an_overflowing_batch_keeps_every_sampled_unit_in_whole_multiples_of_the_shape(model) -> None:
    sizes = [5, 1, 2, 3, 1, 4, 2, 1, 3, 2]
    units = patients(sizes)
    dataset = TensorPoseSet(units.num_records)
    engine = build_engine(dp(unit="patient", sample_rate=0.6, max_records_per_unit=2), model, len(dataset), 4, 10,
                          units=units)
    engine.shape = StepShape(2, 2, 0.6)  # far fewer slots than sampled units: overflow is common
    unit_of_record = {r: u for u, members in enumerate(units.members) for r in members}
    counts, sampled_units = np.zeros(len(sizes)), []
    for step in range(1500):
        engine.noise.reseed(engine_module._SAMPLING_STREAM, step)
        rows, positions = engine.sample_units()
        sampled = sorted({unit_of_record[r] for r in rows})
        sampled_units.append(len(sampled))
        counts[sampled] += 1
        # every record of a sampled unit up to the cap, each unit in its own position: nothing dropped
        assert [rows.count(r) for r in rows] == [1] * len(rows)
        for unit in sampled:
            assert sum(unit_of_record[r] == unit for r in rows) == min(2, sizes[unit])
        records, slots, real = engine.fixed_shape_rows(rows, positions)
        num_slots = 2 * max(1, math.ceil(len(sampled) / 2))
        assert len(records) == len(slots) == len(real) == num_slots * 2
        assert slots == [row // 2 for row in range(num_slots * 2)]
        assert sorted(r for r, keep in zip(records, real) if keep) == sorted(rows)
        for slot in range(num_slots):  # a slot: one unit's records first, then padding
            block = real[slot * 2: slot * 2 + 2]
            assert block == sorted(block, reverse=True)
            assert len({unit_of_record[r] for r, keep in zip(records[slot * 2: slot * 2 + 2], block) if keep}) <= 1
    assert max(sampled_units) > 4  # the draws overflowed by more than one multiple
    # exactly Poisson: each unit joins independently with probability q, so K ~ Binomial(10, 0.6)
    assert stats.binomtest(int(counts.sum()), 1500 * len(sizes), 0.6).pvalue > 1e-4
    observed = np.bincount(sampled_units, minlength=len(sizes) + 1)
    assert stats.chisquare(observed[2:9], stats.binom.pmf(range(2, 9), 10, 0.6) / stats.binom.pmf(range(2, 9), 10, 0.6).sum()
                           * observed[2:9].sum()).pvalue > 1e-4


def test_padding_of_an_overflowing_step_contributes_exactly_zero(model) -> None:
    units = patients([1] * 12)
    dataset = TensorPoseSet(12)
    engine = build_engine(dp(unit="patient", sample_rate=0.75), model, 12, 4, 10, units=units)
    engine.shape = StepShape(3, 1, 0.75)
    for step in range(20):
        engine.noise.reseed(engine_module._SAMPLING_STREAM, step)
        rows, positions = engine.sample_units()
        if len(rows) > 3:
            break
    records, slots, real = engine.fixed_shape_rows(rows, positions)
    assert len(records) == 3 * math.ceil(len(rows) / 3) > 3
    batch = batch_of(dataset, records)
    features = frozen_features(model, batch["image"])
    mask = torch.tensor(real)
    poisoned = features.clone()
    poisoned[~mask] = float("nan")
    total, *_ = clipped_gradient_sum(model, poisoned, batch["joints"], batch["weight"], 0.5, 2, row_mask=mask)
    reference, *_ = clipped_gradient_sum(model, features[mask], batch["joints"][mask], batch["weight"][mask], 0.5, 2)
    torch.testing.assert_close(total, reference, rtol=1e-5, atol=1e-7)
    # and the engine's own step over such a batch: finite, every sampled unit counted
    engine.steps_done = 0
    full = batch_of(dataset, records)
    full["unit_index"], full["row_mask"] = torch.tensor(slots), mask
    metrics = engine.step(model, full)
    assert metrics["batch_size"] == len(rows)
    assert all(math.isfinite(float(p.grad.abs().sum())) for p in model.trainable_parameters().values())


# -- padding contributes exactly zero; a large unit at most C --------------------------------------------
def test_padding_rows_contribute_exactly_zero_even_when_non_finite(model) -> None:
    dataset = TensorPoseSet(12)
    batch = batch_of(dataset, range(12))
    features = frozen_features(model, batch["image"])
    labels = torch.arange(12) // 3
    real = torch.tensor([True, True, False] * 2 + [True, False, False] + [False] * 3)
    total, *_ = clipped_unit_gradient_sum(model, features, batch["joints"], batch["weight"], labels, 0.5, 4, row_mask=real)
    poisoned = features.clone()
    poisoned[~real] = float("nan")
    joints = batch["joints"].clone()
    joints[~real] = 1e30
    again, norms, _, nonfinite = clipped_unit_gradient_sum(model, poisoned, joints, batch["weight"], labels, 0.5, 4,
                                                           row_mask=real)
    assert torch.equal(total, again)  # the same computation: padding content cannot matter
    assert not bool(nonfinite.any()) and float(norms[3]) == 0.0  # an all-padding slot sums to exactly 0
    only_real, *_ = clipped_unit_gradient_sum(model, features[real], batch["joints"][real], batch["weight"][real],
                                              labels[real], 0.5, 4)
    torch.testing.assert_close(total, only_real, rtol=1e-5, atol=1e-7)
    # the per-record path too
    single, *_ = clipped_gradient_sum(model, poisoned, joints, batch["weight"], 0.5, 4, row_mask=real)
    reference, *_ = clipped_gradient_sum(model, features[real], batch["joints"][real], batch["weight"][real], 0.5, 4)
    torch.testing.assert_close(single, reference, rtol=1e-5, atol=1e-7)


def test_a_48_record_unit_moves_the_clipped_sum_by_at_most_c(model) -> None:
    sizes = [48, 1, 1]
    units = patients(sizes)
    dataset = TensorPoseSet(units.num_records)
    # q = 1: the large patient is in every batch (3 slots cover 3 units at q = 1)
    engine = build_engine(dp(unit="patient", max_records_per_unit=4, max_grad_norm=0.3, sample_rate=1.0,
                             max_batch_units=3), model, len(dataset), 1, 10, units=units)
    for step in range(3):
        engine.noise.reseed(engine_module._SAMPLING_STREAM, step)
        records, slots, real = engine.fixed_shape_rows(*engine.sample_units())
        batch = batch_of(dataset, records)
        features = frozen_features(model, batch["image"])
        mask = torch.tensor(real)
        with_all, *_ = clipped_unit_gradient_sum(model, features, batch["joints"], batch["weight"], torch.tensor(slots),
                                                 0.3, 16, row_mask=mask)
        in_large = mask & torch.tensor([r < 48 for r in records])
        without, *_ = clipped_unit_gradient_sum(model, features, batch["joints"], batch["weight"], torch.tensor(slots),
                                                0.3, 16, row_mask=mask & ~in_large)
        assert int(in_large.sum()) == 4  # its slot's 4 rows: a uniform 4 of its 48 records
        assert float(torch.linalg.vector_norm(with_all - without)) <= 0.3 * (1 + 1e-5)


def test_the_public_view_gradient_averages_real_rows_only(model) -> None:
    batch = batch_of(TensorPoseSet(6), range(6))
    features = frozen_features(model, batch["image"])
    real = torch.tensor([True, False, True, True, False, False])
    masked, _ = mean_gradient(model, features, batch["joints"], batch["weight"], row_mask=real)
    reference, _ = mean_gradient(model, features[real], batch["joints"][real], batch["weight"][real])
    torch.testing.assert_close(masked, reference, rtol=1e-5, atol=1e-7)
    none, _ = mean_gradient(model, features, batch["joints"], batch["weight"], row_mask=torch.zeros(6, dtype=torch.bool))
    assert not bool(none.any())


@pytest.mark.parametrize("chunk", [1, 4, 6, 64])
def test_the_public_view_gradient_in_chunks_is_the_one_pass_gradient(model, chunk) -> None:
    """Chunks bound the memory of the ψ gradient (the engine passes its per-sample chunk); the
    gradient and the per-row losses are those of one pass, padding rows still weighted 0."""
    batch = batch_of(TensorPoseSet(6), range(6))
    features = frozen_features(model, batch["image"])
    real = torch.tensor([True, False, True, True, False, True])
    one_pass, one_pass_losses = mean_gradient(model, features, batch["joints"], batch["weight"], row_mask=real)
    chunked, losses = mean_gradient(model, features, batch["joints"], batch["weight"], row_mask=real, chunk_size=chunk)
    torch.testing.assert_close(chunked, one_pass, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(losses, one_pass_losses, rtol=1e-6, atol=1e-7)
    assert bool(one_pass.any())


# -- the per-sample chunk: decided once, from the fixed shape, before any step (item 8) --------------------
def test_the_chunk_fits_the_memory_and_never_exceeds_the_steps_rows() -> None:
    gib = 2**30
    assert chunk_size_for(32 * gib, 4_740_000) == 226
    assert chunk_size_for(32 * gib, 4_740_000, rows=100) == 100  # a larger chunk would never be filled
    assert chunk_size_for(0, 4_740_000, rows=100) == 1


def test_the_chunk_is_decided_when_the_engine_is_built_and_never_per_step(model, monkeypatch) -> None:
    gib = 2**30
    decisions: list[tuple[str, int, int | None]] = []
    free = iter([8 * gib, 1 * gib, 64 * gib, 2 * gib] * 10)  # what the allocator happens to hold, per call

    def decide(device: torch.device, num_params: int, rows: int | None = None) -> int:
        decisions.append((str(device), num_params, rows))
        return chunk_size_for(next(free), num_params, rows)

    monkeypatch.setattr(engine_module, "auto_chunk_size", decide)
    sizes = [48, 1, 2, 1]
    units = patients(sizes)
    dataset = TensorPoseSet(units.num_records)
    engine = build_engine(dp(unit="patient", max_records_per_unit=2, max_batch_units=4), model, len(dataset), 1, 10,
                          units=units)
    params = model.trainable_parameters()
    p = sum(t.numel() for t in params.values())
    assert decisions == [("cpu", p, engine.shape.rows)]  # at build, from the fixed shape: before any step
    chunk = engine.chunk_for(torch.device("cpu"), p)
    for _, batch in zip(range(3), engine.batches(dataset)):
        engine.step(model, batch)
        assert engine.chunk_for(torch.device("cpu"), p) == chunk
    assert len(decisions) == 1
    assert engine.step_rows == engine.shape.rows == 4 * 2


def test_auto_chunk_on_cuda_is_a_function_of_memory_and_the_fixed_rows(monkeypatch) -> None:
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 12 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * gib)
    cuda = torch.device("cuda", 0)
    assert per_sample_module.auto_chunk_size(cuda, 4_740_000, rows=57) == 57
    assert per_sample_module.auto_chunk_size(cuda, 4_740_000, rows=1000) == 226
    assert fixed_shape.step_shape("record", 16, 0.1, None, 4).rows == 57
