"""Render one synthetic person image and its MPII-style annotation.

Pipeline for one example (all randomness from one ``numpy.random.Generator``):
  1. :func:`sample_scene` — pose family → 3D skeleton (body.py) → camera view (yaw: mostly facing
     the camera, sometimes from behind; roll) → orthographic projection → person size and position
     (optionally truncated by the frame) → annotation (joints, joints_vis, center, scale, headbox,
     face_box). Geometry only, cheap.
  2. :func:`render_scene` — background → body parts as tapered capsules / hull polygons painted
     back-to-front with clothing/skin/hair textures → head with face (eyes, brows, nose, mouth,
     optional beard/glasses) → occluders → lighting → camera blur, noise, JPEG.

Conventions: joints outside the image get ``joints_vis = 0`` (truncation); occluded joints keep
``joints_vis = 1`` (MPII annotates occluded joints) and are listed in ``extra["occluded"]``.
``scale = max(box_h, box_w·H/W) / 200`` of the full person box (head, hands and feet included), so a
crop of ``200·scale`` at the image aspect ratio contains the whole person. ``face_box`` is the box
of the visible face (the head box when the person faces away).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from PIL import Image, ImageChops, ImageDraw, ImageFilter

from fedpose.data.synthetic import body
from fedpose.data.synthetic.body import JOINT_INDEX, Skeleton3D, rot_y, rot_z
from fedpose.data.synthetic.profiles import SiteProfile
from fedpose.data.synthetic.textures import (
    BACKGROUNDS, HAIR_COLOURS, SKIN_TONES, clothing_texture, hair_texture, skin_texture, smooth_noise,
)
from fedpose.joints import NUM_JOINTS

# Body-part radii (stature units): (start, end) of each tapered capsule.
RADII: dict[str, tuple[float, float]] = {
    "upper_arm": (0.042, 0.034),
    "forearm": (0.033, 0.024),
    "hand": (0.026, 0.02),
    "thigh": (0.066, 0.046),
    "shin": (0.045, 0.031),
    "foot": (0.03, 0.026),
    "neck": (0.034, 0.034),
}
HEAD_HALF_WIDTH = 0.048
HAIR_STYLES = ("short", "long", "bald", "cap")


@dataclass
class Identity:
    """What makes a person recognisable: the fine detail FDP treats as private."""

    skin: np.ndarray
    hair: np.ndarray
    hair_style: str
    shirt: np.ndarray
    pants: np.ndarray
    shoes: np.ndarray
    eyes: np.ndarray
    long_sleeves: bool
    long_pants: bool
    beard: bool
    glasses: bool
    #: seed of the skin, hair and clothing textures (pattern, period, grain). None: drawn from the
    #: image's own stream (a one-off person); set for a synthetic patient, so every image of them
    #: wears the same fabric patterns, not just the same colours
    texture_seed: int | None = None


@dataclass
class Scene:
    family: str
    skeleton: Skeleton3D
    identity: Identity
    view_yaw: float
    rotation: np.ndarray  # (3, 3) body → camera
    pixels_per_unit: float
    offset: np.ndarray  # (2,) pixel translation
    size: tuple[int, int]  # (H, W)
    truncated: bool
    joints: np.ndarray  # (16, 2) px
    joints_vis: np.ndarray  # (16,)
    center: np.ndarray
    scale: float
    headbox: np.ndarray  # (2, 2)
    face_box: list[float]
    head_ellipse: tuple[np.ndarray, np.ndarray, float, float]  # centre px, up unit, half-length, half-width
    face_visibility: float  # cos(angle between face direction and the camera axis)
    extra: dict[str, Any] = field(default_factory=dict)

    def project(self, points: np.ndarray) -> np.ndarray:
        """Body-frame 3D points (..., 3) → pixel xy (..., 2)."""
        cam = points @ self.rotation.T
        return cam[..., :2] * self.pixels_per_unit + self.offset

    def depth(self, points: np.ndarray) -> np.ndarray:
        return (points @ self.rotation.T)[..., 2]


def _weighted_choice(rng: np.random.Generator, weights: dict[str, float]) -> str:
    names = list(weights)
    p = np.array([weights[n] for n in names], float)
    return names[int(rng.choice(len(names), p=p / p.sum()))]


def sample_identity(rng: np.random.Generator, profile: SiteProfile) -> Identity:
    if profile.extra.get("skin_tone_spread") == "uniform":
        tone_index = rng.uniform(0, len(SKIN_TONES) - 1)
    else:
        tone_index = float(np.clip(rng.normal(profile.skin_tone_mean, 1.2), 0, len(SKIN_TONES) - 1))
    lo = int(np.floor(tone_index))
    hi = min(lo + 1, len(SKIN_TONES) - 1)
    skin = SKIN_TONES[lo] * (1 - (tone_index - lo)) + SKIN_TONES[hi] * (tone_index - lo)

    def garment() -> np.ndarray:
        if rng.random() < 0.3:  # dark/neutral clothes are common
            v = rng.uniform(0.08, 0.85)
            return np.clip(np.array([v, v, v]) + rng.normal(0, 0.04, 3), 0, 1).astype(np.float32)
        return rng.uniform(0.05, 0.95, 3).astype(np.float32)

    return Identity(
        skin=skin.astype(np.float32),
        hair=np.clip(HAIR_COLOURS[rng.integers(len(HAIR_COLOURS))] + rng.normal(0, 0.03, 3), 0, 1).astype(np.float32),
        hair_style=str(rng.choice(HAIR_STYLES, p=[0.45, 0.3, 0.1, 0.15])),
        shirt=garment(),
        pants=garment(),
        shoes=np.clip(rng.uniform(0.02, 0.6) * np.ones(3) + rng.normal(0, 0.08, 3), 0, 1).astype(np.float32),
        eyes=rng.choice([[0.25, 0.15, 0.08], [0.2, 0.35, 0.55], [0.25, 0.4, 0.25], [0.1, 0.07, 0.05]]).astype(np.float32),
        long_sleeves=bool(rng.random() < 0.55),
        long_pants=bool(rng.random() < 0.7),
        beard=bool(rng.random() < 0.15),
        glasses=bool(rng.random() < 0.2),
    )


def _head_geometry(skel: Skeleton3D, rotation: np.ndarray, s: float, offset: np.ndarray):
    top = skel.joints[JOINT_INDEX["head_top"]]
    neck = skel.joints[JOINT_INDEX["upper_neck"]]
    centre3 = 0.5 * (top + neck) + skel.head_frame @ np.array([0, 0, 0.012])
    c = (centre3 @ rotation.T)[:2] * s + offset
    axis = ((top - neck) @ rotation.T)[:2]
    length = float(np.linalg.norm(axis))
    up = axis / length if length > 1e-6 else np.array([0.0, -1.0])
    half_width = HEAD_HALF_WIDTH * s
    half_length = max(0.5 * length * s + 0.004 * s, half_width * 1.05)
    return c, up, half_length, half_width


def _ellipse_points(c: np.ndarray, up: np.ndarray, half_length: float, half_width: float, n: int = 28) -> np.ndarray:
    right = np.array([-up[1], up[0]])
    t = np.linspace(0, 2 * np.pi, n, endpoint=False)
    return c + np.outer(np.cos(t) * half_length, up) + np.outer(np.sin(t) * half_width, right)


def sample_scene(
    rng: np.random.Generator, profile: SiteProfile, size: tuple[int, int], family: str | None = None,
    identity: Identity | None = None,
) -> Scene:
    """All geometry and the annotation of one example (no pixels).

    ``identity``: the person to show (a synthetic patient seen in several images); None draws a
    new one. The image's own identity is drawn either way, so pose, view and placement are the
    same random function of ``rng`` with or without a patient."""
    h, w = size
    family = family or _weighted_choice(rng, profile.pose_weights)
    skel = body.sample_pose(family, rng)
    own_identity = sample_identity(rng, profile)
    identity = identity if identity is not None else own_identity
    if rng.random() < profile.back_facing_probability:
        yaw = 180.0 + float(np.clip(rng.normal(0, 25), -60, 60))
    else:
        yaw = float(np.clip(rng.normal(0, 25), -70, 70))
    roll = float(np.clip(rng.normal(0, profile.camera_roll_std), -30, 30))
    lying = bool(profile.lying_probability) and rng.random() < profile.lying_probability
    if lying:  # a patient in bed, seen by a bedside or ceiling camera
        roll = profile.lying_roll + float(np.clip(rng.normal(0, 10), -20, 20))
    rotation = rot_z(roll) @ rot_y(yaw)

    # Person box in stature units, then size and placement in pixels.
    head_top = skel.joints[JOINT_INDEX["head_top"]]
    head_pts = np.array([head_top + d for d in ([0.05, 0, 0], [-0.05, 0, 0], [0, -0.01, 0])])
    pts3 = np.concatenate([skel.joints, skel.hands, skel.feet, head_pts])
    pts = (pts3 @ rotation.T)[:, :2]
    margin = 0.035  # limb thickness beyond the joint centres
    lo, hi = pts.min(0) - margin, pts.max(0) + margin
    extent = hi - lo
    fraction = rng.uniform(*profile.person_height)
    s = fraction * h / extent[1]
    s = min(s, 0.95 * w / extent[0])
    box = extent * s
    truncated = bool(rng.random() < profile.truncation_probability)
    ox = rng.uniform(0, max(0.0, w - box[0])) - lo[0] * s
    oy = rng.uniform(0, max(0.0, h - box[1])) - lo[1] * s
    if truncated:  # push part of the person out of the frame
        side = rng.choice(["bottom", "left", "right", "top"], p=[0.5, 0.2, 0.2, 0.1])
        cut = rng.uniform(0.12, 0.4)
        if side == "bottom":
            oy = h - (1 - cut) * box[1] - lo[1] * s
        elif side == "top":
            oy = -cut * box[1] - lo[1] * s
        elif side == "left":
            ox = -cut * box[0] - lo[0] * s
        else:
            ox = w - (1 - cut) * box[0] - lo[0] * s
    offset = np.array([ox, oy])

    joints = (skel.joints @ rotation.T)[:, :2] * s + offset
    inside = (joints[:, 0] >= 0) & (joints[:, 0] <= w - 1) & (joints[:, 1] >= 0) & (joints[:, 1] <= h - 1)
    box_lo, box_hi = lo * s + offset, hi * s + offset
    center = 0.5 * (box_lo + box_hi)
    scale = max(box[1], box[0] * h / w) / 200.0

    c, up, half_length, half_width = _head_geometry(skel, rotation, s, offset)
    head_outline = _ellipse_points(c, up, half_length, half_width)
    headbox = np.array([head_outline.min(0), head_outline.max(0)])
    face_dir = (skel.head_frame @ body.FORWARD) @ rotation.T
    face_visibility = float(face_dir[2])
    if face_visibility > 0.2:
        fc, fl, fw = _face_ellipse(c, up, half_length, half_width, face_dir)
        face_outline = _ellipse_points(fc, up, fl, fw)
        face_box = [*face_outline.min(0), *face_outline.max(0)]
    else:
        face_box = [*headbox[0], *headbox[1]]

    return Scene(
        family=family, skeleton=skel, identity=identity, view_yaw=yaw, rotation=rotation,
        pixels_per_unit=s, offset=offset, size=size, truncated=truncated,
        joints=joints.astype(np.float32), joints_vis=inside.astype(np.float32),
        center=center.astype(np.float32), scale=float(scale), headbox=headbox.astype(np.float32),
        face_box=[round(float(v), 2) for v in face_box],
        head_ellipse=(c, up, half_length, half_width), face_visibility=face_visibility,
        extra={"lying": True} if lying else {},
    )


def _face_ellipse(c, up, half_length, half_width, face_dir):
    """The skin region of the face: lower part of the head, shifted towards where the face points."""
    right = np.array([-up[1], up[0]])
    lateral = float(face_dir[0] * right[0] + face_dir[1] * right[1])
    fc = c - up * 0.12 * half_length + right * lateral * 0.45 * half_width
    visibility = max(0.0, float(face_dir[2]))
    return fc, 0.8 * half_length, half_width * (0.45 + 0.4 * visibility)


# ---------------------------------------------------------------------------------------------
# Drawing


def _capsule(draw: ImageDraw.ImageDraw, p: np.ndarray, q: np.ndarray, r1: float, r2: float, fill: int = 255) -> None:
    d = q - p
    n = np.array([-d[1], d[0]]) / max(1e-6, float(np.linalg.norm(d)))
    poly = [tuple(p + n * r1), tuple(q + n * r2), tuple(q - n * r2), tuple(p - n * r1)]
    draw.polygon(poly, fill=fill)
    draw.ellipse([p[0] - r1, p[1] - r1, p[0] + r1, p[1] + r1], fill=fill)
    draw.ellipse([q[0] - r2, q[1] - r2, q[0] + r2, q[1] + r2], fill=fill)


def _convex_hull(points: np.ndarray) -> np.ndarray:
    """Andrew's monotone chain (2D)."""
    pts = sorted(map(tuple, points))
    if len(pts) <= 2:
        return np.array(pts)

    def cross(o, a, b):
        return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])

    lower, upper = [], []
    for p in pts:
        while len(lower) >= 2 and cross(lower[-2], lower[-1], p) <= 0:
            lower.pop()
        lower.append(p)
    for p in reversed(pts):
        while len(upper) >= 2 and cross(upper[-2], upper[-1], p) <= 0:
            upper.pop()
        upper.append(p)
    return np.array(lower[:-1] + upper[:-1])


