"""Contact sheets for a generated dataset: preview.png (skeleton overlays) and blur_demo.png.

blur_demo.png shows what FDP treats as public: ψ(x) = the FDP Gaussian blur with the default
``privacy.blur`` settings (σ = 6 px, 21-tap kernel) — the face, skin and clothing detail vanish while the limbs, and so the pose,
survive.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from fedpose.data.annotations import PoseRecord, resolve_image
from fedpose.io import atomic_write
from fedpose.config import BlurConfig
from fedpose.viz import draw_skeleton

def gaussian_blur(image: np.ndarray) -> np.ndarray:
    """FDP's public view ψ (fedpose.privacy.public_views, default privacy.blur settings) of an
    (H, W[, C]) array; float32 out. The demo shows exactly what FDP treats as public."""
    import torch  # lazy: keeps generator worker start-up light

    from fedpose.privacy.public_views import gaussian_blur as blur_batch

    blur = BlurConfig()
    array = image.astype(np.float32)
    chw = torch.from_numpy(array if array.ndim == 3 else array[..., None]).permute(2, 0, 1)[None]
    out = blur_batch(chw, blur.kernel_size, blur.sigma)[0].permute(1, 2, 0).numpy()
    return out if array.ndim == 3 else out[..., 0]


def draw_pose(image: Image.Image, record: PoseRecord, headbox: bool = True) -> Image.Image:
    """Skeleton overlay (fedpose.viz colours); vis-0 joints skipped; head box in yellow."""
    out = Image.fromarray(draw_skeleton(image, record.joints, record.joints_vis, line_width=2))
    if headbox and record.headbox is not None:
        ImageDraw.Draw(out).rectangle([*record.headbox[0], *record.headbox[1]], outline=(255, 230, 0))
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
        labels += [f"{name} original", f"psi: blur s={BlurConfig().sigma:g} k={BlurConfig().kernel_size}", "pose survives", "face: orig | blur"]
    if tiles:
        _save(path, _grid(tiles, columns=4, labels=labels))
