"""The basis service, both ends (Flower-free): V from public data at the global weights.

Coordinator: every R rounds, G = per-sample gradients (m × p, unclipped) of the current global
model on m public samples, V = top-k eigenvectors of GᵀG via the m×m Gram matrix
(:mod:`fedpose.federation.basis_transport`), shipped either in full (fp32/fp16/bf16) or as a
compact recipe. Site: decode; a recipe is rebuilt by recomputing G on the site's own copy of the
public set at the same global weights (the weights' digest is checked), then cached on disk.

V depends only on public data and the public global weights, so using it is post-processing: it
costs no privacy budget (DESIGN.md, PDP-SGD / FP-DP).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedpose.federation import basis_transport as bt


def public_ids(public_size: int, m: int, version: int) -> list[int]:
    """Which public samples a basis version uses (deterministic per version, sorted)."""
    rng = np.random.default_rng(int(version))
    return sorted(int(i) for i in rng.choice(public_size, size=min(m, public_size), replace=False))


def _public_dataset(public_dir: str | Path, input_size: tuple[int, int]) -> Any:
    from fedpose.data.dataset import PoseDataset, load_records

    records, root = load_records(public_dir)
    return PoseDataset(records, root, input_size=tuple(input_size), train=False)


def public_gradients(model: Any, public_dir: str | Path, ids: list[int]) -> Any:
    """G (len(ids) × p), rows in ``ids`` order, at the model's current weights."""
    import torch

    from fedpose.privacy.per_sample import frozen_features, gradient_matrix

    dataset = _public_dataset(public_dir, model.input_size)
    if ids and max(ids) >= len(dataset):
        raise bt.BasisTransportError(f"public set {public_dir} has {len(dataset)} samples; the basis needs id {max(ids)}")
    batch = torch.utils.data.default_collate([dataset[i] for i in ids])
    model.train_mode()
    features = frozen_features(model, batch["image"])
    return gradient_matrix(model, features, batch["joints"], batch["weight"])


def trainable_digest(model: Any) -> str:
    return bt.weights_digest({k: p.detach().cpu().numpy() for k, p in model.trainable_parameters().items()})


def compute_basis(model: Any, public_dir: str | Path, k: int, m: int, version: int, transport: str, dtype: str) -> bt.BasisMessage:
    """Coordinator: the basis message for ``version`` at the model's (global) weights."""
    dataset_size = len(_public_dataset(public_dir, model.input_size))
    ids = public_ids(dataset_size, m, version)
    gradients = public_gradients(model, public_dir, ids)
    digest = trainable_digest(model)
    basis, recipe = bt.make_recipe(gradients, k, ids, version, digest, public_set=Path(public_dir).name)
    if transport == "compact":
        return recipe.encode()
    return bt.encode_full(basis, version, digest, dtype=dtype)  # type: ignore[arg-type]


def receive_basis(
    arrays: dict[str, np.ndarray], config: dict[str, Any], model: Any, public_dir: str | Path | None, cache_dir: str | Path
) -> np.ndarray:
    """Site: decode (rebuild a recipe from the local public copy at ``model``'s weights), cache, return V."""
    decoded = bt.decode(arrays, config)
    if isinstance(decoded, bt.BasisRecipe):
        if public_dir is None:
            raise bt.BasisTransportError("compact basis transport needs the site's public_data (its copy of S_pub)")
        gradients = public_gradients(model, public_dir, list(decoded.public_ids))
        basis = decoded.rebuild(gradients, trainable_digest(model), public_set=Path(public_dir).name)
    else:
        basis = decoded
    bt.BasisCache(cache_dir).store(decoded.version if isinstance(decoded, bt.BasisRecipe) else int(config["basis.version"]),
                                   np.asarray(basis, dtype=np.float32), str(config.get("basis.weights", "")))
    return np.asarray(basis, dtype=np.float32)