def _ring(centre: np.ndarray, frame: np.ndarray, half_width: float, half_depth: float, n: int = 14) -> np.ndarray:
    t = np.linspace(0, 2 * np.pi, n, endpoint=False)
    local = np.stack([np.cos(t) * half_width, np.zeros_like(t), np.sin(t) * half_depth], 1)
    return centre + local @ frame.T


@dataclass
class _Part:
    depth: float
    material: str
    shape: str  # "capsule" | "polygon"
    points: np.ndarray
    radii: tuple[float, float] = (0.0, 0.0)


def _body_parts(scene: Scene) -> list[_Part]:
    skel, ident, s = scene.skeleton, scene.identity, scene.pixels_per_unit
    J = skel.joints
    torso = skel.torso_frame
    parts: list[_Part] = []

    # Torso: hull of elliptical cross-sections (chest, waist, hips) so bending and yaw look right.
    pelvis, thorax = J[JOINT_INDEX["pelvis"]], J[JOINT_INDEX["thorax"]]
    chest = _ring(thorax + torso @ np.array([0, 0.03, 0]), torso, 0.15, 0.08)
    waist = _ring(pelvis + torso @ np.array([0, -0.1, 0]), torso, 0.12, 0.07)
    belt = _ring(pelvis + torso @ np.array([0, -0.06, 0]), torso, 0.125, 0.072)
    hips = _ring(pelvis + np.array([0, 0.04, 0]), np.eye(3), 0.135, 0.08)
    torso_depth = float(scene.depth(np.stack([pelvis, thorax])).mean()) - 0.03
    parts.append(_Part(torso_depth - 0.001, "pants", "polygon", _convex_hull(scene.project(np.concatenate([belt, hips])))))
    parts.append(_Part(torso_depth, "shirt", "polygon", _convex_hull(scene.project(np.concatenate([chest, waist])))))

    neck3 = np.stack([thorax, J[JOINT_INDEX["upper_neck"]]])
    parts.append(_Part(torso_depth + 0.005, "skin", "capsule", scene.project(neck3), tuple(r * s for r in RADII["neck"])))

    for k, side in enumerate(body.SIDES):
        chain = [
            ("upper_arm", J[JOINT_INDEX[f"{side}_shoulder"]], J[JOINT_INDEX[f"{side}_elbow"]], "shirt"),
            ("forearm", J[JOINT_INDEX[f"{side}_elbow"]], J[JOINT_INDEX[f"{side}_wrist"]], "shirt" if ident.long_sleeves else "skin"),
            ("hand", J[JOINT_INDEX[f"{side}_wrist"]], skel.hands[k], "skin"),
            ("thigh", J[JOINT_INDEX[f"{side}_hip"]], J[JOINT_INDEX[f"{side}_knee"]], "pants"),
            ("shin", J[JOINT_INDEX[f"{side}_knee"]], J[JOINT_INDEX[f"{side}_ankle"]], "pants" if ident.long_pants else "skin"),
            ("foot", J[JOINT_INDEX[f"{side}_ankle"]], skel.feet[k], "shoes"),
        ]
        for name, a, b, material in chain:
            seg = np.stack([a, b])
            depth = float(scene.depth(seg).mean())
            if name in ("thigh",):
                depth = min(depth, torso_depth - 0.002)  # thighs start under the hip/pants region
            parts.append(_Part(depth, material, "capsule", scene.project(seg), tuple(r * s for r in RADII[name])))
    if ident.hair_style == "long":  # hair falling onto the back: behind the torso unless seen from behind
        c, up, half_length, half_width = scene.head_ellipse
        head_depth = float(scene.depth(J[[JOINT_INDEX["head_top"], JOINT_INDEX["upper_neck"]]]).mean())
        depth = torso_depth - 0.01 if scene.face_visibility > 0 else head_depth + 0.05
        parts.append(_Part(depth, "hair", "capsule", np.stack([c, c - up * half_length * 1.6]), (half_width * 1.1, half_width * 1.3)))
    return parts


