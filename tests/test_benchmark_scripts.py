"""The benchmark scripts still drive the library the way it is driven today.

They are not run by the suite (each takes minutes to hours), so a library change can leave one
broken without a failing test: step_cost's fixed batch stopped working for fdp, fpdp and maskdp
when their public-view gradient moved to a public sample of its own (2026-11-27). This runs the
step the script times, for every mechanism, at a small size.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import torch

from benchmark_modules import BENCHMARKS, load_benchmark_module
from fedpose.privacy.engine import build_engine

STEP_COST = BENCHMARKS / "step_cost" / "run.py"
PUBLIC_BASE_BUILD = BENCHMARKS / "public_base" / "build.py"
FEDERATED_UTILITY = BENCHMARKS / "federated_utility" / "run.py"


def _load_step_cost():
    return load_benchmark_module(STEP_COST, "step_cost_run")


def test_step_cost_times_one_step_of_every_mechanism():
    """Every mechanism's step runs on the script's fixed batch; a mechanism with a public view gets
    a public sample apart from the private rows (the engine refuses the private rows as its own)."""
    step_cost = _load_step_cost()
    args = argparse.Namespace(backbone="tiny_vit_test", size=(128, 96), device=torch.device("cpu"))
    model = step_cost.make_model(args)
    batch_size = 2
    private = step_cost.RandomPoseSet(4 * batch_size, args.size)
    public = step_cost.RandomPoseSet(4, args.size, 10_000)
    with_public_sample = set()
    for name in step_cost.MECHANISMS:
        engine = build_engine(step_cost.privacy_config(name, 2, 4), model, len(private), batch_size, 10, public, 0)
        batch = step_cost.fixed_batch(engine, private, batch_size)
        if engine.mechanism.public_view is not None:
            public_sample = batch[step_cost.PUBLIC_SAMPLE_KEY]
            assert set(public_sample["index"].tolist()).isdisjoint(batch["index"].tolist()), name
            with_public_sample.add(name)
        metrics, seconds, _ = step_cost.timed_step(engine, model, batch, args.device)
        assert seconds > 0, name
        assert metrics["batch_size"] == batch_size, name
    assert with_public_sample == {"fdp", "fpdp", "maskdp"}


def _build_public_base(tmp_path: Path, steps: str, name: str) -> subprocess.CompletedProcess:
    """Run build.py as a user does, with its work directory under tmp_path."""
    return subprocess.run([sys.executable, str(PUBLIC_BASE_BUILD), "--steps", steps, "--name", name,
                           "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=120)


def test_public_base_build_refuses_a_name_that_several_backbones_would_overwrite(tmp_path):
    """`build.py --name` names the exported base (the shipped ±60° files are not the default name);
    with several backbones a name without {backbone} would leave one file: refused before any work."""
    done = _build_public_base(tmp_path, "tiny_vit_test=1,tiny_vit_mid=1", "base.pt")
    assert done.returncode == 2
    assert "--name 'base.pt'" in done.stderr and "{backbone}" in done.stderr
    assert not (tmp_path / "work").exists()


def test_public_base_build_refuses_an_unknown_placeholder_in_the_name_before_any_work(tmp_path):
    """A --name the export could not format would otherwise fail only after the training."""
    done = _build_public_base(tmp_path, "tiny_vit_test=1", "base-{steps}.pt")
    assert done.returncode == 2
    assert "--name 'base-{steps}.pt'" in done.stderr and "only {backbone}" in done.stderr
    assert not (tmp_path / "work").exists()


def test_federated_utility_scores_each_sites_own_model_from_what_it_was_sent_and_released(tmp_path):
    """The sweep's ``score_local_models``: a site's own model at the end of a federated run is the global
    model it was sent plus the Δ it released (post-processing of released values). One real round of
    two sites through the coordinator's round loop: each own model is the site's saved release on top
    of what it was sent, FedAvg's global model is their mean, and α 0 is the global model."""
    from fedpose.federation.aggregation import load_array_checkpoint
    from fedpose.federation.deployment import CoordinatorRunConfig
    from fedpose.federation.global_model import load_global_model
    from fedpose.federation.server.in_process import InProcessTransport
    from fedpose.federation.server.rounds import RoundRunner
    from site_round_helpers import INPUT_SIZE, make_site_data, site_config

    sweep = load_benchmark_module(FEDERATED_UTILITY, "federated_utility_run")
    data = make_site_data(tmp_path / "data")
    one = site_config(data, tmp_path / "site-1")
    two = one.model_copy(update={"site_id": "site-2", "state_dir": str(tmp_path / "site-2"),
                                 "train": one.train.model_copy(update={"seed": 2})})
    run = CoordinatorRunConfig.model_validate({"run_id": "r", "coordinator": {
        "checkpoint_dir": str(tmp_path / "coordinator"), "data": {"input_size": list(INPUT_SIZE)}, "rounds": 1,
        "min_sites": 2, "local_steps": 2, "model": {"backbone": "tiny_vit_test", "scenario": "biases_norms"}}})
    recorder = sweep.LastRoundRecorder(InProcessTransport([one, two]))
    RoundRunner(run, echo=lambda _: None).run_rounds(recorder)

    final = load_global_model(tmp_path / "coordinator").model.state_dict()
    assert sorted(recorder.last) == ["site-1", "site-2"]
    own = {}
    for site_id, (received, delta) in recorder.last.items():
        released, meta = load_array_checkpoint(tmp_path / site_id / "released_update.npz")
        assert meta["round"] == 1 and sorted(released) == sorted(delta)
        own[site_id] = sweep.site_model_state(final, received, delta, 1.0)
        for name in delta:
            np.testing.assert_allclose(own[site_id][name].numpy() - received[name], released[name], atol=1e-6)
        assert all(torch.equal(sweep.site_model_state(final, received, delta, 0.0)[name], final[name]) for name in final)
    names = sorted(recorder.last["site-1"][1])
    for name in names:  # two equally weighted sites under FedAvg (server step 1)
        torch.testing.assert_close(final[name], (own["site-1"][name] + own["site-2"][name]) / 2, atol=1e-6, rtol=0)
    assert any(not torch.allclose(own["site-1"][name], final[name]) for name in names)  # each site's own noise


