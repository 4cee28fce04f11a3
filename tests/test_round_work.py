"""Fixed work per round (fedpose.privacy.fixed_shape, "fixed work per round"): a site's round, the
only thing an observer of its replies can time, computes the same rows whatever was sampled, while its
steps may split that work differently; the budget W is the smallest with overflow ≤ η and matches
an independent computation; a round covers every training set its step shape covers; nothing
sampled is ever dropped (so the (ε, δ) stays exact); every step is whole chunks of one shape."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from fedpose.privacy.engine import SPARE_ROWS_KEY, build_engine
from fedpose.privacy.fixed_shape import (
    OVERFLOW_PROBABILITY,
    RoundWork,
    default_max_batch_units,
    round_overflow_probability,
    round_work,
    step_shape,
)
from fedpose.privacy.per_sample import frozen_features
from test_dp_engine import TensorPoseSet
from test_fixed_shape_steps import dp, model, patients  # noqa: F401 (model: the module's fixture)


def chunks_of(units: np.ndarray, units_per_chunk: int) -> np.ndarray:
    return np.maximum(1, -(-units // units_per_chunk))


def step_rows(batch: dict) -> int:
    """Rows a step computes: its own batch's and, on a round's last step, the spare it runs chunk by chunk."""
    return int(batch["image"].shape[0]) + len(batch.get(SPARE_ROWS_KEY, ()))


# -- the budget -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_size", [2, 4, 16, 32, 40])
def test_a_round_of_one_step_in_one_slot_chunks_is_never_more_than_the_step_shape(batch_size: int) -> None:
    shape = step_shape("patient", batch_size, batch_size / 480, None, 1)
    work = round_work(shape, steps=1, chunk_rows=1)
    assert work.slots <= shape.unit_slots == default_max_batch_units(batch_size)
    assert work.max_units >= shape.max_units


def test_the_main_jobs_round_is_60_percent_of_per_step_padding() -> None:
    shape = step_shape("patient", 32, 1 / 15, None, 4)  # configs/demo.toml until 2026-12-07: B = 32 of 480 patients, 4 rows each
    assert round_work(shape, 1, 4).slots == shape.unit_slots == 86  # one step in one-slot chunks: the step shape
    eight, sixteen = round_work(shape, 8, 16), round_work(shape, 16, 16)
    assert eight.units_per_chunk == 4 and eight.chunk_rows == 16
    assert eight.slots / (8 * 86) < 0.62 and sixteen.slots / (16 * 86) < 0.55
    assert sixteen.slots < 1.1 * 8 * shape.unit_slots  # 16 steps a round cost what 8 padded steps did


@pytest.mark.parametrize("rate, steps, chunk_rows", [(1 / 8, 3, 4), (0.25, 2, 2), (1 / 15, 4, 8)])
def test_the_budget_is_the_smallest_whose_overflow_is_below_eta_by_a_plain_convolution(rate, steps, chunk_rows) -> None:
    shape = step_shape("record", 4, rate, None, 1)
    work = round_work(shape, steps, chunk_rows)
    n = shape.max_units
    # independently: T plain convolutions of the exact (untrimmed) pmf of one step's chunk count
    step_pmf = np.bincount(chunks_of(np.arange(n + 1), work.units_per_chunk), weights=stats.binom.pmf(np.arange(n + 1), n, rate))
    total = np.ones(1)
    for _ in range(steps):
        total = np.convolve(total, step_pmf)
    assert total[work.chunks + 1:].sum() <= OVERFLOW_PROBABILITY < total[work.chunks:].sum()
    for chunks in (work.chunks - 1, work.chunks, work.chunks + 3):
        exact = total[chunks + 1:].sum()
        bound = round_overflow_probability(n, rate, steps, work.units_per_chunk, chunks)
        assert exact * (1 - 1e-9) <= bound <= exact * (1 + 1e-9) + 1e-28  # the exact tail, up to rounding


def test_the_overflow_bound_agrees_with_simulated_rounds() -> None:
    units, rate, steps, per_chunk, threshold = 60, 0.1, 5, 2, 18  # overflow is common here: P ≈ 0.2
    rng = np.random.default_rng(0)
    sums = chunks_of(rng.binomial(units, rate, size=(200_000, steps)), per_chunk).sum(axis=1)
    simulated = float((sums > threshold).mean())
    bound = round_overflow_probability(units, rate, steps, per_chunk, threshold)
    assert 0.05 < simulated < 0.5
    assert abs(simulated - bound) < 5 * np.sqrt(bound * (1 - bound) / 200_000)


@pytest.mark.parametrize("batch_size, rate, steps", [(2, 1 / 12, 2), (32, 1 / 15, 8), (64, 64 / 480, 10), (16, 0.9, 3)])
def test_a_round_covers_every_training_set_its_step_shape_covers(batch_size, rate, steps) -> None:
    shape = step_shape("record", batch_size, rate, None, 1)
    work = round_work(shape, steps, 16)
    assert work.max_units >= shape.max_units
    overflow = [round_overflow_probability(n, rate, steps, work.units_per_chunk, work.chunks)
                for n in (work.max_units, work.max_units + 1)]
    assert overflow[0] <= OVERFLOW_PROBABILITY < overflow[1]


def test_a_steps_slots_are_whole_chunks_and_the_last_takes_the_rounds_spare() -> None:
    work = RoundWork(steps=3, units_per_chunk=4, chunks=6, shape=step_shape("patient", 2, 0.2, None, 2))
    assert [work.slots_for(k, 0, last_step=False) for k in (0, 1, 4, 5, 13)] == [4, 4, 4, 8, 16]
    assert work.slots_for(1, 8, last_step=True) == 16  # 24 slots a round, 8 taken: the spare
    assert work.slots_for(9, 20, last_step=True) == 12  # more sampled than the spare: all of them, never truncated


# -- the engine ---------------------------------------------------------------------------------------------
def round_engine(model, sizes: list[int], steps: int = 4, **privacy):
    units = patients(sizes)
    dataset = TensorPoseSet(units.num_records)
    engine = build_engine(dp(unit="patient", max_records_per_unit=3, **privacy), model, len(dataset), 2, steps, units=units,
                          chunk_size=6, round_steps=steps)
    return engine, dataset, units


def test_every_round_does_the_same_work_whatever_was_sampled(model) -> None:
    sizes = [48, 1, 3, 2, 4, 1, 2, 5]  # one large patient among small ones
    engine, dataset, units = round_engine(model, sizes)
    work = engine.round
    assert work.units_per_chunk == 2 and work.chunk_rows == 6 == engine.chunk_for(torch.device("cpu"), 1)
    unit_of_record = {r: u for u, members in enumerate(units.members) for r in members}
    batches = engine.batches(dataset)
    splits, real_per_round = set(), set()
    for _ in range(25):
        rows = []
        real = 0
        for position in range(work.steps):
            batch = next(batches)
            size = batch["image"].shape[0]
            assert size % work.chunk_rows == 0 and size == len(batch["row_mask"]) == len(batch["unit_index"])
            spare = batch.get(SPARE_ROWS_KEY)
            if spare is not None:  # the round's last step only; whole chunks; padding in slots after the step's own
                assert position == work.steps - 1 and len(spare) % work.chunk_rows == 0
                assert spare.slots is not None and min(spare.slots) > int(batch["unit_index"].max())
            # a slot: one unit's records first (at most 3 of the large patient), then padding
            for slot in range(size // 3):
                block = batch["row_mask"][slot * 3: slot * 3 + 3].tolist()
                assert block == sorted(block, reverse=True)
                records = batch["index"][slot * 3: slot * 3 + 3][batch["row_mask"][slot * 3: slot * 3 + 3]].tolist()
                assert len({unit_of_record[r] for r in records}) <= 1
            rows.append(step_rows(batch))
            real += int(batch["row_mask"].sum())
        assert sum(rows) == work.slots * 3  # the round's work: fixed
        splits.add(tuple(rows))
        real_per_round.add(real)
    assert len(splits) > 1 and len(real_per_round) > 1  # the draws and the steps' split differ; the round does not


def test_a_round_that_samples_more_than_its_budget_keeps_every_unit(model) -> None:
    sizes = [2, 1, 3, 2, 1, 2, 3, 1, 2, 2]
    engine, dataset, units = round_engine(model, sizes, steps=2, sample_rate=0.9)
    engine.round = RoundWork(steps=2, units_per_chunk=1, chunks=3, shape=engine.shape)  # far too few: overflow
    batches = engine.batches(dataset)
    for _ in range(10):
        for _ in range(2):
            batch = next(batches)
            slots = batch["image"].shape[0] // 3
            sampled = len(set(batch["unit_index"][batch["row_mask"]].tolist()))
            assert slots >= sampled > 3  # every sampled unit in its own slot, none dropped
            kept = {u for u, members in enumerate(units.members) if set(members) & set(batch["index"][batch["row_mask"]].tolist())}
            assert int(batch["row_mask"].sum()) == sum(sizes[u] for u in kept)  # all their records (≤ 3 each)


def test_a_rounds_steps_release_what_the_step_shape_releases(model) -> None:
    """The layout is only padding: the released gradient of the same draw is the same bits under both."""
    sizes = [2, 1, 3, 2, 1, 2, 3, 1, 2, 2]
    per_round, dataset, _ = round_engine(model, sizes)
    per_step = build_engine(dp(unit="patient", max_records_per_unit=3), model, len(dataset), 2, 4, units=per_round.units,
                            chunk_size=6)
    for engine in (per_round, per_step):
        engine.noise_multiplier = 0.0
    for (_, a), (_, b) in zip(zip(range(4), per_round.batches(dataset)), zip(range(4), per_step.batches(dataset))):
        assert a["index"][a["row_mask"]].tolist() == b["index"][b["row_mask"]].tolist()  # the same seeded draw
        model.zero_grad()
        per_round.step(model, a)
        first = [p.grad.clone() for p in model.trainable_parameters().values()]
        model.zero_grad()
        per_step.step(model, b)
        for x, p in zip(first, model.trainable_parameters().values()):
            torch.testing.assert_close(x, p.grad, rtol=1e-5, atol=1e-6)


def test_the_round_report_is_a_function_of_public_values_only(model) -> None:
    reports = []
    for sizes in ([1] * 16, [1] * 40, [48] + [1] * 15):
        engine, _, _ = round_engine(model, sizes)
        reports.append(engine.privacy_report()["fixed_shape"])
    assert reports[0] == reports[1] == reports[2]
    block = reports[0]
    assert block["steps_per_round"] == 4 and block["rows_per_round"] == block["chunks_per_round"] * block["rows_per_chunk"]
    assert "exact" in block["statement"] and f"at most {block['max_units']} patients" in block["statement"]


def test_the_frozen_forward_in_chunks_is_the_one_pass_forward(model) -> None:
    images = torch.stack([TensorPoseSet(12)[i]["image"] for i in range(12)])
    torch.testing.assert_close(frozen_features(model, images, 4), frozen_features(model, images))
    assert Counter(part.shape[0] for part in images.split(4)) == Counter({4: 3})


def test_a_public_views_own_sample_does_the_rounds_fixed_work_too(model) -> None:
    """fdp releases the ψ gradient of its own Poisson sample without noise: that sample's work is a
    round's fixed work as well, counted apart from the private sample's, and every step is whole chunks."""
    sizes = [1] * 30
    engine, dataset, _ = round_engine(model, sizes, mechanism="fdp")
    work = engine.round
    batches = engine.batches(dataset)
    for _ in range(8):
        private, public = [], []
        for _ in range(work.steps):
            batch = next(batches)
            private.append(step_rows(batch))
            public.append(step_rows(batch["public_sample"]))
            engine.step(model, batch)
        assert sum(private) == sum(public) == work.slots * 3
        assert all(rows % work.chunk_rows == 0 for rows in private + public)


def test_the_last_step_loads_and_runs_the_spare_one_chunk_at_a_time(model) -> None:
    """The round's spare is never one batch: the last step's batch holds its own rows only, and the
    step loads each spare chunk right before its frozen forward — at most one chunk of it held."""
    engine, dataset, _ = round_engine(model, [1] * 12, steps=4, sample_rate=0.1)
    work = engine.round
    loaded: list[int] = []

    class Counting:
        def __len__(self) -> int:
            return len(dataset)

        def __getitem__(self, index: int) -> dict:
            loaded.append(index)
            return dataset[index]

    at_forward: list[tuple[int, int]] = []  # (records loaded so far, rows of this frozen forward)
    forward = model.forward_frozen
    model.forward_frozen = lambda images: (at_forward.append((len(loaded), images.shape[0])), forward(images))[1]
    try:
        batches = engine.batches(Counting())
        for _ in range(work.steps - 1):
            engine.step(model, next(batches))
        loaded.clear()
        at_forward.clear()
        last = next(batches)
        own = int(last["image"].shape[0])
        spare = last[SPARE_ROWS_KEY]
        assert len(loaded) == own and len(spare) >= work.chunk_rows  # spare not loaded yet
        engine.step(model, last)
    finally:
        del model.forward_frozen
    chunks = len(spare) // work.chunk_rows
    assert [rows for _, rows in at_forward] == [work.chunk_rows] * (own // work.chunk_rows + chunks)
    spare_forwards = at_forward[own // work.chunk_rows:]
    assert [count for count, _ in spare_forwards] == [own + (j + 1) * work.chunk_rows for j in range(chunks)]
    assert loaded[own:] == list(spare.records)
