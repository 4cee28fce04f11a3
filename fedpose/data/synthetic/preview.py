"""Contact sheets for a generated dataset: preview.png (skeleton overlays) and blur_demo.png.

blur_demo.png shows what FDP treats as public: ψ(x) = Gaussian blur (σ = 6 px, 21-tap kernel,
the FDP default) — the face, skin and clothing detail vanish while the limbs, and so the pose,
survive.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from fedpose.data.annotations import PoseRecord, resolve_image
from fedpose.io import atomic_write
from fedpose.joints import JOINT_NAMES, SKELETON

FDP_BLUR_SIGMA = 6.0
FDP_BLUR_KERNEL = 21


def gaussian_kernel(sigma: float = FDP_BLUR_SIGMA, kernel_size: int = FDP_BLUR_KERNEL) -> np.ndarray:
    radius = kernel_size // 2
    x = np.arange(-radius, radius + 1, dtype=np.float64)
    k = np.exp(-0.5 * (x / sigma) ** 2)
    return k / k.sum()


def gaussian_blur(image: np.ndarray, sigma: float = FDP_BLUR_SIGMA, kernel_size: int = FDP_BLUR_KERNEL) -> np.ndarray:
    """Separable truncated Gaussian blur of an (H, W[, C]) array, reflect padding; float32 out."""
    from scipy.ndimage import convolve1d  # lazy: keeps worker start-up light

    k = gaussian_kernel(sigma, kernel_size)
    out = convolve1d(image.astype(np.float32), k, axis=0, mode="reflect")
    return convolve1d(out, k, axis=1, mode="reflect")


def _side_colour(joint_a: int, joint_b: int) -> tuple[int, int, int]:
    names = JOINT_NAMES[joint_a] + JOINT_NAMES[joint_b]
    if "r_" in names:
        return (255, 60, 60)
    if "l_" in names:
        return (60, 140, 255)
    return (60, 230, 90)


def draw_pose(image: Image.Image, record: PoseRecord, headbox: bool = True) -> Image.Image:
    """Skeleton overlay: person's right side red, left side blue, spine green; vis-0 joints skipped."""
    out = image.copy()
    draw = ImageDraw.Draw(out)
    j, vis = record.joints, record.joints_vis
    for a, b in SKELETON:
        if vis[a] > 0 and vis[b] > 0:
            draw.line([tuple(j[a]), tuple(j[b])], fill=_side_colour(a, b), width=2)
    for i, (x, y) in enumerate(j):
        if vis[i] > 0:
            occluded = record.extra.get("occluded", [0] * len(j))[i]
            draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=(255, 255, 255) if not occluded else (255, 220, 0))
    if headbox and record.headbox is not None:
        draw.rectangle([*record.headbox[0], *record.headbox[1]], outline=(255, 230, 0))
    return out


def _grid(tiles: list[Image.Image], columns: int, labels: list[str]) -> Image.Image:
    w, h = tiles[0].size
    rows = (len(tiles) + columns - 1) // columns
    sheet = Image.new("RGB", (columns * w, rows * (h + 12)), (20, 20, 20))
    draw = ImageDraw.Draw(sheet)
    for i, (tile, label) in enumerate(zip(tiles, labels)):
        x, y = (i % columns) * w, (i // columns) * (h + 12)
        draw.text((x + 2, y), label, fill=(230, 230, 230))
        sheet.paste(tile, (x, y + 12))
    return sheet


def _save(path: Path, image: Image.Image) -> None:
    atomic_write(path, lambda fh: image.save(fh, format="PNG"))


def save_preview(path: Path, root: Path, split_records: dict[str, list[PoseRecord]], per_split: int = 4, max_splits: int = 6) -> None:
    tiles, labels = [], []
    for name, records in list(split_records.items())[:max_splits]:
        for record in records[:per_split]:
            image = Image.open(resolve_image(root / name, record.image)).convert("RGB")
            tiles.append(draw_pose(image, record))
            labels.append(f"{name} {record.extra.get('pose_family', '')}")
    if tiles:
        _save(path, _grid(tiles, columns=per_split * 2 if len(tiles) > per_split * 3 else per_split, labels=labels))


def save_blur_demo(path: Path, root: Path, split_records: dict[str, list[PoseRecord]], count: int = 4) -> None:
    """Rows: original | ψ(x) blurred | blurred with the ground-truth skeleton | face crops ×3."""
    chosen = []
    for name, records in split_records.items():
        for record in records:
            if record.extra.get("facing") == "front" and not record.extra.get("truncated"):
                chosen.append((name, record))
                break
        if len(chosen) >= count:
            break
    tiles, labels = [], []
    for name, record in chosen:
        original = np.asarray(Image.open(resolve_image(root / name, record.image)).convert("RGB"))
        blurred = Image.fromarray(np.clip(gaussian_blur(original) + 0.5, 0, 255).astype(np.uint8))
        h, w = original.shape[:2]
        x1, y1, x2, y2 = record.extra["face_box"]
        pad = 4
        box = (int(max(0, x1 - pad)), int(max(0, y1 - pad)), int(min(w, x2 + pad)), int(min(h, y2 + pad)))
        face = Image.fromarray(original).crop(box)
        face_blur = blurred.crop(box)
        zoom = Image.new("RGB", (w, h), (20, 20, 20))
        fw, fh = face.size
        k = max(1, int(min((w // 2) / max(fw, 1), h / max(fh, 1))))
        zoom.paste(face.resize((fw * k, fh * k), Image.NEAREST), (0, 0))
        zoom.paste(face_blur.resize((fw * k, fh * k), Image.NEAREST), (w // 2, 0))
        tiles += [Image.fromarray(original), blurred, draw_pose(blurred, record, headbox=False), zoom]
        labels += [f"{name} original", "blur s=6 k=21", "pose survives", "face: orig | blur"]
    if tiles:
        _save(path, _grid(tiles, columns=4, labels=labels))