def test_federated_utility_summary_reads_every_cell_it_names():
    """summary.py lays the sweep's parts side by side; a renamed folder or a missing arm fails here,
    not in a reader's hands."""
    summary = load_benchmark_module(FEDERATED_UTILITY.parent / "summary.py", "federated_utility_summary")
    rows = [summary.summarise(cell) for cell in summary.CELLS]
    assert {(r["sites"], r["mechanism"], r["epsilon"]) for r in rows} >= {(10, "pdp", 2.0), (10, "pdp", 8.0), (3, "pdp", 8.0)}
    for row in rows:
        assert row["arms"]["federated"]["seeds"] >= 3, row["folder"]
        assert row["public_only"] < row["nonprivate_reference"], row["folder"]
        assert row["recovers_met"] == (row["recovers"] >= row["recovers_goal"])
    # the goals' section reads the probes and runs its reasons cite (a renamed file or arm fails here too)
    goals = summary.goal_states(rows)
    assert "| 10 | tiny_vit_test | pdp | 2 |" in summary.markdown(rows, goals)
    assert len(goals) == 5 and all(goal["best"] for goal in goals)
    assert "## Goals of issue 26" in summary.markdown(rows, goals)


def test_main_job_levers_pairs_every_probe_with_the_recipe_it_challenged_as_the_probe_itself_did():
    """main_job_levers.py lists every probe file of the main job (a new one without a label fails
    here), pairs each with the recipe whose published models its file names, reproduces the mean
    difference the probe recorded itself, and its committed table is the one the files give today."""
    import json

    levers = load_benchmark_module(FEDERATED_UTILITY.parent / "main_job_levers.py", "main_job_levers")
    probes = levers.probes()
    assert set(probes) == set(levers.LEVERS), "a probe file without a label, or a label without its file"
    rows = levers.table()
    assert {row["file"] for row in rows} == set(levers.LEVERS)
    for name, probe in probes.items():
        summary = probe.get("summary") if isinstance(probe.get("summary"), dict) else {}
        recorded = probe.get("mean_published_minus_baseline", summary.get("mean"))
        if recorded is not None:  # the files that state one mean hold one variant
            (row,) = [row for row in rows if row["file"] == name]
            assert abs(row["mean"] - recorded) <= 0.011, (name, row["mean"], recorded)
    adopted = [row for row in rows if row["decision"] == "adopted"]
    assert [row["file"] for row in adopted] == ["grey_only_main_job.json", "grey_rows_main_job.json", "grey_early_main_job.json"]
    committed = json.loads((FEDERATED_UTILITY.parent / "main_job_levers.json").read_text())["rows"]
    assert committed == json.loads(json.dumps(rows)), "main_job_levers.json is stale: rerun main_job_levers.py"


