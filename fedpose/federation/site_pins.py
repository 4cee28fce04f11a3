"""What the coordinator may not decide: every setting that changes what a site's guarantee means
or costs is the site's, and is checked on every round before any data work or spend.

A round's inputs come from the coordinator: the instruction (:class:`~fedpose.federation.protocol.
TrainInstruction`, its :class:`~fedpose.config.ModelSpec`), the global arrays and, for projecting
mechanisms, the basis message. Each is either

* **site-pinned** — it changes what the guarantee means. FDP's ψ has its blocks in model-input
  pixels and MaskDP's mask its zoom, so the coordinator's ``input_size`` would decide how much of
  a record is public, and a coordinator changing it from round to round would release several
  differently gridded ψ of the same record. A pinned setting is declared in the site's config or,
  where the site leaves it open, taken from the first round and kept in
  ``<state_dir>/site_pins.json`` (checksummed like the budget), like the guarantee and the unit
  of the genesis marker (:mod:`fedpose.federation.site_budget`). The site's own settings that
  shape the public part (``privacy.public_view``, ``privacy.mask``) are pinned too: they never
  come from the coordinator, and pinning them keeps the site's config from silently changing
  them between releases of the same records. A different value is refused
  (:class:`PinnedSettingMismatch`: the setting, the pinned and the asked value, in the site's log;
  on the wire only the class name). A different value needs a new site state.
* or it **cannot change the guarantee** — the mechanism clips every unit's gradient and noises
  it whatever that value is — and it is checked where a bad value would cost budget without
  training: the global arrays (:func:`check_global_arrays`: names, shapes, finite) and the basis
  V (:func:`check_basis`: shape, finite, k within the site's ``max_basis_k``, orthonormal). Using
  V is post-processing of the noisy gradient, so no ε is lost to a bad one, but a NaN V used to
  fail the round after its spend and a V × 1000 multiplied the update by 10⁶.

:data:`INSTRUCTION_FIELDS` and :data:`MODEL_SPEC_FIELDS` classify every field; a test fails when a
field is added to either model without being classified here.

A state from before pins (or a setting pinned since) adopts the value of its first round with
pins, with a log line: nothing saved is lost, and the releases made before are not checked
against it (they were made before the site could tell). A state created with pins (its genesis
marker says so: version 1 pinned under FDP and MaskDP only, version 2 also the input size under
every guarantee) whose pins file is gone after it spent is refused instead: the file was lost,
and adopting would let the coordinator choose the values anew.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

import numpy as np

from fedpose.config import ModelSpec
from fedpose.federation.site_budget import GENESIS_FILE, BudgetStateError, _read_signed, _state_lock, _write_signed

log = logging.getLogger(__name__)

PINS_FILE = "site_pins.json"
PINS_FORMAT = "fedpose.site-pins/1"

FieldClass = Literal["site-pinned", "cannot change the guarantee", "field by field"]
DP, FDP, MASK_DP = "DP", "FDP", "MaskDP"


@dataclass(frozen=True)
class FieldRule:
    """How a site treats one field the coordinator sends, and why."""

    kind: FieldClass
    why: str
    #: the guarantees under which the field is pinned (empty unless ``kind`` is "site-pinned")
    pinned_for: frozenset[str] = frozenset()


#: Every field of :class:`~fedpose.federation.protocol.TrainInstruction`.
INSTRUCTION_FIELDS: dict[str, FieldRule] = {
    "run_id": FieldRule(
        "cannot change the guarantee",
        "keys the budget's entries: every (run, round) the site trains is composed into its one budget and draws "
        "fresh noise, so a new run id only asks for another round, which ε_max bounds like any other"),
    "round": FieldRule(
        "cannot change the guarantee",
        "as run_id: a replayed (run, round) re-sends its earlier release, a new one is composed"),
    "local_steps": FieldRule(
        "cannot change the guarantee",
        "capped at the site's own local_steps; σ comes from the site's config alone (target_epsilon is calibrated "
        "for the site's local_steps, not the asked count) and the budget composes exactly the steps run, so "
        "asking fewer steps costs less and never buys a lower σ"),
    "model_spec": FieldRule("field by field", "see MODEL_SPEC_FIELDS"),
    "basis_version": FieldRule(
        "cannot change the guarantee",
        "names the basis V projected onto after the noise (post-processing); V itself is checked before any "
        "spend (check_basis)"),
    "ledger_records": FieldRule(
        "cannot change the guarantee",
        "the ledger's record of the site's earlier spends (fedpose.federation.witness): the site composes the "
        "larger of its own events and the record, so a record can only raise its ε (a refusal: denial of "
        "service), never lower it, and never changes σ, q, C or what a unit is"),
    "secure_aggregation": FieldRule(
        "cannot change the guarantee",
        "whether Δ is masked into a secure sum (fedpose.federation.secagg) instead of sent: clipping, quantizing "
        "and masking are post-processing of the privatized Δ, and the budget composes the same steps either way; "
        "a site with require_secure_aggregation refuses a round without it before any data work"),
}

#: Every field of :class:`~fedpose.federation.protocol.SecAggSetup` (the secure sum's settings a coordinator
#: sends in the setup stage). None changes the guarantee (all act on the already privatized Δ); the ones
#: that decide whether the secure sum hides anything the site checks itself (fedpose.federation.secagg.site).
SECAGG_SETUP_FIELDS: dict[str, FieldRule] = {
    "kind": FieldRule("cannot change the guarantee", "the message's type tag (always 'setup')"),
    "run_id": FieldRule("cannot change the guarantee", "checked equal to the train instruction's (one session per round)"),
    "round": FieldRule("cannot change the guarantee", "checked equal to the train instruction's, as run_id"),
    "node": FieldRule("cannot change the guarantee", "the site's index in shares and masks; checked to be among the participants"),
    "participants": FieldRule(
        "cannot change the guarantee",
        "who shares masks with the site; the site refuses fewer than 2 (a sum of one is its update) and more than max_sites"),
    "threshold": FieldRule(
        "cannot change the guarantee",
        "t: the site refuses t ≤ n/2, the threshold below which a coordinator showing two views of who dropped "
        "could collect both secrets of one site and unmask its update; with identities, its peers must have been "
        "given the same t (their signed keys cover the setup's digest)"),
    "clip_range": FieldRule(
        "cannot change the guarantee",
        "r: Δ's coordinates are clipped to [−r, r] after privatization (post-processing; it can only bias the sum)"),
    "max_weight": FieldRule("cannot change the guarantee", "W: the range W·r of w·Δ (post-processing, as clip_range)"),
    "bits": FieldRule("cannot change the guarantee", "quantization levels: rounding a privatized Δ is post-processing"),
    "modulus_bits": FieldRule(
        "cannot change the guarantee",
        "M = 2^m: the site refuses one the sum of max_sites vectors could wrap (n_max·(2^bits − 1) ≥ M)"),
    "max_sites": FieldRule("cannot change the guarantee", "n_max of the overflow check; the site refuses more participants"),
    "vector_length": FieldRule("cannot change the guarantee", "checked equal to the number of the model's trainable parameters"),
    "update_norm_bound": FieldRule(
        "cannot change the guarantee",
        "the site checks ‖Δ‖₂ against it before masking, as the coordinator would on a clear Δ; a failed check "
        "releases nothing (the spend is recorded)"),
}

#: Every field of :class:`~fedpose.config.ModelSpec` (the model the coordinator asks the site to train).
MODEL_SPEC_FIELDS: dict[str, FieldRule] = {
    "backbone": FieldRule(
        "cannot change the guarantee",
        "the architecture: every trainable parameter's gradient is clipped per unit and noised whatever the "
        "network computes; its frozen part is a fixed function of public weights"),
    "scenario": FieldRule(
        "cannot change the guarantee",
        "which parameters train (finetune, norms_head, norms, biases_norms, the grey copies of grey_biases_norms and "
        "grey_early_biases_norms — which "
        "image uses them is a fixed function of the image —, lora's adapters, full): Δ holds only those, each "
        "updated only with privatized gradients, the unit's gradient clipped to C over all of them jointly and every "
        "coordinate noised; the others are not released. The set changes what ε costs in utility (the noise's norm "
        "grows with √p), never the guarantee"),
    "input_size": FieldRule(
        "site-pinned",
        "the pixel grid of the record: FDP's ψ blocks (privacy.public_view.factor) and MaskDP's mask zoom are in "
        "model-input pixels, so the size decides how much of a record is public, and several sizes would release "
        "several differently gridded ψ of the same record. Under every guarantee, timing: a site's training rows "
        "come from windows built for one input size (fedpose.data.canonical), and each new size would make a round "
        "that rebuilds them, its time a sum over every image file of the site",
        frozenset({DP, FDP, MASK_DP})),
    "split_factor": FieldRule(
        "cannot change the guarantee", "SimCC bins per pixel: the head and loss, not the sensitivity (clipped to C)"),
    "label_sigma": FieldRule(
        "cannot change the guarantee", "width of the SimCC targets: the loss, not the sensitivity (clipped to C)"),
    "head_hidden": FieldRule(
        "cannot change the guarantee", "width of the head: the architecture, not the sensitivity (clipped to C)"),
    "lora_rank": FieldRule(
        "cannot change the guarantee",
        "the adapters' rank under scenario lora (at most MAX_LORA_RANK, so the spec stays buildable): how many "
        "parameters train, each clipped with the rest to C and noised, as for scenario"),
    "lora_alpha": FieldRule(
        "cannot change the guarantee",
        "the adapters' scale α/r: the architecture's function, not the sensitivity (the adapters' gradients are "
        "clipped to C with the rest)"),
}

#: The site's own settings that shape the public part of a guarantee: pinned under those guarantees.
SITE_CONFIG_PINS: dict[str, FieldRule] = {
    "privacy.public_view": FieldRule(
        "site-pinned", "ψ itself (kind, block size, bits): what of each record FDP treats as public", frozenset({FDP})),
    "privacy.mask": FieldRule(
        "site-pinned", "the masked region (which box, its margin, the fill): what of each record MaskDP treats as public",
        frozenset({MASK_DP})),
}


class SiteInputRefused(ValueError):
    """Something the coordinator sent is refused before any data work or spend (base class)."""


class PinnedSettingMismatch(SiteInputRefused):
    """A setting that changes what the site's guarantee means differs from the value pinned in its state."""


