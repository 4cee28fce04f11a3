"""A tiny site for tests that call the real site-round code (no Flower): 64×64 synthetic data,
the small TinyViT, DP-SGD with a declared sampling rate."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from fedpose.config import ModelSpec

PER_SITE = 16
BATCH_SIZE = 4
INPUT_SIZE = (64, 64)
#: a well-formed model spec for messages whose model is never built (protocol tests)
PLACEHOLDER_SPEC = ModelSpec(backbone="x", scenario="scratch", input_size=INPUT_SIZE, split_factor=2, label_sigma=6.0, head_hidden=0)
#: a real, small model for messages the egress guard checks (it lists what the model trains: here the
#: grey copies of the early biases and norms, 1 296 values; frozen weights and BatchNorm statistics too)
SMALL_SPEC = PLACEHOLDER_SPEC.model_copy(update={"backbone": "tiny_vit_test", "scenario": "grey_early_biases_norms"})


@functools.cache
def small_model_arrays() -> tuple[dict[str, np.ndarray], list[str]]:
    """(SMALL_SPEC's global arrays — parameters and buffers —, the names of the parameters it trains)."""
    from fedpose.model import build_model_from_spec

    model = build_model_from_spec(SMALL_SPEC)
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}, list(model.trainable_parameters())


def make_site_data(root: Path) -> Path:
    """Generate (once per directory) one site's synthetic training split; return the dataset root."""
    from fedpose.data.synthetic import ensure_dataset

    ensure_dataset(root, sites=1, per_site=PER_SITE, public=8, test=4, size=INPUT_SIZE, seed=0, progress=False)
    return root


def site_config(data_root: Path, state_dir: Path, **privacy: Any) -> Any:
    """A SiteConfig for ``data_root``'s site-1; ``privacy`` overrides the DP-SGD defaults."""
    from fedpose.federation.config import SiteConfig

    return SiteConfig.model_validate({
        "site_id": "site-1", "data": {"train": str(data_root / "site-1")},
        "state_dir": str(state_dir), "eps_max": privacy.pop("eps_max", 50.0), "local_steps": privacy.pop("local_steps", 2),
        "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.0, "weight_decay": 0.0},
        "train": {"batch_size": BATCH_SIZE, "threads": 1, "seed": 1},
        # 4 unit slots: the site has 4 patients (N_max at q = 1/4 is 4), and the default slot count
        # for B = 4 (28, made for sites of ~16 units) would make every step 7× the work
        "privacy": {"mechanism": "dpsgd", "noise_multiplier": 1.0, "sample_rate": BATCH_SIZE / PER_SITE,
                    "max_grad_norm": 1.0, "delta": 1e-5, "max_batch_units": 4, **privacy},
    })


def coordinator_config() -> Any:
    """The coordinator :func:`site_config`'s site belongs to: it decides the model (small TinyViT at 64×64)."""
    from fedpose.federation.config import CoordinatorConfig

    return CoordinatorConfig.model_validate({"data": {"input_size": list(INPUT_SIZE)},
                                             "model": {"backbone": "tiny_vit_test", "scenario": "scratch"}})


def global_model(seed: int = 0, scenario: str = "scratch") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(state dict as arrays, model spec) of a fresh global model, as the coordinator sends them."""
    import torch

    from fedpose.config import ModelConfig
    from fedpose.model import build_model
    from fedpose.model.checkpoint import model_spec

    torch.manual_seed(seed)
    model = build_model(ModelConfig(backbone="tiny_vit_test", scenario=scenario), INPUT_SIZE)
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}, model_spec(model)


def flat(update: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([update[k].ravel() for k in sorted(update)]).astype(np.float64)