def test_main_job_grid_reproduces_the_main_jobs_recipe_and_pairs_variants_by_data_seed(tmp_path):
    """The grid's 'shipped' variant is configs/demo.toml's recipe (its σ recalibrated from the demo's
    ε lands on the demo's σ), and a variant is compared with the shipped runs of the same data seed."""
    sys.path.insert(0, str(FEDERATED_UTILITY.parent))  # the grid imports run.py as its neighbour
    grid = load_benchmark_module(FEDERATED_UTILITY.parent / "main_job_grid.py", "main_job_grid")
    run = load_benchmark_module(FEDERATED_UTILITY, "run")
    settings = run.Settings.model_validate(grid.demo_settings(7))
    demo = tomllib.loads((grid.REPO / "configs" / "demo.toml").read_text())  # read here as written, not as the grid reads it
    privacy = demo["sites"][0]["privacy"]
    assert run.sample_rate_of(settings) == privacy["sample_rate"]
    sigma = run.noise_multiplier(settings, settings.mechanisms[0], settings.epsilons[0], run.sample_rate_of(settings))
    assert abs(sigma - privacy["noise_multiplier"]) <= 0.005 * privacy["noise_multiplier"]
    assert (settings.rounds * settings.local_steps, settings.scenario, settings.init_checkpoint) == (
        demo["coordinator"]["rounds"] * demo["sites"][0]["local_steps"], demo["coordinator"]["model"]["scenario"],
        demo["coordinator"]["model"]["init_checkpoint"])
    assert settings.ema_decay == demo["coordinator"].get("ema", {}).get("decay", 0.0)
    assert all(name == "shipped" or changes for name, changes in grid.VARIANTS.items())

    def result(variant: str, seed: int, gain: float) -> dict:
        return {"variant": variant, "data_seed": seed, "gain": gain}

    refused = {**result("ceiling-eps1000", 7, 0.0), "site_rounds": {"site-1": ["refused"], "site-2": ["refused"]}}
    summary = grid.summarize([result("shipped", 7, 6.0), result("shipped", 7, 7.0), result("shipped", 9, 4.0),
                              result("lr0.2", 7, 7.5), result("lr0.2", 9, 3.0), refused])
    assert "ceiling-eps1000" not in summary  # no site trained: nothing measured
    assert summary["lr0.2"]["minus_shipped_paired"] == round(((7.5 - 6.5) + (3.0 - 4.0)) / 2, 2)
    assert summary["shipped"] == {"runs": 3, "gains_by_data_seed": {7: [6.0, 7.0], 9: [4.0]}, "mean_gain": 5.67,
                                  "minus_shipped_paired": 0.0}
    grid.plot(summary, tmp_path / "grid.png")
    assert (tmp_path / "grid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_job_simulate_reads_the_curve_the_readme_shows_and_uses_its_seed_overrides():
    """main_job_simulate.py reads the round lines ``fedpose simulate`` prints (the README's block, a
    moving-average line included) and passes the README's seed-S overrides."""
    script = load_benchmark_module(FEDERATED_UTILITY.parent / "main_job_simulate.py", "main_job_simulate")
    readme = (BENCHMARKS.parent / "README.md").read_text()
    printed = readme[readme.index("round   0 | PCKh@0.5"):readme.index("federation finished")]
    curve = script.printed_curve(printed)
    assert len(curve) == 3 and all(40.0 < pckh < 100.0 for pckh in curve)
    assert f"PCKh@0.5 = {curve[2]:.2f} (moving average of rounds 1–2)" in printed
    assert script.site_count() == 3  # configs/demo.toml's [[sites]]: one seed override each
    assert script.seed_overrides(1, script.site_count()) == [
        "coordinator.seed=1", "sites.0.train.seed=101", "sites.1.train.seed=102", "sites.2.train.seed=103"]
    assert "sites.I.train.seed=100·S+I+1" in readme


def test_federated_utility_noise_override_sets_every_private_arms_sigma_and_resumes_only_shared_runs(tmp_path):
    """``noise_multiplier`` (an emulation knob) replaces the σ that ε would calibrate in every private arm,
    never a non-private one; resuming from a sweep without it takes that sweep's public-only and
    non-private runs, never its private ones (another σ is another run)."""
    import json

    sweep = load_benchmark_module(FEDERATED_UTILITY, "federated_utility_run")
    calibrated = sweep.Settings(mechanisms=["dpsgd"], epsilons=[8.0], seeds=[0])
    emulated = calibrated.model_copy(update={"noise_multiplier": 1.269})
    private, public = sweep.Arm(0, "dpsgd", 8.0, "central"), sweep.Arm(0, "none", None, "central")
    assert sweep.arm_noise_multiplier(emulated, private) == 1.269
    assert sweep.arm_noise_multiplier(emulated, public) == sweep.arm_noise_multiplier(calibrated, public) == 0.0
    assert sweep.arm_noise_multiplier(calibrated, private) == sweep.noise_multiplier(
        calibrated, "dpsgd", 8.0, sweep.sample_rate_of(calibrated)) != 1.269

    runs = {arm.key: {**{field: getattr(arm, field) for field in ("seed", "mechanism", "epsilon", "kind", "site")},
                      "lr": sweep.arm_lr(calibrated, arm), "noise_multiplier": sweep.arm_noise_multiplier(calibrated, arm)}
            for arm in sweep.all_arms(calibrated)}
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps({"settings": json.loads(calibrated.model_dump_json()), "runs": runs}))
    assert sweep.seed_parts_from(saved, emulated, tmp_path / "work") == 3  # public-only, non-private federated and central
    taken = {path.name for path in (tmp_path / "work" / "parts").iterdir()}
    assert taken and not any("dpsgd" in name for name in taken)


