"""An observer of a site's replies times them (their arrival, Flower's ``created_at``): the time a
round takes must not tell N, nor whether a large patient is in the data (issue 24, item 3).

Wall-clock time on a shared 2-core machine is noise, so these tests observe the *work* of the real
site round exactly instead: the records loaded, the shape of every input each module of the model
sees (the frozen forward, each per-sample chunk under vmap, the public view) and the per-sample
chunk size. The observer times a whole round, never one of its steps, so the work is fixed per
round (fedpose.privacy.fixed_shape, "fixed work per round"): under the same declared settings the
round's total must be identical whatever the data, while its steps may split it differently.
``benchmarks/timing`` measures the wall clock of the same rounds.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from collections import Counter
from typing import Any

import pytest

from fedpose.federation.local_training import run_site_round
from site_round_helpers import INPUT_SIZE, global_model, site_config

#: declared settings shared by every dataset below (patients: the synthetic sites' unit)
DECLARED = {"sample_rate": 1 / 12, "max_records_per_unit": 1, "local_steps": 2, "batch_size": 2, "max_batch_units": None}
LARGE_PATIENT = 48


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """96 synthetic records of 24 patients (4 images each)."""
    from fedpose.data.synthetic import ensure_dataset

    root = tmp_path_factory.mktemp("timing-data")
    ensure_dataset(root, sites=1, per_site=96, public=4, test=4, size=INPUT_SIZE, seed=0, progress=False)
    return root / "site-1"


def subset(source: Path, target: Path, first: int, last: int, large_patient: bool = False) -> Path:
    """A dataset of records [first, last) of ``source``; ``large_patient``: the first 48 of them are
    one patient."""
    records = json.loads((source / "annotations.json").read_text())[first:last]
    if large_patient:
        for record in records[:LARGE_PATIENT]:
            record["patient_id"] = "large-patient"
    target.mkdir(parents=True)
    for record in records:
        (target / record["image"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / record["image"], target / record["image"])
    (target / "annotations.json").write_text(json.dumps(records))
    return target


class WorkLog:
    """``engine_hook`` for :func:`run_site_round`: records the work of every step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.real_rows: list[int] = []
        self._loaded: list[int] = []

    def __call__(self, engine: Any) -> None:
        log, batches, step = self, engine.batches, engine.step

        class Counting:  # the site's dataset, counting what is loaded
            def __init__(self, dataset: Any) -> None:
                self.dataset = dataset

            def __len__(self) -> int:
                return len(self.dataset)

            def __getitem__(self, index: int) -> Any:
                log._loaded.append(1)
                return self.dataset[index]

        def counted_batches(dataset: Any) -> Any:
            return batches(Counting(dataset))

        def observed_step(model: Any, batch: dict) -> dict:
            inputs: list[tuple[str, tuple]] = []

            def record(name: str):
                def hook(module: Any, args: tuple) -> None:
                    if args and hasattr(args[0], "shape"):
                        inputs.append((name, tuple(args[0].shape)))
                return hook

            handles = [module.register_forward_pre_hook(record(name)) for name, module in model.named_modules()]
            try:
                metrics = step(model, batch)
            finally:
                for handle in handles:
                    handle.remove()
            params = model.trainable_parameters()
            log.steps.append({
                "loaded": len(log._loaded),
                "batch": {k: tuple(v.shape) for k, v in batch.items() if hasattr(v, "shape")},
                "spare_rows": len(batch.get("spare_rows", ())),  # the round's spare, run chunk by chunk in the step
                "inputs": inputs,
                "chunk": engine.chunk_for(next(iter(params.values())).device, sum(p.numel() for p in params.values())),
            })
            log._loaded.clear()
            log.real_rows.append(int(metrics["batch_size"]))
            return metrics

        engine.batches, engine.step = counted_batches, observed_step


def round_work(data: Path, state: Path, weights: tuple[dict, dict]) -> WorkLog:
    privacy = {k: v for k, v in DECLARED.items() if k != "batch_size"}
    site = site_config(data.parent, state, **privacy)
    site = site.model_copy(update={"data": site.data.model_copy(update={"train": str(data)}),
                                   "train": site.train.model_copy(update={"batch_size": DECLARED["batch_size"]})})
    work = WorkLog()
    result = run_site_round(site, "run", 1, weights[0], weights[1], DECLARED["local_steps"], engine_hook=work)
    assert result.reply.status == "ok", result.reply
    assert len(work.steps) == DECLARED["local_steps"]
    return work


def total(work: WorkLog) -> dict[str, Any]:
    """What the round's duration is a function of: every record loaded, every module input, the chunk."""
    return {
        "loaded": sum(step["loaded"] for step in work.steps),
        "rows": sum(step["batch"]["image"][0] + step["spare_rows"] for step in work.steps),
        "inputs": Counter(shape for step in work.steps for shape in step["inputs"]),
        "chunks": {step["chunk"] for step in work.steps},
    }


