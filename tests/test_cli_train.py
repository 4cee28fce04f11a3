"""`fedpose train`, `fedpose eval`, `fedpose predict` as a user runs them (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedpose.data.synthetic import generate_dataset


def fedpose(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0")
    return subprocess.run([sys.executable, "-m", "fedpose.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    generate_dataset(root / "synth", sites=1, per_site=4, public=6, test=4, size=(64, 64), workers=1, progress=False)
    (root / "run.toml").write_text(
        '[data]\ntrain = "synth/public"\nval = "synth/test"\ninput_size = [64, 64]\n'
        '[model]\nbackbone = "tiny_vit_test"\nscenario = "scratch"\n'
        '[train]\nsteps = 2\nbatch_size = 3\neval_every = 2\ncheckpoint_every = 2\nout_dir = "run"\n'
    )
    return root


@pytest.mark.slow
def test_train_eval_predict(workdir: Path) -> None:
    trained = fedpose("train", "--config", "run.toml", "--quiet", "--json", cwd=workdir)
    assert trained.returncode == 0, trained.stderr
    summary = json.loads(trained.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["val"]["step"] == 2
    assert "no privacy" in summary["epsilon_text"] and summary["privacy"]["guarantee"] == "none"
    for name in ("metrics.json", "curves.png", "privacy.json", "config.toml", "checkpoints/last.pt", "checkpoints/best.pt"):
        assert (workdir / "run" / name).exists(), name

    evaluated = fedpose("eval", "--checkpoint", "run/checkpoints/last.pt", "--data", "synth/test", "--json",
                        "--overlays", "overlays.png", cwd=workdir)
    assert evaluated.returncode == 0, evaluated.stderr
    scores = json.loads(evaluated.stdout)
    assert scores["samples"] == 4 and 0.0 <= scores["Mean"] <= 100.0
    assert (workdir / "overlays.png").exists()

    images = sorted((workdir / "synth/test/images").glob("*.png"))[:2]
    predicted = fedpose("predict", "--checkpoint", "run/checkpoints/last.pt", *map(str, images), "--out", "pred", cwd=workdir)
    assert predicted.returncode == 0, predicted.stderr
    report = json.loads((workdir / "pred/predictions.json").read_text())
    assert len(report["predictions"]) == 2
    assert set(report["predictions"][0]["joints"]) >= {"head_top", "l_ankle"}
    assert all((workdir / "pred" / f"{p.stem}_pose.png").exists() for p in images)

    # resuming a finished run asks for more steps (refusing a fresh run into the same
    # directory is tested in test_train.py)
    again = fedpose("train", "--resume", "run", "--quiet", cwd=workdir)
    assert again.returncode == 2 and "train.steps" in again.stderr


@pytest.mark.parametrize("args,message", [
    (("train", "--config", "run.toml", "--set", "model.backbone=\"resnet\"", "--set", "train.out_dir=\"fresh\""),
     "model.backbone: unknown backbone"),
    (("train", "--config", "run.toml", "--set", "model.depth=3"), "model.depth: unknown key"),
    (("train", "--config", "missing.toml"), "config file not found"),
    (("train",), "give --config"),
    (("train", "--resume", "no-such-run"), "no such run directory"),
    (("eval", "--checkpoint", "run.toml", "--data", "synth/test"), "not a readable torch checkpoint"),
])
def test_user_errors_exit_2_with_a_clear_message(workdir: Path, args: tuple[str, ...], message: str) -> None:
    result = fedpose(*args, cwd=workdir)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