def test_affine_probe_checks_fedpose_against_vmap_and_times_every_way():
    """step_cost/affine_probe.py: fedpose's per-sample gradients equal the whole network under vmap
    (on the product's backbone, a small chunk), and every way gets its timings."""
    probe = load_benchmark_module(BENCHMARKS / "step_cost" / "affine_probe.py", "affine_probe")
    result = probe.probe((64, 64), repeats=1, device=torch.device("cpu"), rows=2)
    assert result["largest_relative_difference_fedpose_to_vmap_all"] < 1e-4
    assert set(result["median_seconds"]) == {"vmap_all", "fedpose", "non_private"}
    assert result["over_non_private"]["non_private"] == 1.0


def test_gradient_share_splits_every_trainable_tensor_into_parts_whose_shares_add_up():
    """federated_utility/gradient_share.py: every trainable parameter is counted in exactly one part,
    and the squared-norm and mean-gradient shares over the parts each add up to 1."""
    from fedpose.config import ModelConfig
    from fedpose.model import build_model
    from test_dp_engine import TensorPoseSet

    share = load_benchmark_module(BENCHMARKS / "federated_utility" / "gradient_share.py", "gradient_share")
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone="tiny_vit_test", scenario="biases_norms"), (64, 64))
    parts = share.shares(model, TensorPoseSet(20), samples=20)
    assert sum(part["parameters"] for part in parts.values()) == model.num_trainable()
    for key in ("parameter_share", "squared_norm_share", "mean_gradient_share"):
        assert abs(sum(part[key] for part in parts.values()) - 1) < 1e-9
    assert {"stem BatchNorm shift", "stage 1 LayerNorm scale", "stage 1 bias"} <= set(parts)
    assert list(parts) == sorted(parts, key=lambda p: -parts[p]["squared_norm_share"])


def test_main_job_simulate_records_a_failed_run_with_what_it_printed():
    """--keep-going: a run that ``fedpose simulate`` ends with an error (a diverging variant) is kept
    with its round lines and the error line, unscored."""
    script = load_benchmark_module(FEDERATED_UTILITY.parent / "main_job_simulate.py", "main_job_simulate")
    printed = ("round   0 | PCKh@0.5 = 69.98 | initial global model (no site data used)\n"
               "round   1 | PCKh@0.5 = 69.98 | site-1: rejected (norm: ‖Δ‖₂ = 1870 exceeds the bound 1000)\n")
    done = subprocess.CompletedProcess(["fedpose"], 3, printed, "fedpose: error: a site failed (exit code 3)\n")
    record = script.failed_run(7, ["x=1"], done, 12.34)
    assert record["failed"] == "fedpose simulate exited 3" and record["printed_curve_pckh50"] == [69.98, 69.98]
    assert record["last_error"] == "fedpose: error: a site failed (exit code 3)" and len(record["round_lines"]) == 2
    assert "published_pckh50" not in record and record["simulate_seconds_with_data"] == 12.3


