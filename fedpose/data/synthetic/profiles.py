"""Per-site data distributions: what makes site 3 look different from site 1 (non-IID).

A :class:`SiteProfile` fixes a site's pose mix, background family mix, colour palette, lighting
and camera. Profiles depend only on the site index (seeded by ``(PROFILE_SEED, index)``), not on
the dataset seed: "site-2" is the same kind of clinic in every generated dataset, while the seed
changes the individual images. The first sites follow the brief's storyline (site 1 mostly
standing, site 2 arm raises, site 3 sitting, site 4 bending, ...); any N sites all differ.

The public split (the stand-in for COCO next to MPII) is a broader, related distribution: every
pose family and background with equal weight, neutral camera, wider lighting and scale jitter.

What only the sites have (the clinic, which public photo collections lack): patients in bed with
the head end raised, seen by a bedside camera, so the body is tilted 40–60° from upright in the
frame (the public split's camera roll stays within ±30°, and the shipped bases' pre-training rotates
by at most ±30° more; HRNet's clip, ``data.rotation_clip = 2``, would reach ±60°: docs/benchmarks.md,
public_base), and night-time images from infrared cameras (grey, flat, noisy: the public split is in
colour). Every site has both, each in its own proportion and
with its own side of the bed, so a federation shares what a public model has never seen while each
site still differs from the others. A public pre-trained model must learn these from site data:
that is what private training is for (issue 26).
"""

from __future__ import annotations

import colorsys
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Final

import numpy as np

from fedpose.data.synthetic.body import POSE_FAMILIES
from fedpose.data.synthetic.textures import BACKGROUNDS

PROFILE_SEED: Final = 20_240_611
# Dominant pose family and background family of site k are these lists' entries (k−1) mod len.
SITE_POSE_ORDER: Final = ("standing", "arms_raised", "sitting", "bending", "walking", "reaching", "squatting", "athletic")
SITE_BACKGROUND_ORDER: Final = ("room", "outdoor", "tiles", "clouds", "clutter", "gradient")


@dataclass(frozen=True)
class SiteProfile:
    name: str
    pose_weights: dict[str, float]
    background_weights: dict[str, float]
    palette: list[list[float]]  # background colours (RGB in [0, 1])
    brightness: float  # mean multiplicative gain
    contrast: float
    colour_cast: list[float]  # per-channel gain
    lighting_jitter: float  # per-image std of the gains
    person_height: tuple[float, float]  # person box height as a fraction of image height
    camera_roll_std: float  # degrees
    blur_sigma: tuple[float, float]  # camera defocus, px at 256-px height
    noise_std: tuple[float, float]  # sensor noise, 8-bit levels
    jpeg_probability: float
    jpeg_quality: tuple[int, int]
    occlusion_probability: float
    truncation_probability: float
    back_facing_probability: float
    skin_tone_mean: float  # index into SKIN_TONES (site demographics)
    extra: dict[str, Any] = field(default_factory=dict)
    #: clinical views the public split lacks (module docstring); 0 for the public profile, whose
    #: images then draw exactly the random numbers they drew before these existed
    lying_probability: float = 0.0  # patient in bed: the camera's roll is lying_roll (± 10°)
    lying_roll: float = 50.0  # degrees from upright; its sign is the side of the bed the camera is on
    infrared_probability: float = 0.0  # night-time infrared image: grey, flat contrast, noisy

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["person_height"] = list(self.person_height)
        return out

    def describe(self) -> str:
        pose = max(self.pose_weights, key=self.pose_weights.get)
        bg = max(self.background_weights, key=self.background_weights.get)
        poses = f"mostly {pose} ({self.pose_weights[pose]:.0%})" if self.pose_weights[pose] > 0.3 else "all pose families"
        backgrounds = f"mostly {bg} backgrounds" if self.background_weights[bg] > 0.3 else "all background families"
        return (
            f"{self.name}: {poses}, {backgrounds}, "
            f"brightness ×{self.brightness:.2f}, person {self.person_height[0]:.0%}–{self.person_height[1]:.0%} "
            f"of frame, blur σ≤{self.blur_sigma[1]:.1f}px, noise ≤{self.noise_std[1]:.0f}, "
            f"JPEG p={self.jpeg_probability:.2f}, occlusion p={self.occlusion_probability:.2f}"
            + (f", in bed p={self.lying_probability:.2f} (tilted {self.lying_roll:+.0f}°)" if self.lying_probability else "")
            + (f", infrared p={self.infrared_probability:.2f}" if self.infrared_probability else "")
        )


