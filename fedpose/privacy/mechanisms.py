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
plain mean gradient over a public sample of records drawn independently of the private one (same
rate and shape, its own coins: DESIGN.md takes it over the batch itself, which would show who was
sampled; the independent sample keeps the amplification by subsampling, relation ``replace_one``).
FDP's ψ(x) is not computed here: the dataset computes it once per record before augmentation
(``batch["public_image"]``, :mod:`fedpose.privacy.public_views`); MaskDP's mask is applied to
the augmented crop, with the annotated head boxes mapped through the same augmentation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedpose.privacy import report

#: where a mechanism's noise-free public input comes from: the dataset's ψ(x) (computed once per
#: record, before augmentation) or the augmented crop with every head masked out. The functions
#: live in :mod:`fedpose.privacy.public_views` (this module stays free of torch and of the config,
#: so the config can take its list of mechanism names from here).
PublicViewSource = Literal["dataset", "mask"]


@dataclass(frozen=True)
class Mechanism:
    name: str
    guarantee: report.Guarantee
    noisy: bool  #: clip + Gaussian noise on the private gradient (False only for "none")
    projects: bool  #: project the noisy private gradient onto the public basis V
    public_view: PublicViewSource | None = None  #: ψ whose gradient is added without noise

    @property
    def uses_dataset_public_view(self) -> bool:
        """ψ comes from the dataset (``public_image``, computed before augmentation; privacy.public_view)."""
        return self.public_view == "dataset"


MECHANISMS: dict[str, Mechanism] = {
    m.name: m
    for m in (
        Mechanism("none", report.NO_PRIVACY, noisy=False, projects=False),
        Mechanism("dpsgd", report.RECORD_DP, noisy=True, projects=False),
        Mechanism("pdp", report.PROJECTED_DP, noisy=True, projects=True),
        Mechanism("fdp", report.FEATURE_DP, noisy=True, projects=False, public_view="dataset"),
        Mechanism("fpdp", report.FEATURE_PROJECTED_DP, noisy=True, projects=True, public_view="dataset"),
        Mechanism("maskdp", report.MASK_DP, noisy=True, projects=False, public_view="mask"),
    )
}
#: the mechanism names, in registry order (the config's ``privacy.mechanism`` Literal derives from it)
MECHANISM_NAMES: tuple[str, ...] = tuple(MECHANISMS)
#: the mechanisms that add noise (every one that makes a privacy claim)
NOISY_MECHANISM_NAMES: tuple[str, ...] = tuple(name for name, m in MECHANISMS.items() if m.noisy)


def get_mechanism(name: str) -> Mechanism:
    try:
        return MECHANISMS[name]
    except KeyError:
        raise ValueError(f"privacy.mechanism: unknown mechanism {name!r}; available: {', '.join(MECHANISMS)}") from None