class GlobalModelRejected(SiteInputRefused):
    """The global arrays do not fit the model spec, or are not finite."""


class BasisRejected(SiteInputRefused):
    """The projection basis V is not a finite, orthonormal p × k matrix with k within the site's limit."""


# -- pinned settings --------------------------------------------------------------------------------
def pinned_settings(privacy: Any, guarantee: str, model_spec: ModelSpec) -> dict[str, Any]:
    """The values this round would use for every setting pinned under ``guarantee`` (JSON values)."""
    settings: dict[str, Any] = {}
    for name, rule in MODEL_SPEC_FIELDS.items():
        if guarantee in rule.pinned_for:
            settings[f"model_spec.{name}"] = _json(getattr(model_spec, name))
    for name, rule in SITE_CONFIG_PINS.items():
        if guarantee in rule.pinned_for:
            settings[name] = getattr(privacy, name.split(".", 1)[1]).model_dump(mode="json")
    return settings


def _json(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def check_pinned_settings(state_dir: str | Path, site_id: str, guarantee: str, privacy: Any, model_spec: ModelSpec,
                          state_has_rounds: bool) -> dict[str, Any]:
    """Refuse a round whose pinned settings differ from the site's state; pin those not pinned yet.

    Call it after the site's state exists and before any data work or spend. Returns the pinned
    settings. ``state_has_rounds``: the site trained before (its budget has entries), so a setting
    pinned now is adopted from a state that predates it (logged as such)."""
    wanted = pinned_settings(privacy, guarantee, model_spec)
    if not wanted:
        return {}
    state_dir = Path(state_dir)
    path = state_dir / PINS_FILE
    with _state_lock(state_dir):  # two processes of one new site pin one value
        if state_has_rounds and not path.exists() and _kept_pins(_read_signed(state_dir / GENESIS_FILE, "site state marker"), guarantee):
            raise BudgetStateError(
                f"site '{site_id}': its pinned settings {path} are missing, but this state has kept them since it was "
                f"created ({state_dir / GENESIS_FILE}) and has recorded rounds: refusing to pin what the coordinator asks "
                f"now. Restore {PINS_FILE} from a backup of {state_dir}.")
        stored = _load(path, site_id, guarantee)
        pinned = stored.get("settings", {})
        mismatched = [(name, pinned[name], value) for name, value in wanted.items() if name in pinned and pinned[name] != value]
        if mismatched:
            raise PinnedSettingMismatch(_mismatch_message(site_id, path, stored, mismatched))
        new = {name: value for name, value in wanted.items() if name not in pinned}
        if new:
            now = time.time()
            _write_signed(path, {"format": PINS_FORMAT, "site_id": site_id, "guarantee": guarantee,
                                 "settings": {**pinned, **new},
                                 "pinned_at": {**stored.get("pinned_at", {}), **{name: now for name in new}}})
            listed = ", ".join(f"{name} = {value}" for name, value in new.items())
            if pinned or state_has_rounds:
                log.warning("site %s: adopting %s as pinned (%s): this state predates the pin, so earlier releases "
                            "were not checked against it; from now on a different value is refused", site_id, listed, path)
            else:
                log.info("site %s: pinned %s (%s): a different value is refused from now on", site_id, listed, path)
    return wanted


def _kept_pins(genesis: Mapping[str, Any], guarantee: str) -> bool:
    """Whether a state with this genesis marker has written a pins file since its first round: every
    state of pins version 2; under version 1 (``true``) only FDP and MaskDP states — a DP state then
    pinned nothing, so its missing file was never written and the input size is adopted."""
    version = genesis.get("pins")
    if version is True:  # how version 1 was written
        version = 1
    if not isinstance(version, int) or version < 1:
        return False
    return version >= 2 or guarantee in (FDP, MASK_DP)


def _load(path: Path, site_id: str, guarantee: str) -> dict[str, Any]:
    if not path.exists():
        return {}
    payload = _read_signed(path, "site pins")
    if payload.get("format") != PINS_FORMAT:
        raise BudgetStateError(f"site pins {path}: unknown format {payload.get('format')!r} (expected {PINS_FORMAT})")
    if payload.get("site_id") != site_id or payload.get("guarantee") != guarantee:
        raise BudgetStateError(f"site pins {path} belong to site '{payload.get('site_id')}' under "
                               f"{payload.get('guarantee')}, not '{site_id}' under {guarantee}")
    return payload


def _mismatch_message(site_id: str, path: Path, stored: Mapping[str, Any], mismatched: list[tuple[str, Any, Any]]) -> str:
    parts = []
    for name, pinned, asked in mismatched:
        since = stored.get("pinned_at", {}).get(name)
        when = f" since {time.strftime('%Y-%m-%d %H:%M', time.gmtime(since))} UTC" if since else ""
        source = "the coordinator's model spec" if name.startswith("model_spec.") else "the site's config"
        rule = MODEL_SPEC_FIELDS.get(name.removeprefix("model_spec.")) or SITE_CONFIG_PINS[name]
        parts.append(f"{name} is pinned to {pinned}{when}, {source} asks for {asked} ({rule.why.split('. ')[0]})")
    return (f"site '{site_id}' refuses the round: " + "; ".join(parts) + f". Pinned in {path}: the site's earlier "
            "releases of the same records were made with the pinned value. Nothing was read or spent; train with the "
            "pinned value, or start a new site state (another state_dir) for a different one.")


# -- the global arrays ------------------------------------------------------------------------------
def check_global_arrays(expected: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
    """The coordinator's arrays are exactly the spec's state dict: same names, shapes and dtypes,
    finite. ``expected``: the state dict of the model built from the spec. A non-finite weight would
    make the round diverge after its spend, a negative BatchNorm variance release noise only; a
    missing or misshapen one would fail it there. The dtype
    is the model's own, so the check sees the values the model will hold: a float64 1e300 is finite
    and becomes inf in float32, and a Δ of another dtype than the global array's is blocked at egress
    (both after the spend)."""
    missing = sorted(set(expected) - set(arrays))
    unexpected = sorted(set(arrays) - set(expected))
    if missing or unexpected:
        raise GlobalModelRejected(f"the global arrays do not match the model spec: {len(missing)} missing (e.g. "
                                  f"{missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})")
    for name, tensor in expected.items():
        array = np.asarray(arrays[name])
        # a 0-d tensor travels as shape (1,) in Flower's ArrayRecord (torch loads it the same way)
        if tuple(array.shape) != tuple(tensor.shape) and not (len(tensor.shape) == 0 and array.shape == (1,)):
            raise GlobalModelRejected(f"global array {name}: shape {tuple(array.shape)}, the model spec needs {tuple(tensor.shape)}")
        wanted = str(tensor.dtype).removeprefix("torch.")
        if array.dtype != np.dtype(wanted):
            raise GlobalModelRejected(f"global array {name}: dtype {array.dtype}, the model spec's is {wanted}")
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise GlobalModelRejected(f"global array {name}: {int((~np.isfinite(array)).sum())} non-finite values")
        # a negative variance makes every row's normalisation NaN: each sample is zeroed, and the
        # round would spend to release noise only
        if name.endswith("running_var") and (array < 0).any():
            raise GlobalModelRejected(f"global array {name}: {int((array < 0).sum())} negative variances")


# -- the basis --------------------------------------------------------------------------------------
#: the coarsest wire dtype of a basis (a cached V kept as float32 may have been sent in it)
COARSEST_WIRE_DTYPE = "bfloat16"


def orthonormality_tolerance(wire_dtype: str, num_params: int) -> float:
    """Largest |VᵀV − I| accepted for a p × k basis sent in ``wire_dtype``: the producer's own
    re-orthonormalisation threshold, plus rounding V to the wire dtype (each Gram entry moves by at
    most 2u + u² ≤ eps, u = eps/2, by Cauchy-Schwarz on unit columns), plus forming VᵀV from float32
    blocks (≲ eps₃₂·√p). Derived from the dtypes, so it holds on any x86-64."""
    import torch

    from fedpose.privacy.projection import ORTHONORMAL_TOLERANCE

    wire_eps = {"float32": float(np.finfo(np.float32).eps), "float16": float(np.finfo(np.float16).eps),
                "bfloat16": float(torch.finfo(torch.bfloat16).eps)}[wire_dtype]
    return ORTHONORMAL_TOLERANCE + 2 * wire_eps + 4 * float(np.finfo(np.float32).eps) * math.sqrt(num_params)


def check_basis(basis: Any, num_params: int, max_k: int, wire_dtype: str = "float32", what: str = "basis") -> np.ndarray:
    """V as float32 if it is a finite p × k matrix with 1 ≤ k ≤ min(max_k, p) and orthonormal
    columns (|VᵀV − I| ≤ :func:`orthonormality_tolerance`, VᵀV accumulated in float64);
    :class:`BasisRejected` naming the problem otherwise.

    A V within the tolerance is then re-orthonormalized (same column space): entry by entry the
    tolerance admits the wire's rounding, but k entries just inside it can add up — VᵀV = I + c(J − I)
    at bfloat16's tolerance stretched a gradient along one direction ×2.96 at k = 128 — and the
    projection must be the one onto V's span, never more."""
    import torch

    from fedpose.privacy.projection import ORTHONORMAL_TOLERANCE, _gram_float64, orthonormalize

    v = np.asarray(basis)
    if v.ndim != 2 or v.shape[0] != num_params:
        raise BasisRejected(f"{what}: shape {v.shape}, the site's model needs p × k with p = {num_params} trainable parameters")
    k = v.shape[1]
    if not 1 <= k <= min(max_k, num_params):
        raise BasisRejected(f"{what}: k = {k} columns, the site accepts 1 to {min(max_k, num_params)} (max_basis_k = {max_k})")
    if v.dtype.kind != "f":
        raise BasisRejected(f"{what}: dtype {v.dtype} is not floating point")
    v = np.ascontiguousarray(v, dtype=np.float32)
    if not np.isfinite(v).all():
        raise BasisRejected(f"{what}: {int((~np.isfinite(v)).sum())} non-finite values")
    deviation = float((_gram_float64(torch.from_numpy(v)) - torch.eye(k, dtype=torch.float64)).abs().max())
    tolerance = orthonormality_tolerance(wire_dtype, num_params)
    if not deviation <= tolerance:  # also refuses NaN (an overflow in the Gram)
        raise BasisRejected(f"{what}: columns are not orthonormal: max |VᵀV − I| = {deviation:.3g} > {tolerance:.3g} "
                            f"(sent as {wire_dtype}, p = {num_params})")
    if deviation > ORTHONORMAL_TOLERANCE:
        if np.shares_memory(v, basis):
            v = v.copy()  # the caller's array stays as it was sent
        try:
            orthonormalize(torch.from_numpy(v))  # in place
        except torch.linalg.LinAlgError as exc:
            raise BasisRejected(f"{what}: columns are nearly dependent (VᵀV is not positive definite)") from exc
    return v
