"""Video-DPRP: shapes, noise calibration (formula and exact Gaussian privacy profile), utility trend, CLI."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.stats import norm

from fedpose.cli import main
from fedpose.privacy.dprp import (
    DprpError,
    classic_gaussian_sigma,
    jl_gaussian_sigma,
    proportional_split,
    video_dprp,
)
from fedpose.privacy.accountants.sampler_cut import SECURE_TAIL_BOUND_SIGMAS, tail_cut_delta
from fedpose.privacy.noise import InsecureSeededNoise


def _clip(frames=6, height=12, width=16):
    yy, xx = np.mgrid[0:height, 0:width]
    return np.stack(
        [np.stack([0.5 + 0.4 * np.sin((xx + 3 * f) / 5) * np.cos(yy / 7)] * 3, axis=-1) for f in range(frames)]
    )


def _exact_delta(sigma: float, sensitivity: float, epsilon: float) -> float:
    """Tight δ(ε) of the Gaussian mechanism (Balle & Wang 2018, Thm 8), computed in log space."""
    a = sensitivity / (2 * sigma)
    b = epsilon * sigma / sensitivity
    return float(norm.cdf(a - b) - math.exp(epsilon + norm.logcdf(-a - b)))


def test_output_shape_range_and_guarantee():
    clip = _clip()
    result = video_dprp(clip, 100.0, 1e-5, 64)
    assert result.frames.shape == clip.shape and result.frames.dtype == np.float32
    assert result.frames.min() >= 0 and result.frames.max() <= 1
    g = result.guarantee
    assert g["cryptographically_secure"] is True and g["guarantee_void"] is False
    assert "AES-256-CTR" in g["randomness"] and not g["guarantee_statement"].startswith("NO PRIVACY")
    assert g["mechanism"] == "video-dprp" and g["unit_protected"] == "one frame of the clip"
    assert g["epsilon_projection"] + g["epsilon_covariance"] == pytest.approx(100.0)
    assert g["delta_projection"] + g["delta_covariance"] == pytest.approx(1e-5)
    assert g["rank"] == 6


@pytest.mark.parametrize("epsilon,split", [(1.0, 0.5), (40.0, 0.5), (40.0, 0.8)])
def test_noise_scales_follow_the_formulas(epsilon, split):
    clip, delta, k = _clip(), 1e-5, 48
    g = video_dprp(clip, epsilon, delta, k, split=split, insecure_seed=3).guarantee
    d = clip[0].size
    # the mechanism's first draw
    projection = InsecureSeededNoise(3).normal(d * k, 1 / math.sqrt(k), torch.float64).numpy().reshape(d, k)
    w2 = math.sqrt(d) * np.linalg.norm(projection, 2)
    assert g["sensitivity_projection"] == pytest.approx(w2, rel=1e-9)
    assert g["sensitivity_covariance"] == pytest.approx(math.sqrt(2) * w2**2, rel=1e-9)
    e1, d1, e2, d2 = split * epsilon, split * delta, (1 - split) * epsilon, (1 - split) * delta
    assert g["sigma_projection"] == pytest.approx(w2 * math.sqrt(2 * (math.log(1 / (2 * d1)) + e1)) / e1)
    if e2 < 1:  # paper's Theorem 4: classic Gaussian mechanism
        expected = math.sqrt(2) * w2**2 * math.sqrt(2 * math.log(1.25 / d2)) / e2
    else:
        expected = math.sqrt(2) * w2**2 * math.sqrt(2 * (math.log(1 / (2 * d2)) + e2)) / e2
    assert g["sigma_covariance"] == pytest.approx(expected)


@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-9])
@pytest.mark.parametrize("epsilon", [0.1, 0.5, 0.99, 1.0, 5.0, 30.0])
def test_calibrations_are_really_epsilon_delta_dp(epsilon, delta):
    """Check each σ against the exact privacy profile of the Gaussian mechanism."""
    sigma = jl_gaussian_sigma(1.0, epsilon, delta)
    assert _exact_delta(sigma, 1.0, epsilon) <= delta
    if epsilon < 1:
        assert _exact_delta(classic_gaussian_sigma(1.0, epsilon, delta), 1.0, epsilon) <= delta
    else:
        with pytest.raises(DprpError, match="ε < 1"):
            classic_gaussian_sigma(1.0, epsilon, delta)


def test_reconstruction_error_falls_as_epsilon_grows():
    clip = _clip()
    errors = [
        float(np.sqrt(((video_dprp(clip, eps, 1e-5, 256, insecure_seed=0).frames - clip) ** 2).mean()))
        for eps in (10.0, 1e3, 1e5, 1e7)
    ]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors


def test_seeded_runs_are_reproducible_and_void_the_guarantee():
    clip = _clip()
    seeded = video_dprp(clip, 50.0, 1e-5, 32, insecure_seed=7)
    np.testing.assert_array_equal(seeded.frames, video_dprp(clip, 50.0, 1e-5, 32, insecure_seed=7).frames)
    assert not np.array_equal(seeded.frames, video_dprp(clip, 50.0, 1e-5, 32, insecure_seed=8).frames)
    g = seeded.guarantee
    assert g["guarantee_void"] is True and g["cryptographically_secure"] is False
    assert g["guarantee_statement"].startswith("NO PRIVACY GUARANTEE (seeded test noise): ")
    assert "NOT PRIVATE" in g["randomness"]


def test_default_runs_draw_fresh_randomness():
    clip = _clip()
    a, b = (video_dprp(clip, 50.0, 1e-5, 32).frames for _ in range(2))
    assert not np.array_equal(a, b)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"epsilon": 0.0}, "epsilon"),
        ({"epsilon": float("inf")}, "epsilon"),
        ({"delta": 1.0}, "delta"),
        ({"delta": 0.0}, "delta"),
        ({"projection_dim": 0}, "proj-dim"),
        ({"projection_dim": 10_000}, "exceeds the frame dimension"),
        ({"split": 1.0}, "split"),
        ({"rank": 99}, "rank"),
    ],
)
def test_invalid_parameters_are_rejected(kwargs, message):
    params = {"epsilon": 10.0, "delta": 1e-5, "projection_dim": 16} | kwargs
    with pytest.raises(DprpError, match=message):
        video_dprp(_clip(), params.pop("epsilon"), params.pop("delta"), params.pop("projection_dim"), **params)


def test_invalid_clips_are_rejected():
    with pytest.raises(DprpError, match=r"\[0, 1\]"):
        video_dprp(_clip() * 255, 10.0, 1e-5, 16)
    with pytest.raises(DprpError, match="F×H×W×3"):
        video_dprp(np.zeros((4, 8, 8)), 10.0, 1e-5, 16)
    with pytest.raises(DprpError, match="split"):
        proportional_split(1.0, 1e-5, 0.0)


def test_cli_npy_and_frame_directory(tmp_path, capsys):
    clip = (_clip() * 255).astype(np.uint8)
    np.save(tmp_path / "clip.npy", clip)
    args = ["--epsilon", "1000", "--delta", "1e-5", "--proj-dim", "64"]
    assert main(["dprp", str(tmp_path / "clip.npy"), "--out", str(tmp_path / "out.npy"), *args]) == 0
    out = np.load(tmp_path / "out.npy")
    assert out.shape == clip.shape and out.dtype == np.float32
    printed = capsys.readouterr().out
    assert "one frame of the clip" in printed and "randomness: AES-256-CTR" in printed and "NO PRIVACY" not in printed
    seeded = ["--insecure-seed", "1", "--out", str(tmp_path / "seeded.npy")]
    assert main(["dprp", str(tmp_path / "clip.npy"), *seeded, *args]) == 0
    assert "NO PRIVACY GUARANTEE (seeded test noise): ε = 1000" in capsys.readouterr().out

    frames = tmp_path / "frames"
    frames.mkdir()
    for i, frame in enumerate(clip):
        Image.fromarray(frame).save(frames / f"{i:03d}.png")
    assert main(["dprp", str(frames), "--out", str(tmp_path / "private"), *args]) == 0
    written = sorted((tmp_path / "private").iterdir())
    assert [p.name for p in written][:2] == ["frame_00000.png", "frame_00001.png"] and len(written) == 6
    assert np.asarray(Image.open(written[0])).shape == clip.shape[1:]

    assert main(["dprp", str(tmp_path / "clip.npy"), "--out", str(tmp_path / "x.npy"), "--epsilon", "1",
                 "--delta", "1e-5", "--proj-dim", "100000"]) == 2
    assert "exceeds the frame dimension" in capsys.readouterr().err
    assert main(["dprp", str(tmp_path / "clip.npy"), "--out", "x.npy", "--epsilon", "1", "--delta", "2", "--proj-dim", "8"]) == 2


def test_the_samplers_tail_cut_is_part_of_delta():
    """SecureNoise stops at 8.57σ. At ε = 1000 a frame moved a release by ~8σ, and an output of
    probability ~0.4 under one clip was impossible under its neighbour (an attacker review): the
    guarantee now counts that in δ, which is vacuous there and unchanged at practical ε."""
    clip = _clip()
    huge = video_dprp(clip, 1000.0, 1e-5, 48).guarantee
    assert huge["delta"] >= 0.4 and huge["delta_requested"] == 1e-5
    assert "not the 1e-05 asked for" in huge["guarantee_statement"]
    practical = video_dprp(clip, 10.0, 1e-5, 48).guarantee
    assert 1e-5 <= practical["delta"] <= 1e-5 + 1e-9 and "asked for" not in practical["guarantee_statement"]
    assert tail_cut_delta(10, SECURE_TAIL_BOUND_SIGMAS) == 1.0
    shifts = [0.0, 1.0, 2.0, 4.0]
    assert [tail_cut_delta(1, s) for s in shifts] == sorted(tail_cut_delta(1, s) for s in shifts)
    # the Rayleigh tail it rests on: P(R ≥ r) = exp(−r²/2) for a Box–Muller pair's radius
    radius = np.hypot(*np.random.default_rng(0).standard_normal((2, 400_000)))
    assert abs((radius >= 3.0).mean() - math.exp(-4.5)) < 1e-3
