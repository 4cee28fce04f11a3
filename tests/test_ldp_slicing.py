"""LDP-Slicing: allocation, exact per-pixel / per-block LDP, flip rates, LL pruning, CLI round trip."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import pywt
from PIL import Image

from fedpose.cli import main
from fedpose.privacy.ldp_slicing import (
    THRESHOLD_BYTES,
    LdpSlicer,
    LdpSlicingError,
    SeededBytes,
    allocate_budget,
    bernoulli_flips,
    channel_output_distribution,
    flip_thresholds,
    max_log_likelihood_ratio,
    perceptual_mask,
    randomize_bit_planes,
    realized_budgets,
    realized_flip_probabilities,
    remove_low_frequency,
    rgb_to_ycbcr,
    ycbcr_to_rgb,
)

EPSILON = 20.0


def test_sqrt_allocation_sums_and_proportions():
    budgets = allocate_budget(EPSILON, "sqrt")
    assert budgets.shape == (3, 8)
    assert budgets.sum() == pytest.approx(EPSILON)
    # √(w_Y / w_Cb) = 2; √(w_{b+1} / w_b) = √2.
    np.testing.assert_allclose(budgets[0] / budgets[1], 2.0)
    np.testing.assert_allclose(budgets[1], budgets[2])
    np.testing.assert_allclose(budgets[:, 1:] / budgets[:, :-1], math.sqrt(2))
    # closed form for one entry: Y MSB = ε · 2·√128 / (4 · Σ_j 2^{j/2})
    expected = EPSILON * 2 * math.sqrt(128) / (4 * sum(2 ** (j / 2) for j in range(8)))
    assert budgets[0, 7] == pytest.approx(expected)


def test_uniform_and_custom_weights():
    uniform = allocate_budget(2.4, "uniform")
    np.testing.assert_allclose(uniform, 0.1)
    custom = allocate_budget(6.0, "sqrt", channel_weights={"Y": 1, "Cb": 1, "Cr": 1}, bit_weights=[1] * 8)
    np.testing.assert_allclose(custom, 0.25)
    with pytest.raises(LdpSlicingError, match="allocation"):
        allocate_budget(1.0, "cubic")
    with pytest.raises(LdpSlicingError, match="epsilon_total"):
        allocate_budget(0.0)
    with pytest.raises(LdpSlicingError, match="weights"):
        LdpSlicer(1.0, allocation="uniform", channel_weights={"Y": 1, "Cb": 1, "Cr": 1})


def test_realized_budgets_never_exceed_allocation():
    for eps in (0.5, 2.4, 20.0, 58.0, 400.0):
        budgets = allocate_budget(eps)
        realized = realized_budgets(flip_thresholds(budgets))
        assert (realized <= budgets + 1e-12).all()
        if eps <= 58:  # 32-bit thresholds are fine-grained enough to lose < 0.1 %
            assert realized.sum() >= 0.999 * eps


@pytest.mark.parametrize("epsilon", [2.4, EPSILON])
def test_per_bit_flip_rates_match_binomial(epsilon):
    """Run the real mechanism on 10⁵ pixels and count flips per bit plane (5σ binomial bounds)."""
    slicer = LdpSlicer(epsilon, seed=1234)
    values = np.random.default_rng(0).integers(0, 256, (100_000, 3), dtype=np.uint8)
    out = slicer.privatize_ycbcr(values)
    flipped = ((values ^ out)[..., None] >> np.arange(8, dtype=np.uint8)) & 1  # (n, 3, 8)
    counts = flipped.sum(axis=0)
    q = realized_flip_probabilities(slicer.thresholds)
    n = values.shape[0]
    bound = 5 * np.sqrt(n * q * (1 - q))
    assert (np.abs(counts - n * q) <= bound).all(), (counts, n * q)


def test_bernoulli_refinement_levels_are_exact():
    """Thresholds whose leading bytes are 0 are decided in the tie-refinement levels."""
    thresholds = np.array([2 ** 32 // 1000, 2 ** 32 // 50_000, 123_456_789], dtype=np.uint64)
    flips = bernoulli_flips(SeededBytes(7), 2_000_000, thresholds)
    p = realized_flip_probabilities(thresholds)
    counts = flips.sum(axis=0)
    assert (np.abs(counts - 2_000_000 * p) <= 5 * np.sqrt(2_000_000 * p * (1 - p))).all()
    assert THRESHOLD_BYTES == 4


class ExactOutputDistribution:
    """All 256×256 exact per-channel output distributions (product of 8 keep/flip probabilities).

    Channels are independent, so the maximum likelihood ratio over all 2²⁴ outputs of a pixel is
    the product of the per-channel maxima over 256 outputs each: enumerated here, not assumed."""

    def __init__(self, thresholds: np.ndarray) -> None:
        self.log_p = np.stack(
            [np.log(np.stack([channel_output_distribution(v, c, thresholds) for v in range(256)])) for c in range(3)]
        )  # (channel, input value, output value)
        np.testing.assert_allclose(np.exp(self.log_p).sum(axis=-1), 1.0)

    def max_log_ratio(self, x: np.ndarray, x_prime: np.ndarray) -> float:
        """x, x': (..., 3) masked pixels; sum over pixels of the exact per-pixel max log ratio."""
        x = np.asarray(x).reshape(-1, 3)
        x_prime = np.asarray(x_prime).reshape(-1, 3)
        total = 0.0
        for c in range(3):
            total += float((self.log_p[c, x[:, c]] - self.log_p[c, x_prime[:, c]]).max(axis=-1).sum())
        return total