def test_gain_by_kind_scores_grey_and_lying_images_apart(tmp_path):
    """federated_utility/gain_by_kind.py: an image is grey by the product's rule (the grey copies'
    grey_flags: a grey image stored with ±1 levels of chroma noise stays grey, a faint uniform tint
    is colour), lying comes from the record, and each kind is scored on its own images only (perfect
    predictions on the grey images, wrong ones on the colour image)."""
    from PIL import Image

    from fedpose.data.annotations import PoseRecord

    by_kind = load_benchmark_module(BENCHMARKS / "federated_utility" / "gain_by_kind.py", "gain_by_kind")
    rng = np.random.default_rng(0)
    grey = np.repeat(rng.integers(0, 256, (24, 16, 1), dtype=np.uint8), 3, axis=2)
    jpeg_like = grey.copy()
    jpeg_like[3, 5, 2] ^= 1  # one level off in one pixel: still grey
    tinted = grey.astype(np.int16)
    tinted[..., 0] += 3  # a uniform tint of 3 levels: colour
    tinted = np.clip(tinted, 0, 255).astype(np.uint8)
    for name, pixels in (("grey.png", grey), ("almost.png", tinted), ("grey2.png", jpeg_like)):
        Image.fromarray(pixels).save(tmp_path / name)
    joints = rng.uniform(2, 14, (16, 2)).astype(np.float32)
    records = [PoseRecord(image=name, joints=joints, joints_vis=np.ones(16, np.float32), center=np.array([8, 12], np.float32),
                          scale=0.2, headbox=np.array([[0, 0], [10, 10]], np.float32), extra={"lying": lying})
               for name, lying in (("grey.png", True), ("almost.png", False), ("grey2.png", False))]
    masks = by_kind.kind_masks(records, tmp_path)
    assert masks["grey"].tolist() == [True, False, True] and masks["colour"].tolist() == [False, True, False]
    assert masks["lying"].tolist() == [True, False, False] and masks["all"].all()
    truth = np.stack([joints] * 3)
    prediction = {"preds": truth.copy(), "joints": truth, "joints_vis": np.ones((3, 16), np.float32),
                  "headbox": np.stack([r.headbox for r in records])}
    prediction["preds"][1] += 50.0  # the colour image: every joint far off
    scores = by_kind.scores_by_kind(prediction, masks)
    assert scores["grey"] == 100.0 and scores["colour"] == 0.0 and scores["lying"] == 100.0
    assert 0.0 < scores["all"] < 100.0


def test_grey_copies_by_stage_trains_only_each_variants_copies_and_never_moves_colour_images(tmp_path):
    """The noise-free diagnostic behind grey_early_main_job.json: each variant trains the grey copies
    under its prefixes only (the early set is the scenario's), and the colour test images' score never
    moves (they never see the copies); a weight variant trains every weight under its prefixes and
    scores colour images with the base."""
    import json

    from fedpose.config import ModelConfig
    from fedpose.data.synthetic import ensure_dataset
    from fedpose.model import build_model
    from fedpose.model.pose_model import GREY_EARLY_UNITS

    script = load_benchmark_module(BENCHMARKS / "federated_utility" / "grey_copies_by_stage.py", "grey_copies_by_stage")
    ensure_dataset(tmp_path / "syn", sites=2, per_site=24, public=0, test=16, size=(64, 64), seed=0, progress=False)
    out = tmp_path / "by_stage.json"
    assert script.main(["--data", str(tmp_path / "syn"), "--out", str(out), "--steps", "2", "--threads", "1",
                        "--backbone", "tiny_vit_test", "--base", "", "--size", "64x64"]) == 0
    variants = json.loads(out.read_text())["variants"]
    early = build_model(ModelConfig(backbone="tiny_vit_test", scenario="grey_early_biases_norms"), (64, 64))
    assert variants["patch embedding, stages 0-1 (grey_early_biases_norms)"]["prefixes"] == list(GREY_EARLY_UNITS)
    assert variants["patch embedding, stages 0-1 (grey_early_biases_norms)"]["trainable"] == early.num_trainable()
    counts = {name: v["trainable"] for name, v in variants.items()}
    assert counts["every copy"] == counts["patch embedding, stages 0-1 (grey_early_biases_norms)"] + counts["stages 2-3 and the head"]
    weights = json.loads(out.read_text())["weight_variants"]
    full = build_model(ModelConfig(backbone="tiny_vit_test", scenario="full"), (64, 64))
    assert weights["every weight of the model"]["trainable"] == full.num_trainable()
    assert weights["every weight of the patch embedding"]["trainable"] == sum(
        p.numel() for name, p in full.named_parameters() if name.startswith("backbone.patch_embed."))
    assert weights["every weight of the patch embedding and stages 0-1"]["prefixes"] == list(GREY_EARLY_UNITS)
    for variant in [*variants.values(), *weights.values()]:  # a weight variant's colour images are the base's
        curve = variant["curve_every_16_steps"]
        assert len(curve) == 2 and {point["colour"] for point in curve} == {variants["every copy"]["curve_every_16_steps"][0]["colour"]}
