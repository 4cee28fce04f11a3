"""`fedpose export`: the only artefact meant to leave a hospital — weights and the privacy report,
without the private-data statistics that checkpoints and metrics hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedpose.cli import main
from fedpose.data.synthetic import generate_dataset
from fedpose.cli.export import EXPORT_KEYS, PUBLISHABLE_SECTION_KEYS, SITE_KEYS
from fedpose.privacy.ldp_slicing import CHANNELS
from fedpose.privacy.report import PUBLISHABLE_KEYS

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

#: keys of privacy.json / checkpoints that carry private-data statistics or the run's randomness
FORBIDDEN = {"dataset_size", "loss", "train_loss", "grad_norm_median", "clipped_fraction", "batch_size", "expected_batch_size",
             "seed", "rng", "accountant_state", "rdp_curve", "planned_steps"}


@pytest.fixture(scope="module")
def central_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("export")
    generate_dataset(root / "synth", sites=1, per_site=4, public=6, test=4, size=(64, 64), workers=1, progress=False)
    config = root / "run.toml"
    config.write_text(
        f'[data]\ntrain = "{root}/synth/public"\nval = "{root}/synth/test"\ninput_size = [64, 64]\n'
        '[model]\nbackbone = "tiny_vit_test"\nscenario = "scratch"\n'
        f'[train]\nsteps = 2\nbatch_size = 3\neval_every = 2\ncheckpoint_every = 2\nseed = 7\nout_dir = "{root}/run"\n'
        '[privacy]\nmechanism = "dpsgd"\nnoise_multiplier = 1.0\n'
    )
    assert main(["train", "--config", str(config), "--quiet"]) == 0
    return root / "run"


#: every key, at any depth, that an exported privacy report may hold
ALLOWED_KEYS = (PUBLISHABLE_KEYS | EXPORT_KEYS | SITE_KEYS | set(CHANNELS)
                | {key for keys in PUBLISHABLE_SECTION_KEYS.values() for key in keys})


def _keys(obj) -> set[str]:
    if isinstance(obj, dict):
        return set(obj) | {k for v in obj.values() for k in _keys(v)}
    if isinstance(obj, list):
        return {k for v in obj for k in _keys(v)}
    return set()


def test_export_writes_weights_and_an_allow_listed_report_only(central_run: Path, tmp_path: Path) -> None:
    import torch

    from fedpose.model import model_from_checkpoint

    out = tmp_path / "release"
    assert main(["export", str(central_run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["MODEL_CARD.md", "PRIVACY.txt", "model.safetensors", "privacy_report.json"]
    report = json.loads((out / "privacy_report.json").read_text())
    assert set(report) - {"source", "model_selection"} <= PUBLISHABLE_KEYS
    assert _keys(report) <= ALLOWED_KEYS, _keys(report) - ALLOWED_KEYS
    assert not _keys(report) & FORBIDDEN, _keys(report) & FORBIDDEN
    assert report["model_selection"].startswith("last checkpoint")
    assert "(DP, δ = 1e-05, PLD)" in report["epsilon_text"] and "randomness" in report

    # safetensors: tensors and a str→str metadata map (the model spec), nothing that unpickles
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        metadata = fh.metadata()
    assert set(metadata) == {"fedpose.format", "fedpose.model_spec"}
    assert json.loads(metadata["fedpose.model_spec"])["backbone"] == "tiny_vit_test"
    model, _ = model_from_checkpoint(out / "model.safetensors")  # `fedpose eval` / `predict` read it
    trained, _ = model_from_checkpoint(central_run / "checkpoints" / "last.pt")
    assert model.state_dict().keys() == trained.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), trained.state_dict().values()))
    text = (out / "PRIVACY.txt").read_text()
    assert "unit protected" in text and "randomness" in text
    # what leaves, for a central run: no federation wording (sites, replies) in its report
    assert "what leaves: central training publishes only" in text and "federation site" not in text


def test_exporting_best_says_the_selection_used_the_validation_split(central_run: Path, tmp_path: Path) -> None:
    assert main(["export", str(central_run), "--out", str(tmp_path / "best"), "--checkpoint", "best"]) == 0
    report = json.loads((tmp_path / "best" / "privacy_report.json").read_text())
    assert "NOT covered by the guarantee" in report["model_selection"] and "validation split (data.val)" in report["model_selection"]


def test_an_export_holds_nothing_machine_local(central_run: Path, tmp_path: Path) -> None:
    """Issue 27: paths in hospitals carry study and patient names; the artefact names no path, host or user."""
    import getpass
    import re
    import socket

    import torch

    out = tmp_path / "best"
    assert main(["export", str(central_run), "--out", str(out), "--checkpoint", "best"]) == 0
    from safetensors import safe_open

    texts = {name: (out / name).read_text() for name in ("privacy_report.json", "PRIVACY.txt", "MODEL_CARD.md")}
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        texts["model.safetensors"] = json.dumps(fh.metadata(), ensure_ascii=False)
    local = [str(central_run.parent), "synth/test", "synth/public", socket.gethostname()]
    local += [getpass.getuser()] if getpass.getuser() != "root" else []
    for name, text in texts.items():
        for word in local:
            assert word not in text, (name, word)
        assert not re.search(r"(?<![\w.])/(tmp|home|Users|data|mnt|var)\b", text), (name, text)
    # the unit was chosen automatically (public records name images, not patients), and the artefact says so
    assert "protection unit: image (chosen automatically: the coarsest unit the annotations support" in texts["PRIVACY.txt"]
    assert json.loads(texts["privacy_report.json"])["protection_unit_choice"].startswith("chosen automatically")


def test_machine_local_text_is_withheld_and_ordinary_text_kept() -> None:
    from fedpose.cli.export import MACHINE_LOCAL, _withhold_machine_local

    kept = ["q = B/N over units", "add/remove-one-patient adjacency", "(ε, δ)-DP", "ε = 2.5 (DP, δ = 1e-05, RDP) per record",
            "Y/Cb/Cr bit planes", "1/2"]
    assert _withhold_machine_local(kept, ["ward7-pc"]) == kept
    leaky = {"a": "best on /srv/hospital/study-17/val: NOT", "b": ["see ~/runs/x.", r"at D:\scans\p-017 now"], "c": "on ward7-pc"}
    assert _withhold_machine_local(leaky, ["ward7-pc"]) == {
        "a": f"best on {MACHINE_LOCAL}: NOT", "b": [f"see {MACHINE_LOCAL}.", f"at {MACHINE_LOCAL} now"], "c": f"on {MACHINE_LOCAL}"}


def test_a_federated_model_is_exported_with_every_site_s_guarantee(tmp_path: Path) -> None:
    from fedpose.federation.aggregation import save_array_checkpoint
    from site_round_helpers import global_model

    weights, spec = global_model()
    coordinator = tmp_path / "coordinator"
    save_array_checkpoint(coordinator / "global.npz", weights, {"run_id": "demo", "state": {"model_spec": spec.model_dump(mode="json")}})
    (coordinator / "report.json").write_text(json.dumps({"run_id": "demo", "sites": [
        {"site_id": "site-1", "epsilon": 2.5, "delta": 1e-5, "guarantee": "DP", "rounds_joined": 3}]}))
    assert main(["export", str(coordinator), "--out", str(tmp_path / "release")]) == 0
    report = json.loads((tmp_path / "release" / "privacy_report.json").read_text())
    assert report["sites"][0]["epsilon_text"] == "ε = 2.5 (DP, δ = 1e-05, RDP) per record, add/remove-one-record adjacency"  # report.json from before units
    assert "site-1: ε = 2.5 (DP" in (tmp_path / "release" / "PRIVACY.txt").read_text()


def test_export_refuses_a_run_without_its_privacy_report(central_run: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "run"
    shutil.copytree(central_run, broken)
    (broken / "privacy.json").unlink()
    assert main(["export", str(broken), "--out", str(tmp_path / "x")]) != 0
    assert not (tmp_path / "x" / "model.pt").exists()


def _copy_run(central_run: Path, tmp_path: Path) -> Path:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(central_run, run)
    return run


def test_nested_sections_are_allow_listed_and_seeds_withheld(central_run: Path, tmp_path: Path) -> None:
    """A test-only seeded run names its seed in the randomness text; an LDP section carries settings only."""

    run = _copy_run(central_run, tmp_path)
    privacy = json.loads((run / "privacy.json").read_text())
    privacy["randomness"] = "seeded torch.Generator (seed 424242): NOT PRIVATE, tests only"
    privacy["input_privacy"] = {"mechanism": "ldp-slicing", "epsilon_total": 2.0, "randomness": "pcg64 (seed 424242; not cryptographically secure)",
                                "budgets": {"Y": [0.1], "Cb": [0.1], "Cr": [0.1], "images": 17}, "images": 17}
    privacy["basis"] = {"k": 8, "public_samples": 6, "grad_norm_median": 3.0}
    (run / "privacy.json").write_text(json.dumps(privacy))
    out = tmp_path / "release"
    assert main(["export", str(run), "--out", str(out)]) == 0
    report = json.loads((out / "privacy_report.json").read_text())
    assert _keys(report) <= ALLOWED_KEYS, _keys(report) - ALLOWED_KEYS
    assert report["basis"] == {"k": 8, "public_samples": 6}
    assert report["input_privacy"]["budgets"] == {"Y": [0.1], "Cb": [0.1], "Cr": [0.1]}
    assert "seed withheld" in report["randomness"] and "seed withheld" in report["input_privacy"]["randomness"]
    for name in ("privacy_report.json", "PRIVACY.txt", "MODEL_CARD.md"):
        assert "424242" not in (out / name).read_text()
    assert b"424242" not in (out / "model.safetensors").read_bytes()


def test_a_privacy_record_older_than_the_model_is_refused(central_run: Path, tmp_path: Path, capsys) -> None:
    """central.py writes last.pt, then privacy.json: a run stopped in between must not export a smaller ε."""
    run = _copy_run(central_run, tmp_path)
    privacy = json.loads((run / "privacy.json").read_text())
    privacy["steps"] -= 1
    (run / "privacy.json").write_text(json.dumps(privacy))
    assert main(["export", str(run), "--out", str(tmp_path / "x")]) != 0
    assert "understate" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_checkpoint_files_are_accepted_and_the_output_dir_holds_only_the_export(central_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "release"
    assert main(["export", str(central_run / "checkpoints" / "best.pt"), "--out", str(out)]) == 0
    assert "NOT covered by the guarantee" in json.loads((out / "privacy_report.json").read_text())["model_selection"]
    assert main(["export", str(central_run), "--out", str(out)]) == 0  # replacing an earlier export is fine
    assert main(["export", str(central_run), "--out", str(central_run)]) != 0  # never mixed into a run directory
    assert not (central_run / "model.safetensors").exists()


def _coordinator_dir(tmp_path: Path, model_round: int) -> Path:
    from fedpose.federation.aggregation import save_array_checkpoint
    from site_round_helpers import global_model

    weights, spec = global_model()
    coordinator = tmp_path / "coordinator"
    save_array_checkpoint(coordinator / "global.npz", weights, {"run_id": "demo", "state": {"model_spec": spec.model_dump(mode="json"), "round": model_round}})
    return coordinator


def test_a_federated_export_takes_each_site_s_spend_from_the_ledger(tmp_path: Path) -> None:
    from fedpose.federation.ledger import BudgetLedger, LedgerEntry
    from fedpose.privacy.report import RECORD_DP, protected_unit_text

    coordinator = _coordinator_dir(tmp_path, model_round=2)
    # report.json of an earlier, shorter run state: the ledger beside global.npz is what counts
    (coordinator / "report.json").write_text(json.dumps({"run_id": "demo", "rounds": [{"round": 1}], "sites": [
        {"site_id": "site-1", "epsilon": 1.0, "delta": 1e-5, "guarantee": "DP", "rounds_joined": 1}]}))
    with BudgetLedger(coordinator / "ledger.sqlite") as ledger:
        ledger.record_many([LedgerEntry("site-1", r, "ok", epsilon=eps, delta=1e-5, guarantee="DP", steps=10)
                            for r, eps in ((1, 1.0), (2, 1.7))])
    out = tmp_path / "release"
    assert main(["export", str(coordinator / "global.npz"), "--out", str(out)]) == 0
    report = json.loads((out / "privacy_report.json").read_text())
    assert _keys(report) <= ALLOWED_KEYS, _keys(report) - ALLOWED_KEYS
    assert report["sites"] == [{"site_id": "site-1", "guarantee": "DP", "epsilon": 1.7, "delta": 1e-5, "accountant": "rdp",
                                "rounds_joined": 2, "protection_unit": "record",  # ledger rows without a unit
                                "neighbouring_relation": "add_remove",
                                "epsilon_text": "ε = 1.7 (DP, δ = 1e-05, RDP) per record, add/remove-one-record adjacency",
                                "protected_part": protected_unit_text(RECORD_DP, "record"), "treated_as_public": "nothing"}]
    assert "after round 2" in report["model_selection"]
    assert main(["export", str(coordinator), "--out", str(tmp_path / "b"), "--checkpoint", "best"]) != 0  # no 'best' here


def test_a_federated_export_says_what_an_fdp_site_leaves_public_and_every_site_s_spends(tmp_path: Path) -> None:
    """FDP protects only what ψ discards of a unit: the card, PRIVACY.txt and the report say what such a
    site treats as public beside its ε, the Limits section does not claim the whole unit, and each site's
    spends per round (σ, q, steps, from the ledger's witness table) let a reader recompute ε. A round
    spent and then failed (no update) is counted as spent beside the rounds whose update was used."""
    from fedpose.federation.ledger import BudgetLedger, LedgerEntry
    from fedpose.privacy.report import FEATURE_DP, protected_unit_text

    coordinator = _coordinator_dir(tmp_path, model_round=1)
    with BudgetLedger(coordinator / "ledger.sqlite") as ledger:
        ledger.record_many([LedgerEntry("site-1", 1, "ok", epsilon=1.2, delta=1e-5, guarantee="DP", accountant="pld", steps=4),
                            LedgerEntry("site-2", 1, "ok", epsilon=2.0, delta=1e-5, guarantee="FDP", accountant="pld", steps=4,
                                        unit="patient")])
        ledger.record_many([LedgerEntry("site-1", 2, "missing", epsilon=1.7, delta=1e-5, guarantee="DP", accountant="pld",
                                        steps=4, reason="failed")])
        ledger.record_spends("site-1", "demo", [(1, 1.5, 0.25, 4), (2, 1.5, 0.25, 4)])
        ledger.record_spends("site-2", "demo", [(1, 1.1, 0.25, 4)])
    out = tmp_path / "release"
    assert main(["export", str(coordinator), "--out", str(out)]) == 0
    report = json.loads((out / "privacy_report.json").read_text())
    assert _keys(report) <= ALLOWED_KEYS, _keys(report) - ALLOWED_KEYS
    site_1, site_2 = report["sites"]
    assert site_1["spends"] == [{"round": r, "noise_multiplier": 1.5, "sample_rate": 0.25, "steps": 4} for r in (1, 2)]
    protected = protected_unit_text(FEATURE_DP, "patient")
    assert protected.startswith("what the public view ψ discards, in every record of one patient")
    assert (site_2["protected_part"], site_2["treated_as_public"]) == (protected, FEATURE_DP.public)
    card = (out / "MODEL_CARD.md").read_text()
    assert f"- site-2 (FDP): protects {protected}; treated as public, not protected: {FEATURE_DP.public}" in card
    assert "Under FDP or MaskDP the bound covers only the protected part of a unit" in card
    assert "| site-1 | record | 1 | 2 | ε = 1.7 (DP" in card and "| site-2 | patient | 1 | 1 | ε = 2 (FDP" in card
    text = (out / "PRIVACY.txt").read_text()
    assert f"  protects {protected}; treated as public, not protected: {FEATURE_DP.public}" in text
    assert "  spends (round: σ, q, steps): 1: 1.5, 0.25, 4; 2: 1.5, 0.25, 4" in text and "what leaves:" in text
    assert "; rounds joined 1, rounds spent 2" in text
    assert "what leaves: a federation site sends only its typed reply" in text and "central training" not in text


def test_a_federated_export_of_a_run_with_a_moving_average_publishes_the_average(tmp_path: Path) -> None:
    """coordinator.ema on: the directory's model is global_ema.npz, and the report says it is an average."""
    import numpy as np

    from fedpose.federation.aggregation import load_array_checkpoint, save_array_checkpoint
    from fedpose.federation.ledger import BudgetLedger, LedgerEntry
    from fedpose.model import load_checkpoint

    coordinator = _coordinator_dir(tmp_path, model_round=2)
    arrays, meta = load_array_checkpoint(coordinator / "global.npz")
    name = next(k for k, v in arrays.items() if k.startswith("head.") and v.dtype == np.float32)
    averaged = dict(arrays) | {name: arrays[name] + 1.0}
    save_array_checkpoint(coordinator / "global_ema.npz", averaged, meta | {"ema": {"decay": 0.9, "averaged_rounds": 2, "round": 2}})
    with BudgetLedger(coordinator / "ledger.sqlite") as ledger:
        ledger.record_many([LedgerEntry("site-1", r, "ok", epsilon=r * 1.0, delta=1e-5, guarantee="DP", steps=10) for r in (1, 2)])
    out = tmp_path / "release"
    assert main(["export", str(coordinator), "--out", str(out)]) == 0
    report = json.loads((out / "privacy_report.json").read_text())
    assert report["model_selection"].startswith("moving average (decay 0.9) of the global models of the last 2 rounds up to round 2")
    np.testing.assert_array_equal(load_checkpoint(out / "model.safetensors")["model"][name].numpy(), averaged[name])


def test_a_federated_export_with_a_stale_report_and_no_ledger_is_refused(tmp_path: Path, capsys) -> None:
    coordinator = _coordinator_dir(tmp_path, model_round=3)
    (coordinator / "report.json").write_text(json.dumps({"run_id": "demo", "rounds": [{"round": 1}, {"round": 2}], "sites": [
        {"site_id": "site-1", "epsilon": 1.0, "delta": 1e-5, "guarantee": "DP", "rounds_joined": 2}]}))
    assert main(["export", str(coordinator), "--out", str(tmp_path / "x")]) != 0
    err = capsys.readouterr().err
    assert "report.json records rounds up to 2" in err and "after round 3" in err


def test_eval_and_predict_read_the_coordinators_global_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The federation's model is a first-class artefact: `fedpose eval` and `fedpose predict` take
    the coordinator's global.npz (or its directory) and use exactly its weights."""
    import numpy as np

    from fedpose.federation.aggregation import save_array_checkpoint
    from fedpose.federation.global_model import load_global_model
    from site_round_helpers import global_model

    weights, spec = global_model(seed=3)
    coordinator = tmp_path / "coordinator"
    save_array_checkpoint(coordinator / "global.npz", weights,
                          {"run_id": "demo", "state": {"model_spec": spec.model_dump(mode="json"), "round": 4}})
    loaded = load_global_model(coordinator)
    assert loaded.round == 4 and loaded.run_id == "demo"
    assert all(np.array_equal(loaded.model.state_dict()[k].numpy(), v) for k, v in weights.items())

    mpii = SHARED_DATA / "mpii-real"
    assert main(["eval", "--checkpoint", str(coordinator / "global.npz"), "--data", str(mpii), "--json", "--device", "cpu"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["samples"] > 0 and 0.0 <= scores["Mean"] <= 100.0
    image = sorted((mpii / "images").iterdir())[0]
    assert main(["predict", "--checkpoint", str(coordinator), str(image), "--out", str(tmp_path / "pred"), "--device", "cpu"]) == 0
    predictions = json.loads((tmp_path / "pred" / "predictions.json").read_text())["predictions"]
    assert len(predictions) == 1 and (tmp_path / "pred" / f"{image.stem}_pose.png").exists()


def test_a_damaged_or_foreign_global_model_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedpose.federation.aggregation import save_array_checkpoint
    from site_round_helpers import global_model

    mpii = str(SHARED_DATA / "mpii-real")
    garbage = tmp_path / "garbage" / "global.npz"
    garbage.parent.mkdir()
    garbage.write_bytes(b"not a zip archive")
    assert main(["eval", "--checkpoint", str(garbage), "--data", mpii]) != 0
    assert f"{garbage}: not a readable coordinator checkpoint" in capsys.readouterr().err

    weights, spec = global_model()
    weights.pop(sorted(weights)[0])
    partial = tmp_path / "partial" / "global.npz"
    save_array_checkpoint(partial, weights, {"state": {"model_spec": spec.model_dump(mode="json")}})
    assert main(["eval", "--checkpoint", str(partial.parent), "--data", mpii]) != 0
    assert f"{partial}: its weights do not fit its model spec" in capsys.readouterr().err

    assert main(["eval", "--checkpoint", str(tmp_path / "nothing.npz"), "--data", mpii]) != 0
    assert "no coordinator model here" in capsys.readouterr().err


def test_export_writes_safetensors_and_a_model_card_that_eval_reads_with_the_same_pckh(
        central_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 28.5: the published model is safetensors + MODEL_CARD.md; `fedpose eval` on it scores
    exactly what it scores on the checkpoint it came from, and the card carries that score."""
    test_set = central_run.parent / "synth" / "test"
    out = tmp_path / "release"
    assert main(["export", str(central_run), "--out", str(out), "--eval-data", str(test_set),
                 "--eval-name", "the synthetic test split (public)"]) == 0
    capsys.readouterr()
    scores = {}
    for source in (central_run / "checkpoints" / "last.pt", out):
        assert main(["eval", "--checkpoint", str(source), "--data", str(test_set), "--json", "--device", "cpu"]) == 0
        scores[source] = json.loads(capsys.readouterr().out)
    original, exported = scores.values()
    for key in ("Head", "Mean", "Mean@0.1", "samples"):
        assert exported[key] == pytest.approx(original[key], abs=1e-9, nan_ok=True), key

    card = (out / "MODEL_CARD.md").read_text()
    for heading in ("## Architecture", "## Training data and privacy guarantees", "## Evaluation", "## Intended use", "## Limits"):
        assert heading in card
    assert "`tiny_vit_test`" in card and "64×64" in card
    report = json.loads((out / "privacy_report.json").read_text())
    assert f"guarantee: {report['epsilon_text']}" in card and "(DP, δ = 1e-05, PLD)" in card  # never a bare ε
    assert "PCKh@0.5 on the synthetic test split (public) (4 people" in card
    mean = original["Mean"]
    assert (f"| {mean:.2f} |" if mean == mean else "| n/a |") in card
    assert main(["predict", "--checkpoint", str(out), str(sorted((test_set / "images").iterdir())[0]),
                 "--out", str(tmp_path / "pred"), "--device", "cpu"]) == 0


def test_a_federated_model_card_lists_every_site_s_guarantee_and_unit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    coordinator = _coordinator_dir(tmp_path, model_round=2)
    (coordinator / "report.json").write_text(json.dumps({"run_id": "demo", "rounds": [{"round": 1}, {"round": 2}], "sites": [
        {"site_id": "site-1", "epsilon": 2.5, "delta": 1e-5, "guarantee": "DP", "rounds_joined": 2, "unit": "patient",
         "accountant": "pld"},
        {"site_id": "site-2", "epsilon": 1.25, "delta": 1e-6, "guarantee": "DP", "rounds_joined": 1}]}))
    assert main(["export", str(coordinator), "--out", str(tmp_path / "release")]) == 0
    card = (tmp_path / "release" / "MODEL_CARD.md").read_text()
    assert "| site-1 | patient | 2 | not recorded | ε = 2.5 (DP, δ = 1e-05, PLD) per patient, add/remove-one-patient adjacency |" in card
    assert "| site-2 | record | 1 | not recorded | ε = 1.25 (DP, δ = 1e-06, RDP) per record, add/remove-one-record adjacency |" in card
    assert "Not evaluated at export" in card and "Federated run `demo`" in card
    # `privacy report` reads the federated export too (its help's example), one line per site
    capsys.readouterr()
    assert main(["privacy", "report", str(tmp_path / "release")]) == 0
    shown = capsys.readouterr().out
    assert "federated run 'demo'" in shown and "model: global model after round 2" in shown
    assert "site-1: ε = 2.5 (DP, δ = 1e-05, PLD) per patient, add/remove-one-patient adjacency; rounds joined 2" in shown
    # the coordinator's own directory holds no privacy report: the message says where its sites' ε are
    (coordinator / "ledger.sqlite").write_bytes(b"")
    assert main(["privacy", "report", str(coordinator)]) == 2
    assert "fedpose ledger show --db" in capsys.readouterr().err


def test_old_pt_exports_stay_readable_and_a_foreign_safetensors_file_is_named(
        central_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    from safetensors.torch import save_file

    from fedpose.model import model_from_checkpoint
    from fedpose.model.checkpoint import save_weights_only

    trained, _ = model_from_checkpoint(central_run / "checkpoints" / "last.pt")
    old = tmp_path / "old-release"
    old.mkdir()
    save_weights_only(old / "model.pt", trained)  # what exports wrote before safetensors
    test_set = str(central_run.parent / "synth" / "test")
    assert main(["eval", "--checkpoint", str(old), "--data", test_set, "--json", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["export", str(central_run), "--out", str(old)]) == 0  # re-exporting over it replaces the pickle
    assert not (old / "model.pt").exists() and (old / "model.safetensors").exists()

    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(2)}, str(foreign))
    assert main(["eval", "--checkpoint", str(foreign), "--data", test_set]) == 2
    assert f"{foreign}: a safetensors file, but not a fedpose model" in capsys.readouterr().err
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes((old / "model.safetensors").read_bytes()[:100])
    assert main(["eval", "--checkpoint", str(damaged), "--data", test_set]) == 2
    assert f"{damaged}: not a readable safetensors file" in capsys.readouterr().err


def test_a_float16_export_stores_half_the_bytes_and_its_card_scores_the_published_weights(
        central_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--dtype float16: every floating tensor is stored as float16 (integer buffers unchanged), the
    file is about half the float32 export, and the model card's score is what `fedpose eval` gets
    from the file — the rounded weights, not the float32 ones they came from."""
    from safetensors import safe_open

    test_set = central_run.parent / "synth" / "test"
    full, half = tmp_path / "full", tmp_path / "half"
    assert main(["export", str(central_run), "--out", str(full)]) == 0
    assert main(["export", str(central_run), "--out", str(half), "--dtype", "float16", "--eval-data", str(test_set),
                 "--eval-name", "the synthetic test split (public)"]) == 0
    capsys.readouterr()
    with safe_open(str(full / "model.safetensors"), framework="pt") as f32, safe_open(str(half / "model.safetensors"), framework="pt") as f16:
        assert set(f32.keys()) == set(f16.keys())
        for key in f32.keys():
            original, stored = f32.get_tensor(key), f16.get_tensor(key)
            assert stored.dtype == (torch.float16 if original.is_floating_point() else original.dtype), key
            assert torch.equal(stored, original.to(stored.dtype)), key
    assert (half / "model.safetensors").stat().st_size < 0.55 * (full / "model.safetensors").stat().st_size
    card = (half / "MODEL_CARD.md").read_text()
    assert "weights stored as float16" in card and "weights stored as float16" not in (full / "MODEL_CARD.md").read_text()
    assert main(["eval", "--checkpoint", str(half), "--data", str(test_set), "--json", "--device", "cpu"]) == 0
    mean = json.loads(capsys.readouterr().out)["Mean"]
    assert (f"| {mean:.2f} |" if mean == mean else "| n/a |") in card


def test_a_float16_export_refuses_a_weight_beyond_float16s_range_and_writes_nothing(
        central_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy_run(central_run, tmp_path)
    checkpoint = torch.load(run / "checkpoints" / "last.pt", weights_only=False)
    key = next(k for k, v in checkpoint["model"].items() if v.is_floating_point())
    checkpoint["model"][key].view(-1)[0] = 1e6
    torch.save(checkpoint, run / "checkpoints" / "last.pt")
    assert main(["export", str(run), "--out", str(tmp_path / "x"), "--dtype", "float16"]) != 0
    error = capsys.readouterr().err
    assert key in error and "float16" in error and "float32" in error
    assert not (tmp_path / "x").exists()
