"""Contact sheets for a generated dataset: preview.png (skeleton overlays) and public_view_demo.png.

public_view_demo.png shows what FDP treats as public: ψ(x) with the default ``privacy.public_view``
(area-downsample f×f + b-bit quantization, fedpose.privacy.public_views) — the face, skin and
clothing detail vanish while the limbs, and so the pose, survive.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from fedpose.data.annotations import PoseRecord, resolve_image
from fedpose.io import atomic_write
from fedpose.config import BlurConfig, PublicViewConfig
from fedpose.viz import draw_skeleton

def gaussian_blur(image: np.ndarray) -> np.ndarray:
    """Gaussian blur (σ 6 px, 21 taps: ``privacy.public_view.blur`` defaults) of an (H, W[, C]) array;
    float32 out. The generator's textures are designed so this scale of blur removes identity
    detail; it is *not* FDP's default ψ (a blur is invertible, see fedpose.privacy.public_views)."""
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


#: the image height the default ψ's block size is stated for (``privacy.public_view.factor``)
REFERENCE_HEIGHT = 256


def default_view_config(height: int) -> PublicViewConfig:
    """The default ψ for images ``height`` pixels high: the default block size scaled from 256 px
    (16 at 256×192 = 8 at 128×96, as the config reference states), so the picture shows what a
    site training at this size treats as public."""
    default = PublicViewConfig()
    return default.model_copy(update={"factor": max(2, default.factor * height // REFERENCE_HEIGHT)})


def default_public_view(image: np.ndarray) -> np.ndarray:
    """FDP's default ψ (:func:`default_view_config` for the image's height) of a uint8 (H, W, 3)
    image, cropped to whole blocks and padded back (the dataset applies it to block-aligned windows)."""
    from fedpose.privacy.public_views import ImagePublicView  # lazy: keeps generator worker start-up light

    view = ImagePublicView(default_view_config(image.shape[0]))
    h, w = image.shape[:2]
    hb, wb = h - h % view.block, w - w % view.block
    out = image.copy()
    out[:hb, :wb] = view(np.ascontiguousarray(image[:hb, :wb]))
    return out


def save_public_view_demo(path: Path, root: Path, split_records: dict[str, list[PoseRecord]], count: int = 4) -> None:
    """Rows: original | ψ(x) | ψ(x) with the ground-truth skeleton | face crops ×3."""
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
        blurred = Image.fromarray(default_public_view(original))
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
        view = default_view_config(h)
        labels += [f"{name} original", f"psi: {view.factor}x{view.factor} blocks, {view.bits} bits", "pose survives", "face: orig | psi"]
    if tiles:
        _save(path, _grid(tiles, columns=4, labels=labels))
