"""What a privacy number means: guarantee types, unit protected, and how ε is printed.

fedpose never shows a bare ε. Every ε travels with the guarantee it belongs to (DP, FDP,
MaskDP, ...), its δ and the accountant that produced it; FDP's ε is about the fine detail of
an image whose blurred version and label are public, so it is not comparable with DP-SGD's ε
on whole records. ``format_epsilon`` is the single place that turns the numbers into text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from fedpose.privacy.csprng import SEEDED_NO_GUARANTEE


@dataclass(frozen=True)
class Guarantee:
    """The formal statement a mechanism makes (see DESIGN.md, 'Privacy semantics')."""

    name: str  #: short tag printed next to ε: "DP", "FDP", "MaskDP", "none"
    statement: str  #: the guarantee in words
    unit: str  #: what one neighbouring dataset changes
    public: str  #: what is treated as public (never protected)
    relation: str = "add_remove"  #: neighbouring relation the accountant composes (accountant.RELATIONS)


NO_PRIVACY = Guarantee(
    name="none",
    statement="no formal privacy guarantee",
    unit="nothing",
    public="everything (non-private training)",
)
RECORD_DP = Guarantee(
    name="DP",
    statement="(ε, δ)-differential privacy, Poisson sampling",
    unit="one record (image + keypoints) of the training set",
    public="nothing",
)
PROJECTED_DP = Guarantee(
    name="DP",
    statement="(ε, δ)-differential privacy; projection onto a basis computed from public data only is post-processing",
    unit="one record (image + keypoints) of the training set",
    public="the public set S_pub that the projection basis is computed from",
)
#: Until ψ is many-to-one (the protection-units issue), every FDP statement carries this warning:
#: a Gaussian blur is invertible, so neighbours that share ψ(x) are (almost) the same image.
_INVERTIBLE_VIEW = (" — WARNING: ψ is currently a Gaussian blur, which is invertible (deconvolution recovers the "
                    "crop), so this protects little of the image")

FEATURE_DP = Guarantee(
    name="FDP",
    statement="(ε, δ)-feature-level differential privacy: neighbouring datasets share ψ(x) and the label" + _INVERTIBLE_VIEW,
    unit="the fine detail of one image (what the Gaussian blur ψ removes)",
    public="ψ(x) = Gaussian blur of each image, and the keypoints; the public-loss gradient carries no noise",
    relation="replace_public_membership",
)
FEATURE_PROJECTED_DP = Guarantee(
    name="FDP",
    statement="(ε, δ)-feature-level differential privacy (FP-DP): FDP with public-subspace projection" + _INVERTIBLE_VIEW,
    unit="the fine detail of one image (what the Gaussian blur ψ removes)",
    public="ψ(x) = Gaussian blur of each image, the keypoints, and S_pub",
    relation="replace_public_membership",
)
MASK_DP = Guarantee(
    name="MaskDP",
    statement="(ε, δ)-MaskDP: neighbouring datasets differ only inside the declared private region of one record",
    unit="the masked-private region (head/face box) of one record",
    public="the image outside the private region, and the keypoints; the mask comes from the annotation box only",
    relation="replace_public_membership",
)


def format_epsilon(epsilon: float, delta: float, guarantee: str | Guarantee, accountant: str = "rdp") -> str:
    """``ε = 0.800 (DP, δ = 4e-05, RDP)`` — the only way fedpose prints an ε."""
    tag = guarantee.name if isinstance(guarantee, Guarantee) else str(guarantee)
    if tag == "none":
        return "ε = ∞ (no privacy: non-private training)"
    eps_text = "∞" if not math.isfinite(epsilon) else f"{epsilon:.4g}"
    return f"ε = {eps_text} ({tag}, δ = {delta:.3g}, {accountant.upper()})"


def describe(report: Mapping[str, Any]) -> str:
    """Human summary of an ``engine.privacy_report()`` / privacy.json dict, one fact per line."""
    lines = [f"mechanism: {report['mechanism']}"]
    if report.get("guarantee") == "none":
        lines.append(format_epsilon(math.inf, 0.0, "none"))
        lines.append("randomness: none drawn (no noise)")
        return "\n".join(lines)
    epsilon_line = format_epsilon(report["epsilon"], report["delta"], report["guarantee"], report["accountant"])
    # Seeded test noise can be regenerated and subtracted: the ε above then promises nothing.
    lines.append(f"{SEEDED_NO_GUARANTEE}: {epsilon_line}" if report.get("guarantee_void") else epsilon_line)
    lines.append(f"randomness: {report.get('randomness', 'not recorded (privacy.json predates this field)')}")
    lines.append(f"guarantee: {report['guarantee_statement']}")
    lines.append(f"unit protected: {report['unit_protected']}")
    lines.append(f"adjacency: {report.get('adjacency', report.get('neighbouring_relation', 'not recorded'))}")
    if report.get("dataset_size_public", True):
        lines.append(f"dataset size N: public (q = B/N; N = {report.get('dataset_size', 'not recorded')})")
    else:
        lines.append("dataset size N: secret (the sampling rate q is declared, N enters nothing released)")
    lines.append(f"treated as public: {report['public']}")
    lines.append(
        f"noise multiplier σ = {report['noise_multiplier']:.4g}, clip C = {report['max_grad_norm']:g}, "
        f"sample rate q = {report['sample_rate']:.4g}, steps = {report['steps']}"
    )
    lines.append(f"what leaves: {WHAT_LEAVES}")
    return "\n".join(lines)


#: What is released, in words (README "Privacy semantics" says the same)
WHAT_LEAVES = (
    "central training publishes only what `fedpose export` writes (weights + this report; checkpoints/, metrics.json "
    "and curves.png hold private-data statistics and stay internal); a federation site sends only its typed reply — "
    "the privatized Δ, a status with a fixed reason code, this cumulative report, basis version, run and round ids"
)


GUARANTEES: dict[str, Guarantee] = {g.name: g for g in (NO_PRIVACY, RECORD_DP, FEATURE_DP, MASK_DP)}


def relation_of(guarantee_name: str) -> str:
    """Neighbouring relation an accountant must use for a guarantee tag ("DP", "FDP", "MaskDP")."""
    if guarantee_name not in GUARANTEES:
        raise ValueError(f"unknown guarantee {guarantee_name!r}; known: {sorted(GUARANTEES)}")
    return GUARANTEES[guarantee_name].relation


#: Keys of a privacy report that may be published with a model: what the guarantee is and how it
#: was computed from declared values. Never the dataset size, losses, gradient norms, batch
#: sizes, seeds or RNG state (privacy.json of a central run is site-internal and may hold N).
PUBLISHABLE_KEYS = frozenset({
    "mechanism", "guarantee", "guarantee_statement", "unit_protected", "public", "epsilon", "delta",
    "epsilon_text", "accountant", "neighbouring_relation", "adjacency", "dataset_size_public", "noise_multiplier",
    "max_grad_norm", "sample_rate", "steps", "randomness", "guarantee_void", "input_privacy", "basis", "public_view",
})


def publishable_report(report: Mapping[str, Any]) -> dict[str, Any]:
    """The part of an engine privacy report that is safe to ship beside a model."""
    return {key: value for key, value in report.items() if key in PUBLISHABLE_KEYS}
