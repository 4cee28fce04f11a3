"""The command line a newcomer can trust (issue 27): resume writes where it is pointed, and every
subcommand answers bad input with one line and exit 2, never a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fedpose.cli import main
from fedpose.data.synthetic import generate_dataset
from file_trees import tree_bytes


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


def test_resuming_a_copied_run_writes_only_into_the_copy(private_run: Path, tmp_path: Path) -> None:
    from fedpose.model import load_checkpoint

    original = tree_bytes(private_run)
    copy = tmp_path / "copy"
    shutil.copytree(private_run, copy)
    assert main(["train", "--resume", str(copy), "--set", "train.steps=4", "--quiet"]) == 0
    assert tree_bytes(private_run) == original  # not one byte of the original changed
    assert load_checkpoint(copy / "checkpoints" / "last.pt")["step"] == 4
    assert json.loads((copy / "privacy.json").read_text())["steps"] == 4
    assert f'out_dir = "{copy}"' in (copy / "config.toml").read_text()


def test_resume_refuses_to_write_anywhere_else(private_run: Path, tmp_path: Path, capsys) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(private_run, copy)
    before = tree_bytes(copy)
    code = main(["train", "--resume", str(copy), "--set", "train.steps=4", "--set", f'train.out_dir="{tmp_path / "other"}"',
                 "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "train.out_dir: a resumed run continues in the run directory it is resumed from" in err
    assert not (tmp_path / "other").exists() and tree_bytes(copy) == before
    # a checkpoint outside any run directory has no directory to continue in
    loose = tmp_path / "loose.pt"
    shutil.copy(copy / "checkpoints" / "last.pt", loose)
    assert main(["train", "--resume", str(loose), "--set", "train.steps=4", "--quiet"]) == 2
    assert "not inside a run's checkpoints/ directory" in capsys.readouterr().err
    # a checkpoint file inside a run continues that run
    assert main(["train", "--resume", str(copy / "checkpoints" / "last.pt"), "--set", "train.steps=3", "--quiet"]) == 0
    assert json.loads((copy / "privacy.json").read_text())["steps"] == 3


# -- item 5: every subcommand, bad input: exit 2, one line on stderr, no traceback ------------------
def leaf_parsers(parser=None, prefix: tuple[str, ...] = ()):
    """(command words, parser) of every runnable subcommand, from the argparse tree itself (a new
    subcommand is covered without touching this test)."""
    import argparse

    from fedpose.cli import build_parser

    parser = build_parser() if parser is None else parser
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield prefix, parser
        return
    for name, sub in subs[0].choices.items():
        yield from leaf_parsers(sub, prefix + (name,))


LEAVES = {" ".join(words): parser for words, parser in leaf_parsers()}
#: what every path argument gets; outputs (dest out / run_dir) always get a place that cannot be
#: made (under a file), so no invocation can succeed and start real work
BAD_INPUTS = ("missing", "directory", "garbage", "empty", "bad-number")
OUTPUT_DESTS = {"out", "run_dir"}
#: optional arguments filled too, so that a command whose required arguments are all numbers still reads a bad file
ALSO_FILLED = {"config"}


def _value(action, kind: str, files: dict[str, Path]) -> str:
    number_types = {"int", "float", "positive_float", "nonnegative_float", "open_unit_interval", "positive_int", "_rate"}
    type_name = getattr(action.type, "__name__", None)
    if action.choices:
        return str(next(iter(action.choices)))
    if type_name in number_types:
        if kind == "bad-number":
            return "-1e-5"  # a negative value, not an option: named as a bad value
        for candidate in ("0.5", "1", "3"):
            try:
                action.type(candidate)
                return candidate
            except Exception:
                continue
    if action.dest in OUTPUT_DESTS:
        return str(files["garbage"] / "sub")
    return str(files["garbage" if kind == "bad-number" else kind])


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-inputs")
    (root / "directory").mkdir()
    (root / "garbage.bin").write_bytes(bytes(range(256)) * 7 + b"\xff\xfe not json, not toml, not an image [[[")
    (root / "empty.json").write_bytes(b"")
    return {"missing": root / "no-such" / "thing.json", "directory": root / "directory", "garbage": root / "garbage.bin",
            "empty": root / "empty.json"}


def _reads_files(parser) -> bool:
    """Whether a command takes a path (else its only bad input is a bad number)."""
    numeric = {"int", "float", "positive_float", "nonnegative_float", "open_unit_interval", "positive_int", "_rate"}
    return any((a.required or not a.option_strings or a.dest in ALSO_FILLED) and not a.choices and a.nargs != 0
               and getattr(a.type, "__name__", None) not in numeric and a.dest != "help" for a in parser._actions)


CASES = [(command, kind) for command in sorted(LEAVES) for kind in BAD_INPUTS
         if kind == "bad-number" or _reads_files(LEAVES[command])]


@pytest.mark.parametrize("command,kind", CASES)
def test_every_subcommand_answers_bad_input_in_one_line(command: str, kind: str, bad_files, tmp_path, monkeypatch,
                                                        capsys) -> None:
    monkeypatch.chdir(tmp_path)  # default output directories (deploy's runs/…) land here
    argv = command.split()
    for action in LEAVES[command]._actions:
        if action.help == "==SUPPRESS==" or action.dest == "help" or action.nargs == 0:
            continue
        if not (action.required or not action.option_strings or action.dest in ALSO_FILLED):
            continue
        value = _value(action, kind, bad_files)
        argv += [value] if not action.option_strings else [action.option_strings[0], value]
    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out, argv
    assert code == 2, (argv, captured.err)
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], (argv, captured.err)


def test_broken_pipe_is_quiet(private_run: Path) -> None:
    """`fedpose privacy report RUN --json | head -c 60`: the reader leaves early; no traceback."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0")
    command = f"{sys.executable} -m fedpose.cli privacy report {private_run} --json | head -c 60"
    for _ in range(3):  # the race (reader gone before or after the write) goes both ways
        result = subprocess.run(["bash", "-c", "set -o pipefail; " + command], env=env, capture_output=True, text=True,
                                timeout=120)
        assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr
        assert result.stderr == "" and len(result.stdout) <= 60


