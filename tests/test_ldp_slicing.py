"""LDP-Slicing: allocation, exact per-pixel / per-block LDP, flip rates, LL pruning, CLI round trip."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import pywt
from PIL import Image
from scipy import stats

from fedpose.cli import main
from fedpose.privacy.ldp_slicing import (
    THRESHOLD_BITS,
    LdpSlicer,
    LdpSlicingError,
    SeededBytes,
    allocate_budget,
    bernoulli_flips,
    bernoulli_words,
    channel_output_distribution,
    flip_thresholds,
    max_log_likelihood_ratio,
    perceptual_mask,
    randomize_bit_planes,
    realized_budgets,
    realized_flip_probabilities,
    remove_low_frequency,
    remove_low_frequency_pywt,
    rgb_to_ycbcr,
    to_uint8,
    ycbcr_to_rgb,
)

EPSILON = 20.0
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


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


def _within_binomial_bounds(counts: np.ndarray, n: int, p: np.ndarray, sigmas: float = 5.0) -> bool:
    return bool((np.abs(counts - n * p) <= sigmas * np.sqrt(n * p * (1 - p))).all())


@pytest.mark.parametrize(("epsilon", "pixels"), [(2.4, 100_000), (EPSILON, 100_000), (EPSILON, 100_003)])
def test_per_bit_flip_rates_match_binomial(epsilon, pixels):
    """Run the real mechanism on 10⁵ pixels and count flips per bit plane (5σ binomial bounds).
    3·100_003 bytes is not a multiple of 8: the last flip word is cut after the last byte."""
    slicer = LdpSlicer(epsilon, insecure_seed=1234)
    values = np.random.default_rng(0).integers(0, 256, (pixels, 3), dtype=np.uint8)
    out = slicer.privatize_ycbcr(values)
    flipped = ((values ^ out)[..., None] >> np.arange(8, dtype=np.uint8)) & 1  # (n, 3, 8)
    q = realized_flip_probabilities(slicer.thresholds)
    assert _within_binomial_bounds(flipped.sum(axis=0), pixels, q), (flipped.sum(axis=0), pixels * q)


def test_flip_rates_on_channel_planar_and_strided_input():
    """perceptual_mask returns channel-planar storage and callers may pass strided views: every bit
    must still be flipped with its own plane's probability, and the input must stay untouched."""
    slicer = LdpSlicer(EPSILON, insecure_seed=11)
    q = realized_flip_probabilities(slicer.thresholds)
    rgb = np.random.default_rng(2).integers(0, 256, (8, 96, 128, 3), dtype=np.uint8)
    masked = perceptual_mask(rgb_to_ycbcr(rgb), True)
    strided = np.concatenate([masked, masked], axis=2)[:, :, ::2]
    for values in (masked, strided):
        before = values.copy()
        out = slicer.privatize_ycbcr(values)
        np.testing.assert_array_equal(values, before)
        flipped = ((values ^ out)[..., None] >> np.arange(8, dtype=np.uint8)) & 1
        assert _within_binomial_bounds(flipped.reshape(-1, 3, 8).sum(axis=0), values[..., 0].size, q)


