"""The command line a newcomer can trust (issue 27): resume writes where it is pointed, and every
subcommand answers bad input with one line and exit 2, never a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fedpose.cli import main
from fedpose.data.synthetic import generate_dataset


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli-synth")
    generate_dataset(root, sites=1, per_site=4, public=6, test=4, size=(64, 64), workers=1, progress=False)
    return root


def write_config(path: Path, synth: Path, out_dir: Path, steps: int = 2, **privacy: object) -> Path:
    privacy_lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in ({"mechanism": "dpsgd", "noise_multiplier": 1.0} | privacy).items())
    path.write_text(
        f'[data]\ntrain = "{synth / "site-1"}"\nval = "{synth / "test"}"\ninput_size = [64, 64]\n'
        '[model]\nbackbone = "tiny_vit_test"\nscenario = "scratch"\n'
        f'[train]\nsteps = {steps}\nbatch_size = 1\neval_every = 2\ncheckpoint_every = 2\nthreads = 1\nout_dir = "{out_dir}"\n'
        f"[privacy]\n{privacy_lines}"
    )
    return path


@pytest.fixture(scope="module")
def private_run(synth: Path, tmp_path_factory) -> Path:
    """A finished 2-step DP-SGD run (per patient: site-1 records carry patient_id)."""
    root = tmp_path_factory.mktemp("cli-run")
    config = write_config(root / "run.toml", synth, root / "run")
    assert main(["train", "--config", str(config), "--quiet"]) == 0
    return root / "run"


# -- item 2: resume writes where it is pointed -----------------------------------------------------
def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_resuming_a_copied_run_writes_only_into_the_copy(private_run: Path, tmp_path: Path) -> None:
    from fedpose.model import load_checkpoint

    original = _snapshot(private_run)
    copy = tmp_path / "copy"
    shutil.copytree(private_run, copy)
    assert main(["train", "--resume", str(copy), "--set", "train.steps=4", "--quiet"]) == 0
    assert _snapshot(private_run) == original  # not one byte of the original changed
    assert load_checkpoint(copy / "checkpoints" / "last.pt")["step"] == 4
    assert json.loads((copy / "privacy.json").read_text())["steps"] == 4
    assert f'out_dir = "{copy}"' in (copy / "config.toml").read_text()


def test_resume_refuses_to_write_anywhere_else(private_run: Path, tmp_path: Path, capsys) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(private_run, copy)
    before = _snapshot(copy)
    code = main(["train", "--resume", str(copy), "--set", "train.steps=4", "--set", f'train.out_dir="{tmp_path / "other"}"',
                 "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "train.out_dir: a resumed run continues in the run directory it is resumed from" in err
    assert not (tmp_path / "other").exists() and _snapshot(copy) == before
    # a checkpoint outside any run directory has no directory to continue in
    loose = tmp_path / "loose.pt"
    shutil.copy(copy / "checkpoints" / "last.pt", loose)
    assert main(["train", "--resume", str(loose), "--set", "train.steps=4", "--quiet"]) == 2
    assert "not inside a run's checkpoints/ directory" in capsys.readouterr().err
    # a checkpoint file inside a run continues that run
    assert main(["train", "--resume", str(copy / "checkpoints" / "last.pt"), "--set", "train.steps=3", "--quiet"]) == 0
    assert json.loads((copy / "privacy.json").read_text())["steps"] == 3