@pytest.mark.parametrize("allocation", ["sqrt", "uniform"])
def test_pixel_is_pure_epsilon_total_ldp_exactly(allocation):
    slicer = LdpSlicer(EPSILON, allocation=allocation, seed=0)
    rng = np.random.default_rng(1)
    pairs = [(np.zeros(3, np.uint8), np.full(3, 255, np.uint8))]
    pairs += [tuple(rng.integers(0, 256, (2, 3), dtype=np.uint8)) for _ in range(200)]
    exact_distribution = ExactOutputDistribution(slicer.thresholds)
    worst = 0.0
    for x, x_prime in pairs:
        exact = exact_distribution.max_log_ratio(x, x_prime)
        assert exact == pytest.approx(max_log_likelihood_ratio(x, x_prime, slicer.thresholds), abs=1e-9)
        assert exact <= EPSILON + 1e-9
        worst = max(worst, exact)
    # all 24 bits differ for 0 vs 255: the bound is attained (up to threshold rounding)
    assert worst == pytest.approx(EPSILON, rel=1e-3)


def test_ll_pruned_guarantee_is_per_2x2_block():
    """With LL pruning one original pixel moves all 4 masked pixels of its block: the exact ratio
    stays within 4·ε_total for the block, and a single-pixel change can exceed ε_total."""
    slicer = LdpSlicer(EPSILON, ll_prune=True, seed=0)
    exact_distribution = ExactOutputDistribution(slicer.thresholds)
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3000, 2, 2, 3), dtype=np.uint8)
    others = blocks.copy()
    rows, cols = rng.integers(0, 2, 3000), rng.integers(0, 2, 3000)
    others[np.arange(3000), rows, cols] = rng.integers(0, 256, (3000, 3))  # one original pixel changed
    masked = perceptual_mask(rgb_to_ycbcr(blocks), True).reshape(3000, 4, 3)
    masked_other = perceptual_mask(rgb_to_ycbcr(others), True).reshape(3000, 4, 3)
    ratios = np.array([exact_distribution.max_log_ratio(a, b) for a, b in zip(masked, masked_other)])
    assert (ratios <= 4 * EPSILON + 1e-9).all()
    worst_single_pixel = ratios.max()
    assert worst_single_pixel > EPSILON  # so "ε_total per original pixel" would be false here
    guarantee = slicer.guarantee()
    assert guarantee["epsilon_per_original_pixel"] == 4 * EPSILON
    assert "2×2" in guarantee["unit_protected"]
    assert LdpSlicer(EPSILON, ll_prune=False).guarantee()["epsilon_per_original_pixel"] == EPSILON


def test_without_pruning_other_pixels_are_untouched_by_a_change():
    slicer = LdpSlicer(EPSILON, ll_prune=False, seed=0)
    image = np.random.default_rng(3).integers(0, 256, (2, 2, 3), dtype=np.uint8)
    other = image.copy()
    other[0, 0] = 255 - other[0, 0]
    masked = perceptual_mask(rgb_to_ycbcr(image), False).reshape(4, 3)
    masked_other = perceptual_mask(rgb_to_ycbcr(other), False).reshape(4, 3)
    ratios = [max_log_likelihood_ratio(a, b, slicer.thresholds) for a, b in zip(masked, masked_other)]
    assert ratios[1:] == [0.0, 0.0, 0.0] and 0 < ratios[0] <= EPSILON


