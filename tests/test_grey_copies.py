"""Grey copies (model.scenario "grey_biases_norms" and "grey_early_biases_norms", fedpose.model.grey_copies).

Which images count as grey; that a colour image's output and gradient never depend on the copies and
a grey image's only on them; that per-sample gradients equal a per-sample loop, so a unit's clipped
gradient is what the engine bounds; that the engine noises exactly the copies and refuses to project
them; that a base without copies starts them as its own tensors; checkpoints, specs and deep copies.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from fedpose.config import GREY_SCENARIOS, ModelConfig, PrivacyConfig
from fedpose.data.dataset import normalize
from fedpose.model import build_model, build_model_from_spec, model_from_checkpoint, save_checkpoint
from fedpose.model.checkpoint import model_spec
from fedpose.model.grey_copies import GREY_PREFIX, grey_flags, is_grey_copy_key, own_key
from fedpose.model.pose_model import GREY_EARLY_UNITS
from fedpose.privacy.engine import build_engine
from fedpose.privacy.per_sample import flatten, frozen_features, per_sample_gradients

SIZE = (64, 64)


def make(scenario: str = "grey_biases_norms", seed: int = 0, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # partial scenarios without init_checkpoint
        return build_model(ModelConfig(backbone="tiny_vit_test", scenario=scenario, **kwargs), SIZE)


def images(kinds: str, seed: int = 0) -> torch.Tensor:
    """ImageNet-normalised images, 'g' grey (R = G = B) or 'c' colour, as the dataset makes them."""
    rng = np.random.default_rng(seed)
    out = []
    for kind in kinds:
        pixels = rng.integers(0, 256, (*SIZE, 1 if kind == "g" else 3), dtype=np.uint8)
        out.append(normalize(np.repeat(pixels, 3, axis=2) if kind == "g" else pixels))
    return torch.stack(out)


def moved_copies(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Grey copies away from their own tensors (as after training)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_grey_copy_key(name):
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model


def targets(n: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n, 16, 2, generator=generator) * (SIZE[0] - 1), (torch.rand(n, 16, generator=generator) > 0.2).float()


def test_grey_flags_follow_the_pixels_not_the_padding_or_one_pixel():
    grey, colour = images("gc")
    black_padding = grey.clone()
    black_padding[:, :20] = normalize(np.zeros((20, SIZE[1], 3), np.uint8))  # the augmentation's fill
    faint = np.repeat(np.full((*SIZE, 1), 128, np.uint8), 3, axis=2)
    faint[: SIZE[0] // 2, :, 1] += 1  # a JPEG's chroma rounding: one level off in half the pixels
    faint = normalize(faint)
    assert grey_flags(torch.stack([grey, colour, black_padding, faint, grey.flip(-1)])).tolist() == [1, 0, 1, 1, 1]
    tinted = np.repeat(np.full((*SIZE, 1), 128, np.uint8), 3, axis=2) + np.array([0, 3, 0], np.uint8)
    assert grey_flags(normalize(tinted)[None]).tolist() == [0]  # a uniform tint of 3 levels is colour


@pytest.mark.parametrize("scenario", GREY_SCENARIOS)
def test_the_copies_are_the_only_trainable_tensors_and_mirror_biases_norms(scenario: str):
    """grey_biases_norms copies every tensor of biases_norms; grey_early_biases_norms those in the patch
    embedding and the first two stages, nothing after them; the engine sees the copies only."""
    model, plain = make(scenario), make("biases_norms")
    trainable = set(model.trainable_parameters())
    assert all(is_grey_copy_key(name) for name in trainable)
    copied = set(plain.trainable_parameters())
    if scenario == "grey_early_biases_norms":
        copied = {name for name in copied if name.startswith(GREY_EARLY_UNITS)}
        assert {name.split(".")[1] for name in copied} == {"patch_embed", "stages"} and len(copied) < plain.num_trainable() / 3
        assert not [name for name in model.state_dict() if is_grey_copy_key(name) and not name.startswith(GREY_EARLY_UNITS)]
    assert {own_key(name) for name in trainable} == copied
    assert model.num_trainable() == sum(plain.trainable_parameters()[name].numel() for name in copied)
    assert model.frozen_prefix == [] and model.affine_tuned_part == []  # the images reach every copy's hook
    with pytest.raises(ValueError, match=f"built with the grey copies of '{scenario}'"):
        model.set_scenario("biases_norms")
    with pytest.raises(ValueError, match=f"built with the grey copies of '{scenario}'"):
        model.set_scenario(next(other for other in GREY_SCENARIOS if other != scenario))
    with pytest.raises(ValueError, match="built without grey copies"):
        plain.set_scenario(scenario)


@pytest.mark.parametrize("scenario", GREY_SCENARIOS)
def test_colour_images_never_see_the_copies_and_grey_images_see_only_them(scenario: str):
    model, plain = make(scenario), make("biases_norms")
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if GREY_PREFIX not in k})
    batch = images("cgcg")
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(model(batch), plain(batch)))  # fresh: exactly the base
        moved_copies(model)
        ours, base = model(batch), plain(batch)
        assert all(torch.equal(a[[0, 2]], b[[0, 2]]) for a, b in zip(ours, base))  # colour rows: the base's
        assert all((a[[1, 3]] - b[[1, 3]]).abs().max() > 1e-3 for a, b in zip(ours, base))
        # a grey image alone or among colour ones: the same output (its rows are its own)
        alone = model(batch[1:2])
        assert all(torch.allclose(a[1:2], b, atol=1e-5) for a, b in zip(ours, alone))
        # ... and moving the tensors the copies copy changes no grey output
        for name, param in model.named_parameters():
            if is_grey_copy_key(name):
                model.get_parameter(own_key(name)).add_(0.1)
        assert all(torch.allclose(a[[1, 3]], b[[1, 3]], atol=1e-5) for a, b in zip(model(batch), ours))


@pytest.mark.parametrize("scenario", GREY_SCENARIOS)
def test_per_sample_gradients_equal_a_loop_and_are_zero_for_colour_images(scenario: str):
    model = moved_copies(make(scenario))
    batch, (joints, weight) = images("gcgc"), targets(4)
    params = model.trainable_parameters()
    features = frozen_features(model, batch)
    for _ in range(2):  # twice: the flags of one pass must not leak into the next
        grads, _ = per_sample_gradients(model, features, joints, weight)
    for i in range(4):
        loss = model.loss(*model(batch[i: i + 1]), joints[i: i + 1], weight[i: i + 1]).sum()
        reference = flatten(list(torch.autograd.grad(loss, list(params.values()), allow_unused=True, materialize_grads=True)))
        ours = flatten([grads[name][i] for name in params])
        if i % 2:  # colour: no copy is on its path
            assert torch.equal(ours, torch.zeros_like(ours)) and torch.equal(reference, torch.zeros_like(reference))
        else:
            assert reference.norm() > 0 and (ours - reference).norm() / reference.norm() <= 1e-4, i


@pytest.mark.parametrize("scenario", GREY_SCENARIOS)
def test_the_engine_noises_exactly_the_copies_and_a_colour_batch_moves_only_by_noise(scenario: str):
    model = make(scenario)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    joints, weight = targets(4)
    batch = {"image": images("cccc"), "joints": joints, "weight": weight, "index": torch.arange(4)}
    privacy = PrivacyConfig(mechanism="dpsgd", noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)
    engine = build_engine(privacy, model, 8, 4, 1, seed=0)
    metrics = engine.step(model, batch)
    for name, param in model.named_parameters():
        if is_grey_copy_key(name):  # the copies' gradient is pure noise (colour images give none)
            assert param.grad is not None and bool((param.grad != 0).all()), name
        else:
            assert param.grad is None and torch.equal(param.detach(), before[name]), name
    assert metrics["grad_norm_median"] == 0.0 and metrics["clipped_fraction"] == 0.0
    for mechanism in ("pdp", "fpdp"):
        with pytest.raises(ValueError, match="grey copies"):
            build_engine(PrivacyConfig(mechanism=mechanism, noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5),
                         model, 8, 4, 1, seed=0)


@pytest.mark.parametrize("scenario", GREY_SCENARIOS)
def test_a_base_without_copies_starts_them_as_its_own_tensors_and_checkpoints_keep_them(tmp_path: Path, scenario: str):
    base = make("biases_norms", seed=5)
    path = save_checkpoint(tmp_path / "base.pt", base)
    torch.manual_seed(9)
    model = build_model(ModelConfig(backbone="tiny_vit_test", scenario=scenario, init_checkpoint=path), SIZE)
    state = model.state_dict()
    assert all(torch.equal(state[key], state[own_key(key)]) for key in state if is_grey_copy_key(key))
    batch = images("gc")
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(model(batch), base(batch)))
        moved_copies(model)
        expected = model(batch)
    saved = save_checkpoint(tmp_path / "grey.pt", model)
    restored, _ = model_from_checkpoint(saved)  # built from its spec: the copies included, as trained
    rebuilt = build_model_from_spec(model_spec(model))
    rebuilt.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(restored(batch), expected))
        assert all(torch.equal(a, b) for a, b in zip(rebuilt(batch), expected))
        twin = copy.deepcopy(model)  # its hooks read its own modules' flags, not the original's
        twin_out = twin(images("gg", seed=4))
        assert all(torch.equal(a, b) for a, b in zip(model(images("gg", seed=4)), twin_out))


def test_a_federation_that_would_project_grey_copies_is_refused_before_it_runs(tmp_path: Path):
    from fedpose.cli.simulate import resolve_federation

    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.toml"
    checkpoint = f'coordinator.checkpoint_dir="{tmp_path / "coordinator"}"'
    federation, _, _ = resolve_federation(demo, [checkpoint])
    assert federation.coordinator.model.scenario == "grey_early_biases_norms"  # the main job's set
    with pytest.raises(ValueError, match=r"sites \['site-2'\]: pdp and fpdp project onto public gradients"):
        resolve_federation(demo, [checkpoint, "sites.1.privacy.mechanism=pdp"])


def test_only_grey_records_can_train_grey_copies_and_their_crops_stay_grey(tmp_path: Path):
    """records_with_gradient flags exactly the records whose un-augmented crop is grey — the infrared
    images of a synthetic site — for a model that trains only grey copies, and nothing (None: every
    record trains) for one that trains anything else; a flagged record's augmented crops stay grey
    and an unflagged one's stay colour, so the records left out carry exactly zero gradient."""
    from fedpose.data.dataset import PoseDataset, load_records
    from fedpose.data.synthetic import ensure_dataset
    from fedpose.model.grey_copies import records_with_gradient

    ensure_dataset(tmp_path / "syn", sites=1, per_site=24, public=0, test=0, size=SIZE, seed=0, progress=False)
    records, root = load_records(tmp_path / "syn" / "site-1")
    dataset = PoseDataset(records, root, input_size=SIZE, train=True, seed=0)
    flags = records_with_gradient(make().trainable_parameters(), dataset)
    assert flags is not None and len(flags) == len(records) and 0 < sum(flags) < len(flags)
    plain = torch.stack([dataset.load(i, plain=True)["image"] for i in range(len(records))])
    assert flags == [bool(f) for f in grey_flags(plain).tolist()]
    rng = np.random.default_rng(0)
    for i in range(len(records)):
        augmented = torch.stack([dataset.load(i, rng)["image"] for _ in range(4)])
        assert grey_flags(augmented).tolist() == [float(flags[i])] * 4, i
    assert records_with_gradient(make("biases_norms").trainable_parameters(), dataset) is None
    assert records_with_gradient({}, dataset) is None


