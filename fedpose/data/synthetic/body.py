"""A 3D kinematic human skeleton with joint-angle limits, and the pose families sites draw from.

Units are *stature*: a standing person measures ~1.0 from head top to sole. The body frame has
its origin at the pelvis, x towards the person's LEFT, y DOWN, z FORWARD (out of the chest). A
person facing the camera therefore shows their left side on the image right, as in MPII.

Proportions follow adult anthropometry and the MPII joint definitions: head top → upper neck
(chin level) ≈ 0.125, upper neck → thorax (sternal notch) ≈ 0.06, thorax → pelvis ≈ 0.28,
thigh ≈ shin ≈ 0.245, upper arm ≈ 0.17, forearm ≈ 0.15.

Joint angles are sampled per *pose family* (standing, walking, sitting, ...) and always clipped to
anatomical limits (:data:`LIMITS`): elbows and knees only flex one way, shoulders and hips stay in
their range of motion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Final

import numpy as np

from fedpose.joints import JOINT_INDEX, NUM_JOINTS

# Segment lengths (stature units).
HEAD_LENGTH: Final = 0.125  # upper neck → head top
NECK_LENGTH: Final = 0.06  # thorax → upper neck
TORSO_LENGTH: Final = 0.28  # pelvis → thorax
SHOULDER_HALF_WIDTH: Final = 0.125
HIP_HALF_WIDTH: Final = 0.085
UPPER_ARM: Final = 0.17
FOREARM: Final = 0.15
THIGH: Final = 0.245
SHIN: Final = 0.245
HAND: Final = 0.06
FOOT: Final = 0.1

# Anatomical range of motion, degrees: (min, max).
LIMITS: Final[dict[str, tuple[float, float]]] = {
    "torso_pitch": (-20.0, 95.0),  # forward bend (+) / lean back (−)
    "torso_lean": (-30.0, 30.0),  # sideways
    "torso_twist": (-40.0, 40.0),
    "pelvis_roll": (-15.0, 15.0),
    "neck_pitch": (-30.0, 40.0),
    "neck_roll": (-25.0, 25.0),
    "head_yaw": (-60.0, 60.0),
    "head_pitch": (-30.0, 30.0),
    "shoulder_abduction": (-10.0, 175.0),  # arm sideways away from the body
    "shoulder_flexion": (-50.0, 180.0),  # arm forward/up (+) or backward (−)
    "shoulder_rotation": (-70.0, 80.0),  # humeral rotation about the arm's long axis
    "elbow_flexion": (0.0, 150.0),  # one way only
    "hip_flexion": (-30.0, 130.0),
    "hip_abduction": (-15.0, 60.0),
    "hip_rotation": (-35.0, 35.0),
    "knee_flexion": (0.0, 150.0),  # one way only (shin moves backward)
    "ankle": (70.0, 120.0),  # foot direction relative to the shin
}

SIDES: Final = ("r", "l")


def rot_x(deg: float) -> np.ndarray:
    a = np.deg2rad(deg)
    c, s = np.cos(a), np.sin(a)
    return np.array([[1, 0, 0], [0, c, -s], [0, s, c]])


def rot_y(deg: float) -> np.ndarray:
    a = np.deg2rad(deg)
    c, s = np.cos(a), np.sin(a)
    return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])


def rot_z(deg: float) -> np.ndarray:
    a = np.deg2rad(deg)
    c, s = np.cos(a), np.sin(a)
    return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]])


DOWN: Final = np.array([0.0, 1.0, 0.0])
UP: Final = -DOWN
FORWARD: Final = np.array([0.0, 0.0, 1.0])


@dataclass
class Skeleton3D:
    """Posed 3D body: the 16 MPII joints plus the extra points the renderer needs."""

    joints: np.ndarray  # (16, 3) in MPII order
    hands: np.ndarray  # (2, 3) hand tips, [right, left]
    feet: np.ndarray  # (2, 3) toe tips, [right, left]
    torso_frame: np.ndarray  # (3, 3) columns: torso left, down, forward
    head_frame: np.ndarray  # (3, 3) columns: head left, down, face direction
    angles: dict[str, float]


def clip_angles(angles: dict[str, float]) -> dict[str, float]:
    """Clip every angle to its anatomical limit (keys like 'r_elbow_flexion' use the base limit)."""
    out = {}
    for key, value in angles.items():
        base = key[2:] if key[:2] in ("r_", "l_") else key
        lo, hi = LIMITS[base]
        out[key] = min(hi, max(lo, float(value)))
    return out


def pose_skeleton(angles: dict[str, float]) -> Skeleton3D:
    """Forward kinematics: joint angles (degrees, already within limits) → 3D joints."""
    a = angles
    j = np.zeros((NUM_JOINTS, 3))
    pelvis = np.zeros(3)
    hips_frame = rot_z(a.get("pelvis_roll", 0.0))
    # rot_x(−p) turns the body's up axis (−y) towards +z: positive pitch is a forward bend.
    torso = rot_y(a["torso_twist"]) @ rot_x(-a["torso_pitch"]) @ rot_z(a["torso_lean"])
    thorax = pelvis + torso @ (UP * TORSO_LENGTH)
    neck = torso @ rot_x(-a["neck_pitch"]) @ rot_z(a["neck_roll"])  # positive pitch = chin to chest
    upper_neck = thorax + neck @ (UP * NECK_LENGTH)
    head = neck @ rot_y(a["head_yaw"]) @ rot_x(-a["head_pitch"])
    head_top = upper_neck + head @ (UP * HEAD_LENGTH)

    j[JOINT_INDEX["pelvis"]] = pelvis
    j[JOINT_INDEX["thorax"]] = thorax
    j[JOINT_INDEX["upper_neck"]] = upper_neck
    j[JOINT_INDEX["head_top"]] = head_top

    hands, feet = np.zeros((2, 3)), np.zeros((2, 3))
    for k, side in enumerate(SIDES):
        sign = -1.0 if side == "r" else 1.0  # the right side is at −x
        # Arm: abduct in the frontal plane (outwards = towards the side's sign), then flex forward.
        shoulder = thorax + torso @ np.array([sign * SHOULDER_HALF_WIDTH, 0.015, 0.0])
        arm = (
            torso
            @ rot_x(a[f"{side}_shoulder_flexion"])
            @ rot_z(-sign * a[f"{side}_shoulder_abduction"])
            @ rot_y(sign * a[f"{side}_shoulder_rotation"])
        )
        elbow = shoulder + arm @ (DOWN * UPPER_ARM)
        forearm = arm @ rot_x(a[f"{side}_elbow_flexion"])  # elbow flexes forward in the arm frame
        wrist = elbow + forearm @ (DOWN * FOREARM)
        hands[k] = wrist + forearm @ (DOWN * HAND)

        hip = pelvis + hips_frame @ np.array([sign * HIP_HALF_WIDTH, 0.01, 0.0])
        leg = (
            hips_frame
            @ rot_x(a[f"{side}_hip_flexion"])
            @ rot_z(-sign * a[f"{side}_hip_abduction"])
            @ rot_y(sign * a[f"{side}_hip_rotation"])
        )
        knee = hip + leg @ (DOWN * THIGH)
        shin = leg @ rot_x(-a[f"{side}_knee_flexion"])  # knee flexes backward
        ankle = knee + shin @ (DOWN * SHIN)
        feet[k] = ankle + shin @ rot_x(a[f"{side}_ankle"]) @ (DOWN * FOOT)

        j[JOINT_INDEX[f"{side}_shoulder"]] = shoulder
        j[JOINT_INDEX[f"{side}_elbow"]] = elbow
        j[JOINT_INDEX[f"{side}_wrist"]] = wrist
        j[JOINT_INDEX[f"{side}_hip"]] = hip
        j[JOINT_INDEX[f"{side}_knee"]] = knee
        j[JOINT_INDEX[f"{side}_ankle"]] = ankle
    return Skeleton3D(j, hands, feet, torso, head, dict(angles))


# ---------------------------------------------------------------------------------------------
# Pose families. Each sampler returns raw angles; clip_angles enforces the limits afterwards.

PoseSampler = Callable[[np.random.Generator], dict[str, float]]


def _base(rng: np.random.Generator) -> dict[str, float]:
    """Relaxed standing: small random deviations everywhere."""
    u, n = rng.uniform, rng.normal
    angles = {
        "torso_pitch": u(-5, 8), "torso_lean": n(0, 3), "torso_twist": n(0, 6),
        "neck_pitch": u(-5, 12), "neck_roll": n(0, 5), "head_yaw": n(0, 15), "head_pitch": n(0, 8),
        "pelvis_roll": n(0, 2),
    }
    for s in SIDES:
        angles |= {
            f"{s}_shoulder_abduction": u(4, 22), f"{s}_shoulder_flexion": u(-12, 20),
            f"{s}_shoulder_rotation": u(-15, 35), f"{s}_elbow_flexion": u(0, 35),
            f"{s}_hip_flexion": u(-6, 10), f"{s}_hip_abduction": u(0, 10), f"{s}_hip_rotation": n(0, 8),
            f"{s}_knee_flexion": u(0, 12), f"{s}_ankle": u(80, 100),
        }
    return angles


def standing(rng: np.random.Generator) -> dict[str, float]:
    a = _base(rng)
    if rng.random() < 0.4:  # hands on hips / crossed-ish arms
        for s in SIDES:
            a[f"{s}_shoulder_abduction"] = rng.uniform(20, 45)
            a[f"{s}_elbow_flexion"] = rng.uniform(70, 120)
            a[f"{s}_shoulder_rotation"] = rng.uniform(-60, 10)
    return a


def walking(rng: np.random.Generator) -> dict[str, float]:
    a = _base(rng)
    phase = rng.uniform(-1, 1)
    amp = rng.uniform(20, 40)
    a["r_hip_flexion"], a["l_hip_flexion"] = amp * phase, -amp * phase
    back = "l" if phase > 0 else "r"
    a[f"{back}_knee_flexion"] = rng.uniform(10, 50)
    a["r_shoulder_flexion"], a["l_shoulder_flexion"] = -amp * phase, amp * phase
    for s in SIDES:
        a[f"{s}_elbow_flexion"] = rng.uniform(10, 60)
    return a


def arms_raised(rng: np.random.Generator) -> dict[str, float]:
    a = _base(rng)
    sides = [s for s in SIDES if rng.random() < 0.7] or [SIDES[int(rng.integers(2))]]
    for s in sides:
        if rng.random() < 0.5:  # sideways raise (T-pose up to overhead)
            a[f"{s}_shoulder_abduction"] = rng.uniform(60, 170)
            a[f"{s}_shoulder_flexion"] = rng.uniform(-10, 30)
        else:  # forward/overhead raise
            a[f"{s}_shoulder_flexion"] = rng.uniform(80, 175)
            a[f"{s}_shoulder_abduction"] = rng.uniform(0, 40)
        a[f"{s}_elbow_flexion"] = rng.uniform(0, 100)
        a[f"{s}_shoulder_rotation"] = rng.uniform(-40, 70)
    return a


def reaching(rng: np.random.Generator) -> dict[str, float]:
    """One-arm actions: reaching forward, waving, pointing."""
    a = _base(rng)
    s = SIDES[int(rng.integers(2))]
    kind = rng.integers(3)
    if kind == 0:  # reach forward
        a[f"{s}_shoulder_flexion"] = rng.uniform(50, 120)
        a[f"{s}_elbow_flexion"] = rng.uniform(0, 50)
    elif kind == 1:  # wave: upper arm sideways, forearm up
        a[f"{s}_shoulder_abduction"] = rng.uniform(70, 110)
        a[f"{s}_elbow_flexion"] = rng.uniform(60, 130)
        a[f"{s}_shoulder_rotation"] = rng.uniform(40, 80)
    else:  # point sideways
        a[f"{s}_shoulder_abduction"] = rng.uniform(60, 100)
        a[f"{s}_shoulder_flexion"] = rng.uniform(0, 40)
        a[f"{s}_elbow_flexion"] = rng.uniform(0, 20)
    a["torso_twist"] += rng.normal(0, 10)
    return a


def sitting(rng: np.random.Generator) -> dict[str, float]:
    a = _base(rng)
    a["torso_pitch"] = rng.uniform(-10, 25)
    for s in SIDES:
        a[f"{s}_hip_flexion"] = rng.uniform(70, 105)
        a[f"{s}_knee_flexion"] = rng.uniform(70, 110)
        a[f"{s}_hip_abduction"] = rng.uniform(0, 20)
        a[f"{s}_shoulder_flexion"] = rng.uniform(10, 55)  # hands on the lap or a desk
        a[f"{s}_elbow_flexion"] = rng.uniform(30, 100)
    return a


def bending(rng: np.random.Generator) -> dict[str, float]:
    a = _base(rng)
    pitch = rng.uniform(30, 90)
    a["torso_pitch"] = pitch
    a["neck_pitch"] = -rng.uniform(0, 0.5) * pitch  # keep looking ahead-ish
    for s in SIDES:
        a[f"{s}_knee_flexion"] = rng.uniform(0, 40)
        a[f"{s}_hip_flexion"] = rng.uniform(-5, 15)
        a[f"{s}_shoulder_flexion"] = pitch * rng.uniform(0.5, 1.2)  # arms hang towards the floor
        a[f"{s}_elbow_flexion"] = rng.uniform(0, 50)
    return a


def squatting(rng: np.random.Generator) -> dict[str, float]:
    a = _base(rng)
    if rng.random() < 0.5:  # squat
        a["torso_pitch"] = rng.uniform(10, 45)
        for s in SIDES:
            a[f"{s}_hip_flexion"] = rng.uniform(80, 125)
            a[f"{s}_knee_flexion"] = rng.uniform(100, 145)
            a[f"{s}_hip_abduction"] = rng.uniform(5, 30)
            a[f"{s}_shoulder_flexion"] = rng.uniform(20, 80)
            a[f"{s}_elbow_flexion"] = rng.uniform(0, 90)
    else:  # kneel on one knee
        s, o = ("r", "l") if rng.random() < 0.5 else ("l", "r")
        a[f"{s}_hip_flexion"], a[f"{s}_knee_flexion"] = rng.uniform(-10, 15), rng.uniform(80, 110)
        a[f"{o}_hip_flexion"], a[f"{o}_knee_flexion"] = rng.uniform(70, 100), rng.uniform(70, 100)
    return a


def athletic(rng: np.random.Generator) -> dict[str, float]:
    """Anything within the range of motion (sport, dance, exercise)."""
    a = _base(rng)
    a["torso_pitch"] = rng.uniform(-15, 50)
    a["torso_lean"] = rng.normal(0, 12)
    a["torso_twist"] = rng.normal(0, 15)
    for s in SIDES:
        for name in ("shoulder_abduction", "shoulder_flexion", "shoulder_rotation", "elbow_flexion"):
            lo, hi = LIMITS[name]
            a[f"{s}_{name}"] = rng.uniform(lo, hi)
        a[f"{s}_hip_flexion"] = rng.uniform(-20, 100)
        a[f"{s}_hip_abduction"] = rng.uniform(-5, 45)
        a[f"{s}_knee_flexion"] = rng.uniform(0, 120)
    return a


POSE_FAMILIES: Final[dict[str, PoseSampler]] = {
    "standing": standing,
    "arms_raised": arms_raised,
    "sitting": sitting,
    "bending": bending,
    "walking": walking,
    "reaching": reaching,
    "squatting": squatting,
    "athletic": athletic,
}


def sample_pose(family: str, rng: np.random.Generator) -> Skeleton3D:
    return pose_skeleton(clip_angles(POSE_FAMILIES[family](rng)))