def test_ll_pruning_zeroes_the_low_band_before_randomization():
    rgb = np.random.default_rng(5).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    ycbcr = rgb_to_ycbcr(rgb)
    pruned = remove_low_frequency(ycbcr)
    low, _ = pywt.dwt2(np.moveaxis(pruned, -1, 0), "haar")
    assert np.abs(low).max() < 1e-3
    block_mean = ycbcr.reshape(24, 2, 32, 2, 3).mean(axis=(1, 3))
    np.testing.assert_allclose(pruned, ycbcr - np.repeat(np.repeat(block_mean, 2, 0), 2, 1), atol=1e-3)
    # With an enormous budget (flip probability 2⁻³²) the release is exactly the masked image.
    released = LdpSlicer(1e5, ll_prune=True, seed=0)(rgb).ycbcr
    np.testing.assert_array_equal(released, perceptual_mask(ycbcr, True))
    assert not np.array_equal(released, perceptual_mask(ycbcr, False))
    # the re-centred variant keeps negative details: clamp(x − block mean + 128)
    np.testing.assert_array_equal(perceptual_mask(ycbcr, True, 128.0), np.clip(np.rint(pruned + 128), 0, 255))
    assert (perceptual_mask(ycbcr, True) == 0).mean() > 0.3  # the specified clamp zeroes the negative half


def test_odd_sizes_and_batches():
    slicer = LdpSlicer(EPSILON, seed=0)
    single = slicer(np.zeros((31, 17, 3), np.uint8))
    assert single.ycbcr.shape == (31, 17, 3) and single.rgb.dtype == np.uint8
    batch = slicer(np.zeros((4, 16, 16, 3), np.uint8))
    assert batch.rgb.shape == (4, 16, 16, 3)
    with pytest.raises(LdpSlicingError):
        slicer(np.zeros((16, 16), np.uint8))


def test_seeded_is_reproducible_and_default_is_secure():
    rgb = np.random.default_rng(0).integers(0, 256, (24, 32, 3), dtype=np.uint8)
    a = LdpSlicer(EPSILON, seed=9)(rgb).ycbcr
    b = LdpSlicer(EPSILON, seed=9)(rgb).ycbcr
    np.testing.assert_array_equal(a, b)
    secure = LdpSlicer(EPSILON)
    assert secure.guarantee()["cryptographically_secure"] is True
    assert not np.array_equal(secure(rgb).ycbcr, LdpSlicer(EPSILON)(rgb).ycbcr)
    assert LdpSlicer(EPSILON, seed=1).guarantee()["cryptographically_secure"] is False


def test_randomize_rejects_wrong_input():
    with pytest.raises(LdpSlicingError):
        randomize_bit_planes(np.zeros((4, 4, 3), np.float32), flip_thresholds(allocate_budget(1.0)), SeededBytes(0))


def _write_png(path: Path, seed: int, size=(48, 64)) -> None:
    rgb = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(path)


def test_cli_png_equals_npy_converted(tmp_path, capsys):
    """The PNG is exactly ycbcr_to_rgb of the released YCbCr array (same seed). The reverse is
    not exact: out-of-gamut YCbCr triples are clipped to RGB and both conversions round."""
    _write_png(tmp_path / "a.png", 0)
    common = ["ldp", "slice", str(tmp_path / "a.png"), "--epsilon", "20", "--seed", "3"]
    assert main(common + ["--out", str(tmp_path / "png")]) == 0
    assert main(common + ["--out", str(tmp_path / "npy"), "--format", "npy"]) == 0
    ycbcr = np.load(tmp_path / "npy" / "a.npy")
    assert ycbcr.shape == (48, 64, 3) and ycbcr.dtype == np.uint8
    decoded = np.asarray(Image.open(tmp_path / "png" / "a.png"))
    np.testing.assert_array_equal(decoded, ycbcr_to_rgb(ycbcr))
    assert "pure ε-LDP per pixel" in capsys.readouterr().out


def test_cli_walks_directories_and_survives_corrupt_images(tmp_path, capsys):
    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    _write_png(src / "good.png", 1)
    _write_png(src / "sub" / "other.png", 2)
    (src / "broken.png").write_bytes(b"not an image")
    code = main(["ldp", "slice", str(src), "--out", str(tmp_path / "out"), "--epsilon", "5", "--no-ll-prune"])
    assert code == 1
    err = capsys.readouterr().err
    assert "broken.png" in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["good.png", "other.png"]


def test_cli_allocate_json(capsys):
    assert main(["ldp", "allocate", "--epsilon", "58", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["epsilon_total"] == 58.0
    assert set(payload["budgets"]) == {"Y", "Cb", "Cr"}
    assert sum(sum(v) for v in payload["budgets"].values()) == pytest.approx(58.0)
    assert payload["budgets"]["Y"][7] > payload["budgets"]["Y"][0]  # LSB first
