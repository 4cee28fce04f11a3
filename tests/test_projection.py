"""Public-subspace projection: V orthonormal, projection idempotent, top-k subspace of the public
gradients, and the basis never sees a private sample."""

from __future__ import annotations

import numpy as np
import pytest
from numerics import sum_tolerance
import torch

from fedpose.config import PrivacyConfig
from fedpose.privacy import engine as engine_module
from fedpose.privacy import projection
from fedpose.privacy.engine import build_engine
from fedpose.privacy.per_sample import flatten
from fedpose.privacy.projection import Basis, ProvenanceError, basis_from_gradients, compute_basis

from test_dp_engine import TensorPoseSet, make_model


def projector(v: torch.Tensor) -> torch.Tensor:
    return v.double() @ v.double().T


def test_basis_is_orthonormal_and_spans_the_top_eigenvectors() -> None:
    torch.manual_seed(0)
    # public gradients with a clear 6-dimensional signal plus small isotropic noise
    signal = torch.randn(6, 400) * torch.tensor([10.0, 8, 6, 5, 4, 3]).unsqueeze(1)
    gradients = torch.randn(30, 6) @ signal + 0.01 * torch.randn(30, 400)
    v, eigenvalues = basis_from_gradients(gradients, k=6)
    assert v.shape == (400, 6)
    assert torch.allclose(v.T @ v, torch.eye(6), atol=sum_tolerance(400))  # unit columns: entries ~ 1/√p, products sum p terms
    assert torch.all(eigenvalues[:-1] >= eigenvalues[1:])
    # same subspace as the top-6 right singular vectors of G (= eigenvectors of GᵀG, never formed here)
    _, _, vh = torch.linalg.svd(gradients.double(), full_matrices=False)
    assert torch.allclose(projector(v), projector(vh[:6].T), atol=1e-4)
    # eigenvalues of G Gᵀ are the squared singular values
    singular = torch.linalg.svdvals(gradients.double())[:6]
    assert torch.allclose(eigenvalues.double(), singular**2, rtol=1e-4)


def test_projection_is_idempotent_and_stays_in_the_span() -> None:
    torch.manual_seed(1)
    v, _ = basis_from_gradients(torch.randn(12, 300), k=5)
    basis = Basis(v)
    g = torch.randn(300)
    once = basis.project(g)
    rounding = sum_tolerance(300, scale=float(g.abs().max()))
    assert torch.allclose(basis.project(once), once, atol=rounding)
    assert torch.allclose(v @ (v.T @ once), once, atol=rounding)
    assert once.norm() <= g.norm()  # orthogonal projection never lengthens
    residual = g - once
    assert torch.allclose(v.T @ residual, torch.zeros(5), atol=rounding)


def test_rank_deficient_gradients_give_a_smaller_basis() -> None:
    torch.manual_seed(2)
    gradients = torch.randn(10, 3) @ torch.randn(3, 200)  # rank 3
    v, eigenvalues = basis_from_gradients(gradients, k=8)
    assert v.shape == (200, 3) and eigenvalues.numel() == 3
    with pytest.raises(ValueError, match="all zero"):
        basis_from_gradients(torch.zeros(4, 50), k=2)


def test_low_precision_basis_projects_close_to_float32() -> None:
    torch.manual_seed(3)
    v, _ = basis_from_gradients(torch.randn(10, 500), k=6)
    g = torch.randn(500)
    exact = Basis(v).project(g)
    approx = Basis(v.to(torch.bfloat16)).project(g)
    assert approx.dtype == torch.float32
    assert (approx - exact).norm() <= 0.02 * exact.norm()


def test_compute_basis_refuses_batches_not_tagged_public() -> None:
    model = make_model()
    batch = engine_module.collate([TensorPoseSet(3)[i] for i in range(3)])
    with pytest.raises(ProvenanceError):
        compute_basis(model, batch, k=2)
    batch["provenance"] = "private"
    with pytest.raises(ProvenanceError):
        compute_basis(model, batch, k=2)


def test_engine_basis_sees_only_public_samples_and_refreshes_on_schedule(monkeypatch) -> None:
    model = make_model()
    private = TensorPoseSet(20, offset=0)
    public = TensorPoseSet(15, offset=10_000)  # different images
    seen: list[dict] = []
    real_compute_basis = projection.compute_basis

    def recording_compute_basis(model_, public_batch, *args, **kwargs):
        seen.append({key: value for key, value in public_batch.items()})
        return real_compute_basis(model_, public_batch, *args, **kwargs)

    monkeypatch.setattr(projection, "compute_basis", recording_compute_basis)
    cfg = PrivacyConfig(mechanism="pdp", noise_multiplier=1.0, max_grad_norm=0.5,
                        basis={"k": 4, "public_samples": 6, "refresh_every": 2})
    engine = build_engine(cfg, model, len(private), 4, 10, public_dataset=public, seed=0)
    private_images = torch.stack([private[i]["image"] for i in range(len(private))])
    for _, batch in zip(range(3), engine.batches(private)):
        engine.step(model, batch)
        gradient = flatten([p.grad for p in model.trainable_parameters().values()])
        # the update lies in the public subspace (checked in float64: float32 sums over p ≈ 10⁶
        # entries carry ~1e-4 relative round-off of their own)
        v, g = engine.basis.vectors.double(), gradient.double()
        assert (v @ (v.T @ g) - g).norm() <= 1e-4 * g.norm()
    assert len(seen) == 2  # steps 0 and 2
    for public_batch in seen:
        assert public_batch["provenance"] == "public"
        ids = public_batch["index"].tolist()
        assert len(ids) == 6 and set(ids) <= set(range(len(public)))
        expected = torch.stack([public[i]["image"] for i in ids])
        assert torch.equal(public_batch["image"], expected)
        # no private image is among them
        distances = torch.cdist(public_batch["image"].flatten(1), private_images.flatten(1))
        assert distances.min() > 1.0
    report = engine.privacy_report()
    assert report["guarantee"] == "DP" and report["basis"]["refreshes"] == 2 and report["basis"]["k"] == 4


