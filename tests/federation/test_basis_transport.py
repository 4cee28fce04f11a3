"""Basis transport: full-mode dtypes, compact recipe rebuilt exactly at a site, version bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
from numerics import sum_tolerance
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fedpose.federation.basis_transport import (
    BasisCache,
    BasisRecipe,
    BasisTransportError,
    basis_from_gradients,
    build_basis_message,
    choose_public_ids,
    decode,
    encode_full,
    make_recipe,
    public_gradient_fn,
    receive_basis,
    weights_digest,
)

K, M = 8, 16


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 16 * 16, 16), nn.Tanh(), nn.Linear(16, 2))


def _public_set() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return torch.randn(40, 3, 16, 16, generator=g), torch.randn(40, 2, generator=g)


def _public_gradients(model: nn.Module, ids: list[int], chunk: int) -> np.ndarray:
    """m×p per-sample gradients of the loss at the model's weights, rows in ``ids`` order."""
    images, targets = _public_set()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x, y):
        out = functional_call(model, p, (x.unsqueeze(0),))
        return ((out - y.unsqueeze(0)) ** 2).mean()

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))
    rows = []
    for start in range(0, len(ids), chunk):
        idx = torch.tensor(ids[start : start + chunk])
        grads = per_sample(params, images[idx], targets[idx])
        rows.append(torch.cat([grads[k].reshape(len(idx), -1) for k in params], dim=1))
    return torch.cat(rows).numpy()


def _weights(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def test_compact_recipe_rebuilds_the_shipped_basis():
    coordinator_model = _model(seed=0)
    global_weights = _weights(coordinator_model)
    version = weights_digest(global_weights)
    ids = [int(i) for i in np.random.default_rng(0).choice(40, M, replace=False)]
    g = _public_gradients(coordinator_model, ids, chunk=M)
    basis, recipe = make_recipe(g, K, ids, version=1, weights_version=version, public_set="synthetic-40")

    # Orthonormal, and spans the top-k right singular vectors of G (the top eigenvectors of M).
    np.testing.assert_allclose(basis.T @ basis, np.eye(K), atol=sum_tolerance(g.shape[1]))
    _, _, vt = np.linalg.svd(g.astype(np.float64), full_matrices=False)
    x = np.random.default_rng(1).standard_normal(g.shape[1])
    np.testing.assert_allclose(basis @ (basis.T @ x), vt[:K].T @ (vt[:K] @ x), rtol=1e-3, atol=1e-4 * np.linalg.norm(x))

    # Over the wire ...
    message = recipe.encode()
    full = encode_full(basis, 1, version, "float32")
    assert message.nbytes < 0.01 * full.nbytes, (message.nbytes, full.nbytes)
    received = decode(message.arrays, message.config)
    assert isinstance(received, BasisRecipe) and received.public_ids == tuple(ids)

    # ... a site with its own model object, loaded from the global weights, rebuilds V.
    site_model = _model(seed=99)
    site_model.load_state_dict({k: torch.from_numpy(v) for k, v in global_weights.items()})
    site_weights_version = weights_digest(_weights(site_model))
    site_g = _public_gradients(site_model, list(received.public_ids), chunk=5)  # different chunking
    rebuilt = received.rebuild(site_g, site_weights_version, public_set="synthetic-40")
    np.testing.assert_allclose(rebuilt, basis, rtol=0, atol=1e-5 * np.abs(basis).max())


def test_recipe_refuses_other_weights_or_public_set():
    model = _model(seed=0)
    ids = list(range(M))
    g = _public_gradients(model, ids, chunk=M)
    _, recipe = make_recipe(g, K, ids, version=3, weights_version=weights_digest(_weights(model)), public_set="pub-A")
    moved = _model(seed=1)
    with pytest.raises(BasisTransportError, match="global weights"):
        recipe.rebuild(g, weights_digest(_weights(moved)))
    with pytest.raises(BasisTransportError, match="public set"):
        recipe.rebuild(g, recipe.weights_version, public_set="pub-B")
    with pytest.raises(BasisTransportError, match="public samples"):
        recipe.rebuild(g[:-1], recipe.weights_version)


@pytest.mark.parametrize("dtype, rtol", [("float32", 0.0), ("float16", 1e-3), ("bfloat16", 8e-3)])
def test_full_transport_round_trips_in_each_dtype(dtype, rtol):
    rng = np.random.default_rng(2)
    basis, _ = basis_from_gradients(rng.standard_normal((M, 3000)).astype(np.float32), K)
    message = encode_full(basis, 5, "w", dtype)
    assert message.nbytes >= basis.size * (4 if dtype == "float32" else 2)
    assert message.nbytes < basis.size * (4 if dtype == "float32" else 2) + 512
    decoded = decode(message.arrays, message.config)
    assert decoded.dtype == np.float32 and decoded.shape == basis.shape
    np.testing.assert_allclose(decoded, basis, rtol=rtol, atol=rtol * 1e-3)
    if dtype == "bfloat16":  # bit-exact round-to-nearest-even (independent numpy reference)
        bits = basis.view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        np.testing.assert_array_equal(decoded, (rounded << np.uint32(16)).view(np.float32))


def test_malformed_messages_are_clear_errors():
    message = encode_full(np.eye(4, 2, dtype=np.float32), 1, "w", "float16")
    with pytest.raises(BasisTransportError, match="does not match"):
        decode({"basis.v": message.arrays["basis.v"].astype(np.float32)}, message.config)
    with pytest.raises(BasisTransportError, match="lacks"):
        decode({}, message.config)
    with pytest.raises(BasisTransportError, match="unknown basis transport"):
        decode({}, dict(message.config, **{"basis.transport": "carrier-pigeon"}))


def test_site_cache_round_trips(tmp_path):
    cache = BasisCache(tmp_path)
    assert cache.version() is None and cache.load() is None
    basis = np.random.default_rng(3).standard_normal((100, 4)).astype(np.float32)
    cache.store(7, basis, "w7")
    version, loaded = BasisCache(tmp_path).load()
    assert version == 7
    np.testing.assert_array_equal(loaded, basis)


@pytest.mark.parametrize("transport", ["full", "compact"])
def test_coordinator_to_site_round_trip(transport):
    coordinator_model = _model(seed=0)
    version = weights_digest(_weights(coordinator_model))
    ids = choose_public_ids(40, M, seed=7, version=2)
    assert ids == choose_public_ids(40, M, seed=7, version=2) != choose_public_ids(40, M, seed=7, version=3)
    basis, message = build_basis_message(
        lambda rows: _public_gradients(coordinator_model, list(rows), chunk=M), ids, K, 2, version, transport, "float32", "pub"
    )
    site_model = _model(seed=5)
    site_model.load_state_dict(coordinator_model.state_dict())
    rebuilt = receive_basis(message.arrays, message.config, weights_digest(_weights(site_model)),
                            lambda rows: _public_gradients(site_model, list(rows), chunk=4), public_set="pub")
    np.testing.assert_allclose(rebuilt, basis, rtol=0, atol=1e-5 * np.abs(basis).max())
    with pytest.raises(BasisTransportError, match="weights"):
        receive_basis(message.arrays, message.config, "another-version", lambda rows: None)


def test_matches_the_privacy_engines_basis():
    """A shipped/rebuilt V equals fedpose.privacy.projection's own basis (sites may mix both)."""
    from fedpose.privacy.projection import basis_from_gradients as engine_basis

    g = np.random.default_rng(8).standard_normal((M, 5000)).astype(np.float32)
    ours, _ = basis_from_gradients(g, K)
    theirs, _ = engine_basis(torch.from_numpy(g), K)
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=0, atol=1e-5)


