"""Protection units (record / image / patient): one unit's summed gradient is clipped to C as one,
sampling is Poisson over units, the default unit is the coarsest the annotations support, and
every report names the unit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from fedpose.config import ConfigError, PrivacyConfig, load_config
from fedpose.data.annotations import AnnotationError, PoseRecord
from fedpose.data.loaders import load_records
from fedpose.data.units import UnitError, UnitIndex, resolve_unit, supported_units
from fedpose.privacy import engine as engine_module
from fedpose.privacy.engine import build_engine
from fedpose.privacy.per_sample import (
    clip_factors,
    clipped_gradient_sum,
    clipped_unit_gradient_sum,
    flatten,
    frozen_features,
    per_sample_gradients,
)
from fedpose.privacy.report import describe
from test_dp_engine import TensorPoseSet, make_model
from test_fixed_shape_steps import patients

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="module")
def model():
    return make_model()


def _batch(ids: list[int]) -> dict:
    dataset = TensorPoseSet(8)
    return engine_module.collate([dataset[i] for i in ids])


def _reference_unit_sum(model, batch: dict, unit_index: list[int], clip: float) -> torch.Tensor:
    """Σ_u clip(Σ_{i∈u} g_i) computed the slow, obvious way."""
    features = frozen_features(model, batch["image"])
    grads, _ = per_sample_gradients(model, features, batch["joints"], batch["weight"])
    rows = [flatten([g[i] for g in grads.values()]) for i in range(features.shape[0])]
    total = torch.zeros_like(rows[0])
    for unit in sorted(set(unit_index)):
        unit_sum = sum(rows[i] for i, u in enumerate(unit_index) if u == unit)
        total += unit_sum * clip_factors(unit_sum.norm().unsqueeze(0), clip)[0]
    return total


# -- clipping -------------------------------------------------------------------------------------
def test_unit_sum_equals_the_obvious_computation_across_chunks(model) -> None:
    # units interleaved in the batch and spanning chunk boundaries (chunk size 2)
    batch = _batch([0, 1, 2, 3, 4, 5, 6])
    unit_index = [2, 0, 2, 1, 0, 2, 2]
    features = frozen_features(model, batch["image"])
    total, norms, losses, nonfinite = clipped_unit_gradient_sum(
        model, features, batch["joints"], batch["weight"], torch.tensor(unit_index), 0.05, chunk_size=2
    )
    reference = _reference_unit_sum(model, batch, unit_index, 0.05)
    assert torch.allclose(total, reference, rtol=1e-4, atol=1e-7)
    assert norms.shape == (3,) and not nonfinite.any()
    _, _, per_sample_losses = clipped_gradient_sum(model, features, batch["joints"], batch["weight"], 0.05)
    assert torch.allclose(losses, per_sample_losses)  # losses come back in batch order


def test_the_clipped_sums_products_run_without_tf32_even_where_training_enables_it(model, monkeypatch) -> None:
    """On CUDA, training turns TF32 matmuls on (fedpose.runtime.configure_device); inside the clipped
    sum a TF32 product would round each unit's gradient after its norm was taken (a unit could then
    move the sum by up to C·(1 + 2⁻¹¹)). Every product of both clipped sums runs with TF32 off, and
    the process setting is restored afterwards."""
    seen: list[bool] = []
    original = torch.Tensor.addmv_

    def recording(self, *args, **kwargs):
        seen.append(torch.backends.cuda.matmul.allow_tf32)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "addmv_", recording)
    batch = _batch([0, 1, 2, 3])
    features = frozen_features(model, batch["image"])
    before = torch.backends.cuda.matmul.allow_tf32  # a process setting (torch's flag object is not monkeypatchable)
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        clipped_gradient_sum(model, features, batch["joints"], batch["weight"], 0.05)
        clipped_unit_gradient_sum(model, features, batch["joints"], batch["weight"], torch.tensor([0, 0, 1, 1]), 0.05)
        assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert seen and not any(seen)


@pytest.mark.parametrize("k", [1, 5, 12])
def test_a_unit_of_k_aligned_records_moves_the_clipped_sum_by_at_most_c(model, k: int) -> None:
    """Adversarial: k copies of one record (perfectly aligned gradients, each far above C) in one unit."""
    clip = 1e-3
    others = [1, 2, 3]
    other_units = [0, 0, 1]
    with_unit = _batch([0] * k + others)
    features = frozen_features(model, with_unit["image"])
    index = torch.tensor([7] * k + other_units)
    total_with, norms, _, _ = clipped_unit_gradient_sum(model, features, with_unit["joints"], with_unit["weight"], index, clip, 4)
    without = _batch(others)
    features_without = frozen_features(model, without["image"])
    total_without, _, _, _ = clipped_unit_gradient_sum(
        model, features_without, without["joints"], without["weight"], torch.tensor(other_units), clip, 4
    )
    assert norms.max() > 10 * clip  # clipping is active
    assert (total_with - total_without).norm() <= clip * (1 + 1e-4)
    # per-record clipping of the same batch would let the unit move the sum by k·C
    record_level, _, _ = clipped_gradient_sum(model, features, with_unit["joints"], with_unit["weight"], clip)
    record_without, _, _ = clipped_gradient_sum(model, features_without, without["joints"], without["weight"], clip)
    assert (record_level - record_without).norm() == pytest.approx(k * clip, rel=1e-3)


def test_a_non_finite_record_is_zeroed_inside_its_unit(model) -> None:
    batch = _batch([0, 1, 2, 3])
    batch["image"][1] = float("nan")
    features = frozen_features(model, batch["image"])
    unit_index = torch.tensor([0, 0, 1, 1])
    total, norms, _, nonfinite = clipped_unit_gradient_sum(model, features, batch["joints"], batch["weight"], unit_index, 1.0)
    assert torch.isfinite(total).all() and torch.isfinite(norms).all()
    assert nonfinite.tolist() == [False, True, False, False]
    clean = _batch([0, 2, 3])
    reference, _, _, _ = clipped_unit_gradient_sum(
        model, frozen_features(model, clean["image"]), clean["joints"], clean["weight"], torch.tensor([0, 1, 1]), 1.0
    )
    assert torch.allclose(total, reference, rtol=1e-5, atol=1e-7)


def test_engine_step_clips_per_unit_and_normalises_by_expected_units(model) -> None:
    dataset = TensorPoseSet(8)
    units = UnitIndex("patient", ((0, 1, 2), (3,), (4, 5), (6, 7)))
    privacy = PrivacyConfig(mechanism="dpsgd", noise_multiplier=0.0, max_grad_norm=0.01, unit="patient")
    engine = build_engine(privacy, model, len(dataset), 2, 5, seed=0, units=units)
    batch = engine_module.collate([dataset[i] for i in (0, 1, 2, 4, 5)])
    batch["unit_index"] = torch.tensor([0, 0, 0, 1, 1])
    metrics = engine.step(model, batch)
    gradient = flatten([p.grad for p in model.trainable_parameters().values()])
    reference = _reference_unit_sum(model, batch, [0, 0, 0, 1, 1], 0.01) / 2  # B = 2 expected units
    assert torch.allclose(gradient, reference, rtol=1e-4, atol=1e-8)
    assert metrics["batch_units"] == 2.0 and metrics["batch_size"] == 5.0
    assert engine.sample_rate == pytest.approx(2 / 4)  # q over 4 patients, not 8 records


@pytest.mark.parametrize("mechanism", ["fdp", "maskdp"])
def test_public_view_mechanisms_clip_the_private_part_per_unit(model, mechanism: str) -> None:
    """The noisy private part of FDP / MaskDP is per unit too; the public part is the plain mean over its own sample."""
    dataset = TensorPoseSet(8)
    units = UnitIndex("image", ((0, 1, 2, 3), (4, 5, 6, 7)))
    privacy = PrivacyConfig(mechanism=mechanism, noise_multiplier=0.0, max_grad_norm=1e-3, unit="image")
    engine = build_engine(privacy, model, len(dataset), 1, 5, seed=0, units=units)
    batch = engine_module.collate([dataset[i] for i in range(4)])
    batch["unit_index"] = torch.zeros(4, dtype=torch.long)
    batch["public_sample"] = engine_module.collate([dataset[i] for i in range(4, 8)])
    private_only = {}

    def capture(*args, **kwargs):
        result = clipped_unit_gradient_sum(*args, **kwargs)
        private_only["sum"] = result[0]
        return result

    original = engine_module.clipped_unit_gradient_sum
    engine_module.clipped_unit_gradient_sum = capture
    try:
        engine.step(model, batch)
    finally:
        engine_module.clipped_unit_gradient_sum = original
    assert private_only["sum"].norm() <= 1e-3 * (1 + 1e-4)  # four records, one clip


# -- sampling ---------------------------------------------------------------------------------------
def test_poisson_sampling_is_over_units_and_takes_every_record_of_a_sampled_unit(model) -> None:
    sizes = [1, 3, 2, 5, 1, 4, 2, 2, 3, 1, 6, 2]  # 12 patients, 32 records
    units = patients(sizes)
    privacy = PrivacyConfig(mechanism="dpsgd", noise_multiplier=1.0, unit="patient", max_records_per_unit=6,
                            insecure_seeded_noise=True)  # the cap (default 4) at the largest unit: no subsampling
    engine = build_engine(privacy, model, units.num_records, 3, 10, seed=0, units=units)
    assert engine.dataset_size == 12 and engine.sample_rate == pytest.approx(0.25)
    unit_of_record = {r: u for u, members in enumerate(units.members) for r in members}
    draws = 2000
    counts = np.zeros(len(sizes))
    for step in range(draws):
        engine.noise.reseed(engine_module._SAMPLING_STREAM, step)
        rows, positions = engine.sample_units()
        sampled = sorted({unit_of_record[r] for r in rows})
        # all records of each sampled unit, none of any other; positions name the sampled units in order
        assert sorted(rows) == sorted(r for u in sampled for r in units.members[u])
        assert [sampled[p] for p in positions] == [unit_of_record[r] for r in rows]
        counts[sampled] += 1
    # each unit joins independently at rate q, whatever its size
    assert abs(counts.mean() / draws - 0.25) < 4 * math.sqrt(0.25 * 0.75 / (draws * len(sizes)))
    assert stats.chisquare(counts).pvalue > 1e-4


def test_batches_carry_each_rows_unit(model) -> None:
    dataset = TensorPoseSet(10)
    units = patients([3, 3, 4])
    privacy = PrivacyConfig(mechanism="dpsgd", noise_multiplier=1.0, unit="patient", insecure_seeded_noise=True)
    engine = build_engine(privacy, model, len(dataset), 2, 10, seed=1, units=units)
    seen_nonempty = False
    for _, batch in zip(range(8), engine.batches(dataset)):
        index, unit_index, real = batch["index"].tolist(), batch["unit_index"].tolist(), batch["row_mask"].tolist()
        assert len(index) == len(unit_index) == len(real) == batch["image"].shape[0]
        # the sampled units' rows (padding rows of the fixed shape, row_mask False, carry no unit)
        index, unit_index = [i for i, r in zip(index, real) if r], [u for u, r in zip(unit_index, real) if r]
        groups: dict[int, list[int]] = {}
        for record, position in zip(index, unit_index):
            groups.setdefault(position, []).append(record)
        assert sorted(tuple(sorted(g)) for g in groups.values()) == sorted(
            m for m in units.members if set(m) & set(index)
        )
        seen_nonempty |= bool(index)
    assert seen_nonempty


def test_records_per_unit_cap_takes_a_uniform_subset(model) -> None:
    units = patients([6, 1])
    privacy = PrivacyConfig(mechanism="dpsgd", noise_multiplier=1.0, unit="patient", max_records_per_unit=2,
                            insecure_seeded_noise=True)
    engine = build_engine(privacy, model, units.num_records, 1, 10, seed=0, units=units)
    picks = np.zeros(6)
    for step in range(3000):
        engine.noise.reseed(engine_module._SAMPLING_STREAM, step)
        rows, positions = engine.sample_units()
        big = [r for r in rows if r < 6]
        assert len(big) in (0, 2) and len(set(big)) == len(big)
        picks[big] += 1
    assert stats.chisquare(picks).pvalue > 1e-4
    assert engine.privacy_report()["max_records_per_unit"] == 2


def test_rows_come_from_the_records_that_can_train_while_sampling_stays_over_every_unit(model) -> None:
    """Grey copies: a colour record's gradient is exactly 0, so a unit's row slots take only its
    records flagged ``trainable_records``. Sampling is still Poisson over every unit (q = B/N counts
    the units with no flagged record too), the cap takes a uniform subset of the flagged records,
    and every step keeps its fixed shape."""
    sizes = [4, 4, 4, 4, 4, 4]  # unit 0: no flagged record; unit 1: one; unit 5: four (over the cap of 2)
    units = patients(sizes)
    flags = ([False] * 4 + [False, True, False, False] + [True, False, True, False] + [False, False, True, True]
             + [True, False, False, False] + [True] * 4)
    privacy = PrivacyConfig(mechanism="dpsgd", noise_multiplier=1.0, unit="patient", max_records_per_unit=2,
                            insecure_seeded_noise=True)
    engine = build_engine(privacy, model, units.num_records, 3, 10, seed=0, units=units, trainable_records=flags)
    assert engine.dataset_size == 6 and engine.sample_rate == pytest.approx(0.5)  # q = 3 / 6: every unit counts
    unit_of_record = {r: u for u, members in enumerate(units.members) for r in members}
    picks = np.zeros(4)
    joined = np.zeros(len(sizes))
    draws = 3000
    for step in range(draws):
        engine.noise.reseed(engine_module._SAMPLING_STREAM, step)
        rows, positions = engine.sample_units()
        assert all(flags[r] for r in rows)
        by_unit: dict[int, list[int]] = {}
        for record in rows:
            by_unit.setdefault(unit_of_record[record], []).append(record)
        for unit, records in by_unit.items():
            assert len(records) == min(2, sum(flags[r] for r in units.members[unit]))
            joined[unit] += 1
        picks[[r - 20 for r in by_unit.get(5, [])]] += 1
    # units with flagged records join at rate q; the capped one's two rows are a uniform pair of its four
    assert joined[0] == 0 and all(abs(joined[u] / draws - 0.5) < 0.05 for u in range(1, 6))
    assert stats.chisquare(picks).pvalue > 1e-4
    # the step's work does not depend on the flags: the same fixed shape with and without them
    unflagged = build_engine(privacy, model, units.num_records, 3, 10, seed=0, units=units)
    dataset = TensorPoseSet(units.num_records)
    assert ({batch["image"].shape[0] for _, batch in zip(range(20), engine.batches(dataset))}
            == {batch["image"].shape[0] for _, batch in zip(range(20), unflagged.batches(dataset))} == {engine.shape.rows})
    with pytest.raises(ValueError, match="3 trainable-record flags for a training set of 24 records"):
        build_engine(privacy, model, units.num_records, 3, 10, units=units, trainable_records=[True] * 3)


def test_unit_index_must_cover_the_training_set(model) -> None:
    with pytest.raises(ValueError, match="covers 3 records, the training set has 4"):
        build_engine(PrivacyConfig(mechanism="dpsgd", noise_multiplier=1.0), model, 4, 1, 1, units=patients([3]))
    with pytest.raises(ValueError, match="2 patients"):
        build_engine(PrivacyConfig(mechanism="dpsgd", noise_multiplier=1.0), model, 4, 3, 1, units=patients([2, 2]))


# -- default unit ---------------------------------------------------------------------------------
def _record(image: str, patient: str | None = None) -> PoseRecord:
    return PoseRecord(image, np.zeros((16, 2), np.float32), np.ones(16, np.float32), np.array([5, 5], np.float32), 1.0,
                      patient_id=patient)


def test_default_unit_is_the_coarsest_the_annotations_support() -> None:
    with_patients = [_record("a.png", "p1"), _record("b.png", "p1"), _record("b.png", "p2")]
    choice = resolve_unit("auto", with_patients, "site A")
    assert choice.unit == "patient" and "patient_id" in choice.reason
    partly = [_record("a.png", "p1"), _record("b.png")]
    assert resolve_unit("auto", partly, "site A").unit == "image"
    anonymous = [_record(""), _record("")]
    assert resolve_unit("auto", anonymous, "site A").unit == "record"
    assert supported_units(partly) == ("record", "image")


def test_patients_shown_in_one_image_are_one_unit() -> None:
    """Removing an image of two patients must touch one unit, not two (2C), and a patient's face in
    the other's crop must be covered: patients who share an image (directly or through others)
    form one patient unit; everyone else keeps their own."""
    records = [_record("a.png", "A"), _record("b.png", "B"), _record("ward.png", "A"), _record("ward.png", "B"),
               _record("c.png", "C"), _record("e.png", "E"), _record("bed.png", "C"), _record("bed.png", "D")]
    index = UnitIndex.from_records(records, "patient")
    assert index.members == ((0, 1, 2, 3), (4, 6, 7), (5,))
    for image in {r.image for r in records}:  # every image's records lie in exactly one unit
        rows = {i for i, r in enumerate(records) if r.image == image}
        assert sum(bool(rows & set(unit)) for unit in index.members) == 1, image
    alone = [_record("a.png", "A"), _record("b.png", "A"), _record("c.png", "B")]
    assert UnitIndex.from_records(alone, "patient").members == ((0, 1), (2,))


def test_patient_ids_that_differ_only_in_case_or_spacing_are_one_patient() -> None:
    """One patient typed "P-017" in one record and "p-017 " or "P-017" with a doubled space in others
    would otherwise be two units, each protected as only part of that patient."""
    records = [_record("a.png", "P-017"), _record("b.png", "p-017"), _record("c.png", "P-018"),
               _record("d.png", "P-017 "), _record("e.png", "p-018"), _record("f.png", "Ward 3  bed 7"),
               _record("g.png", "ward 3 bed 7"), _record("h.png", "P-0170")]
    assert UnitIndex.from_records(records, "patient").members == ((0, 1, 3), (2, 4), (5, 6), (7,))
    assert records[1].patient_id == "p-017"  # the record keeps the id as written


def test_patient_ids_written_with_invisible_look_alike_or_padding_characters_are_one_patient() -> None:
    """A red-team (2026-12-07) split one patient into 7 units with spellings case-folding missed: a
    zero-width space, a byte-order mark, a soft hyphen, a full-width letter, dash variants — and
    17 / "017" / "0017", as a spreadsheet writes them. Each is one patient now; distinct ids stay apart."""
    spellings = ["P-017", "P\u200b-017", "\ufeffP-017", "P\u00ad-017", "\uff30-017", "P\u2011017", "P\u2013017",
                 "P\u2212017", "p-017\u00a0"]
    records = [_record(f"{i}.png", spelling) for i, spelling in enumerate(spellings)]
    records += [_record("x.png", 17), _record("y.png", "017"), _record("z.png", "0017"), _record("w.png", "P-018"),
                _record("v.png", "1017")]
    n = len(spellings)
    assert UnitIndex.from_records(records, "patient").members == (tuple(range(n)), (n, n + 1, n + 2), (n + 3,), (n + 4,))


def test_patient_unit_without_patient_ids_names_the_problem_and_where() -> None:
    records = [_record("a.png", "p1"), _record("b.png"), _record("c.png")]
    with pytest.raises(UnitError, match=r"site B: privacy.unit = 'patient' needs 'patient_id' on every record, but 2 of 3 "
                                        r"records lack it \(first: record 1, image 'b.png'\)"):
        resolve_unit("patient", records, "site B")
    with pytest.raises(UnitError, match="site B"):
        UnitIndex.from_records(records, "patient", "site B")


def test_unit_index_groups_images_and_patients() -> None:
    records = [_record("a.png", "p1"), _record("b.png", "p2"), _record("a.png", "p1"), _record("c.png", "p1")]
    assert UnitIndex.from_records(records, "image").members == ((0, 2), (1,), (3,))
    assert UnitIndex.from_records(records, "patient").members == ((0, 2, 3), (1,))
    assert UnitIndex.from_records(records, "record").members == ((0,), (1,), (2,), (3,))


def test_loaders_read_patient_ids(tmp_path: Path) -> None:
    valid = json.loads((SHARED_DATA / "mpii-real" / "annotations.json").read_text()) if (SHARED_DATA / "mpii-real" / "annotations.json").exists() else None
    rows = [_record("x.png", "p-1").to_json(), {**_record("y.png").to_json(), "patient_id": 17}]
    (tmp_path / "annotations.json").write_text(json.dumps(rows))
    records, _ = load_records(tmp_path)
    assert [r.patient_id for r in records] == ["p-1", "17"]
    assert records[0].to_json()["patient_id"] == "p-1" and "patient_id" not in records[0].extra
    (tmp_path / "annotations.json").write_text(json.dumps([{**rows[0], "patient_id": ""}]))
    with pytest.raises(AnnotationError, match="record 0: 'patient_id' is empty"):
        load_records(tmp_path)
    if valid is not None:  # real MPII: no patient ids, image identity from the file name → image
        records, _ = load_records(SHARED_DATA / "mpii-real")
        assert resolve_unit("auto", records, "mpii-real").unit == "image"


def test_coco_patient_id_from_the_image_or_the_person(tmp_path: Path) -> None:
    coco_dir = SHARED_DATA / "coco-real"
    if not coco_dir.exists():
        pytest.skip("shared/data/coco-real not present")
    source = next(p for p in sorted(coco_dir.glob("*.json")))
    raw = json.loads(source.read_text())
    assert resolve_unit("auto", load_records(source)[0], "coco").unit == "image"
    raw["images"] = [{**img, "patient_id": f"img-{img['id']}"} for img in raw["images"]]
    raw["annotations"][0]["patient_id"] = "person-0"
    path = tmp_path / "coco.json"
    path.write_text(json.dumps(raw))
    records, _ = load_records(path)
    assert resolve_unit("auto", records, "coco").unit == "patient"
    by_annotation = {r.extra["coco_annotation_id"]: r.patient_id for r in records}
    assert by_annotation[raw["annotations"][0]["id"]] == "person-0"
    assert all(pid.startswith("img-") for aid, pid in by_annotation.items() if aid != raw["annotations"][0]["id"])


def test_config_unit_is_validated_once() -> None:
    assert load_config(None).privacy.unit == "auto"
    assert load_config(None, ["privacy.unit=\"patient\""]).privacy.unit == "patient"
    with pytest.raises(ConfigError, match="privacy.unit"):
        load_config(None, ["privacy.unit=\"person\""])
    with pytest.raises(ConfigError, match="privacy.max_records_per_unit"):
        load_config(None, ["privacy.max_records_per_unit=0"])


# -- reports ----------------------------------------------------------------------------------------
def test_the_report_names_the_unit(model) -> None:
    units = patients([2, 2, 1, 3])
    privacy = PrivacyConfig(mechanism="dpsgd", noise_multiplier=1.0, unit="patient", delta=1e-5)
    engine = build_engine(privacy, model, units.num_records, 1, 10, seed=0, units=units)
    engine.step(model, engine_module.collate([], engine_module.collate([TensorPoseSet(1)[0]])))
    report = engine.privacy_report()
    assert report["protection_unit"] == "patient"
    assert report["epsilon_text"].endswith("(DP, δ = 1e-05, PLD) per patient, add/remove-one-patient adjacency")  # PLD: the default accountant
    assert report["guarantee_sentence"].endswith("-DP per patient, add/remove-one-patient adjacency, PLD accountant")
    assert report["unit_protected"].startswith("one patient")
    assert report["adjacency"].startswith("add/remove one patient")
    text = describe(report)
    assert "per patient" in text and "protection unit: patient" in text
    fdp = build_engine(PrivacyConfig(mechanism="fdp", noise_multiplier=1.0, unit="image"), model, units.num_records, 1, 1,
                       units=UnitIndex.from_records([_record("a.png")] * 8, "image"))
    fdp_report = fdp.privacy_report()
    assert fdp_report["epsilon_text"].endswith("per image, replace-one-image's-protected-part adjacency") and "one image" in fdp_report["unit_protected"]
    assert "replace-one-image" in fdp_report["guarantee_sentence"]


def test_cli_epsilon_names_the_unit(capsys) -> None:
    from fedpose.cli import main

    args = ["privacy", "epsilon", "--sample-rate", "0.01", "--noise-multiplier", "1.0", "--steps", "100", "--delta", "1e-5"]
    assert main([*args, "--unit", "patient"]) == 0
    out = capsys.readouterr().out
    assert "PLD) per patient" in out and "-DP per patient, add/remove-one-patient adjacency, PLD accountant" in out
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["protection_unit"] == "record"


@pytest.fixture(scope="module")
def synth_patients(tmp_path_factory) -> Path:
    from fedpose.data.synthetic import generate_dataset

    out = tmp_path_factory.mktemp("synth-units") / "data"
    generate_dataset(out, sites=1, per_site=8, public=2, test=2, size=(64, 64), workers=1, progress=False)
    return out


def _central(data: Path, out: Path, *overrides: str):
    from fedpose.train.central import run_training

    cfg = load_config(None, [
        f'data.train="{data}"', "data.input_size=[64, 64]", 'model.backbone="tiny_vit_test"', 'model.scenario="scratch"',
        "train.steps=1", "train.batch_size=1", "train.checkpoint_every=1", f'train.out_dir="{out}"',
        'privacy.mechanism="dpsgd"', "privacy.noise_multiplier=1.0", *overrides,
    ])
    lines: list[str] = []
    summary = run_training(cfg, progress=False, log=lines.append)
    return summary, lines


def test_central_training_on_synthetic_patients_is_patient_level_by_default(synth_patients: Path, tmp_path: Path) -> None:
    summary, lines = _central(synth_patients / "site-1", tmp_path / "run")
    report = json.loads((tmp_path / "run" / "privacy.json").read_text())
    assert report["protection_unit"] == "patient" and "every record has a patient_id" in report["protection_unit_choice"]
    assert report["sample_rate"] == pytest.approx(1 / 2)  # 8 images = 2 patients; q over patients
    assert summary["epsilon_text"].endswith("per patient, add/remove-one-patient adjacency") and summary["privacy"]["protection_unit"] == "patient"
    assert any(line.startswith("protection unit: patient") for line in lines)
    # the run's ledger is per patient: resuming it per image would mix two guarantees
    with pytest.raises(ConfigError, match="the checkpoint's privacy ledger is per patient"):
        from fedpose.train.central import run_training

        cfg = load_config(tmp_path / "run" / "config.toml", ["train.steps=2", 'privacy.unit="image"'])
        run_training(cfg, resume=tmp_path / "run", progress=False, log=lambda _: None)


def test_central_training_refuses_a_patient_unit_without_patient_ids(synth_patients: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"privacy.unit: data.train \(.*public\): privacy.unit = 'patient' needs 'patient_id'"):
        _central(synth_patients / "public", tmp_path / "run", 'privacy.unit="patient"')


def test_a_site_pins_its_default_unit_and_reports_it(tmp_path: Path) -> None:
    from fedpose.federation.local_training import run_site_round, site_protection_unit, train_site_round
    from fedpose.federation.site_budget import BudgetStateError
    from site_round_helpers import global_model, make_site_data, site_config

    data = make_site_data(tmp_path / "data")  # synthetic: 16 images of 4 patients
    weights, spec = global_model()
    site = site_config(data, tmp_path / "state")
    assert site.privacy.unit == "auto" and site_protection_unit(site) == "patient"
    result = train_site_round(site, "run", 1, weights, spec, 1)
    assert result.reply.status == "ok"
    privacy = result.reply.privacy
    assert privacy is not None and privacy.protection_unit == "patient" and privacy.unit.startswith("one patient")
    # the unit is pinned in the budget state: a later explicit change is a guarantee change, refused
    image_site = site_config(data, tmp_path / "state", unit="image")
    with pytest.raises(BudgetStateError, match="accounted per patient"):
        train_site_round(image_site, "run", 2, weights, spec, 1)
    assert run_site_round(image_site, "run", 2, weights, spec, 1).reply.error_class == "BudgetStateError"


def test_mpii_validation_split_defaults_to_images_of_up_to_four_people() -> None:
    path = SHARED_DATA / "mpii-valid" / "valid.json"
    if not path.exists():
        pytest.skip("shared/data/mpii-valid not present")
    records, _ = load_records(path)
    choice = resolve_unit("auto", records, str(path))
    units = UnitIndex.from_records(records, choice.unit, str(path))
    assert choice.unit == "image"
    assert (units.num_records, units.num_units, units.max_records_per_unit) == (2958, 2729, 4)


def test_the_coordinators_round_line_names_each_sites_unit() -> None:
    from fedpose.federation.report import RoundRecord, round_line

    line = round_line(RoundRecord.model_validate({"round": 3, "sites": {
        "a": {"status": "ok", "epsilon": 1.0, "delta": 1e-5, "guarantee": "DP", "accountant": "rdp", "unit": "patient"},
        "b": {"status": "ok", "epsilon": 2.0, "delta": 1e-5, "guarantee": "DP", "accountant": "rdp"},  # history from before units
    }}))
    assert "a: ok, ε = 1 (DP, δ = 1e-05, RDP) per patient" in line and "b: ok, ε = 2 (DP, δ = 1e-05, RDP) per record" in line
