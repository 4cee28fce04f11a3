"""The basis service, both ends, on the models (Flower-free glue over
:mod:`fedpose.federation.basis_transport`): V from public data at the global weights.

Coordinator: every R rounds, G = per-sample gradients (m × p, unclipped) of the current global
model on m public samples, V = its top-k right singular directions, shipped in full (fp32 / fp16 /
bf16) or as a compact recipe. Site: decode; a recipe is rebuilt by recomputing G on the site's own
copy of the public set at the same global weights (the weights' digest is checked), then cached
on disk (a new ClientApp process per message).

V depends only on public data and the public global weights, so using it is post-processing: it
costs no privacy budget (DESIGN.md, PDP-SGD / FP-DP).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from fedpose.federation import basis_transport as bt

PUBLIC_IDS_SEED = 0


def _public_dataset(public_dir: str | Path, input_size: tuple[int, int]) -> Any:
    from fedpose.data.dataset import PoseDataset, load_records

    records, root = load_records(public_dir)
    return PoseDataset(records, root, input_size=tuple(input_size), train=False)


def trainable_digest(model: Any) -> str:
    """The version id of the global weights a basis belongs to (trainable parameters only)."""
    return bt.weights_digest({k: p.detach().cpu().numpy() for k, p in model.trainable_parameters().items()})


def compute_basis(model: Any, public_dir: str | Path, k: int, m: int, version: int, transport: str, dtype: str) -> bt.BasisMessage:
    """Coordinator: the basis message for ``version`` at the model's (global) weights."""
    public = _public_dataset(public_dir, model.input_size)
    model.train_mode()
    ids = bt.choose_public_ids(len(public), min(m, len(public)), PUBLIC_IDS_SEED, version)
    _, message = bt.build_basis_message(
        bt.public_gradient_fn(model, public), ids, k, version, trainable_digest(model),
        transport=transport, dtype=dtype, public_set=Path(public_dir).name,  # type: ignore[arg-type]
    )
    return message


def receive_basis(
    arrays: dict[str, np.ndarray], config: dict[str, Any], model: Any, public_dir: str | Path | None, cache_dir: str | Path,
    check: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """Site: V from the coordinator's message (rebuilt from the local public copy if compact),
    passed through ``check`` (which raises on a V the site refuses) and only then cached."""
    model.train_mode()
    gradients = bt.public_gradient_fn(model, _public_dataset(public_dir, model.input_size)) if public_dir is not None else None
    digest = trainable_digest(model)
    basis = bt.receive_basis(arrays, config, digest, gradients, Path(public_dir).name if public_dir is not None else None)
    if check is not None:
        basis = check(basis)
    version = bt.message_version(config)
    assert version is not None
    bt.BasisCache(cache_dir).store(version, np.asarray(basis, dtype=np.float32), digest)
    return np.asarray(basis, dtype=np.float32)