def test_privacy_report_reads_a_run_or_export_directory(private_run: Path, tmp_path: Path, capsys) -> None:
    assert main(["privacy", "report", str(private_run)]) == 0
    from_run = capsys.readouterr().out
    assert "per patient" in from_run and "protection unit: patient (chosen automatically" in from_run
    assert main(["export", str(private_run), "--out", str(tmp_path / "release")]) == 0
    capsys.readouterr()
    assert main(["privacy", "report", str(tmp_path / "release")]) == 0
    assert "per patient" in capsys.readouterr().out


def test_a_garbage_checkpoint_is_named_without_torch_s_unsafe_advice(synth: Path, tmp_path: Path, capsys) -> None:
    garbage = tmp_path / "model.pt"
    garbage.write_bytes(b"\x80\x04\x95 not a checkpoint")
    assert main(["eval", "--checkpoint", str(garbage), "--data", str(synth / "test")]) == 2
    err = capsys.readouterr().err
    assert "not a readable torch checkpoint" in err and "weights_only=False" not in err and len(err.splitlines()) == 1


# -- item 4: divergence is warned and recorded --------------------------------------------------------
def test_a_diverging_private_run_is_warned_and_recorded(synth: Path, tmp_path: Path, capsys) -> None:
    config = write_config(tmp_path / "div.toml", synth, tmp_path / "run", steps=4)
    text = "".join(line for line in config.read_text().splitlines(True) if not line.startswith("val ="))  # no validation
    config.write_text(text + '[optim]\nname = "sgd"\nlr = 5.0\nmomentum = 0.9\ncosine = false\n')
    assert main(["train", "--config", str(config), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "WARNING: training is diverging at step" in out and "WARNING: the training loss diverged" in out
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["divergence"] and metrics["divergence"][0]["step"] <= 4


def test_predict_confidences_mean_something_and_saturation_is_not_certainty(private_run: Path, synth: Path, tmp_path: Path,
                                                                             capsys) -> None:
    import torch

    from fedpose.model import load_checkpoint

    # a directory of images is walked, like `ldp slice` does
    assert main(["predict", "--checkpoint", str(private_run), "--out", str(tmp_path / "ok"), str(synth / "test")]) == 0
    result = json.loads((tmp_path / "ok" / "predictions.json").read_text())
    confidences = [c for p in result["predictions"] for c in p["confidence"].values()]
    assert len(result["predictions"]) == 4 and "relative to the peak of a training target" in result["confidence"]
    assert all(c is not None and 0 <= c <= 1 for c in confidences) and min(confidences) < 1
    assert "WARNING" not in capsys.readouterr().err
    # blown-up logits (what a diverged model has): a peak of ~1.0 is saturation, reported as such
    blown = tmp_path / "blown" / "checkpoints" / "last.pt"
    blown.parent.mkdir(parents=True)
    checkpoint = load_checkpoint(private_run / "checkpoints" / "last.pt")
    for key in [k for k in checkpoint["model"] if k.startswith("head.cls_")]:
        checkpoint["model"][key] = checkpoint["model"][key] * 1e4
    torch.save(checkpoint, blown)
    assert main(["predict", "--checkpoint", str(blown), "--out", str(tmp_path / "blown-out"), str(synth / "test")]) == 0
    result = json.loads((tmp_path / "blown-out" / "predictions.json").read_text())
    confidences = [c for p in result["predictions"] for c in p["confidence"].values()]
    assert confidences.count(None) > len(confidences) / 2
    assert "joints have saturated outputs" in capsys.readouterr().err


def test_a_checkpoint_argument_takes_a_file_a_run_dir_or_an_export_dir(private_run: Path, synth: Path, tmp_path: Path,
                                                                        capsys) -> None:
    assert main(["export", str(private_run), "--out", str(tmp_path / "release")]) == 0
    capsys.readouterr()
    scores = []
    for checkpoint in (private_run / "checkpoints" / "last.pt", private_run, tmp_path / "release"):
        assert main(["eval", "--checkpoint", str(checkpoint), "--data", str(synth / "test"), "--json"]) == 0
        scores.append(json.loads(capsys.readouterr().out)["Mean"])
    assert scores[0] == scores[1] == scores[2]


def test_eval_and_predict_use_flip_test_unless_told_not_to(private_run: Path, synth: Path, tmp_path: Path, capsys) -> None:
    """Flip test is the default and is stated in the output; --no-flip-test scores the crops alone,
    the way evaluate(flip_test=False) does."""
    from fedpose.data.dataset import PoseDataset, load_records
    from fedpose.model import model_from_checkpoint
    from fedpose.train.evaluate import evaluate

    scores = {}
    for flag in ([], ["--no-flip-test"]):
        assert main(["eval", "--checkpoint", str(private_run), "--data", str(synth / "test"), "--json", *flag]) == 0
        out = json.loads(capsys.readouterr().out)
        scores[out["flip_test"]] = out["Mean"]
    model, _ = model_from_checkpoint(private_run / "checkpoints" / "last.pt")
    records, root = load_records(synth / "test")
    dataset = PoseDataset(records, root, input_size=model.input_size, train=False)
    for flip_test in (True, False):
        assert scores[flip_test] == evaluate(model, dataset, flip_test=flip_test)["Mean"]
    assert main(["eval", "--checkpoint", str(private_run), "--data", str(synth / "test"), "--no-flip-test"]) == 0
    assert "no flip test" in capsys.readouterr().out
    for flag, out_dir in (([], "flip"), (["--no-flip-test"], "plain")):
        image = next(p for p in sorted((synth / "test").rglob("*")) if p.suffix in (".png", ".jpg"))
        assert main(["predict", "--checkpoint", str(private_run), "--out", str(tmp_path / out_dir), str(image), *flag]) == 0
        assert json.loads((tmp_path / out_dir / "predictions.json").read_text())["flip_test"] is (not flag)


# -- item 7: with --json, stdout is one JSON document, structured all the way down -------------------
def _json_commands() -> list[str]:
    return sorted(command for command, parser in LEAVES.items()
                  if any("--json" in action.option_strings for action in parser._actions))


def _json_argv(command: str, private_run: Path, synth: Path, tmp_path: Path) -> list[str]:
    """A valid invocation of each command that has --json (a new one fails here until it is added)."""
    from fedpose.federation.site_budget import SiteBudget

    shared = Path(__file__).resolve().parents[2] / "shared" / "data" / "mpii-valid"
    number = ["--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5", "--accountant", "rdp"]  # rdp: fast
    if command == "privacy budget":
        SiteBudget(tmp_path / "site", "site-a", eps_max=10.0, delta=1e-5, guarantee="DP")
    if command == "privacy adopt":  # a site whose budget holds every spend: nothing to adopt
        SiteBudget(tmp_path / "adopting", "site-a", eps_max=10.0, delta=1e-5, guarantee="DP")
    if command == "site report":  # a site's audit log with one (error) reply in it
        from fedpose.federation.protocol import SiteReply
        from fedpose.federation.site_audit import record_reply

        (tmp_path / "audited").mkdir()
        record_reply(tmp_path / "audited", SiteReply(site_id="site-a", run_id="r", round=1, status="error",
                                                     reason="site-error", error_class="ValueError"), {}, None)
    config = write_config(tmp_path / "json.toml", synth, tmp_path / "run", steps=1)
    return {
        "train": ["train", "--config", str(config), "--quiet"],
        "audit": ["audit", "--config", str(config), "--canaries", "10"],
        "eval": ["eval", "--checkpoint", str(private_run), "--data", str(synth / "test")],
        "pckh": ["pckh", "--gt", str(shared / "valid.json"), "--pred", str(shared / "preds_hg_s8.json")],
        "privacy epsilon": ["privacy", "epsilon", "--noise-multiplier", "1.0", *number],
        "privacy noise": ["privacy", "noise", "--target-epsilon", "2", *number],
        "privacy report": ["privacy", "report", str(private_run)],
        "privacy budget": ["privacy", "budget", str(tmp_path / "site")],
        "privacy adopt": ["privacy", "adopt", str(tmp_path / "adopting"), "--dry-run"],
        "site report": ["site", "report", "--state-dir", str(tmp_path / "audited")],
        "ldp allocate": ["ldp", "allocate", "--epsilon", "8"],
        "data synth": ["data", "synth", "--out", str(tmp_path / "tiny"), "--sites", "1", "--per-site", "1", "--public", "1",
                       "--test", "1", "--size", "32x32", "--workers", "1", "--quiet"],
    }[command] + ["--json"]


@pytest.mark.parametrize("command", _json_commands())
def test_json_output_is_one_structured_document(command: str, private_run: Path, synth: Path, tmp_path: Path,
                                                capsys) -> None:
    code = main(_json_argv(command, private_run, synth, tmp_path))
    out = capsys.readouterr().out
    assert code == 0
    document = json.loads(out)  # the whole of stdout, strict
    assert isinstance(document, dict) and out.count("\n") == 1

    def no_embedded_json(value) -> None:  # structured all the way down: no JSON-in-a-string, no NaN
        if isinstance(value, str):
            assert not value.lstrip().startswith(("{", "[")), value
        elif isinstance(value, dict):
            [no_embedded_json(v) for v in value.values()]
        elif isinstance(value, list):
            [no_embedded_json(v) for v in value]

    no_embedded_json(document)
    if command == "train":
        assert isinstance(document["privacy"], dict) and document["privacy"]["protection_unit"] == "patient"


# -- item 8: errors blame the right input -------------------------------------------------------------
def test_a_bad_set_is_blamed_on_set_and_negative_numbers_are_values(synth: Path, tmp_path: Path, capsys) -> None:
    config = write_config(tmp_path / "c.toml", synth, tmp_path / "run")
    for override, named in (("train.stepz=5", "train.stepz: unknown key"), ("train.steps=abc", "train.steps: Input should be")):
        assert main(["train", "--config", str(config), "--set", override]) == 2
        err = capsys.readouterr().err
        assert f"invalid configuration in --set {override}: {named}" in err and str(config) not in err
    config.write_text(config.read_text().replace("steps = 2", "steps = 0"))  # the file's own mistake stays the file's
    assert main(["train", "--config", str(config), "--set", "train.batch_size=2"]) == 2
    assert f"invalid configuration in {config}: train.steps" in capsys.readouterr().err
    code = main(["privacy", "epsilon", "--noise-multiplier", "1", "--sample-rate", "0.01", "--steps", "10", "--delta", "-1e-5"])
    assert code == 2 and "argument --delta: must be a finite number > 0, got -1e-5" in capsys.readouterr().err


# -- item 10: help ------------------------------------------------------------------------------------
def all_parsers():
    import argparse

    from fedpose.cli import build_parser

    def walk(parser, words):
        yield " ".join(words) or "fedpose", parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, words + [name])

    return list(walk(build_parser(), []))


def test_a_description_opens_with_its_help_capitalised_but_never_a_symbol() -> None:
    """The description a subcommand's --help opens with is its one-line help as a sentence: a
    letter capitalised, a symbol as written (ε and Ε are different quantities)."""
    parsers = dict(all_parsers())
    assert parsers["privacy epsilon"].description.startswith("ε of T Poisson-subsampled Gaussian steps")
    assert parsers["data"].description == "Create and inspect datasets."


def test_every_command_and_argument_is_described_in_plain_text() -> None:
    import argparse

    for name, parser in all_parsers():
        assert parser.description, f"{name}: no description"
        for action in parser._actions:
            if not isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                assert action.help, f"{name} {action.option_strings or action.dest}: no help"
        text = parser.format_help()
        assert "``" not in text and ":data:`" not in text and ":func:`" not in text, name
    main_commands = ("train", "eval", "predict", "audit", "export", "privacy epsilon", "privacy report", "ldp slice")
    examples = {name: parser.format_help() for name, parser in all_parsers() if name in main_commands}
    assert all("fedpose " + name.split()[0] in text.split("usage:", 2)[1].split("\n", 1)[1] for name, text in examples.items())


def test_version_and_bare_fedpose(capsys) -> None:
    from fedpose import __version__

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"fedpose {__version__}"
    assert main([]) == 0 and "usage: fedpose" in capsys.readouterr().out


# -- items 9 and 11: output that reads well in a log, and files others can read -----------------------
def test_progress_on_a_non_terminal_is_plain_lines() -> None:
    import io

    from fedpose.progress import PlainProgress, progress_bar

    stream = io.StringIO()  # not a TTY, like a log file or a CI console
    bar = progress_bar(10, "train", unit="step", stream=stream)
    assert isinstance(bar, PlainProgress)
    bar.interval = 0.0
    for _ in range(10):
        bar.set_postfix(loss="3.2000", refresh=False)
        bar.update(1)
    bar.close()
    text = stream.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert lines[0].startswith("train: 1/10 step (10%)") and "loss 3.2000" in lines[0]
    assert lines[-1].startswith("train: 10/10 step (100%)") and len(lines) == 10


def test_ldp_slice_says_what_it_keeps_and_writes_files_others_can_read(synth: Path, tmp_path: Path, capsys) -> None:
    import os
    import stat

    old = os.umask(0o022)
    try:
        assert main(["ldp", "slice", str(synth / "test"), "--out", str(tmp_path / "out"), "--epsilon", "20",
                     "--insecure-seed", "1"]) == 0
    finally:
        os.umask(old)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"wrote 4 images to {tmp_path / 'out'} (png)" and max(len(line) for line in lines) < 400
    assert "only edges and fine detail are released" in out and "--ll-offset 128" in out and "--no-ll-prune" in out
    for path in (tmp_path / "out").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_site_identity_writes_a_private_key_and_prints_its_public_half(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`fedpose site identity`: the key for the site config's identity.key (owner-only), and the public
    key its peers list; it never overwrites an identity unasked (its peers know the old one)."""
    from fedpose.federation.secagg import crypto

    out = tmp_path / "keys" / "site-1.identity.pem"
    assert main(["site", "identity", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["public_key"] == crypto.identity_public_key(crypto.load_identity(out))
    assert out.stat().st_mode & 0o777 == 0o600
    before = out.read_bytes()
    assert main(["site", "identity", "--out", str(out)]) != 0
    assert "already exists" in capsys.readouterr().err and out.read_bytes() == before
