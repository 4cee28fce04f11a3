"""Full-frame colour textures (clothing, skin, hair) and background families, as float32 HxWx3 in [0, 1].

Clothing, skin and hair textures carry the *fine identity detail*: periods of 2–8 px at 256-px
image height, which a Gaussian blur with σ≈6 px attenuates by e^(−2π²σ²/P²) ≈ 0 while the coarse
silhouette of the limbs (≥ 6 px thick) survives. Backgrounds are mostly low/medium frequency with
optional clutter.
"""

from __future__ import annotations

from typing import Callable, Final

import numpy as np
from PIL import Image, ImageDraw

Texture = np.ndarray  # (H, W, 3) float32 in [0, 1]


def _grid(h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """Broadcastable pixel coordinates: yy (H, 1), xx (1, W)."""
    return np.arange(h, dtype=np.float32)[:, None], np.arange(w, dtype=np.float32)[None, :]


def smooth_noise(rng: np.random.Generator, h: int, w: int, cells: int, channels: int = 1) -> np.ndarray:
    """Value noise: a cells×cells random grid bilinearly upsampled (cheap low-frequency variation)."""
    small = rng.random((cells, max(2, cells * w // h), channels), dtype=np.float32)
    out = np.empty((h, w, channels), np.float32)
    for c in range(channels):
        out[..., c] = np.asarray(Image.fromarray(small[..., c], mode="F").resize((w, h), Image.BILINEAR))
    return out


def _mix(c1: np.ndarray, c2: np.ndarray, t: np.ndarray) -> Texture:
    c1 = np.asarray(c1, np.float32)
    return c1 + (np.asarray(c2, np.float32) - c1) * t.astype(np.float32)[..., None]


def clothing_texture(rng: np.random.Generator, h: int, w: int, base: np.ndarray, pixel_scale: float) -> Texture:
    """A fabric: base colour + a high-frequency pattern (stripes, checks, dots, tweed) + grain.

    ``pixel_scale`` = image height / 256, so pattern periods scale with the image.
    """
    yy, xx = _grid(h, w)
    kind = rng.choice(["solid", "stripes", "checks", "dots", "plaid", "tweed"], p=[0.12, 0.28, 0.18, 0.12, 0.15, 0.15])
    period = rng.uniform(3.0, 8.0) * pixel_scale
    angle = rng.uniform(0, np.pi)
    second = np.clip(base * rng.uniform(0.35, 0.7) + rng.uniform(0, 0.4, 3) * rng.random(), 0, 1).astype(np.float32)
    if rng.random() < 0.3:  # a contrasting second colour instead of a darker shade
        second = rng.uniform(0.1, 0.95, 3).astype(np.float32)
    u = xx * np.cos(angle) + yy * np.sin(angle)
    v = -xx * np.sin(angle) + yy * np.cos(angle)
    if kind == "solid":
        t = np.zeros((h, w), np.float32)
    elif kind == "stripes":
        duty = rng.uniform(0.3, 0.6)
        t = ((u / period) % 1.0 < duty).astype(np.float32)
    elif kind == "checks":
        t = (((u // period) + (v // period)) % 2).astype(np.float32)
    elif kind == "dots":
        t = ((np.sin(2 * np.pi * u / period) * np.sin(2 * np.pi * v / period)) > 0.55).astype(np.float32)
    elif kind == "plaid":
        t = 0.5 * ((u / period) % 1.0 < 0.35) + 0.5 * ((v / (period * 1.3)) % 1.0 < 0.35)
        t = t.astype(np.float32)
    else:  # tweed / knit: per-pixel random fibres
        t = (rng.random((h, w), dtype=np.float32) < rng.uniform(0.2, 0.5)).astype(np.float32)
    tex = _mix(base.astype(np.float32), second, t)
    grain = 1.0 + rng.uniform(0.04, 0.12) * (rng.random((h, w, 1), dtype=np.float32) - 0.5) * 2
    return np.clip(tex * grain, 0, 1)


# Skin tones (sRGB, light → dark), loosely following the Fitzpatrick scale.
SKIN_TONES: Final = np.array(
    [[0.96, 0.84, 0.74], [0.92, 0.76, 0.63], [0.85, 0.66, 0.52], [0.74, 0.55, 0.40],
     [0.60, 0.42, 0.30], [0.45, 0.31, 0.22], [0.33, 0.23, 0.17]], np.float32,
)
HAIR_COLOURS: Final = np.array(
    [[0.08, 0.06, 0.05], [0.22, 0.14, 0.08], [0.40, 0.26, 0.14], [0.70, 0.55, 0.30],
     [0.55, 0.22, 0.10], [0.60, 0.60, 0.60], [0.85, 0.82, 0.75]], np.float32,
)


def skin_texture(rng: np.random.Generator, h: int, w: int, tone: np.ndarray) -> Texture:
    """Skin: tone + pores (per-pixel noise) + freckles/moles (sparse dark dots)."""
    pores = 1.0 + 0.07 * (rng.random((h, w, 1), dtype=np.float32) - 0.5) * 2
    tex = tone[None, None, :] * pores
    freckles = rng.random((h, w), dtype=np.float32) < rng.uniform(0.0, 0.04)
    tex[freckles] *= 0.75
    return np.clip(tex, 0, 1)


def hair_texture(rng: np.random.Generator, h: int, w: int, colour: np.ndarray, pixel_scale: float) -> Texture:
    """Hair: fine strands (1.5–3 px period stripes, slightly curly) + highlights."""
    yy, xx = _grid(h, w)
    period = rng.uniform(1.5, 3.0) * pixel_scale
    curl = rng.uniform(0, 0.6)
    strands = np.sin(2 * np.pi * (xx + curl * 3 * np.sin(yy / (2.0 * pixel_scale))) / period)
    shade = 1.0 + 0.25 * strands[..., None] + 0.1 * (rng.random((h, w, 1), dtype=np.float32) - 0.5)
    return np.clip(colour[None, None, :] * shade + 0.04, 0, 1).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Backgrounds. Each takes (rng, h, w, palette) where palette is a (k, 3) array of site colours.

Background = Callable[[np.random.Generator, int, int, np.ndarray], Texture]


def _pick(rng: np.random.Generator, palette: np.ndarray) -> np.ndarray:
    colour = palette[rng.integers(len(palette))] + rng.normal(0, 0.06, 3)
    return np.clip(colour, 0, 1).astype(np.float32)


def bg_gradient(rng: np.random.Generator, h: int, w: int, palette: np.ndarray) -> Texture:
    yy, xx = _grid(h, w)
    angle = rng.uniform(0, 2 * np.pi)
    t = (xx * np.cos(angle) + yy * np.sin(angle)) / max(h, w)
    t = (t - t.min()) / max(1e-6, float(np.ptp(t)))
    tex = _mix(_pick(rng, palette), _pick(rng, palette), t)
    return np.clip(tex + 0.05 * (smooth_noise(rng, h, w, 6) - 0.5), 0, 1)


def bg_room(rng: np.random.Generator, h: int, w: int, palette: np.ndarray) -> Texture:
    """Wall above a horizon, textured floor below, a door/window rectangle or two."""
    yy, _ = _grid(h, w)
    horizon = rng.uniform(0.45, 0.85) * h
    wall, floor = _pick(rng, palette), _pick(rng, palette) * 0.8
    tex = np.where((yy < horizon)[..., None], wall[None, None], floor[None, None]).astype(np.float32)
    tex = np.broadcast_to(tex, (h, w, 3))
    tex = tex * (0.9 + 0.2 * smooth_noise(rng, h, w, 8))
    img = Image.fromarray((np.clip(tex, 0, 1) * 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.integers(0, 3)):
        x0, y0 = rng.uniform(-0.2, 0.9) * w, rng.uniform(0, 0.4) * horizon
        x1, y1 = x0 + rng.uniform(0.15, 0.5) * w, y0 + rng.uniform(0.2, 0.6) * h
        draw.rectangle([x0, y0, x1, max(y0, min(y1, horizon))], fill=tuple(int(c * 255) for c in _pick(rng, palette)))
    return np.asarray(img, np.float32) / 255


def bg_tiles(rng: np.random.Generator, h: int, w: int, palette: np.ndarray) -> Texture:
    """Tiled wall or brick: medium-frequency grid lines."""
    yy, xx = _grid(h, w)
    tile = rng.uniform(14, 40) * h / 256
    offset = (yy // tile % 2) * tile * 0.5 if rng.random() < 0.5 else 0.0
    grout = np.broadcast_to(((xx + offset) % (tile * rng.uniform(1, 2)) < 2) | (yy % tile < 2), (h, w))
    base = _pick(rng, palette)
    tex = base[None, None] * (0.85 + 0.3 * smooth_noise(rng, h, w, 12))
    tex[grout] = tex[grout] * 0.55
    return np.clip(tex, 0, 1)


def bg_clouds(rng: np.random.Generator, h: int, w: int, palette: np.ndarray) -> Texture:
    """Multi-octave value noise between two colours (outdoor foliage, stone, blurry scenes)."""
    t = 0.5 * smooth_noise(rng, h, w, 4) + 0.3 * smooth_noise(rng, h, w, 10) + 0.2 * smooth_noise(rng, h, w, 24)
    return np.clip(_mix(_pick(rng, palette), _pick(rng, palette), t[..., 0]), 0, 1)


def bg_outdoor(rng: np.random.Generator, h: int, w: int, palette: np.ndarray) -> Texture:
    """Sky gradient above, grass/pavement noise below, a few tree/bush blobs."""
    yy, _ = _grid(h, w)
    horizon = rng.uniform(0.3, 0.7) * h
    sky = _mix(np.array([0.55, 0.7, 0.95], np.float32), np.array([0.85, 0.9, 0.97], np.float32), np.broadcast_to(yy / h, (h, w)))
    ground_colour = _pick(rng, palette)
    ground = ground_colour[None, None] * (0.75 + 0.5 * smooth_noise(rng, h, w, 20))
    tex = np.where((yy < horizon)[..., None], sky, ground)
    img = Image.fromarray((np.clip(tex, 0, 1) * 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.integers(1, 5)):
        cx, cy, r = rng.uniform(0, w), horizon + rng.uniform(-0.25, 0.05) * h, rng.uniform(0.08, 0.25) * h
        green = (int(rng.uniform(20, 80)), int(rng.uniform(70, 140)), int(rng.uniform(20, 70)))
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=green)
    return np.asarray(img, np.float32) / 255


def bg_clutter(rng: np.random.Generator, h: int, w: int, palette: np.ndarray) -> Texture:
    """A base texture covered with random shapes: boxes, discs, bars and limb-like capsules."""
    base = bg_gradient(rng, h, w, palette)
    img = Image.fromarray((base * 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.integers(6, 18)):
        colour = tuple(int(c * 255) for c in (_pick(rng, palette) if rng.random() < 0.6 else rng.uniform(0, 1, 3)))
        x, y = rng.uniform(-0.1, 1.1) * w, rng.uniform(-0.1, 1.1) * h
        size = rng.uniform(0.04, 0.3) * h
        kind = rng.integers(4)
        if kind == 0:
            draw.rectangle([x, y, x + size * rng.uniform(0.3, 2), y + size * rng.uniform(0.3, 2)], fill=colour)
        elif kind == 1:
            draw.ellipse([x, y, x + size, y + size * rng.uniform(0.5, 1.5)], fill=colour)
        else:  # bars and capsules look like limbs: the model must use context, not "any bar is an arm"
            angle = rng.uniform(0, np.pi)
            x2, y2 = x + np.cos(angle) * size * 1.5, y + np.sin(angle) * size * 1.5
            draw.line([x, y, x2, y2], fill=colour, width=int(rng.uniform(3, 12) * h / 256))
    return np.asarray(img, np.float32) / 255


BACKGROUNDS: Final[dict[str, Background]] = {
    "gradient": bg_gradient,
    "room": bg_room,
    "tiles": bg_tiles,
    "clouds": bg_clouds,
    "outdoor": bg_outdoor,
    "clutter": bg_clutter,
}
