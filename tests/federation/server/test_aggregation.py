"""Streaming FedAvg, server optimizers vs hand computations, state round-trips, update validation."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from numerics import eps, sum_tolerance

from fedpose.federation.aggregation import (
    FedAdam,
    FedAvgM,
    FedAvgServer,
    StreamingMean,
    aggregate_round,
    build_server_optimizer,
    load_server_optimizer,
    save_server_optimizer,
)
from fedpose.federation.config import AggregationConfig
from fedpose.federation.validation import spec_of, update_norm, validate_update


def _arrays(rng: np.random.Generator, scale: float = 1.0) -> dict[str, np.ndarray]:
    return {
        "backbone.weight": (scale * rng.standard_normal((4, 3))).astype(np.float32),
        "head.bias": (scale * rng.standard_normal(5)).astype(np.float32),
    }


def test_streaming_fedavg_equals_the_weighted_mean():
    rng = np.random.default_rng(0)
    updates = [_arrays(rng) for _ in range(7)]
    weights = [3.0, 1.0, 10.0, 2.5, 7.0, 1.0, 4.0]
    mean = StreamingMean(spec_of(updates[0]))
    for u, w in zip(updates, weights):
        mean.add(u, w)
    got = mean.mean()
    for name in updates[0]:
        expected = np.average(np.stack([u[name] for u in updates]), axis=0, weights=weights)
        # float64 running sum, one float32 rounding of the mean
        np.testing.assert_allclose(got[name], expected, rtol=eps(np.float32), atol=sum_tolerance(1, float(np.abs(expected).max())))
        assert got[name].dtype == np.float32
    assert mean.count == 7 and mean.total_weight == pytest.approx(sum(weights))


def test_streaming_memory_does_not_grow_with_sites():
    spec = spec_of({"w": np.zeros(200_000, np.float32)})
    rng = np.random.default_rng(1)
    update = {"w": rng.standard_normal(200_000).astype(np.float32)}

    def peak(n_sites: int) -> int:
        tracemalloc.start()
        mean = StreamingMean(spec)
        for _ in range(n_sites):
            mean.add(update, 2.0)
        mean.mean()
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    assert peak(40) <= peak(2) * 1.05


def test_fedavg_server_step():
    rng = np.random.default_rng(2)
    w, d = _arrays(rng), _arrays(rng)
    new = FedAvgServer(server_lr=0.5).step(w, d)
    for k in w:
        np.testing.assert_allclose(new[k], w[k] + 0.5 * d[k], rtol=1e-6)


def test_fedavgm_matches_hand_computation():
    w = {"x": np.array([1.0, -2.0], np.float32)}
    d1, d2 = {"x": np.array([0.5, 1.0], np.float32)}, {"x": np.array([-1.0, 0.25], np.float32)}
    opt = FedAvgM(server_lr=0.1, momentum=0.9)
    w1 = opt.step(w, d1)  # v = d1
    w2 = opt.step(w1, d2)  # v = 0.9·d1 + d2
    np.testing.assert_allclose(w1["x"], [1.05, -1.9], rtol=1e-6)
    v2 = np.array([0.9 * 0.5 - 1.0, 0.9 * 1.0 + 0.25])
    np.testing.assert_allclose(w2["x"], np.array([1.05, -1.9]) + 0.1 * v2, rtol=1e-6)


def test_fedadam_matches_hand_computation():
    b1, b2, tau, lr = 0.9, 0.99, 1e-3, 0.01
    w = {"x": np.array([1.0, -2.0, 0.0], np.float32)}
    deltas = [np.array([0.5, -1.0, 0.0]), np.array([0.1, 0.2, -0.3])]
    opt = FedAdam(server_lr=lr, beta1=b1, beta2=b2, tau=tau)
    expected, m, v = np.array([1.0, -2.0, 0.0]), np.zeros(3), np.zeros(3)
    current = w
    for t, d in enumerate(deltas, start=1):
        m = b1 * m + (1 - b1) * d
        v = b2 * v + (1 - b2) * d**2
        expected = expected + lr * np.sqrt(1 - b2**t) / (1 - b1**t) * m / (np.sqrt(v) + tau)
        current = opt.step(current, {"x": d.astype(np.float32)})
        np.testing.assert_allclose(current["x"], expected, rtol=1e-5, atol=1e-7)
    # First step of bias-corrected Adam moves each coordinate by ≈ lr·sign(Δ) (τ small).
    assert abs(expected[0] - 1.0) > 0.015


@pytest.mark.parametrize("strategy", ["fedavg", "fedavgm", "fedadam"])
def test_server_optimizer_state_round_trips(tmp_path, strategy):
    cfg = AggregationConfig(strategy=strategy)
    rng = np.random.default_rng(3)
    w = _arrays(rng)
    deltas = [_arrays(rng, 0.1) for _ in range(3)]
    straight = build_server_optimizer(cfg)
    w_straight = w
    for d in deltas:
        w_straight = straight.step(w_straight, d)
    # Interrupted after 2 rounds, saved, "restarted", resumed.
    first = build_server_optimizer(cfg)
    w_resumed = first.step(first.step(w, deltas[0]), deltas[1])
    save_server_optimizer(tmp_path / "opt.npz", first)
    resumed = load_server_optimizer(tmp_path / "opt.npz", cfg)
    assert resumed.steps == 2
    w_resumed = resumed.step(w_resumed, deltas[2])
    for k in w:
        np.testing.assert_array_equal(w_resumed[k], w_straight[k])


@pytest.mark.parametrize("strategy", ["fedavg", "fedavgm"])
def test_cosine_server_schedule_decays_to_its_final_fraction_and_resumes_where_it_was(tmp_path, strategy):
    cfg = AggregationConfig(strategy=strategy, server_lr=2.0, momentum=0.0, lr_schedule="cosine", final_lr_fraction=0.1)
    opt = build_server_optimizer(cfg, rounds=5)
    w, one = {"x": np.zeros(1, np.float32)}, {"x": np.ones(1, np.float32)}
    moves = []
    for _ in range(3):
        new = opt.step(w, one)
        moves.append(float(new["x"][0] - w["x"][0]))
        w = new
    save_server_optimizer(tmp_path / "opt.npz", opt)
    resumed = load_server_optimizer(tmp_path / "opt.npz", cfg, rounds=5)  # a restarted coordinator
    for _ in range(2):
        new = resumed.step(w, one)
        moves.append(float(new["x"][0] - w["x"][0]))
        w = new
    # η_t = 2 (0.1 + 0.9 · ½ (1 + cos π (t−1)/4)): 2, 1.7364, 1.1, 0.4636, 0.2
    np.testing.assert_allclose(moves, [2.0, 1.73640, 1.1, 0.46360, 0.2], rtol=1e-4)
    with pytest.raises(ValueError, match="config asks"):  # the schedule is part of the optimizer's identity
        load_server_optimizer(tmp_path / "opt.npz", AggregationConfig(strategy=strategy, server_lr=2.0, momentum=0.0), rounds=5)


def test_resume_with_other_hyper_parameters_is_refused(tmp_path):
    opt = build_server_optimizer(AggregationConfig(strategy="fedadam"))
    opt.step({"x": np.zeros(2, np.float32)}, {"x": np.ones(2, np.float32)})
    save_server_optimizer(tmp_path / "opt.npz", opt)
    with pytest.raises(ValueError, match="config asks"):
        load_server_optimizer(tmp_path / "opt.npz", AggregationConfig(strategy="fedadam", beta1=0.5))
    with pytest.raises(ValueError):
        load_server_optimizer(tmp_path / "opt.npz", AggregationConfig(strategy="fedavgm"))


def test_validation_reasons():
    rng = np.random.default_rng(4)
    glob = _arrays(rng)
    spec = spec_of(glob)
    good = _arrays(rng)
    assert validate_update("s", good, spec).ok
    nan = dict(good, **{"head.bias": np.full(5, np.nan, np.float32)})
    inf = dict(good, **{"head.bias": np.array([0, 0, np.inf, 0, 0], np.float32)})
    cases = {
        "non_finite": [nan, inf],
        "shape": [dict(good, **{"head.bias": np.zeros(6, np.float32)})],
        "dtype": [dict(good, **{"head.bias": np.zeros(5, np.float64)}), dict(good, **{"head.bias": [0.0] * 5})],
        "missing_arrays": [{"backbone.weight": good["backbone.weight"]}],
        "unexpected_arrays": [dict(good, extra=np.zeros(1, np.float32))],
    }
    for reason, updates in cases.items():
        for u in updates:
            result = validate_update("site-x", u, spec)
            assert not result.ok and result.reason == reason and result.site_id == "site-x", (reason, result)
    norm = update_norm(good)
    assert validate_update("s", good, spec, max_norm=norm * 1.001).ok
    over = validate_update("s", good, spec, max_norm=norm * 0.999)
    assert over.reason == "norm" and over.norm == pytest.approx(norm) and "exceeds" in str(over)
    assert validate_update("s", good, spec, weight=0).reason == "weight"
    assert validate_update("s", good, spec, weight=float("nan")).reason == "weight"


def test_aggregate_round_skips_rejected_updates():
    rng = np.random.default_rng(5)
    w = _arrays(rng)
    a, b = _arrays(rng, 0.1), _arrays(rng, 0.1)
    bad = dict(a, **{"head.bias": np.full(5, np.nan, np.float32)})
    huge = _arrays(rng, 100.0)

    def stream():  # lazily decoded replies
        yield "a", a, 1.0
        yield "bad", bad, 5.0
        yield "b", b, 3.0
        yield "huge", huge, 1.0

    result = aggregate_round(w, stream(), FedAvgServer(), max_norm=10.0)
    assert [r.site_id for r in result.accepted] == ["a", "b"]
    assert {(r.site_id, r.reason) for r in result.rejected} == {("bad", "non_finite"), ("huge", "norm")}
    for k in w:
        expected = w[k] + (a[k] + 3 * b[k]) / 4
        np.testing.assert_allclose(result.weights[k], expected, rtol=0, atol=sum_tolerance(4, float(np.abs(expected).max())))
    assert aggregate_round(w, iter([("bad", bad, 1.0)]), FedAvgServer()).weights is None