def _paste(canvas: Image.Image, texture: Image.Image, mask: Image.Image) -> None:
    canvas.paste(texture, (0, 0), mask)


def _to_image(array: np.ndarray) -> Image.Image:
    return Image.fromarray((np.clip(array, 0, 1) * 255 + 0.5).astype(np.uint8))


def _draw_head(scene: Scene, canvas: Image.Image, textures: dict[str, Image.Image]) -> None:
    ident = scene.identity
    h, w = scene.size
    c, up, half_length, half_width = scene.head_ellipse
    right = np.array([-up[1], up[0]])
    face_dir = (scene.skeleton.head_frame @ body.FORWARD) @ scene.rotation.T
    head_outline = _ellipse_points(c, up, half_length, half_width)

    head_mask = Image.new("L", (w, h), 0)
    ImageDraw.Draw(head_mask).polygon([tuple(p) for p in head_outline], fill=255)
    bald = ident.hair_style == "bald"
    _paste(canvas, textures["skin" if bald else "hair"], head_mask)

    visibility = scene.face_visibility
    if visibility > -0.1 and not bald:
        fc, fl, fw = _face_ellipse(c, up, half_length, half_width, face_dir)
        face_mask = Image.new("L", (w, h), 0)
        ImageDraw.Draw(face_mask).polygon([tuple(p) for p in _ellipse_points(fc, up, fl, fw)], fill=255)
        _paste(canvas, textures["skin"], ImageChops.multiply(face_mask, head_mask))
    if ident.hair_style == "cap":
        cap = Image.new("L", (w, h), 0)
        cap_centre = c + up * half_length * 0.45
        ImageDraw.Draw(cap).polygon([tuple(p) for p in _ellipse_points(cap_centre, up, half_length * 0.6, half_width * 1.08)], fill=255)
        _paste(canvas, textures["cap"], ImageChops.multiply(cap, head_mask))
    if visibility <= 0.25:
        return
    # Face features: positions in the face frame, squeezed towards the turned side.
    fc, fl, fw = _face_ellipse(c, up, half_length, half_width, face_dir)
    draw = ImageDraw.Draw(canvas)
    u = half_width / 9.0  # face unit ≈ 1 px at 256-px images with an average-size person
    eye_y = fc + up * 0.22 * fl
    eye_dx = 0.42 * fw
    dark = tuple(int(v * 255) for v in np.clip(ident.skin * 0.55, 0, 1))
    hair = tuple(int(v * 255) for v in ident.hair)
    iris = tuple(int(v * 255) for v in ident.eyes)
    for sign in (-1, 1):
        e = eye_y + right * sign * eye_dx
        ex, ey = 1.9 * u * (0.5 + 0.5 * visibility), 1.2 * u
        draw.ellipse([e[0] - ex, e[1] - ey, e[0] + ex, e[1] + ey], fill=(240, 238, 230))
        draw.ellipse([e[0] - 0.9 * u, e[1] - 0.9 * u, e[0] + 0.9 * u, e[1] + 0.9 * u], fill=iris)
        b0, b1 = e + up * 2.6 * u - right * 2 * u, e + up * 2.9 * u + right * 2 * u
        draw.line([tuple(b0), tuple(b1)], fill=hair, width=max(1, int(round(u))))
        if ident.glasses:
            r = 2.8 * u
            draw.ellipse([e[0] - r, e[1] - r, e[0] + r, e[1] + r], outline=(20, 20, 25), width=max(1, int(round(0.8 * u))))
    nose0, nose1 = fc + up * 0.12 * fl, fc - up * 0.15 * fl
    draw.line([tuple(nose0), tuple(nose1)], fill=dark, width=max(1, int(round(u))))
    mouth = fc - up * 0.45 * fl
    mx, my = 2.8 * u * (0.5 + 0.5 * visibility), 0.9 * u
    lips = tuple(int(v * 255) for v in np.clip(ident.skin * np.array([0.85, 0.45, 0.45]), 0, 1))
    draw.ellipse([mouth[0] - mx, mouth[1] - my, mouth[0] + mx, mouth[1] + my], fill=lips)
    if ident.beard:
        beard = Image.new("L", (w, h), 0)
        ImageDraw.Draw(beard).polygon([tuple(p) for p in _ellipse_points(fc - up * 0.55 * fl, up, 0.5 * fl, 0.9 * fw)], fill=255)
        _paste(canvas, textures["hair"], ImageChops.multiply(beard, head_mask))
        draw.ellipse([mouth[0] - mx, mouth[1] - my, mouth[0] + mx, mouth[1] + my], fill=lips)


