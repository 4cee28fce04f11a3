"""What a privacy number means: guarantee types, unit protected, and how ε is printed.

fedpose never shows a bare ε. Every ε travels with the guarantee it belongs to (DP, FDP,
MaskDP, ...), its δ and the accountant that produced it; FDP's ε is about what the public view
ψ discards of one record (with the default ψ: everything finer than an f×f-pixel block at b bits
— facial identity, skin and clothing texture) while ψ(x) and the keypoints are public, so it is
not comparable with DP-SGD's ε on whole records. ``format_epsilon`` is the single place that turns the numbers into text.
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, Decimal
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
#: The FDP statements are completed per run by :func:`public_view_statement` (engine.privacy_report),
#: which names ψ's parameters and, for the invertible Gaussian blur, says the relation is degenerate.
FEATURE_DP = Guarantee(
    name="FDP",
    statement="(ε, δ)-feature-level differential privacy: neighbouring datasets differ in one record whose public "
              "view ψ(x) and keypoints stay the same",
    unit="what the public view ψ discards of one record (one person crop)",
    public="ψ(x) of each record (computed once from the original image, before augmentation) and the keypoints; "
           "the public-loss gradient carries no noise and is taken on a sample of records drawn independently of "
           "the private one",
    relation="replace_one",
)
FEATURE_PROJECTED_DP = Guarantee(
    name="FDP",
    statement="(ε, δ)-feature-level differential privacy (FP-DP): FDP with public-subspace projection; neighbouring "
              "datasets differ in one record whose public view ψ(x) and keypoints stay the same",
    unit="what the public view ψ discards of one record (one person crop)",
    public="ψ(x) of each record (computed once from the original image, before augmentation), the keypoints, and S_pub; "
           "the public-loss gradient carries no noise and is taken on a sample of records drawn independently of "
           "the private one",
    relation="replace_one",
)


def public_view_statement(
    guarantee: Guarantee, view_name: str, many_to_one: bool, protects: str, unit: str
) -> tuple[str, str]:
    """(statement, unit protected) of an FDP guarantee with its ψ and protection unit filled in,
    in words a clinician can check."""
    from fedpose.data.units import UNIT_MEANING

    whole = UNIT_MEANING[unit]
    if not many_to_one:
        return (
            f"{guarantee.statement} — WARNING: ψ = {view_name} is invertible, so this neighbour relation is degenerate "
            f"(records with the same ψ(x) are essentially the same image): it protects {protects}",
            f"almost nothing (ψ is invertible), in every record of {whole}",
        )
    return (
        f"{guarantee.statement}; ψ = {view_name} is many-to-one, so what is protected is {protects}",
        f"what ψ discards ({protects}), in every record of {whole}",
    )


MASK_DP = Guarantee(
    name="MaskDP",
    statement="(ε, δ)-MaskDP: neighbouring datasets differ only inside the masked region of one record — every "
              "annotated head (face) of the image that falls in the record's crop, with margin",
    unit="the masked region of one record: every annotated head in its crop (all people of the image, not only the "
         "record's own); a person with no head annotation has their whole person box masked",
    public="the crop outside all masked heads, and the keypoints; the mask comes from the annotations only (people "
           "nobody annotated are not masked); the public-loss gradient is taken on a sample of records drawn "
           "independently of the private one",
    relation="replace_one",
)


def epsilon_digits(epsilon: float) -> str:
    """ε to 4 significant digits, rounded up: a printed ε is never below the one computed (0.741045
    prints 0.7411, not 0.741). The float's shortest decimal form is what is rounded, so a value such as
    1.7 stays 1.7."""
    exact = Decimal(repr(float(epsilon)))
    if exact == 0:
        return "0"
    quantum = Decimal(1).scaleb(exact.adjusted() - 3)
    return f"{float(exact.quantize(quantum, rounding=ROUND_CEILING)):.4g}"


def format_epsilon(
    epsilon: float, delta: float, guarantee: str | Guarantee, accountant: str = "rdp", unit: str | None = None,
    relation: str | None = None,
) -> str:
    """``ε = 0.800 (DP, δ = 4e-05, RDP) per patient, add/remove-one-patient adjacency`` — the only way
    fedpose prints an ε: guarantee, δ, accountant, protection unit and neighbouring relation.

    ``unit``: the protection unit (record / image / patient) the ε is about; every report passes
    it. None only where no unit was recorded (callers outside a run, e.g. the accountant CLI's
    unit-free arithmetic). ``relation``: the accountant's neighbouring relation ("add_remove",
    "replace_one"); None: the guarantee's own (:func:`relation_of`), which every run since
    replace-one FDP uses."""
    tag = guarantee.name if isinstance(guarantee, Guarantee) else str(guarantee)
    if tag == "none":
        return "ε = ∞ (no privacy: non-private training)"
    eps_text = "∞" if not math.isfinite(epsilon) else epsilon_digits(epsilon)
    text = f"ε = {eps_text} ({tag}, δ = {delta:.3g}, {accountant.upper()})" + (f" per {unit}" if unit else "")
    relation = relation or (GUARANTEES[tag].relation if tag in GUARANTEES else None)
    return f"{text}, {adjacency_words(relation, unit)}" if relation else text


def input_privacy_text(epsilon_total: float, ll_prune: bool) -> str:
    """A site's LDP-Slicing guarantee on its inputs, as reports print it: the ε per original pixel (per
    2×2 block under LL pruning, 4 · ε_total), pure (δ = 0), and what privatized once means."""
    per_original = 4 * epsilon_total if ll_prune else epsilon_total
    where = (f"per 2×2 block of an original image (ε_total = {epsilon_digits(epsilon_total)} per privatized pixel, LL pruning)"
             if ll_prune else "per pixel of an original image") + f", {ldp_adjacency(ll_prune)}"
    return (f"ε = {epsilon_digits(per_original)} (LDP, δ = 0, pure composition) {where}; LDP-Slicing, each training "
            "image privatized once per copy the site keeps (docs/input-privacy.md)")


def ldp_adjacency(per_block: bool) -> str:
    """Local DP's neighbouring relation in words: any two values of one pixel, or of one 2×2 block
    (LL pruning makes every masked pixel depend on its whole block)."""
    return f"any-two-values-of-one-{'2×2-block' if per_block else 'pixel'} (local) adjacency"


#: what of one unit each guarantee protects (the rest is public under that guarantee)
_PROTECTED_PART = {
    "DP": "everything",
    "FDP": "what the public view ψ discards",
    "MaskDP": "the masked private region",
}


def protected_unit_text(guarantee: Guarantee, unit: str) -> str:
    """What one neighbouring dataset changes, naming the protection unit:
    e.g. "one patient: every annotated crop of them, over all their images at this site"."""
    from fedpose.data.units import UNIT_MEANING

    if guarantee.name == "none":
        return guarantee.unit
    if unit not in UNIT_MEANING:
        raise ValueError(f"unknown protection unit {unit!r}; known: {sorted(UNIT_MEANING)}")
    part = _PROTECTED_PART.get(guarantee.name, guarantee.unit)
    whole = UNIT_MEANING[unit]
    return whole if part == "everything" else f"{part}, in every record of {whole}"


def adjacency_words(relation: str, unit: str | None) -> str:
    """"add/remove-one-patient adjacency" — the neighbouring relation in words, per unit (None: a
    unit-free statement, "add/remove-one adjacency")."""
    one = f"one-{unit}" if unit else "one"
    if relation == "add_remove":
        return f"add/remove-{one} adjacency"
    return f"replace-{one}'s-protected-part adjacency" if unit else "replace-one adjacency"


def guarantee_sentence(
    epsilon: float | None, delta: float | None, guarantee: str, unit: str, relation: str, accountant: str = "rdp"
) -> str:
    """"(ε = 1.2, δ = 1e-05)-DP per patient, add/remove-one-patient adjacency, RDP accountant"."""
    if guarantee == "none" or epsilon is None and delta is None:
        return "no privacy guarantee (non-private training)"
    eps = "∞" if epsilon is None or not math.isfinite(epsilon) else epsilon_digits(epsilon)
    return (f"(ε = {eps}, δ = {float(delta or 0.0):.3g})-{guarantee} per {unit}, "
            f"{adjacency_words(relation, unit)}, {accountant.upper()} accountant")


def describe(report: Mapping[str, Any]) -> str:
    """Human summary of an ``engine.privacy_report()`` / privacy.json dict, one fact per line."""
    lines = [f"mechanism: {report['mechanism']}"]
    if report.get("guarantee") == "none":
        lines.append(format_epsilon(math.inf, 0.0, "none"))
        lines.append("randomness: none drawn (no noise)")
        return "\n".join(lines)
    # privacy.json files from before protection units were record-level
    unit = report.get("protection_unit", "record")
    epsilon_line = format_epsilon(report["epsilon"], report["delta"], report["guarantee"], report["accountant"], unit,
                                  report.get("neighbouring_relation"))
    # Seeded test noise can be regenerated and subtracted: the ε above then promises nothing.
    lines.append(f"{SEEDED_NO_GUARANTEE}: {epsilon_line}" if report.get("guarantee_void") else epsilon_line)
    lines.append(f"randomness: {report.get('randomness', 'not recorded (privacy.json predates this field)')}")
    lines.append(f"guarantee: {report['guarantee_statement']}")
    choice = report.get("protection_unit_choice") or (
        "as configured" if "protection_unit" in report else "privacy.json from before protection units: record-level")
    lines.append(f"protection unit: {unit} ({choice})")
    lines.append(f"unit protected: {report['unit_protected']}")
    if report.get("guarantee_sentence"):
        lines.append(f"statement: {report['guarantee_sentence']}")
    lines.append(f"adjacency: {report.get('adjacency', report.get('neighbouring_relation', 'not recorded'))}")
    if report.get("dataset_size_public", True):
        lines.append(f"dataset size N: public (q = B/N; N = {report.get('dataset_size', 'not recorded')})")
    else:
        lines.append("dataset size N: secret (the sampling rate q is declared: N enters nothing released but the "
                     "private update, where the ε protects it like any other statistic of the data)")
    shape = report.get("fixed_shape")
    if shape:
        lines.append(f"step shape: {shape['statement']}")
    lines.append(f"treated as public: {report['public']}")
    lines.append(
        f"noise multiplier σ = {report['noise_multiplier']:.4g}, clip C = {report['max_grad_norm']:g}, "
        f"sample rate q = {report['sample_rate']:.4g}, steps = {report['steps']}"
    )
    lines.append(f"what leaves: {WHAT_LEAVES_CENTRAL}")
    return "\n".join(lines)


def describe_federation(report: Mapping[str, Any]) -> str:
    """Human summary of a federated export's privacy_report.json: each site's own guarantee."""
    lines = [f"federated run '{report.get('run_id')}': {report.get('guarantee_statement', 'each site guarantees its own units')}",
             f"model: {report.get('model_selection', 'not recorded')}"]
    for site in report.get("sites", []):
        lines.append(f"{site.get('site_id')}: {site.get('epsilon_text', 'ε not recorded')}; "
                     f"rounds joined {site.get('rounds_joined', 'not recorded')}"
                     + (f", rounds spent {len(site['spends'])}" if "spends" in site else ""))
        if site.get("guarantee") not in ("DP", "none", None) and site.get("treated_as_public"):
            lines.append(f"  protects {site.get('protected_part')}; treated as public, not protected: "
                         f"{site['treated_as_public']}")
        if site.get("input_privacy"):
            lines.append(f"  inputs locally privatized: {site['input_privacy']['epsilon_text']}")
        if site.get("spends"):
            lines.append("  spends (round: σ, q, steps): " + "; ".join(
                f"{e['round']}: {e['noise_multiplier']:.6g}, {e['sample_rate']:.6g}, {e['steps']}" for e in site["spends"]))
    lines.append(f"what leaves: {WHAT_LEAVES_FEDERATION}")
    return "\n".join(lines)


#: What is released, in words (docs/privacy.md says the same): by a central run, and by a federation's sites
WHAT_LEAVES_CENTRAL = (
    "central training publishes only what `fedpose export` writes (weights + this report; checkpoints/, metrics.json "
    "and curves.png hold private-data statistics and stay internal)"
)
WHAT_LEAVES_FEDERATION = (
    "a federation site sends only its typed reply — the privatized Δ (under secure aggregation its masked vector "
    "instead, and the protocol's own messages: public keys, encrypted shares, unmasking shares), a status with a fixed "
    "reason code (an error: its exception's class name), its cumulative privacy report with its spends per round "
    "(declared σ, q, steps) and its declared input privacy settings, the steps run, its declared aggregation weight, "
    "basis version, run and round ids (sites/egress.py checks each reply against this list); the published model is "
    "what `fedpose export` writes from the coordinator's global weights, and this report"
)
WHAT_LEAVES = (
    "central training publishes only what `fedpose export` writes (weights + this report; checkpoints/, metrics.json "
    "and curves.png hold private-data statistics and stay internal); a federation site sends only its typed reply — "
    "the privatized Δ (under secure aggregation its masked vector instead, and the protocol's own messages: public "
    "keys, encrypted shares, unmasking shares), a status with a fixed reason code (an error: its exception's class "
    "name), this cumulative report with its spends per round (declared σ, q, steps), the steps run, its declared "
    "aggregation weight, basis version, run and round ids (sites/egress.py checks each reply against this list)"
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
    "mechanism", "guarantee", "guarantee_statement", "unit_protected", "protection_unit", "protection_unit_choice",
    "guarantee_sentence",
    "max_records_per_unit", "public", "epsilon", "delta",
    "epsilon_text", "accountant", "neighbouring_relation", "adjacency", "dataset_size_public", "noise_multiplier",
    "max_grad_norm", "sample_rate", "steps", "randomness", "guarantee_void", "input_privacy", "basis", "public_view",
    "fixed_shape",
})


def publishable_report(report: Mapping[str, Any]) -> dict[str, Any]:
    """The part of an engine privacy report that is safe to ship beside a model."""
    return {key: value for key, value in report.items() if key in PUBLISHABLE_KEYS}