def _mixture(rng: np.random.Generator, names: tuple[str, ...] | list[str], dominant: str, weight: float) -> dict[str, float]:
    rest = rng.dirichlet(np.ones(len(names)))
    return {n: round(float(weight * (n == dominant) + (1 - weight) * r), 4) for n, r in zip(names, rest)}


def _palette(rng: np.random.Generator, hue: float, spread: float, count: int) -> list[list[float]]:
    colours = []
    for _ in range(count):
        h = (hue + rng.uniform(-spread, spread)) % 1.0
        rgb = colorsys.hsv_to_rgb(h, rng.uniform(0.15, 0.7), rng.uniform(0.3, 0.95))
        colours.append([round(c, 4) for c in rgb])
    return colours


def site_profile(index: int) -> SiteProfile:
    """The profile of site ``index`` (1-based)."""
    if index < 1:
        raise ValueError(f"site index must be ≥ 1, got {index}")
    rng = np.random.default_rng([PROFILE_SEED, index])
    pose = SITE_POSE_ORDER[(index - 1) % len(SITE_POSE_ORDER)]
    background = SITE_BACKGROUND_ORDER[(index - 1) % len(SITE_BACKGROUND_ORDER)]
    low = float(rng.uniform(0.6, 0.72))
    profile = SiteProfile(
        name=f"site-{index}",
        pose_weights=_mixture(rng, list(POSE_FAMILIES), pose, 0.6),
        background_weights=_mixture(rng, list(BACKGROUNDS), background, 0.6),
        palette=_palette(rng, hue=(index * 0.618034) % 1.0, spread=0.08, count=5),
        brightness=round(float(rng.uniform(0.75, 1.2)), 3),
        contrast=round(float(rng.uniform(0.75, 1.15)), 3),
        colour_cast=[round(float(c), 3) for c in 1 + rng.uniform(-0.12, 0.12, 3)],
        lighting_jitter=0.06,
        person_height=(round(low, 3), round(min(0.92, low + float(rng.uniform(0.12, 0.2))), 3)),
        camera_roll_std=round(float(rng.uniform(3, 10)), 2),
        blur_sigma=(0.0, round(float(rng.uniform(0.3, 1.3)), 2)),
        noise_std=(0.0, round(float(rng.uniform(1, 7)), 2)),
        jpeg_probability=round(float(rng.uniform(0, 0.8)), 3),
        jpeg_quality=(int(rng.integers(30, 60)), 92),
        occlusion_probability=round(float(rng.uniform(0.15, 0.4)), 3),
        truncation_probability=round(float(rng.uniform(0.05, 0.2)), 3),
        back_facing_probability=round(float(rng.uniform(0.05, 0.15)), 3),
        skin_tone_mean=round(float(rng.uniform(0.5, 5.5)), 2),
    )
    # Drawn after the rest, so the site's other traits are those it always had.
    return replace(
        profile,
        lying_probability=round(float(rng.uniform(0.3, 0.6)), 3),
        lying_roll=round(float(rng.choice([-1.0, 1.0]) * rng.uniform(40, 60)), 1),
        infrared_probability=round(float(rng.uniform(0.15, 0.45)), 3),
    )


def public_profile() -> SiteProfile:
    """The public split: broad mix of everything (the COCO-to-MPII relation)."""
    rng = np.random.default_rng([PROFILE_SEED, 0])
    uniform_pose = {n: round(1 / len(POSE_FAMILIES), 4) for n in POSE_FAMILIES}
    uniform_bg = {n: round(1 / len(BACKGROUNDS), 4) for n in BACKGROUNDS}
    palette = [[round(c, 4) for c in colorsys.hsv_to_rgb(h, s, v)]
               for h, s, v in zip(np.linspace(0, 1, 12, endpoint=False), rng.uniform(0.1, 0.6, 12), rng.uniform(0.35, 0.95, 12))]
    return SiteProfile(
        name="public",
        pose_weights=uniform_pose,
        background_weights=uniform_bg,
        palette=palette,
        brightness=1.0,
        contrast=1.0,
        colour_cast=[1.0, 1.0, 1.0],
        lighting_jitter=0.12,
        person_height=(0.55, 0.9),
        camera_roll_std=8.0,
        blur_sigma=(0.0, 0.8),
        noise_std=(0.0, 4.0),
        jpeg_probability=0.5,
        jpeg_quality=(40, 92),
        occlusion_probability=0.25,
        truncation_probability=0.12,
        back_facing_probability=0.1,
        skin_tone_mean=3.0,
        extra={"skin_tone_spread": "uniform"},
    )