def _draw_chair(scene: Scene, draw: ImageDraw.ImageDraw, rng: np.random.Generator) -> None:
    """A seat under a sitting person, so the pose has context (drawn before the body)."""
    J = scene.skeleton.joints
    hips = scene.project(J[[JOINT_INDEX["r_hip"], JOINT_INDEX["l_hip"]]])
    knees = scene.project(J[[JOINT_INDEX["r_knee"], JOINT_INDEX["l_knee"]]])
    ankles = scene.project(J[[JOINT_INDEX["r_ankle"], JOINT_INDEX["l_ankle"]]])
    s = scene.pixels_per_unit
    x0 = min(hips[:, 0].min(), knees[:, 0].min()) - 0.06 * s
    x1 = max(hips[:, 0].max(), knees[:, 0].max()) + 0.06 * s
    y_seat = hips[:, 1].mean() + 0.06 * s
    colour = tuple(int(v) for v in rng.uniform(40, 200, 3))
    draw.rectangle([x0, y_seat, x1, y_seat + 0.05 * s], fill=colour)
    y_floor = ankles[:, 1].max()
    for x in (x0 + 0.02 * s, x1 - 0.04 * s):
        draw.rectangle([x, y_seat, x + 0.025 * s, y_floor], fill=colour)


def _draw_bed(scene: Scene, draw: ImageDraw.ImageDraw, rng: np.random.Generator) -> None:
    """A mattress under a patient in bed (drawn before the body): a rectangle along the body's
    long axis in the image, a little longer and wider than the body."""
    points = scene.joints.astype(np.float64)
    centre = points.mean(0)
    _, _, axes = np.linalg.svd(points - centre, full_matrices=False)
    along, across = axes[0], axes[1]
    t, u = (points - centre) @ along, (points - centre) @ across
    s = scene.pixels_per_unit
    t0, t1 = t.min() - 0.12 * s, t.max() + 0.12 * s
    u0, u1 = u.min() - 0.1 * s, u.max() + 0.1 * s
    corners = [centre + a * along + b * across for a, b in ((t0, u0), (t1, u0), (t1, u1), (t0, u1))]
    sheet = tuple(int(v) for v in rng.uniform(170, 240, 3))
    draw.polygon([tuple(c) for c in corners], fill=sheet)


