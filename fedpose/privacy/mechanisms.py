"""Registry of gradient mechanisms, keyed by ``privacy.mechanism``.

One engine (:mod:`fedpose.privacy.engine`) runs them all; a mechanism only declares which
pieces it uses:

================  =========  ===========  ============================  =========
mechanism         noisy      projection   public view ψ (noise-free)    guarantee
================  =========  ===========  ============================  =========
``none``          no         no           —                             none
``dpsgd``         yes        no           —                             DP
``pdp``           yes        V Vᵀ         —                             DP
``fdp``           yes        no           ψ(x), default downsample+     FDP
                                          quantize (privacy.public_view)
``fpdp``          yes        V Vᵀ         same as fdp                   FDP
``maskdp``        yes        no           every head in the crop        MaskDP
                                          masked out
================  =========  ===========  ============================  =========

Gradient of one step (DESIGN.md): g = g_pub(ψ(x)) + P( (Σ_u clip(Σ_{i∈u} ∇l(x_i), C) + N(0, σ²C²I)) / B ),
over the sampled protection units u (records, images or patients: :mod:`fedpose.data.units`), with
P = V Vᵀ when projecting (else identity), B the expected number of units per batch and g_pub the
plain mean gradient over the batch's records.
FDP's ψ(x) is not computed here: the dataset computes it once per record before augmentation
(``batch["public_image"]``, :mod:`fedpose.privacy.public_views`); MaskDP's mask is applied to
the augmented crop, with the annotated head boxes mapped through the same augmentation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from fedpose.config import PrivacyConfig
from fedpose.privacy import report
from fedpose.privacy.public_views import mask_view, precomputed_view

PublicView = Callable[[dict, PrivacyConfig], Tensor]


@dataclass(frozen=True)
class Mechanism:
    name: str
    guarantee: report.Guarantee
    noisy: bool  #: clip + Gaussian noise on the private gradient (False only for "none")
    projects: bool  #: project the noisy private gradient onto the public basis V
    public_view: PublicView | None = None  #: ψ whose gradient is added without noise
    #: ψ comes from the dataset (``public_image``, computed before augmentation; privacy.public_view)
    uses_dataset_public_view: bool = False


MECHANISMS: dict[str, Mechanism] = {
    m.name: m
    for m in (
        Mechanism("none", report.NO_PRIVACY, noisy=False, projects=False),
        Mechanism("dpsgd", report.RECORD_DP, noisy=True, projects=False),
        Mechanism("pdp", report.PROJECTED_DP, noisy=True, projects=True),
        Mechanism("fdp", report.FEATURE_DP, noisy=True, projects=False, public_view=precomputed_view, uses_dataset_public_view=True),
        Mechanism("fpdp", report.FEATURE_PROJECTED_DP, noisy=True, projects=True, public_view=precomputed_view, uses_dataset_public_view=True),
        Mechanism("maskdp", report.MASK_DP, noisy=True, projects=False, public_view=mask_view),
    )
}


def get_mechanism(name: str) -> Mechanism:
    try:
        return MECHANISMS[name]
    except KeyError:
        raise ValueError(f"privacy.mechanism: unknown mechanism {name!r}; available: {', '.join(MECHANISMS)}") from None


def guarantee_for(name: str) -> report.Guarantee:
    return get_mechanism(name).guarantee