@pytest.mark.slow  # ~10 s of CPU (real model per-sample gradients); longer on a loaded machine
def test_compact_recipe_on_the_pose_model_and_real_public_images():
    """End to end on the real PoseModel (tiny_vit_test) and real MPII crops as the public set."""
    from pathlib import Path

    from fedpose.config import ModelConfig
    from fedpose.data.dataset import PoseDataset, load_records
    from fedpose.model import build_model

    records, root = load_records(Path(__file__).resolve().parents[3] / "shared" / "data" / "mpii-real")
    public = PoseDataset(records, root, input_size=(64, 64), train=False)
    torch.manual_seed(0)
    coordinator_model = build_model(ModelConfig(backbone="tiny_vit_test", scenario="full"), (64, 64))
    coordinator_model.train_mode()
    state = {k: v.detach().numpy().copy() for k, v in coordinator_model.state_dict().items()}
    ids = choose_public_ids(len(public), 4, seed=0, version=1)
    basis, message = build_basis_message(
        public_gradient_fn(coordinator_model, public, chunk_size=4), ids, 3, 1, weights_digest(state), "compact", public_set="mpii-real"
    )
    assert basis.shape[1] == 3 and message.nbytes < 1024

    torch.manual_seed(1)  # the site builds its own model object and loads the global weights
    site_model = build_model(ModelConfig(backbone="tiny_vit_test", scenario="full"), (64, 64))
    site_model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    site_model.train_mode()
    rebuilt = receive_basis(message.arrays, message.config, weights_digest(state),
                            public_gradient_fn(site_model, public, chunk_size=2), public_set="mpii-real")
    np.testing.assert_allclose(rebuilt, basis, rtol=0, atol=1e-4 * np.abs(basis).max())
    rebuilt64 = rebuilt.astype(np.float64)  # V was orthonormalized from float32 sums over p entries
    np.testing.assert_allclose(rebuilt64.T @ rebuilt64, np.eye(3), atol=sum_tolerance(rebuilt.shape[0]))
