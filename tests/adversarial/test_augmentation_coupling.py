"""Training augmentation against an attacker who knows the config: one sampled unit more must change
the step's clipped sum by that unit's clipped gradient and nothing else.

Until 2026-12-06 a private step's rows drew their augmentations from the dataset's own stream, seeded
by ``train.seed`` and restarted every round: the k-th row loaded got the k-th draw. Adding unit u
ahead of unit v moved v to the next draw, so v's clipped gradient changed too, and neighbouring sums
differed by 1.2 C (2.5 C with 14 units after u) instead of ≤ C — the subsampled Gaussian's analysis,
and every ε printed, assumed ≤ C. Now each row's augmentation is drawn from a generator seeded per
row by the engine's CSPRNG (:func:`fedpose.privacy.engine.load_rows`): a function of that row's
seed alone, fresh every step, and no config value determines it.
"""

from __future__ import annotations

import pytest
import torch

from fedpose.federation.local_training import load_site_dataset
from fedpose.model import build_model_from_spec
from fedpose.privacy.engine import augmentation_seeds, build_engine, load_rows
from fedpose.privacy.noise import InsecureSeededNoise, SecureNoise
from fedpose.privacy.per_sample import frozen_features
from site_round_helpers import global_model, make_site_data, site_config

CHUNK = 8


@pytest.fixture(scope="module")
def site_and_model(tmp_path_factory):
    root = make_site_data(tmp_path_factory.mktemp("site-data"))
    site = site_config(root, tmp_path_factory.mktemp("state"), unit="record")
    arrays, spec = global_model()
    model = build_model_from_spec(spec)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in arrays.items()})
    model.train_mode()
    return site, spec, model


def _engine_and_dataset(site, spec, model):
    dataset = load_site_dataset(site, tuple(spec.input_size))  # fresh, as every round's ClientApp builds it
    engine = build_engine(site.privacy, model, dataset_size=len(dataset), batch_size=4, planned_steps=2, chunk_size=CHUNK)
    return engine, dataset


def _clipped_sum(engine, model, batch) -> torch.Tensor:
    features = frozen_features(model, batch["image"], CHUNK)
    total, *_ = engine._clipped_sum(model, features, batch["joints"], batch["weight"], batch["unit_index"],
                                    batch["row_mask"], CHUNK)
    return total


def test_one_more_unit_ahead_of_the_others_moves_the_clipped_sum_by_its_own_clipped_gradient_only(site_and_model):
    site, spec, model = site_and_model
    engine, dataset = _engine_and_dataset(site, spec, model)
    assert dataset.train and dataset.rotation > 0  # the site's rows are augmented
    others, added = [3, 5, 7], 1
    seeds = dict(zip([added, *others], augmentation_seeds(SecureNoise(), 4)))  # the coupling: each unit keeps its draw

    def step_of(units: list[int]) -> dict:
        records, slots, real = engine.fixed_shape_rows(units, list(range(len(units))))
        padding = augmentation_seeds(SecureNoise(), len(records))
        row_seeds = [seeds[r] if is_real else pad for r, is_real, pad in zip(records, real, padding)]
        return load_rows(dataset, records, slots, real, row_seeds)

    without, with_added = step_of(others), step_of([added, *others])  # the added unit loads first: everyone shifts
    for unit in others:  # each unit's rows are the same images, augmentations and all, in both neighbours
        a, b = (batch["index"].tolist().index(unit) for batch in (without, with_added))
        assert (without["rotation"][a], without["flipped"][a]) == (with_added["rotation"][b], with_added["flipped"][b])
        assert torch.equal(without["image"][a], with_added["image"][b])
    only_added = dict(with_added, row_mask=with_added["row_mask"] & (with_added["index"] == added))
    difference = _clipped_sum(engine, model, with_added) - _clipped_sum(engine, model, without)
    clipped_added = _clipped_sum(engine, model, only_added)
    assert float(difference.norm()) <= site.privacy.max_grad_norm * (1 + 1e-5)
    torch.testing.assert_close(difference, clipped_added, rtol=1e-4, atol=1e-5)


def test_a_private_step_draws_augmentations_from_the_csprng_not_the_seeded_dataset_stream(site_and_model):
    site, spec, model = site_and_model
    first_rows = []
    for _ in range(2):  # two rounds of the same site config (train.seed, the same for every round)
        engine, dataset = _engine_and_dataset(site, spec, model)
        stream = dataset._rng.bit_generator.state
        batch = next(engine.batches(dataset))
        assert dataset._rng.bit_generator.state == stream  # the config-seeded stream is never drawn
        first_rows.append([(float(r), bool(f)) for r, f in zip(batch["rotation"], batch["flipped"])])
    assert first_rows[0] != first_rows[1]  # fresh per round: the k-th row's draw is no longer a function of the seed


def test_augmentation_seeds_are_what_the_noise_source_draws_two_53_bit_words_a_row():
    seeds = augmentation_seeds(InsecureSeededNoise(3), 5)
    again = augmentation_seeds(InsecureSeededNoise(3), 5)
    assert seeds == again and len(set(seeds)) == 5
    assert all(0 <= word < 2**53 for seed in seeds for word in seed)
    assert augmentation_seeds(SecureNoise(), 5) != augmentation_seeds(SecureNoise(), 5)