def _occluders(scene: Scene, canvas: Image.Image, rng: np.random.Generator, palette: np.ndarray) -> np.ndarray:
    """Objects in front of the person; returns the occluded-joint flags."""
    h, w = scene.size
    s = scene.pixels_per_unit
    occluded = np.zeros(NUM_JOINTS, np.float32)
    limb_joints = [0, 1, 4, 5, 10, 11, 14, 15, 2, 3]
    for _ in range(int(rng.integers(1, 3))):
        target = scene.joints[limb_joints[int(rng.integers(len(limb_joints)))]]
        centre = target + rng.normal(0, 0.04 * s, 2)
        mask = Image.new("L", (w, h), 0)
        draw = ImageDraw.Draw(mask)
        kind = rng.integers(3)
        if kind == 0:  # box / table edge
            half = rng.uniform(0.06, 0.18, 2) * s
            draw.rectangle([*(centre - half), *(centre + half)], fill=255)
        elif kind == 1:  # ball / bag
            r = rng.uniform(0.05, 0.12) * s
            draw.ellipse([*(centre - r), *(centre + r)], fill=255)
        else:  # pole / bar
            angle = rng.uniform(0, np.pi)
            d = np.array([np.cos(angle), np.sin(angle)]) * max(h, w)
            draw.line([tuple(centre - d), tuple(centre + d)], fill=255, width=int(rng.uniform(0.03, 0.07) * s) + 2)
        base = palette[int(rng.integers(len(palette)))] if rng.random() < 0.5 else rng.uniform(0.1, 0.9, 3)
        tex = np.clip(np.asarray(base, np.float32)[None, None] * (0.75 + 0.5 * smooth_noise(rng, h, w, 16)), 0, 1)
        _paste(canvas, _to_image(tex), mask)
        m = np.asarray(mask) > 0
        for j, (x, y) in enumerate(scene.joints):
            if 0 <= x < w and 0 <= y < h and m[int(y), int(x)]:
                occluded[j] = 1
    return occluded


