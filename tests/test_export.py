"""`fedpose export`: the only artefact meant to leave a hospital — weights and the privacy report,
without the private-data statistics that checkpoints and metrics hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedpose.cli import main
from fedpose.data.synthetic import generate_dataset
from fedpose.privacy.report import PUBLISHABLE_KEYS

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
    assert sorted(p.name for p in out.iterdir()) == ["PRIVACY.txt", "model.pt", "privacy_report.json"]
    report = json.loads((out / "privacy_report.json").read_text())
    assert set(report) - {"source", "model_selection"} <= PUBLISHABLE_KEYS
    assert not _keys(report) & FORBIDDEN, _keys(report) & FORBIDDEN
    assert report["model_selection"].startswith("last checkpoint")
    assert "(DP, δ = 1e-05, RDP)" in report["epsilon_text"] and "randomness" in report

    checkpoint = torch.load(out / "model.pt", weights_only=False)
    assert checkpoint["optimizer"] is None and checkpoint["rng"] is None and checkpoint["metrics"] is None
    assert checkpoint["config"] is None and checkpoint["step"] == 0
    model, _ = model_from_checkpoint(out / "model.pt")  # `fedpose eval` / `predict` read it
    trained, _ = model_from_checkpoint(central_run / "checkpoints" / "last.pt")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), trained.state_dict().values()))
    text = (out / "PRIVACY.txt").read_text()
    assert "unit protected" in text and "randomness" in text


def test_exporting_best_says_the_selection_used_the_validation_split(central_run: Path, tmp_path: Path) -> None:
    assert main(["export", str(central_run), "--out", str(tmp_path / "best"), "--checkpoint", "best"]) == 0
    report = json.loads((tmp_path / "best" / "privacy_report.json").read_text())
    assert "NOT covered by the guarantee" in report["model_selection"] and "synth/test" in report["model_selection"]


def test_a_federated_model_is_exported_with_every_site_s_guarantee(tmp_path: Path) -> None:
    from fedpose.federation.aggregation import save_array_checkpoint
    from site_round_helpers import global_model

    weights, spec = global_model()
    coordinator = tmp_path / "coordinator"
    save_array_checkpoint(coordinator / "global.npz", weights, {"run_id": "demo", "state": {"model_spec": spec}})
    (coordinator / "report.json").write_text(json.dumps({"run_id": "demo", "sites": [
        {"site_id": "site-1", "epsilon": 2.5, "delta": 1e-5, "guarantee": "DP", "rounds_joined": 3}]}))
    assert main(["export", str(coordinator), "--out", str(tmp_path / "release")]) == 0
    report = json.loads((tmp_path / "release" / "privacy_report.json").read_text())
    assert report["sites"][0]["epsilon_text"] == "ε = 2.5 (DP, δ = 1e-05, RDP)"
    assert "site-1: ε = 2.5 (DP" in (tmp_path / "release" / "PRIVACY.txt").read_text()


def test_export_refuses_a_run_without_its_privacy_report(central_run: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "run"
    shutil.copytree(central_run, broken)
    (broken / "privacy.json").unlink()
    assert main(["export", str(broken), "--out", str(tmp_path / "x")]) != 0
    assert not (tmp_path / "x" / "model.pt").exists()
