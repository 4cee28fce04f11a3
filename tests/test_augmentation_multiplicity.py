"""Augmentation multiplicity (``privacy.augmentation_multiplicity`` K; De et al. 2022, issue 26 lever 1):
every record of a step is loaded K times with independent augmentations, a unit's gradient is the
sum over its records of the mean over their K copies, clipped to C once. So the engine's clipped sum
is exactly that hand computation, one unit still moves it by at most C however its copies are
crafted, σ, q and ε (and every accountant input) are those of K = 1, K = 1 is bit for bit the engine
without the setting, every step has the same U·R·K rows, and the setting is the site's own,
validated where it is read."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from fedpose.config import ModelSpec, PrivacyConfig, RunConfig
from fedpose.data.units import UnitIndex
from fedpose.privacy import engine as engine_module
from fedpose.privacy.engine import build_engine
from fedpose.privacy.per_sample import clipped_unit_gradient_sum, flatten, frozen_features
from test_dp_engine import SHARED_DATA, SIZE, TensorPoseSet, batch_of, loop_gradients, make_model
from test_fixed_shape_steps import patients


@pytest.fixture(scope="module")
def model():
    return make_model()


class AugmentingSet(TensorPoseSet):
    """TensorPoseSet whose every load draws a fresh augmentation (a flip, pixel noise, a joint shift)
    from one generator per dataset — like :class:`~fedpose.data.dataset.PoseDataset`, never per index."""

    def __init__(self, n: int, seed: int = 0) -> None:
        super().__init__(n)
        self._rng = torch.Generator().manual_seed(seed)

    def __getitem__(self, i: int) -> dict:
        sample = super().__getitem__(i)
        if bool(torch.rand((), generator=self._rng) < 0.5):
            sample["image"] = sample["image"].flip(-1)
        sample["image"] = sample["image"] + 0.5 * torch.randn(sample["image"].shape, generator=self._rng)
        sample["joints"] = sample["joints"] + 2.0 * torch.randn(sample["joints"].shape, generator=self._rng)
        return sample


def dp(**kwargs) -> PrivacyConfig:
    base = {"mechanism": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0, "sample_rate": 0.5,
            "insecure_seeded_noise": True, "unit": "patient", "max_records_per_unit": 2, "max_batch_units": 3}
    return PrivacyConfig(**{**base, **kwargs})


def hand_clipped_sum(model, batch: dict, copies: int, clip: float) -> tuple[torch.Tensor, list[float]]:
    """Per record: the mean of its K per-augmentation gradients (autograd, one row at a time); per
    unit: the sum over its records; clipped to C; summed. Padding rows (row_mask False) are skipped."""
    features = frozen_features(model, batch["image"])
    grads = loop_gradients(model, features, batch["joints"], batch["weight"])
    units: dict[int, dict[int, list[torch.Tensor]]] = {}
    for row, (slot, real) in enumerate(zip(batch["unit_index"].tolist(), batch["row_mask"].tolist())):
        if real:  # the engine lays a record's K copies out in adjacent rows
            units.setdefault(slot, {}).setdefault(row // copies, []).append(grads[row])
    total, norms = torch.zeros_like(grads[0]), []
    for records in units.values():
        assert all(len(rows) == copies for rows in records.values())
        unit_gradient = sum(torch.stack(rows).mean(0) for rows in records.values())
        norm = float(torch.linalg.vector_norm(unit_gradient, dtype=torch.float64))  # exact enough: float32's comes out low
        norms.append(norm)
        total += unit_gradient * min(1.0, clip / norm)
    return total, norms


def released(model, engine, batch: dict) -> torch.Tensor:
    """The step's released gradient (flat)."""
    engine.step(model, batch)
    return flatten([p.grad for p in model.trainable_parameters().values()])


def step_gradient(model, engine, batch: dict) -> torch.Tensor:
    """The step's clipped (noise-free at σ = 0) sum: its gradient × B."""
    return released(model, engine, batch) * engine.expected_batch_size