def _region(scene: Scene, parts: list[_Part]) -> tuple[int, int, int, int]:
    h, w = scene.size
    c, _, half_length, _ = scene.head_ellipse
    lo = np.array([c[0] - 2 * half_length, c[1] - 2 * half_length])
    hi = np.array([c[0] + 2 * half_length, c[1] + 2 * half_length])
    for part in parts:
        r = max(part.radii) + 2
        lo = np.minimum(lo, part.points.min(0) - r)
        hi = np.maximum(hi, part.points.max(0) + r)
    x0, y0 = int(np.clip(np.floor(lo[0]), 0, w - 1)), int(np.clip(np.floor(lo[1]), 0, h - 1))
    x1, y1 = int(np.clip(np.ceil(hi[0]), x0 + 1, w)), int(np.clip(np.ceil(hi[1]), y0 + 1, h))
    return x0, y0, x1, y1


def _darker(image: Image.Image, factor: float) -> Image.Image:
    return image.point([int(v * factor) for v in range(256)] * 3)


def _paint_person(scene: Scene, parts: list[_Part], canvas: Image.Image, rng: np.random.Generator, pixel_scale: float) -> None:
    """Paint body parts back-to-front (painter's algorithm) and the head onto ``canvas``."""
    h, w = scene.size
    ident = scene.identity
    # a patient's textures come from their own seed: the same fabric in every image of them
    texture_rng = rng if ident.texture_seed is None else np.random.default_rng(ident.texture_seed)
    textures = {
        "skin": skin_texture(texture_rng, h, w, ident.skin),
        "hair": hair_texture(texture_rng, h, w, ident.hair, pixel_scale),
        "shirt": clothing_texture(texture_rng, h, w, ident.shirt, pixel_scale),
        "pants": clothing_texture(texture_rng, h, w, ident.pants, pixel_scale),
        "shoes": clothing_texture(texture_rng, h, w, ident.shoes, pixel_scale),
    }
    if ident.hair_style == "cap":
        textures["cap"] = clothing_texture(texture_rng, h, w, texture_rng.uniform(0.1, 0.9, 3).astype(np.float32), pixel_scale)
    images = {k: _to_image(v) for k, v in textures.items()}
    # Parts farther away than the torso are slightly darker: separates overlapping limbs.
    shaded: dict[str, Image.Image] = {}
    torso_depth = max(p.depth for p in parts if p.material == "shirt" and p.shape == "polygon")
    head_depth = float(scene.depth(scene.skeleton.joints[[JOINT_INDEX["head_top"], JOINT_INDEX["upper_neck"]]]).mean())
    head_drawn = False
    outline = ImageDraw.Draw(canvas)
    for part in parts:
        if not head_drawn and part.depth > head_depth + 0.04:
            _draw_head(scene, canvas, images)
            head_drawn = True
        mask = Image.new("L", (w, h), 0)
        draw = ImageDraw.Draw(mask)
        if part.shape == "capsule":
            _capsule(draw, part.points[0], part.points[1], *part.radii)
        else:
            draw.polygon([tuple(p) for p in part.points], fill=255)
        behind = part.depth < torso_depth - 0.05 and part.shape == "capsule"
        if behind and part.material != "hair":
            if part.material not in shaded:
                shaded[part.material] = _darker(images[part.material], 0.78)
            _paste(canvas, shaded[part.material], mask)
        else:
            _paste(canvas, images[part.material], mask)
        if part.shape == "capsule":  # a thin darker contour, as real limbs have shading at edges
            edge = tuple(int(v * 255 * 0.6) for v in getattr(ident, part.material))
            p, q = part.points
            d = q - p
            n = np.array([-d[1], d[0]]) / max(1e-6, float(np.linalg.norm(d)))
            r1, r2 = part.radii
            outline.line([tuple(p + n * r1), tuple(q + n * r2)], fill=edge, width=1)
            outline.line([tuple(p - n * r1), tuple(q - n * r2)], fill=edge, width=1)
    if not head_drawn:
        _draw_head(scene, canvas, images)


