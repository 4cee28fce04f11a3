"""The 16 MPII joints: order, left/right pairs, skeleton and PCKh groups.

Every dataset in fedpose (synthetic, MPII, COCO) is expressed in this joint order.
"""

from typing import Final

JOINT_NAMES: Final[tuple[str, ...]] = (
    "r_ankle", "r_knee", "r_hip", "l_hip", "l_knee", "l_ankle",
    "pelvis", "thorax", "upper_neck", "head_top",
    "r_wrist", "r_elbow", "r_shoulder", "l_shoulder", "l_elbow", "l_wrist",
)
NUM_JOINTS: Final[int] = len(JOINT_NAMES)
JOINT_INDEX: Final[dict[str, int]] = {name: i for i, name in enumerate(JOINT_NAMES)}

# Index pairs swapped by a horizontal flip.
FLIP_PAIRS: Final[tuple[tuple[int, int], ...]] = ((0, 5), (1, 4), (2, 3), (10, 15), (11, 14), (12, 13))

# Bones drawn in overlays (parent, child).
SKELETON: Final[tuple[tuple[int, int], ...]] = (
    (0, 1), (1, 2), (2, 6), (6, 3), (3, 4), (4, 5),
    (6, 7), (7, 8), (8, 9),
    (7, 12), (12, 11), (11, 10), (7, 13), (13, 14), (14, 15),
)

# PCKh reporting groups (MPII convention). "Head" is the head top only.
PCKH_GROUPS: Final[dict[str, tuple[int, ...]]] = {
    "Head": (9,),
    "Shoulder": (12, 13),
    "Elbow": (11, 14),
    "Wrist": (10, 15),
    "Hip": (2, 3),
    "Knee": (1, 4),
    "Ankle": (0, 5),
}
# Joints excluded from the MPII mean (pelvis and thorax).
PCKH_EXCLUDED: Final[tuple[int, ...]] = (6, 7)


def flip_permutation() -> list[int]:
    """Index map such that joints_flipped = joints[perm] after mirroring x."""
    perm = list(range(NUM_JOINTS))
    for a, b in FLIP_PAIRS:
        perm[a], perm[b] = b, a
    return perm