def test_coordinator_basis_is_used_as_given() -> None:
    model = make_model()
    private = TensorPoseSet(10)
    cfg = PrivacyConfig(mechanism="fpdp", noise_multiplier=1.0)
    engine = build_engine(cfg, model, len(private), 2, 10)
    p = model.num_trainable()
    v, _ = basis_from_gradients(torch.randn(8, p), k=8)
    engine.set_basis({"basis.v": v.numpy().astype(np.float32)}, version=7)
    batch = engine_module.collate([private[i] for i in range(2)])
    batch["public_sample"] = engine_module.collate([private[i] for i in range(2, 4)])
    engine.step(model, batch)
    assert engine.basis.version == 7 and engine.privacy_report()["basis"]["source"] == "coordinator"
    with pytest.raises(ValueError, match="does not project"):
        build_engine(PrivacyConfig(mechanism="dpsgd", noise_multiplier=1.0), model, 10, 2, 10).set_basis(v)


@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_blocked_threaded_projection_matches_the_exact_projector(layout: str) -> None:
    """p spans several 2^18-column blocks shared among threads; any input layout gives V V^T g."""
    torch.manual_seed(5)
    p, k = 700_001, 7
    v = torch.linalg.qr(torch.randn(p, k, dtype=torch.float64))[0]
    stored = v.float() if layout == "row-major" else v.float().T.contiguous().T
    basis = Basis(stored)
    assert basis.vectors.T.is_contiguous() and basis.k == k
    g = torch.randn(p)
    exact = v @ (v.T @ g.double())
    for threads in (1, 2):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            projected = basis.project(g)
        finally:
            torch.set_num_threads(previous)
        assert projected.dtype == torch.float32
        assert (projected.double() - exact).norm() <= 1e-5 * exact.norm()
    with pytest.raises(ValueError, match="basis is for p"):
        basis.project(torch.randn(p - 1))


def test_refreshes_reuse_one_workspace_for_gradients_and_basis() -> None:
    model = make_model()
    private, public = TensorPoseSet(10), TensorPoseSet(12, offset=10_000)
    cfg = PrivacyConfig(mechanism="pdp", noise_multiplier=1.0, basis={"k": 3, "public_samples": 5, "refresh_every": 1})
    engine = build_engine(cfg, model, len(private), 2, 10, public_dataset=public, seed=0)
    p = model.num_trainable()
    engine.refresh_basis(model)
    workspace = engine._basis_workspace
    assert workspace is not None and workspace.numel() == (5 + 3) * p
    first = engine.basis.vectors.clone()
    engine.refresh_basis(model)
    assert engine._basis_workspace is workspace  # nothing new allocated
    # V lives in the workspace's tail, after the 5 × p gradient matrix
    start = workspace.data_ptr() + 5 * p * workspace.element_size()
    assert engine.basis.vectors.data_ptr() == start
    v = engine.basis.vectors.double()
    assert torch.allclose(v.T @ v, torch.eye(v.shape[1], dtype=torch.float64), atol=sum_tolerance(p))
    assert not torch.equal(first, engine.basis.vectors)  # another public sample, another basis
    with pytest.raises(ValueError, match="workspace must be float32"):
        compute_basis(model, engine.public_batch(), k=3, workspace=torch.empty(10))


@pytest.mark.parametrize("where", ["site", "coordinator"])
def test_a_basis_rank_no_public_sample_count_can_reach_is_refused_when_configured(where: str) -> None:
    # m public gradients span at most m directions: a k above m would silently project onto fewer
    from pydantic import ValidationError

    from fedpose.federation.config import BasisTransportConfig

    def build(k: int, m: int):
        if where == "site":
            return PrivacyConfig(mechanism="pdp", noise_multiplier=1.0, basis={"k": k, "public_samples": m}).basis
        return BasisTransportConfig(k=k, public_samples=m)

    with pytest.raises(ValidationError, match=r"basis k = 128 exceeds public_samples = 64: m public gradients span at most m"):
        build(128, 64)
    assert build(64, 64).k == 64


def test_a_public_set_smaller_than_public_samples_is_named_in_the_log_with_the_rank_it_caps(caplog) -> None:
    model = make_model()
    private = TensorPoseSet(20, offset=0)
    cfg = PrivacyConfig(mechanism="pdp", noise_multiplier=1.0, basis={"k": 8, "public_samples": 12, "refresh_every": 100})
    with caplog.at_level("WARNING", logger="fedpose.privacy.engine"):
        engine = build_engine(cfg, model, len(private), 4, 10, public_dataset=TensorPoseSet(6, offset=10_000), seed=0)
    warned = [r.getMessage() for r in caplog.records if "public set" in r.getMessage()]
    assert warned == ["the public set holds 6 images, fewer than basis.public_samples = 12: every basis is computed from "
                      "those 6, so at most 6 of its k = 8 directions; add public images or lower public_samples"]
    engine.step(model, next(iter(engine.batches(private))))
    assert engine.basis.k <= 6  # what the warning said
    caplog.clear()
    with caplog.at_level("WARNING", logger="fedpose.privacy.engine"):
        build_engine(cfg, model, len(private), 4, 10, public_dataset=TensorPoseSet(12, offset=10_000), seed=0)
    assert not [r for r in caplog.records if "public set" in r.getMessage()]