# -- exactness --------------------------------------------------------------------------------------------
def test_the_clipped_sum_is_each_units_sum_of_its_records_augmentation_means_clipped_once(model) -> None:
    units = patients([3, 1, 2, 2, 1])
    dataset = AugmentingSet(units.num_records)
    privacy = dp(noise_multiplier=0.0, augmentation_multiplicity=3)
    drawer = build_engine(privacy, model, len(dataset), 2, 10, units=units, seed=3)
    batch = next(b for b in drawer.batches(dataset) if 2 <= int(b["unit_index"][b["row_mask"]].unique().numel()))
    images = batch["image"].reshape(-1, 3, *batch["image"].shape[1:])
    assert all(not torch.equal(group[0], group[1]) for group in images)  # every copy its own augmentation
    _, norms = hand_clipped_sum(model, batch, 3, math.inf)
    clip = sorted(norms)[len(norms) // 2]  # some units clipped, some not
    assert min(norms) < clip * (1 - 1e-3) or max(norms) > clip * (1 + 1e-3)
    expected, _ = hand_clipped_sum(model, batch, 3, clip)
    engine = build_engine(privacy.model_copy(update={"max_grad_norm": clip}), model, len(dataset), 2, 10, units=units)
    torch.testing.assert_close(step_gradient(model, engine, batch), expected, rtol=2e-5, atol=1e-7)


def test_the_per_record_unit_averages_its_copies_before_the_clip(model) -> None:
    """Unit "record": one record per slot, its K copies averaged then clipped (not each copy clipped)."""
    dataset = AugmentingSet(6, seed=1)
    privacy = dp(unit="record", noise_multiplier=0.0, max_grad_norm=1e-3, augmentation_multiplicity=4, max_batch_units=6,
                 sample_rate=0.3)
    engine = build_engine(privacy, model, len(dataset), 1, 10, seed=1)
    batch = next(b for b in engine.batches(dataset) if int(b["row_mask"].sum()) >= 8)
    assert batch["image"].shape[0] == engine.shape.rows == 6 * 1 * 4
    expected, _ = hand_clipped_sum(model, batch, 4, 1e-3)
    torch.testing.assert_close(step_gradient(model, engine, batch), expected, rtol=2e-5, atol=1e-9)
    # clipping each copy to C instead would give a sum of norm up to K·C per record; the mean's is ≤ C
    assert float(torch.linalg.vector_norm(expected)) <= 1e-3 * int(batch["unit_index"][batch["row_mask"]].unique().numel()) * (1 + 1e-5)


# -- sensitivity ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("copies", [1, 4])
def test_one_unit_with_aligned_copies_crafted_for_a_large_norm_moves_the_sum_by_exactly_c(model, copies: int) -> None:
    """The adversary's best case for K: all K copies of each of its records identical (nothing
    averages out) and far from the labels (a huge gradient). Removing the unit (its rows padding,
    the rest of the batch unchanged) moves the clipped sum by C — exactly, never K·C or R·K·C."""
    clip = 0.01
    dataset = TensorPoseSet(8)
    records = [0, 1, 2, 3]  # unit 0: records 0, 1; unit 1: 2, 3
    rows = [r for r in records for _ in range(copies)]
    batch = batch_of(dataset, rows)
    batch["image"][: 2 * copies] *= 50.0  # the crafted unit, its copies aligned (identical per record),
    batch["joints"][: 2 * copies] = 1e4  # its labels far off: a large gradient
    labels = torch.tensor([0] * 2 * copies + [1] * 2 * copies)
    features = frozen_features(model, batch["image"])
    with_unit, norms, *_ = clipped_unit_gradient_sum(model, features, batch["joints"], batch["weight"], labels, clip, 5,
                                                     augmentations=copies)
    assert float(norms[0]) > 100 * clip  # far beyond C: the clip binds (the mean of aligned copies keeps the norm)
    without = labels != 0
    without_unit, *_ = clipped_unit_gradient_sum(model, features, batch["joints"], batch["weight"], labels, clip, 5,
                                                 row_mask=without, augmentations=copies)
    moved = float(torch.linalg.vector_norm(with_unit - without_unit, dtype=torch.float64))
    assert moved <= clip and moved == pytest.approx(clip, rel=1e-5)  # exactly C, never above it


def test_a_large_patient_moves_the_engines_sum_by_at_most_c_with_copies(model) -> None:
    units = patients([48, 1, 1])
    dataset = AugmentingSet(units.num_records, seed=2)
    privacy = dp(max_records_per_unit=4, max_grad_norm=0.3, sample_rate=1.0, augmentation_multiplicity=3)
    engine = build_engine(privacy, model, len(dataset), 1, 10, units=units)
    for step in range(2):
        engine.noise.reseed(engine_module._SAMPLING_STREAM, step)
        records, slots, real = engine.fixed_shape_rows(*engine.sample_units())
        batch = batch_of(dataset, records)
        batch["image"][torch.tensor([r < 48 for r in records])] *= 30.0
        features = frozen_features(model, batch["image"])
        mask = torch.tensor(real)
        in_large = mask & torch.tensor([r < 48 for r in records])
        assert int(in_large.sum()) == 4 * 3  # 4 of its 48 records, 3 copies each
        args = (model, features, batch["joints"], batch["weight"], torch.tensor(slots), 0.3, 7)
        with_all, *_ = clipped_unit_gradient_sum(*args, row_mask=mask, augmentations=3)
        without, *_ = clipped_unit_gradient_sum(*args, row_mask=mask & ~in_large, augmentations=3)
        assert float(torch.linalg.vector_norm(with_all - without)) <= 0.3 * (1 + 1e-5)


# -- the guarantee does not change ---------------------------------------------------------------------------
def test_sigma_q_epsilon_and_the_accountants_inputs_are_those_of_k_1(model) -> None:
    units = patients([2, 1, 3, 1, 2, 1])
    dataset = AugmentingSet(units.num_records)
    reports, events = [], []
    for copies in (1, 4):
        # σ calibrated by the engine (RDP: the same search as PLD's, faster); 6 slots for 6 patients: no overflow
        privacy = dp(noise_multiplier=None, target_epsilon=3.0, accountant="rdp", max_batch_units=6,
                     augmentation_multiplicity=copies)
        engine = build_engine(privacy, model, len(dataset), 2, 40, units=units)
        for _, batch in zip(range(2), engine.batches(dataset)):
            engine.step(model, batch)
        reports.append(engine.privacy_report())
        events.append(engine.accountant.to_dict())
    one, four = reports
    assert events[0] == events[1]  # the (σ, q, steps) events the accountant composes
    for key in ("epsilon", "planned_epsilon", "noise_multiplier", "sample_rate", "max_grad_norm", "expected_batch_size",
                "delta", "accountant", "neighbouring_relation", "rdp_curve", "steps"):
        assert one[key] == four[key], key
    assert one["fixed_shape"]["augmentations_per_record"] == 1 and four["fixed_shape"]["augmentations_per_record"] == 4
    assert four["fixed_shape"]["rows_per_step"] == 4 * one["fixed_shape"]["rows_per_step"]
    assert "4 augmentations" in four["fixed_shape"]["statement"] and "augmentations" not in one["fixed_shape"]["statement"]
    assert "mean gradient over its 4 augmentations, clipped to C as one" in four["clipping"]


# -- K = 1 is the engine without the setting; fixed shapes ----------------------------------------------------
def test_k_1_is_bit_identical_and_k_only_repeats_the_rows_of_the_same_draw(model) -> None:
    units = patients([2, 1, 3, 1, 2, 1])
    draws = {}
    for name, privacy in (("unset", dp()), ("1", dp(augmentation_multiplicity=1)), ("4", dp(augmentation_multiplicity=4))):
        engine = build_engine(privacy, model, units.num_records, 2, 10, units=units, seed=5)
        draws[name] = []
        for step in range(6):
            engine.noise.reseed(engine_module._SAMPLING_STREAM, step)
            draws[name].append(engine.fixed_shape_rows(*engine.sample_units()))
    assert draws["1"] == draws["unset"]
    for plain, repeated in zip(draws["1"], draws["4"]):  # the same CSPRNG coins, each row 4 times, adjacent
        assert tuple([v for v in column for _ in range(4)] for column in plain) == repeated

    dataset = TensorPoseSet(units.num_records)
    grads = []
    for privacy in (dp(), dp(augmentation_multiplicity=1)):
        engine = build_engine(privacy, model, len(dataset), 2, 10, units=units, seed=5)
        batch = next(engine.batches(dataset))
        grads.append(released(model, engine, batch))
        # the formula of the engine before the setting existed: the unit sum, σC noise of the step's stream, ÷ B
        features = frozen_features(model, batch["image"])
        reference, *_ = clipped_unit_gradient_sum(model, features, batch["joints"], batch["weight"], batch["unit_index"], 1.0,
                                                  engine.chunk_for(torch.device("cpu"), grads[-1].numel()),
                                                  row_mask=batch["row_mask"])
        engine.noise.reseed(engine_module._NOISE_STREAM, 0)
        assert torch.equal(grads[-1], (reference + engine.noise.normal(reference.numel(), 1.0)) / engine.expected_batch_size)
    assert torch.equal(grads[0], grads[1])


def test_every_step_has_the_same_shape_with_k_4(model) -> None:
    units = patients([3, 1, 2, 2, 1])
    dataset = AugmentingSet(units.num_records)
    # 5 slots for 5 patients: no draw can overflow, so every step must have exactly this shape
    engine = build_engine(dp(augmentation_multiplicity=4, max_batch_units=5), model, len(dataset), 2, 10, units=units)
    assert engine.step_rows == engine.shape.rows == 5 * 2 * 4
    real_counts = set()
    for _, batch in zip(range(8), engine.batches(dataset)):
        assert batch["image"].shape[0] == batch["unit_index"].shape[0] == batch["row_mask"].shape[0] == 5 * 2 * 4
        assert batch["unit_index"].tolist() == [row // 8 for row in range(40)]
        assert batch["index"].reshape(-1, 4).unique(dim=1).shape[1] == 1  # each record's 4 copies adjacent
        real_counts.add(int(batch["row_mask"].sum()))
        engine.step(model, batch)
    assert len(real_counts) > 1  # the draws differ; the shape does not


def test_non_private_batches_hold_each_record_k_times(model) -> None:
    dataset = AugmentingSet(6)
    engine = build_engine(PrivacyConfig(augmentation_multiplicity=3), model, len(dataset), 2, 10)
    batch = next(engine.batches(dataset))
    assert batch["image"].shape[0] == engine.step_rows == 6
    assert batch["index"].reshape(2, 3).unique(dim=1).shape[1] == 1
    engine.step(model, batch)


def test_a_batch_without_each_records_copies_is_refused(model) -> None:
    dataset = TensorPoseSet(4)
    engine = build_engine(dp(unit="record", augmentation_multiplicity=2), model, 4, 1, 10)
    with pytest.raises(ValueError, match="augmentation_multiplicity = 2: a batch needs unit_index"):
        engine.step(model, batch_of(dataset, [0, 1]))
    uneven = batch_of(dataset, [0, 0, 1])
    uneven["unit_index"] = torch.tensor([0, 0, 1])
    with pytest.raises(ValueError, match="whole multiple"):
        engine.step(model, uneven)


# -- the dataset's augmentation is random per load, not per index ----------------------------------------------
def test_pose_dataset_draws_a_new_augmentation_for_every_load_of_a_record(model) -> None:
    from fedpose.data.dataset import PoseDataset
    from fedpose.data.loaders import load_records

    records, root = load_records(SHARED_DATA / "mpii-real")
    dataset = PoseDataset(records, root, input_size=SIZE, train=True, seed=0)
    copies = [dataset[0] for _ in range(4)]
    assert len({(c["scale"], c["rotation"], c["flipped"]) for c in copies}) == 4
    assert all(not torch.equal(a["image"], b["image"]) for a, b in zip(copies, copies[1:]))
    units = UnitIndex.per_record(len(dataset))
    engine = build_engine(dp(unit="record", sample_rate=1.0, max_batch_units=len(dataset), augmentation_multiplicity=2),
                          model, len(dataset), 1, 10, units=units)
    batch = next(engine.batches(dataset))
    pairs = batch["image"].reshape(-1, 2, *batch["image"].shape[1:])
    assert all(not torch.equal(pair[0], pair[1]) for pair in pairs)


# -- configuration -----------------------------------------------------------------------------------------
def test_invalid_multiplicities_are_named() -> None:
    from fedpose.config import format_validation_error

    for bad in (0, -2, 1.5, "four"):
        with pytest.raises(ValidationError) as caught:
            RunConfig.model_validate({"privacy": {"augmentation_multiplicity": bad}})
        assert "privacy.augmentation_multiplicity" in format_validation_error(caught.value, "run.toml")
    off = {"flip": False, "scale_jitter": 0.0, "rotation": 0.0}
    with pytest.raises(ValidationError, match=r"privacy.augmentation_multiplicity = 2: every copy of a record would be the same"):
        RunConfig.model_validate({"data": off, "privacy": {"augmentation_multiplicity": 2}})
    assert RunConfig.model_validate({"data": {**off, "rotation": 5.0}, "privacy": {"augmentation_multiplicity": 2}})
    assert RunConfig.model_validate({"data": off})  # K = 1 needs no augmentation


def test_the_multiplicity_is_the_sites_own_setting(tmp_path) -> None:
    from fedpose.federation.config import SiteConfig
    from fedpose.federation.protocol import TrainInstruction
    from fedpose.federation.site_pins import INSTRUCTION_FIELDS, MODEL_SPEC_FIELDS

    # nothing the coordinator sends names it: it never reaches a site from outside its own config
    for fields in (TrainInstruction.model_fields, ModelSpec.model_fields, INSTRUCTION_FIELDS, MODEL_SPEC_FIELDS):
        assert not any("augment" in name for name in fields)
    site = {"site_id": "site-1", "data": {"train": str(tmp_path)}, "state_dir": str(tmp_path / "state"), "eps_max": 8.0,
            "privacy": {"mechanism": "dpsgd", "target_epsilon": 2.0, "sample_rate": 0.1, "augmentation_multiplicity": 4}}
    assert SiteConfig.model_validate(site).privacy.augmentation_multiplicity == 4
    with pytest.raises(ValidationError, match=r"site 'site-1': privacy.augmentation_multiplicity = 4: every copy"):
        SiteConfig.model_validate({**site, "data": {"train": str(tmp_path), "flip": False, "scale_jitter": 0.0, "rotation": 0.0}})


def test_a_site_round_with_copies_reports_the_epsilon_of_k_1_and_logs_the_cost(tmp_path, caplog) -> None:
    """The real site round (budget guard, engine, reply): K = 2 trains, and the reply's privacy
    report — what leaves the site — is the one K = 1 sends; the K× cost is in the site's log."""
    import logging

    import numpy as np

    from fedpose.federation.local_training import run_site_round
    from site_round_helpers import global_model, make_site_data, site_config

    data_root = make_site_data(tmp_path / "data")
    global_state, spec = global_model()
    replies = {}
    for copies in (1, 2):
        site = site_config(data_root, tmp_path / f"state-k{copies}", augmentation_multiplicity=copies, local_steps=1)
        with caplog.at_level(logging.INFO, logger="fedpose.federation.local_training"):
            result = run_site_round(site, "run", 1, global_state, spec, 1)
        assert result.reply.status == "ok", result.reply
        assert all(np.isfinite(v).all() for v in result.update.values())
        replies[copies] = result.reply
    assert replies[1].privacy == replies[2].privacy
    assert replies[2].privacy.epsilon is not None and replies[2].privacy.epsilon > 0
    cost = [r.getMessage() for r in caplog.records if "augmentation multiplicity K = 2" in r.getMessage()]
    assert len(cost) == 1 and "every round of 1 step computes 32 rows (2 chunks of 2 patient slots × 4 records × 2 augmentations)" in cost[0]