def test_a_rounds_work_is_the_same_for_16_and_96_records(source, tmp_path) -> None:
    weights = global_model()
    small = round_work(subset(source, tmp_path / "n16", 0, 16), tmp_path / "state-16", weights)
    large = round_work(subset(source, tmp_path / "n96", 0, 96), tmp_path / "state-96", weights)
    reference = total(small)
    # the fixed work of a round of 2 steps at B = 2: 3 chunks of 16 patient slots × 1 row, every one
    # loaded and computed (fixed_shape.round_work: the 21-slot step shape, chunks of 16)
    assert reference["rows"] == reference["loaded"] == 48 and reference["chunks"] == {16}
    assert reference["inputs"], "the model saw no input"
    assert total(large) == reference
    # ... while what was sampled is the data's: at most 4 patients of 16 records (1 row each)
    assert max(small.real_rows) <= 4


def test_a_rounds_work_is_the_same_with_and_without_a_48_record_patient(source, tmp_path) -> None:
    weights = global_model()
    present = round_work(subset(source, tmp_path / "present", 0, 96, large_patient=True), tmp_path / "state-p", weights)
    absent = round_work(subset(source, tmp_path / "absent", 48, 96), tmp_path / "state-a", weights)
    assert total(present) == total(absent)
    # the large patient, when sampled, fills its slot's 1 row: never more rows than any patient
    assert max(present.real_rows) <= 13


def capacity_round(source: Path, tmp_path: Path, patients: int, caplog) -> tuple[Any, list[str], list[dict]]:
    """One round of 2 steps of a site of ``patients`` one-record patients with 3 unit slots a step at
    q = 1/12 (N_max = 3): (reply, the warnings of the site's process log, its rounds.jsonl entries)."""
    from fedpose.federation.local_training import ROUND_LOG

    data = subset(source, tmp_path / f"n{patients}", 0, patients)
    records = json.loads((data / "annotations.json").read_text())
    for number, record in enumerate(records):
        record["patient_id"] = f"patient-{number}"
    (data / "annotations.json").write_text(json.dumps(records))
    state = tmp_path / f"state-{patients}"
    site = site_config(data.parent, state, sample_rate=1 / 12, max_batch_units=3, max_records_per_unit=1)
    site = site.model_copy(update={"data": site.data.model_copy(update={"train": str(data)})})
    weights = global_model()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        result = run_site_round(site, "run", 1, weights[0], weights[1], 2)
    warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    rounds = [json.loads(line) for line in (state / ROUND_LOG).read_text().splitlines()]
    return result, warnings, rounds


def test_a_site_beyond_the_timing_domain_trains_and_one_unit_more_changes_no_reply(source, tmp_path, caplog) -> None:
    from fedpose.federation.site_budget import SiteBudget
    from fedpose.privacy.fixed_shape import round_work, step_shape

    # a round of 2 steps at q = 1/12 with 3 one-row slots a step (chunks of 3): a 4th patient could
    # make it overflow its 2 chunks with probability > 1e-15
    work = round_work(step_shape("patient", 4, 1 / 12, 3, 1), 2, 3)
    assert (work.chunks, work.max_units) == (2, 3)
    n_max = work.max_units
    at, at_warnings, at_rounds = capacity_round(source, tmp_path, n_max, caplog)
    beyond, beyond_warnings, beyond_rounds = capacity_round(source, tmp_path, n_max + 1, caplog)
    # the adversarial point: one patient more, at N = N_max, flips nothing the coordinator sees
    for result in (at, beyond):
        assert result.reply.status == "ok" and result.reply.reason is None and result.reply.error_class is None
        assert result.update
    assert at.reply.model_dump() == beyond.reply.model_dump()  # the same schema, the same values (N is in none)
    assert {k: v.shape for k, v in at.update.items()} == {k: v.shape for k, v in beyond.update.items()}
    # the guarantee is spent as for any N: the same ε, the accountant's δ
    spent = [SiteBudget(tmp_path / f"state-{n}", "site-1", 50.0, 1e-5, "DP").epsilon for n in (n_max, n_max + 1)]
    assert spent[0] == pytest.approx(spent[1]) and spent[0] > 0
    assert at.reply.privacy.delta == 1e-5
    # the warning, naming N and the settings, is in the site's local log and rounds.jsonl only
    assert not any("timing independent" in text for text in at_warnings), at_warnings
    assert "note" not in at_rounds[-1]
    warning = next(text for text in beyond_warnings if "timing independent" in text)
    assert "4 patients" in warning and "up to 3 patients" in warning and "privacy.sample_rate" in warning
    assert beyond_rounds[-1]["outcome"] == "ok" and beyond_rounds[-1]["note"] == warning
    assert "timing independent" not in beyond.reply.model_dump_json() and "4 patients" not in beyond.reply.model_dump_json()