def test_training_data_without_a_grey_image_is_said_on_the_site_machine(tmp_path: Path):
    """Grey copies on colour-only data (the synthetic public split: no infrared camera) would train on
    noise alone; records_with_gradient says so as a local warning (the operator's stderr / log, never
    a reply), and a site with grey images gets no warning."""
    from fedpose.data.dataset import PoseDataset, load_records
    from fedpose.data.synthetic import ensure_dataset
    from fedpose.model.grey_copies import records_with_gradient

    ensure_dataset(tmp_path / "syn", sites=1, per_site=24, public=12, test=0, size=SIZE, seed=0, progress=False)
    trainable = make().trainable_parameters()
    records, root = load_records(tmp_path / "syn" / "public")
    with pytest.warns(RuntimeWarning, match="none of the 12 training images is grey"):
        assert records_with_gradient(trainable, PoseDataset(records, root, input_size=SIZE, train=True)) == [False] * 12
    records, root = load_records(tmp_path / "syn" / "site-1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert any(records_with_gradient(trainable, PoseDataset(records, root, input_size=SIZE, train=True)))


def test_a_site_round_fills_its_rows_from_its_grey_records_only(tmp_path: Path):
    """The real site round under grey copies: its engine's unit rows are each patient's grey records
    (the flags of the site's own training set), and the round trains and replies as usual."""
    from fedpose.federation.local_training import load_site_dataset, train_site_round
    from fedpose.model.grey_copies import records_with_gradient
    from site_round_helpers import INPUT_SIZE, global_model, make_site_data, site_config

    site = site_config(make_site_data(tmp_path / "data"), tmp_path / "state", unit="patient")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a partial scenario without init_checkpoint
        state, spec = global_model(scenario="grey_biases_norms")
    engines: list = []
    result = train_site_round(site, "run", 1, state, spec, 2, engine_hook=engines.append)
    assert result.reply.status == "ok" and result.update
    (engine,) = engines
    flags = records_with_gradient(make().trainable_parameters(), load_site_dataset(site, INPUT_SIZE))
    assert flags is not None and 0 < sum(flags) < len(flags)
    assert engine.unit_rows == tuple(tuple(r for r in members if flags[r]) for members in engine.units.members)