def render_scene(scene: Scene, rng: np.random.Generator, profile: SiteProfile) -> np.ndarray:
    """Pixels for a sampled scene: uint8 (H, W, 3)."""
    h, w = scene.size
    pixel_scale = h / 256.0
    palette = np.asarray(profile.palette, np.float32)
    bg_name = _weighted_choice(rng, profile.background_weights)
    canvas = _to_image(BACKGROUNDS[bg_name](rng, h, w, palette))
    if scene.extra.get("lying"):
        _draw_bed(scene, ImageDraw.Draw(canvas), rng)
    elif scene.family == "sitting":
        _draw_chair(scene, ImageDraw.Draw(canvas), rng)

    # Paint the person on a crop around it: textures cost ∝ area, and the person is ~⅓ of the frame.
    parts = sorted(_body_parts(scene), key=lambda p: p.depth)
    x0, y0, x1, y1 = _region(scene, parts)
    local = replace(
        scene, offset=scene.offset - (x0, y0), size=(y1 - y0, x1 - x0),
        head_ellipse=(scene.head_ellipse[0] - (x0, y0), *scene.head_ellipse[1:]),
    )
    crop = canvas.crop((x0, y0, x1, y1))
    _paint_person(local, [replace(p, points=p.points - (x0, y0)) for p in parts], crop, rng, pixel_scale)
    canvas.paste(crop, (x0, y0))

    occluded = np.zeros(NUM_JOINTS, np.float32)
    if rng.random() < profile.occlusion_probability:
        occluded = _occluders(scene, canvas, rng, palette)
    scene.extra["occluded"] = [int(v) for v in occluded]
    scene.extra["background"] = bg_name

    # Lighting: gain, contrast, colour cast and a smooth illumination ramp.
    img = np.asarray(canvas, np.float32) / 255
    jitter = profile.lighting_jitter
    gain = profile.brightness * (1 + rng.normal(0, jitter))
    contrast = profile.contrast * (1 + rng.normal(0, jitter))
    cast = np.asarray(profile.colour_cast, np.float32) * (1 + rng.normal(0, jitter / 3, 3))
    yy, xx = np.arange(h, dtype=np.float32)[:, None], np.arange(w, dtype=np.float32)[None, :]
    angle = rng.uniform(0, 2 * np.pi)
    strength = np.float32(rng.uniform(0, 0.25))
    ramp = 1 + strength * ((xx / w - 0.5) * np.float32(np.cos(angle)) + (yy / h - 0.5) * np.float32(np.sin(angle)))
    img = (img - 0.5) * np.float32(contrast) + 0.5
    img *= (np.float32(gain) * cast.astype(np.float32))[None, None] * ramp[..., None]
    out = _to_image(img)

    # Camera: defocus, sensor noise, JPEG compression.
    sigma = rng.uniform(*profile.blur_sigma) * pixel_scale
    if sigma > 0.25:
        out = out.filter(ImageFilter.GaussianBlur(sigma))
    noise = rng.uniform(*profile.noise_std)
    arr = np.asarray(out, np.float32)
    if noise > 0.5:
        arr = arr + np.float32(noise) * rng.standard_normal(arr.shape, dtype=np.float32)
    arr = np.clip(arr + 0.5, 0, 255).astype(np.uint8)
    if rng.random() < profile.jpeg_probability:
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=int(rng.integers(*profile.jpeg_quality)))
        buf.seek(0)
        arr = np.asarray(Image.open(buf).convert("RGB"))
    if profile.infrared_probability and rng.random() < profile.infrared_probability:
        arr = _infrared(arr, rng)
    return arr


