"""Synthetic federated pose data: fedpose's embedded default dataset.

Articulated 3D figures (kinematic tree with joint-angle limits) rendered with skin, face, hair
and patterned clothing on varied backgrounds, one distribution per site (non-IID), written in the
MPII/HRNet annotation schema. See :func:`generate_dataset` and :func:`ensure_dataset`.
"""

from fedpose.data.synthetic.generate import (
    GENERATOR_VERSION,
    MANIFEST_FILE,
    SplitSpec,
    SyntheticDataError,
    dataset_params,
    ensure_dataset,
    generate_dataset,
    interrupted_dataset,
    params_differ,
    parse_size,
    render_example,
)
from fedpose.data.synthetic.preview import gaussian_blur
from fedpose.data.synthetic.profiles import SiteProfile, public_profile, site_profile

__all__ = [
    "GENERATOR_VERSION", "MANIFEST_FILE", "SplitSpec", "SyntheticDataError", "dataset_params", "ensure_dataset",
    "generate_dataset", "interrupted_dataset", "params_differ", "parse_size", "render_example", "gaussian_blur", "SiteProfile",
    "public_profile", "site_profile",
]
