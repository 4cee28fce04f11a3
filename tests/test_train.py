"""Training loop, evaluation pipeline and central runs (resume, run directory, privacy ledger)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from fedpose.config import ModelConfig, PrivacyConfig, RunConfig, load_config
from fedpose.data.dataset import PoseDataset, load_records
from fedpose.data.synthetic import generate_dataset
from fedpose.joints import flip_permutation
from fedpose.model import build_model, load_checkpoint
from fedpose.model.pose_model import PoseModel
from fedpose.privacy.engine import build_engine
from fedpose.train import build_optimizer, build_scheduler, evaluate, train_steps
from fedpose.train.central import run_training
from fedpose.train.optim import lr_factor

SIZE = (64, 64)


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "data"
    generate_dataset(out, sites=1, per_site=6, public=8, test=6, size=SIZE, workers=1, progress=False)
    return out


def tiny_model(scenario: str = "scratch", **kwargs):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_model(ModelConfig(backbone="tiny_vit_test", scenario=scenario, **kwargs), SIZE)


def test_train_steps_drives_engine_and_reduces_loss(synth: Path) -> None:
    records, root = load_records(synth / "public")
    dataset = PoseDataset(records[:2], root, input_size=SIZE, train=False, cache_images=True)
    model = tiny_model(label_sigma=2.0)
    cfg = load_config(None, ["optim.lr=0.002", "optim.warmup_steps=2"]).optim
    engine = build_engine(PrivacyConfig(), model, len(dataset), 2, 25, None, 0)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, 25)
    seen: list[int] = []
    history = train_steps(model, engine, dataset, optimizer, 25, scheduler, on_step=lambda s, r: seen.append(s),
                          progress=False, first_step=10)
    assert [h["step"] for h in history] == list(range(11, 36)) == seen
    assert history[0]["lr"] == pytest.approx(2e-3)  # second warm-up step after the first scheduler step
    assert history[-1]["lr"] == pytest.approx(0.0, abs=1e-9)
    first, last = sum(h["loss"] for h in history[:3]) / 3, sum(h["loss"] for h in history[-3:]) / 3
    assert last < 0.7 * first
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert all(not bn.training for bn in bns)


def test_lr_schedule_warmup_then_cosine() -> None:
    assert lr_factor(0, 100, 10, True) == pytest.approx(0.1)
    assert lr_factor(9, 100, 10, True) == pytest.approx(1.0)
    assert lr_factor(55, 100, 10, True) == pytest.approx(0.5)
    assert lr_factor(100, 100, 10, True) == pytest.approx(0.0)
    assert lr_factor(50, 100, 0, False) == 1.0


class OracleModel(torch.nn.Module):
    """Wraps a real PoseModel but answers with the ground-truth SimCC targets of each crop, in
    dataset order, and with the mirrored targets for the mirror of the batch it just answered
    (flip test): exercises decode (and unmirror) → crop_to_original → PCKh end to end."""

    predict_crops = PoseModel.predict_crops  # the real method, calling this oracle's forward

    def __init__(self, model, targets: list[torch.Tensor]) -> None:
        super().__init__()
        self.inner, self.targets, self.cursor, self.last = model, targets, 0, None

    def forward(self, images):
        if self.last is not None and torch.equal(images, self.last[0].flip(-1)):
            joints = self.last[1][:, flip_permutation()].clone()
            joints[..., 0] = images.shape[-1] - 1 - joints[..., 0]  # x → W − 1 − x
        else:
            joints = torch.stack(self.targets[self.cursor:self.cursor + len(images)])
            self.cursor += len(images)
            self.last = (images, joints)
        bins_y, bins_x = self.inner.codec.bins
        return self.inner.codec.log_targets(joints[..., 0], bins_x), self.inner.codec.log_targets(joints[..., 1], bins_y)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


def test_evaluate_scores_ground_truth_as_perfect(synth: Path) -> None:
    records, root = load_records(synth / "test")
    dataset = PoseDataset(records, root, input_size=SIZE, train=False)
    for flip_test in (True, False):
        oracle = OracleModel(tiny_model(label_sigma=1.0), [dataset[i]["joints"] for i in range(len(dataset))])
        scores = evaluate(oracle, dataset, batch_size=4, flip_test=flip_test)
        assert scores["Mean"] == pytest.approx(100.0)
        assert scores["Mean@0.1"] > 90.0
        assert scores["samples"] == len(dataset)


def run_config(synth: Path, out: Path, *overrides: str, val: bool = True) -> RunConfig:
    base = [
        f'data.train="{synth / "public"}"', "data.input_size=[64, 64]",
        'model.backbone="tiny_vit_test"', 'model.scenario="scratch"', "train.steps=4", "train.batch_size=3",
        "train.eval_every=2", "train.checkpoint_every=2", f'train.out_dir="{out}"', "optim.warmup_steps=1",
    ]
    if val:
        base.append(f'data.val="{synth / "test"}"')
    return load_config(None, base + list(overrides))


@pytest.mark.slow
def test_resume_continues_exactly(synth: Path, tmp_path: Path) -> None:
    quiet = dict(progress=False, log=lambda _: None)
    # 8 records, batch 3: 2 batches per epoch, so the resumed part crosses an epoch boundary
    steps = ("train.steps=3", "train.eval_every=2", "train.checkpoint_every=2")
    run_training(run_config(synth, tmp_path / "straight", *steps), **quiet)
    interrupted = run_config(synth, tmp_path / "resumed", *steps)
    run_training(interrupted, stop_after=1, **quiet)
    assert load_checkpoint(tmp_path / "resumed/checkpoints/last.pt")["step"] == 1
    run_training(interrupted, resume=tmp_path / "resumed", **quiet)

    a = load_checkpoint(tmp_path / "straight/checkpoints/last.pt")
    b = load_checkpoint(tmp_path / "resumed/checkpoints/last.pt")
    assert a["step"] == b["step"] == 3
    assert [r["loss"] for r in a["metrics"]["train"]] == [r["loss"] for r in b["metrics"]["train"]]
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    run_dir = tmp_path / "resumed"
    for name in ("config.toml", "metrics.json", "curves.png", "privacy.json", "checkpoints/best.pt"):
        assert (run_dir / name).exists(), name
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert [v["step"] for v in metrics["val"]] == [1, 2, 3]  # every 2 steps, and where each invocation ended
    assert json.loads((run_dir / "privacy.json").read_text())["guarantee"] == "none"
    # the written config.toml reloads to the same configuration
    assert load_config(run_dir / "config.toml") == interrupted


@pytest.mark.slow
def test_dp_resume_continues_the_privacy_ledger(synth: Path, tmp_path: Path) -> None:
    quiet = dict(progress=False, log=lambda _: None)
    dp = ('privacy.mechanism="dpsgd"', "privacy.noise_multiplier=1.0", "train.steps=2", "train.checkpoint_every=1")
    run_training(run_config(synth, tmp_path / "straight", *dp, val=False), **quiet)
    cfg = run_config(synth, tmp_path / "resumed", *dp, val=False)
    run_training(cfg, stop_after=1, **quiet)
    run_training(cfg, resume=tmp_path / "resumed", **quiet)
    straight = json.loads((tmp_path / "straight/privacy.json").read_text())
    resumed = json.loads((tmp_path / "resumed/privacy.json").read_text())
    assert resumed["steps"] == straight["steps"] == 2
    assert resumed["accountant_state"] == straight["accountant_state"]
    assert resumed["epsilon"] == pytest.approx(straight["epsilon"])


def test_a_dp_run_never_resumes_from_a_checkpoint_behind_its_spend(synth: Path, tmp_path: Path) -> None:
    """best.pt (or any older checkpoint) restores its own, shorter ledger: resuming from it would drop
    the later steps — whose validation scores chose it — from ε. Refused, nothing written."""
    from fedpose.config import ConfigError

    quiet = dict(progress=False, log=lambda _: None)
    dp = ('privacy.mechanism="dpsgd"', "privacy.noise_multiplier=1.0", "train.steps=3", "train.checkpoint_every=1")
    run = tmp_path / "run"
    cfg = run_config(synth, run, *dp, val=False)
    run_training(cfg, **quiet)
    older = run / "checkpoints" / "step-1.pt"
    torch.save(torch.load(run / "checkpoints" / "last.pt", weights_only=False) | {"step": 1}, older)
    before = (run / "privacy.json").read_bytes()
    with pytest.raises(ConfigError, match=r"at step 1, but .*privacy.json holds 3 DP steps already spent: .*drop steps 2–3"):
        run_training(run_config(synth, run, *dp, "train.steps=5", val=False), resume=older, **quiet)
    assert (run / "privacy.json").read_bytes() == before


@pytest.mark.slow
def test_a_run_resumed_for_more_steps_stays_within_its_target_epsilon(synth: Path, tmp_path: Path) -> None:
    """A finished target-ε run continued with more steps (what the CLI suggests: raise train.steps)
    recalibrated σ for the new step count from scratch, its first steps already spent at the smaller
    σ: it ended at ε 2.48 for a target of 2 while privacy.json's planned ε said 1.99 (a red-team
    finding). σ for the remaining steps now counts the spent ones; the plan includes them; a target
    already out of reach is refused, naming it, nothing written."""
    from fedpose.privacy.accountant import PrivacyLedger

    quiet = dict(progress=False, log=lambda _: None)
    dp = ('privacy.mechanism="dpsgd"', "privacy.target_epsilon=2.0", 'privacy.accountant="pld"', "privacy.sample_rate=0.25",
          "train.checkpoint_every=1")
    run = tmp_path / "run"
    run_training(run_config(synth, run, *dp, "train.steps=4", val=False), **quiet)
    first = json.loads((run / "privacy.json").read_text())
    run_training(run_config(synth, run, *dp, "train.steps=12", val=False), resume=run, **quiet)
    report = json.loads((run / "privacy.json").read_text())
    assert report["steps"] == 12 and report["epsilon"] <= 2.0
    assert report["planned_epsilon"] == pytest.approx(report["epsilon"], rel=1e-6)
    history = PrivacyLedger.from_dict(report["accountant_state"]).history
    assert history[0] == (first["noise_multiplier"], 0.25, 4) and history[1][2] == 8 and history[1][0] > history[0][0]

    before = (run / "privacy.json").read_bytes()
    with pytest.raises(ValueError, match=r"target ε = 1.5 is unreachable for the 1 steps left after the 12 the resumed run spent "
                                         r"\(ε = [0-9.]+ \(DP, δ = .*\) per .*adjacency\)"):
        run_training(run_config(synth, run, *dp, "train.steps=13", 'privacy.target_epsilon=1.5', val=False), resume=run, **quiet)
    assert (run / "privacy.json").read_bytes() == before


def _rewrite_ledger(checkpoint_path: Path, **changes) -> None:
    """The checkpoint as an older fedpose would have written it: its ledger state changed."""
    checkpoint = torch.load(checkpoint_path, weights_only=False)
    checkpoint["extra"]["accountant"].update(changes)
    torch.save(checkpoint, checkpoint_path)


@pytest.mark.slow
def test_an_fdp_run_from_before_replace_one_resumes_under_its_own_relation_within_its_target(synth: Path, tmp_path: Path) -> None:
    """An FDP checkpoint whose ledger is visible-membership (written before ``replace_one``) goes on
    under that relation, with σ calibrated there — σ calibrated under ``replace_one`` but composed
    under visible membership would end above the target. A ledger whose relation does not bound
    FDP (add/remove) is refused, naming it, and the checkpoint is left as it was."""
    from fedpose.privacy.accountant import noise_multiplier_for

    quiet = dict(progress=False, log=lambda _: None)
    target, steps = 4.0, 3
    fdp = ('privacy.mechanism="fdp"', f"privacy.target_epsilon={target}", f"train.steps={steps}", "train.checkpoint_every=1")
    cfg = run_config(synth, tmp_path / "old", *fdp, val=False)
    run_training(cfg, stop_after=1, **quiet)
    last = tmp_path / "old/checkpoints/last.pt"
    ledger = torch.load(last, weights_only=False)["extra"]["accountant"]
    (event,) = ledger["history"]
    visible_sigma = noise_multiplier_for(target, event["sample_rate"], steps, 1e-5, relation="replace_public_membership",
                                         accountant=ledger["accountant"])
    assert visible_sigma > 1.2 * event["noise_multiplier"]  # replace_one needs much less noise at this q
    # what the old code recorded for the first step: visible membership, σ calibrated under it
    _rewrite_ledger(last, relation="replace_public_membership", history=[{**event, "noise_multiplier": visible_sigma}])
    run_training(cfg, resume=tmp_path / "old", **quiet)
    report = json.loads((tmp_path / "old/privacy.json").read_text())
    assert report["steps"] == steps and report["neighbouring_relation"] == "replace_public_membership"
    assert report["noise_multiplier"] == pytest.approx(visible_sigma, rel=0.01)  # the rest calibrated after the spent step
    assert report["epsilon"] <= target

    cfg = run_config(synth, tmp_path / "add_remove", *fdp, val=False)
    run_training(cfg, stop_after=1, **quiet)
    last = tmp_path / "add_remove/checkpoints/last.pt"
    _rewrite_ledger(last, relation="add_remove")
    before = last.read_bytes()
    with pytest.raises(ValueError, match="'add_remove' relation, which does not bound mechanism 'fdp'"):
        run_training(cfg, resume=tmp_path / "add_remove", **quiet)
    assert last.read_bytes() == before


@pytest.mark.slow
def test_dp_runs_draw_fresh_noise_unless_seeded_test_noise_voids_the_guarantee(synth: Path, tmp_path: Path) -> None:
    """Identical config and seed: DP-SGD runs differ (CSPRNG noise); with insecure_seeded_noise they
    are identical, and every output says there is no privacy guarantee."""
    dp = ('privacy.mechanism="dpsgd"', "privacy.noise_multiplier=1.0", "train.steps=2", "train.seed=7")
    weights: dict[str, list[dict[str, torch.Tensor]]] = {"secure": [], "seeded": []}
    logs: dict[str, list[str]] = {"secure": [], "seeded": []}
    for kind, extra in (("secure", ()), ("seeded", ("privacy.insecure_seeded_noise=true",))):
        for run in range(2):
            out = tmp_path / f"{kind}{run}"
            run_training(run_config(synth, out, *dp, *extra, val=False), progress=False, log=logs[kind].append)
            weights[kind].append(load_checkpoint(out / "checkpoints/last.pt")["model"])
    (secure_a, secure_b), (seeded_a, seeded_b) = weights["secure"], weights["seeded"]
    assert any(not torch.equal(secure_a[key], secure_b[key]) for key in secure_a)
    assert all(torch.equal(seeded_a[key], seeded_b[key]) for key in seeded_a)

    void = "NO PRIVACY GUARANTEE (seeded test noise)"
    secure_report = json.loads((tmp_path / "secure0/privacy.json").read_text())
    assert secure_report["guarantee_void"] is False and secure_report["randomness"].startswith("AES-256-CTR")
    assert not any(void in line for line in logs["secure"])
    seeded_report = json.loads((tmp_path / "seeded0/privacy.json").read_text())
    assert seeded_report["epsilon_text"].startswith(void + ": ε = ")
    assert seeded_report["guarantee_void"] is True and seeded_report["reproducible_noise"] is True
    assert json.loads((tmp_path / "seeded0/metrics.json").read_text())["privacy"].startswith(void)
    assert json.loads((tmp_path / "secure0/metrics.json").read_text())["privacy"].startswith("ε = ")
    assert logs["seeded"][1].startswith(void) and logs["seeded"][-1].endswith(seeded_report["epsilon_text"])


def test_existing_run_dir_is_not_overwritten(synth: Path, tmp_path: Path) -> None:
    from fedpose.config import ConfigError

    cfg = run_config(synth, tmp_path / "run", "train.steps=1", val=False)
    run_training(cfg, progress=False, log=lambda _: None)
    before = (tmp_path / "run/checkpoints/last.pt").read_bytes()
    with pytest.raises(ConfigError, match="train.out_dir: .* already holds a run"):
        run_training(cfg, progress=False, log=lambda _: None)
    assert (tmp_path / "run/checkpoints/last.pt").read_bytes() == before


@pytest.mark.parametrize("mechanism, source", [("none", "public"), ("pdp", "test"), ("dpsgd", None)])
def test_scratch_batchnorm_calibration_never_sees_private_data(synth: Path, tmp_path: Path, monkeypatch, mechanism, source) -> None:
    """BatchNorm statistics ship with the model: a private run calibrates them on public data only."""
    from fedpose.data.dataset import PoseDataset, load_records
    from fedpose.model.pose_model import PoseModel

    seen: list[torch.Tensor] = []
    monkeypatch.setattr(PoseModel, "calibrate_batch_norm", lambda self, images: seen.append(images))
    overrides = ["train.steps=1"]
    if mechanism != "none":
        overrides += [f'privacy.mechanism="{mechanism}"', "privacy.noise_multiplier=1.0"]
    if mechanism == "pdp":  # the test split stands in for S_pub here
        overrides += [f'privacy.basis.public_data="{synth / "test"}"', "privacy.basis.k=2", "privacy.basis.public_samples=3"]
    run_training(run_config(synth, tmp_path / "run", *overrides, val=False), progress=False, log=lambda _: None)
    build_time, data = seen[0], seen[1:]  # build_model calibrates on data-independent noise first
    assert build_time.shape[-2:] == SIZE
    if source is None:
        assert data == []  # no public data: the noise calibration stays
        return
    records, root = load_records(synth / source)
    expected = PoseDataset(records, root, input_size=SIZE, train=False)
    assert len(data) == 1
    assert torch.equal(data[0], torch.stack([expected[i]["image"] for i in range(len(data[0]))]))


def test_input_privacy_covers_training_and_validation_images(synth: Path, tmp_path: Path) -> None:
    """A site with input privacy trains and validates on privatized copies only; the guarantee is reported."""
    import shutil

    data = tmp_path / "data"
    for split in ("public", "test"):
        shutil.copytree(synth / split, data / split)
    cfg = run_config(data, tmp_path / "run", "train.steps=2", 'input_privacy.mechanism="ldp-slicing"',
                     "input_privacy.epsilon=20.0", "input_privacy.insecure_seed=3")
    summary = run_training(cfg, progress=False, log=lambda _: None)
    assert summary["train_dir"] == str(data / "public.ldp-sliced")
    assert summary["val_dir"] == str(data / "test.ldp-sliced")
    for split in ("public", "test"):
        assert len(load_records(data / f"{split}.ldp-sliced")[0]) == len(load_records(data / split)[0])
    report = json.loads((tmp_path / "run/privacy.json").read_text())
    assert report["input_privacy"]["mechanism"] == "ldp-slicing" and report["input_privacy"]["epsilon_total"] == 20.0