def test_bernoulli_thresholds_near_zero_near_half_and_arbitrary():
    """The bit-sliced sampler is exact for any 32-bit threshold: tiny ones (decided only after many
    tied levels), ones at and just below 2³¹ (leading bits 1 or 0) and arbitrary bit patterns."""
    thresholds = np.array(
        [
            [2**32 // 1000, 2**32 // 50_000, 123_456_789, 0x0000_FFFF],
            [2**31, 2**31 - 1, 2**31 - 2**20, 0x7FF0_0001],
            [0x5A5A_5A5A, 0x1234_5678, 0x2AAA_AAAB, 0x0F0F_0F0F],
        ],
        dtype=np.uint64,
    )
    n = 2_000_000
    flips = bernoulli_flips(SeededBytes(7), n, thresholds)
    assert flips.shape == (n, 3, 4) and flips.dtype == bool
    assert _within_binomial_bounds(flips.sum(axis=0), n, realized_flip_probabilities(thresholds))
    assert THRESHOLD_BITS == 32


class _ConstantBytes:
    """A deterministic byte source (not random): pins what the comparison does with all-0 / all-1 bits."""

    name, cryptographically_secure = "constant (test only)", False

    def __init__(self, byte: int) -> None:
        self.byte = byte

    def uint8(self, count: int) -> np.ndarray:
        return np.full(count, self.byte, dtype=np.uint8)


def test_bernoulli_comparison_at_the_extremes():
    """Random bits all 0 keep every lane tied with T for all 32 bits (U = T is not below T: no
    flip); all 1 decide every lane on the first bit (U ≥ 2³¹: a flip only when T = 2³¹)."""
    lanes = np.array([[1] * 32 + [2**31 - 1] * 16 + [2**31] * 16], dtype=np.uint64)
    assert not bernoulli_words(_ConstantBytes(0), lanes, 50_000).any()
    np.testing.assert_array_equal(bernoulli_words(_ConstantBytes(0xFF), lanes, 50_000), np.uint64(0xFFFF) << np.uint64(48))
    with pytest.raises(LdpSlicingError, match="2\\^32"):
        bernoulli_words(_ConstantBytes(0), np.full((1, 64), 2**32, dtype=np.uint64), 1)


def test_bits_of_a_flip_byte_are_independent():
    """Chi-square over the 256 flip patterns of each channel byte (and the 16 joint patterns of the
    LSBs of Y, Cb, Cr and the next pixel's Y) against the product of the per-bit probabilities."""
    slicer = LdpSlicer(6.0, allocation="uniform", insecure_seed=3)  # q ≈ 0.44 on every plane: all patterns frequent
    q = realized_flip_probabilities(slicer.thresholds)
    pixels = 200_000
    flips = slicer.privatize_ycbcr(np.zeros((pixels, 3), np.uint8))  # zero input: the output is the flip bytes
    bits = (np.arange(256)[:, None] >> np.arange(8)) & 1
    for channel in range(3):
        expected = np.prod(np.where(bits == 1, q[channel], 1 - q[channel]), axis=1) * pixels
        observed = np.bincount(flips[:, channel], minlength=256)
        assert stats.chisquare(observed, expected).pvalue > 1e-4, channel
    lsb = (flips & 1).astype(np.int64)
    joint = lsb[0::2, 0] | lsb[0::2, 1] << 1 | lsb[0::2, 2] << 2 | lsb[1::2, 0] << 3
    joint_q = np.array([q[0, 0], q[1, 0], q[2, 0], q[0, 0]])
    bits = (np.arange(16)[:, None] >> np.arange(4)) & 1
    expected = np.prod(np.where(bits == 1, joint_q, 1 - joint_q), axis=1) * joint.size
    assert stats.chisquare(np.bincount(joint, minlength=16), expected).pvalue > 1e-4


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
    slicer = LdpSlicer(EPSILON, allocation=allocation, insecure_seed=0)
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
    slicer = LdpSlicer(EPSILON, ll_prune=True, insecure_seed=0)
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
    slicer = LdpSlicer(EPSILON, ll_prune=False, insecure_seed=0)
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
    released = LdpSlicer(1e5, ll_prune=True, insecure_seed=0)(rgb).ycbcr
    np.testing.assert_array_equal(released, perceptual_mask(ycbcr, True))
    assert not np.array_equal(released, perceptual_mask(ycbcr, False))
    # the re-centred variant keeps negative details: clamp(x − block mean + 128)
    np.testing.assert_array_equal(perceptual_mask(ycbcr, True, 128.0), np.clip(np.rint(pruned + 128), 0, 255))
    assert (perceptual_mask(ycbcr, True) == 0).mean() > 0.3  # the specified clamp zeroes the negative half


def _real_image(name: str) -> np.ndarray:
    path = next(SHARED_DATA.glob(f"*/images/{name}"), None)
    if path is None:
        pytest.skip(f"{name} not under {SHARED_DATA}")
    return np.asarray(Image.open(path).convert("RGB"))


@pytest.mark.parametrize(
    ("name", "window"),
    [
        ("000000040083.jpg", None),  # COCO, 333 × 500: odd height
        ("052475643.jpg", (240, 320)),  # MPII crops: even × even
        ("052475643.jpg", (241, 321)),  # odd × odd
        ("004645041.jpg", (160, 203)),  # even × odd
    ],
)
def test_closed_form_ll_pruning_equals_pywavelets(name, window):
    """The fast path (x − 2×2 block mean, last row/column repeated for odd sizes) equals
    pywt.dwt2 → LL zeroed → pywt.idwt2 to float32 precision on real photos: on YCbCr floats, on
    the raw uint8 RGB, and after clamping and rounding up to ties at .5 (float32 noise in either
    implementation can round those either way)."""
    rgb = _real_image(name)
    if window is not None:
        rgb = rgb[100 : 100 + window[0], 200 : 200 + window[1]]
    ycbcr = rgb_to_ycbcr(rgb)
    fast, reference = remove_low_frequency(ycbcr), remove_low_frequency_pywt(ycbcr)
    assert fast.shape == reference.shape == rgb.shape and fast.dtype == np.float32
    np.testing.assert_allclose(fast, reference, rtol=0, atol=2e-4)
    np.testing.assert_allclose(remove_low_frequency(rgb), remove_low_frequency_pywt(rgb), rtol=0, atol=2e-4)
    masked = perceptual_mask(ycbcr, True)
    rounded_difference = np.abs(masked.astype(int) - to_uint8(reference))
    # JPEG-decoded photos have near-integer YCbCr, so x − (sum of 4)/4 is often exactly k + ½:
    # the closed form rounds those half to even, PyWavelets' float noise either way. Nowhere else.
    at_tie = np.abs(np.abs(fast - np.floor(fast)) - 0.5) < 1e-4
    assert rounded_difference.max() <= 1 and not (rounded_difference[~at_tie]).any()
    assert (masked > 0).mean() > 0.05  # some real detail survives the clamp (the test is not vacuous)


def test_closed_form_ll_pruning_small_odd_shapes_and_batches():
    rng = np.random.default_rng(4)
    for shape in [(1, 1, 3), (1, 6, 3), (5, 1, 3), (3, 5, 7, 3), (2, 2, 9, 6, 3)]:
        values = rng.uniform(0, 255, shape).astype(np.float32)
        np.testing.assert_allclose(remove_low_frequency(values), remove_low_frequency_pywt(values), rtol=0, atol=2e-4)


def test_odd_sizes_and_batches():
    slicer = LdpSlicer(EPSILON, insecure_seed=0)
    single = slicer(np.zeros((31, 17, 3), np.uint8))
    assert single.ycbcr.shape == (31, 17, 3) and single.rgb.dtype == np.uint8
    batch = slicer(np.zeros((4, 16, 16, 3), np.uint8))
    assert batch.rgb.shape == (4, 16, 16, 3)
    with pytest.raises(LdpSlicingError):
        slicer(np.zeros((16, 16), np.uint8))


def test_seeded_is_reproducible_and_default_is_secure():
    rgb = np.random.default_rng(0).integers(0, 256, (24, 32, 3), dtype=np.uint8)
    a = LdpSlicer(EPSILON, insecure_seed=9)(rgb).ycbcr
    b = LdpSlicer(EPSILON, insecure_seed=9)(rgb).ycbcr
    np.testing.assert_array_equal(a, b)
    secure = LdpSlicer(EPSILON)
    assert secure.guarantee()["cryptographically_secure"] is True
    assert not np.array_equal(secure(rgb).ycbcr, LdpSlicer(EPSILON)(rgb).ycbcr)
    seeded = LdpSlicer(EPSILON, insecure_seed=1).guarantee()
    assert seeded["cryptographically_secure"] is False and seeded["guarantee_void"] is True
    assert seeded["guarantee_statement"].startswith("NO PRIVACY GUARANTEE (seeded test noise): ")
    assert "not cryptographically secure" in seeded["randomness"]
    assert secure.guarantee()["guarantee_void"] is False


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
    common = ["ldp", "slice", str(tmp_path / "a.png"), "--epsilon", "20", "--insecure-seed", "3"]
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
    assert code == 2
    err = capsys.readouterr().err
    assert "broken.png" in err and "1 of 3 input(s) could not be decoded and were skipped (the other 2 were written)" in err
    assert len(err.strip().splitlines()) == 1  # named once, in one line
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["good.png", "other.png"]


def test_cli_allocate_json(capsys):
    assert main(["ldp", "allocate", "--epsilon", "58", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["epsilon_total"] == 58.0
    assert (payload["guarantee"], payload["delta"], payload["unit"], payload["accountant"]) == ("LDP", 0.0, "pixel", "pure composition")
    assert payload["adjacency"] == "any-two-values-of-one-pixel (local) adjacency"
    assert set(payload["budgets"]) == {"Y", "Cb", "Cr"}
    assert sum(sum(v) for v in payload["budgets"].values()) == pytest.approx(58.0)
    assert payload["budgets"]["Y"][7] > payload["budgets"]["Y"][0]  # LSB first
