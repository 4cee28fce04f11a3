"""Adversarial: under grey copies, a public view's noise-free gradient shows nothing of a private image.

With only grey copies training (``model.scenario`` grey_*), a DP step fills a sampled unit's rows
from its grey records only (``trainable_records``): whether a record is grey is read from its
*private* image. FDP and MaskDP also release a gradient without noise, on the public view of their
own public sample, and treat as neighbours two records with the same public view. The attacker (a
coordinator, which chooses the scenario and the weights) holds two such neighbours that differ in
the grey flag: a grey image and the same with a faint colour cast under ψ's quantisation (FDP), or
a grey image whose head is grey or magenta (MaskDP, the head masked). Were the public sample to take
the flags, the grey neighbour would fill a public row and the other a padding row, and the noise-free
public gradient — which the coordinator can scale at will through the weights — would tell them
apart. It must be the same in both worlds, row for row.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from fedpose.config import ModelConfig, PrivacyConfig
from fedpose.data.dataset import normalize
from fedpose.model import build_model
from fedpose.model.grey_copies import grey_flags, records_with_gradient
from fedpose.privacy.engine import PUBLIC_SAMPLE_KEY, build_engine
from fedpose.privacy.per_sample import flatten
from fedpose.privacy.public_views import downsample_quantize, mask_view

SIZE = (64, 64)
RECORDS = 8
HEAD = (19.2, 6.4, 38.4, 22.4)  # x0, y0, x1, y1 of record 0's (only) head box, in crop pixels
VIEW_FACTOR, VIEW_BITS = 8, 3  # ψ: 8×8 block means on 8 levels a channel (privacy.public_view's default kind)
MASK = {"region": "head", "margin": 0.1, "fill": "zero"}  # black keeps a grey image's masked view grey (the mean pixel is not grey)


def grey_neighbours(mechanism: str) -> tuple[np.ndarray, np.ndarray]:
    """Record 0 in each world: a grey image, and its neighbour under the mechanism's relation (the
    same public view) that is not grey."""
    rng = np.random.default_rng(0)
    if mechanism == "fdp":
        grey = np.full((*SIZE, 3), 112, np.uint8)
        cast = grey.copy()
        cast[..., 0], cast[..., 2] = 116, 108  # one quantisation bin: ψ cannot see it
        return grey, cast
    grey = np.repeat(rng.integers(0, 256, (*SIZE, 1), dtype=np.uint8), 3, axis=2)
    magenta_head = grey.copy()
    x0, y0, x1, y1 = HEAD
    magenta_head[int(y0) + 1:int(y1), int(x0) + 1:int(x1)] = (255, 0, 255)  # inside the head box only
    return grey, magenta_head


class World(torch.utils.data.Dataset):
    """Eight records with the keys the engine reads: record 0 is ``first``, the others colour noise
    (the same in both worlds); ``public_image`` is the dataset's ψ(x) (FDP's public view)."""

    def __init__(self, first: np.ndarray) -> None:
        rng = np.random.default_rng(1)
        self.pixels = [first] + [rng.integers(0, 256, (*SIZE, 3), dtype=np.uint8) for _ in range(RECORDS - 1)]

    def __len__(self) -> int:
        return RECORDS

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        head = torch.tensor([HEAD])
        view = downsample_quantize(self.pixels[i], VIEW_FACTOR, VIEW_BITS)
        return {"image": normalize(self.pixels[i]), "public_image": normalize(view),
                "joints": torch.rand(16, 2, generator=g) * SIZE[0], "weight": torch.ones(16), "index": i,
                "face_box": head[0], "head_boxes": head, "head_count": torch.tensor(1), "face_boxes": head,
                "face_count": torch.tensor(1), "private_reach": torch.tensor([1.5, 1.5])}

    def load(self, i: int, plain: bool = False) -> dict:
        return self[i]  # no augmentation here: the plain crop is the crop


def public_releases(mechanism: str, first: np.ndarray, steps: int = 2) -> list[tuple[list[int], list[bool], torch.Tensor]]:
    """Each step's public sample (records, real rows) and the released gradient, with the private part
    clipped to ~0 and no noise: what is left is the noise-free public gradient."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a partial scenario without init_checkpoint
        model = build_model(ModelConfig(backbone="tiny_vit_test", scenario="grey_biases_norms"), SIZE)
    dataset = World(first)
    privacy = PrivacyConfig(mechanism=mechanism, noise_multiplier=0.0, max_grad_norm=1e-9, delta=1e-5,
                            insecure_seeded_noise=True,  # the same coins in both worlds
                            mask=MASK)
    engine = build_engine(privacy, model, RECORDS, 6, steps, seed=5,
                          trainable_records=records_with_gradient(model.trainable_parameters(), dataset))
    out = []
    for _, batch in zip(range(steps), engine.batches(dataset)):
        sample = batch[PUBLIC_SAMPLE_KEY]
        engine.step(model, batch)
        out.append((sample["index"].tolist(), sample["row_mask"].tolist(),
                    flatten([p.grad for p in model.trainable_parameters().values()]).clone()))
    return out


@pytest.mark.parametrize("mechanism", ["fdp", "maskdp"])
def test_a_records_grey_flag_never_reaches_the_noise_free_public_gradient(mechanism: str) -> None:
    grey, neighbour = grey_neighbours(mechanism)
    # the premise: the two are neighbours (the same public view) and only one of them is grey
    flags = grey_flags(torch.stack([normalize(grey), normalize(neighbour)])).tolist()
    assert flags == [1.0, 0.0]
    a, b = World(grey)[0], World(neighbour)[0]
    if mechanism == "fdp":
        assert torch.equal(a["public_image"], b["public_image"])
    else:
        batches = [{k: v[None] for k, v in x.items() if torch.is_tensor(v)} for x in (a, b)]
        privacy = PrivacyConfig(mechanism="maskdp", noise_multiplier=1.0, mask=MASK)
        assert torch.equal(mask_view(batches[0], privacy), mask_view(batches[1], privacy))

    in_grey, in_neighbour = public_releases(mechanism, grey), public_releases(mechanism, neighbour)
    # the grey record fills a real public row in some step, and its public gradient is far from zero there
    # (the private part, clipped to 1e-9, is not): the comparison below is not of zeros
    scale = max(gradient.norm() for records, real, gradient in in_grey if 0 in records and real[records.index(0)])
    assert scale > 1e-4
    for (records_a, real_a, gradient_a), (records_b, real_b, gradient_b) in zip(in_grey, in_neighbour):
        assert (records_a, real_a) == (records_b, real_b)
        assert (gradient_a - gradient_b).norm() <= 1e-6 * scale