def _infrared(arr: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A night-time infrared camera's view of the scene: one grey channel, flattened contrast,
    a brighter floor, and the sensor noise of low light."""
    grey = arr.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)
    grey = 40 + grey * np.float32(rng.uniform(0.45, 0.7))
    grey += np.float32(rng.uniform(4, 10)) * rng.standard_normal(grey.shape, dtype=np.float32)
    return np.repeat(np.clip(grey + 0.5, 0, 255).astype(np.uint8)[..., None], 3, axis=2)


def annotation_fields(scene: Scene, site: str) -> dict[str, Any]:
    """The record fields (besides the image name) for a rendered scene."""
    return {
        "joints": scene.joints,
        "joints_vis": scene.joints_vis,
        "center": scene.center,
        "scale": scene.scale,
        "headbox": scene.headbox,
        "extra": {
            "site": site,
            "face_box": scene.face_box,
            "pose_family": scene.family,
            "facing": "front" if abs(((scene.view_yaw + 180) % 360) - 180) < 90 else "back",
            "truncated": scene.truncated,
            **scene.extra,
        },
    }


def person_mask(scene: Scene) -> np.ndarray:
    """Boolean (H, W) silhouette of the person (body parts and head), for tests and analysis."""
    h, w = scene.size
    mask = Image.new("L", (w, h), 0)
    draw = ImageDraw.Draw(mask)
    for part in _body_parts(scene):
        if part.shape == "capsule":
            _capsule(draw, part.points[0], part.points[1], *part.radii)
        else:
            draw.polygon([tuple(p) for p in part.points], fill=255)
    draw.polygon([tuple(p) for p in _ellipse_points(*scene.head_ellipse)], fill=255)
    return np.asarray(mask) > 0
