"""One site's part of one federated round, without Flower: guard the budget, train, return Δ.

``sites/client_app.py`` is a thin Flower wrapper around :func:`run_site_round`. Everything a
ClientApp needs between rounds lives on disk in the site's ``state_dir`` (deployment starts a new
ClientApp process per message): the budget (:class:`~fedpose.federation.site_budget.SiteBudget`),
the cached projection basis, the last released update and a site-local diagnostics log.

What leaves the site is one :class:`~fedpose.federation.protocol.SiteReply` plus, for status
"ok", Δ = w_local − w_global of the trainable parameters. Δ is computed from weights that were
only ever updated with privatized gradients (clipped + noised by the engine), so releasing it is
post-processing. The reply's other fields are functions of public values (declared σ, q, δ,
ε_max, step counts). Diagnostics computed from private data (loss, zeroed non-finite samples,
wall time) go to ``<state_dir>/rounds.jsonl`` and the site's log only. Every reply is entered in
the site's hash-chained audit log (``<state_dir>/audit.jsonl``, :mod:`fedpose.federation.site_audit`)
before it is returned: public values only, for the site's privacy officer.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import shutil
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, ParamSpec

import numpy as np

from fedpose.config import ModelSpec
from fedpose.federation import site_audit, witness
from fedpose.federation.config import SiteConfig
from fedpose.federation.protocol import (
    MASKED_KEY,
    InputPrivacyStatement,
    PrivacyReport,
    ReasonCode,
    ReplyStatus,
    SecAggShareInbox,
    SiteReply,
    SpendRecord,
    error_class_name,
)
from fedpose.federation.reply_signature import ReplySigner
from fedpose.federation.secagg.site import SecAggRefused, SiteSecAggSession
from fedpose.federation.site_budget import GENESIS_FILE, BudgetExhausted, SiteBudget
from fedpose.federation.site_pins import GlobalModelRejected, check_global_arrays, check_pinned_settings
from fedpose.privacy.mechanisms import get_mechanism

log = logging.getLogger(__name__)
P = ParamSpec("P")

#: site-local diagnostics, one JSON line per round (never sent)
ROUND_LOG = "rounds.jsonl"
#: which training images were decoded successfully (size, mtime per file), so later rounds skip them
IMAGE_CHECK_CACHE = "image_check.json"
#: the training records' canonical windows (fedpose.data.canonical), under the state directory
CANONICAL_WINDOWS_DIR = "canonical-windows"


@dataclass(frozen=True)
class SiteRoundResult:
    """What a site sends back for one round: the typed reply, and Δ when ``reply.status == "ok"``."""

    reply: SiteReply
    update: dict[str, np.ndarray] = field(default_factory=dict)
    #: secure aggregation, status "ok": the masked vector (uint64) that leaves instead of ``update``
    #: (which then stays at the site: it is kept here for the caller's audit entry only)
    masked: np.ndarray | None = None


def site_protection_unit(site: SiteConfig) -> str:
    """The site's protection unit: ``privacy.unit``; for "auto", the unit its budget state was
    created with, or — for a new site — the coarsest unit its training annotations support
    (read from annotations.json only: no image is opened). Decided once: the budget state pins it,
    so a later change of the data cannot silently change the guarantee."""
    from fedpose.federation.site_budget import stored_unit

    if site.privacy.unit != "auto":
        return site.privacy.unit
    pinned = stored_unit(site.state_dir)
    if pinned is not None:
        return pinned
    from fedpose.data.loaders import load_records
    from fedpose.data.units import resolve_unit

    records, _ = load_records(site.data.train)
    choice = resolve_unit("auto", records, f"site '{site.site_id}' data.train ({site.data.train})")
    log.info("site %s: protection unit %s (%s)", site.site_id, choice.unit, choice.reason)
    return choice.unit


def open_budget(site: SiteConfig) -> SiteBudget | None:
    """The site's persisted budget (None for non-private training, which has nothing to guard)."""
    mechanism = get_mechanism(site.privacy.mechanism)
    if not mechanism.noisy:
        from fedpose.federation.site_budget import ensure_site_state

        # no budget, but the state still remembers that this site once trained without privacy
        ensure_site_state(site.state_dir, site.site_id, mechanism.guarantee.name, None)
        return None
    return SiteBudget(site.state_dir, site.site_id, site.eps_max, site.delta, mechanism.guarantee.name,
                      site.privacy.accountant, site_protection_unit(site))


def declared_noise(site: SiteConfig) -> tuple[float, float]:
    """(σ, q) of a round, from the site's config only (q is declared: neither depends on N).

    A ``privacy.target_epsilon`` is calibrated for the site's own ``local_steps``, whatever a
    round runs: otherwise a coordinator asking for one step would buy a σ that spends a whole
    round's ε on that step."""
    from fedpose.privacy.engine import resolve_noise_multiplier

    if site.privacy.sample_rate is None:  # SiteConfig's validator forbids this for noisy mechanisms
        raise ValueError(f"site '{site.site_id}': privacy.sample_rate must be declared")
    rate = float(site.privacy.sample_rate)
    return resolve_noise_multiplier(site.privacy, rate, site.local_steps), rate


def privacy_report(site: SiteConfig, budget: SiteBudget | None, next_round_affordable: bool = True,
                   extra_events: Sequence[tuple[float, float, int]] = ()) -> PrivacyReport:
    """The site's cumulative privacy state, as it goes on the wire (``extra_events``: spends on the
    federation's record that the budget lacks, composed in — :mod:`fedpose.federation.witness`)."""
    from fedpose.privacy.report import protected_unit_text

    guarantee = get_mechanism(site.privacy.mechanism).guarantee
    inputs = site.input_privacy
    input_privacy = (InputPrivacyStatement(mechanism=inputs.mechanism, epsilon_total=inputs.epsilon, ll_prune=inputs.ll_prune)
                     if inputs.mechanism == "ldp-slicing" and inputs.epsilon is not None else None)
    if budget is None:
        return PrivacyReport(guarantee=guarantee.name, unit=guarantee.unit, adjacency="none", accountant="none",
                             epsilon=None, delta=0.0, eps_max=site.eps_max, steps=0, rounds_spent=0, orders=[], rdp=[],
                             next_round_affordable=True, input_privacy=input_privacy)
    state = budget.report(extra_events)
    epsilon = float(state["epsilon"])
    return PrivacyReport(
        guarantee=guarantee.name, unit=protected_unit_text(guarantee, budget.unit), protection_unit=budget.unit,
        adjacency=state["relation"], accountant=state["accountant"],
        epsilon=epsilon if math.isfinite(epsilon) else None, delta=budget.delta, eps_max=budget.eps_max,
        steps=int(state["steps"]), rounds_spent=int(state["rounds_spent"]),
        orders=[float(x) for x in state["orders"]], rdp=[float(x) for x in state["rdp"]],
        next_round_affordable=next_round_affordable, input_privacy=input_privacy,
    )


# -- basis (cached on disk: a new ClientApp process per message) ----------------------------------------
def basis_cache_dir(site: SiteConfig) -> Path:
    return Path(site.state_dir) / "basis"


def cached_basis_version(site: SiteConfig) -> int:
    """The basis version cached at the site (-1 = none)."""
    from fedpose.federation.basis_transport import BasisCache

    version = BasisCache(basis_cache_dir(site)).version()
    return -1 if version is None else version


def _site_basis(site: SiteConfig, model: Any, version: int, message: tuple[dict, dict] | None) -> np.ndarray | None:
    """V for this round: decode/rebuild the coordinator's message, or load the cached copy; checked
    (:func:`~fedpose.federation.site_pins.check_basis`) before it is cached or used."""
    from fedpose.federation.basis_transport import BasisCache, BasisTransportError
    from fedpose.federation.public_basis import receive_basis
    from fedpose.federation.site_pins import COARSEST_WIRE_DTYPE, check_basis

    if version < 0:
        return None
    num_params = model.num_trainable()
    if message is not None:
        # a recipe is rebuilt here in float32; a full V was rounded to its wire dtype
        wire = str(message[1].get("basis.dtype", "float32")) if message[1].get("basis.transport") == "full" else "float32"
        return receive_basis(message[0], message[1], model, site.public_data, basis_cache_dir(site),
                             check=lambda v: check_basis(v, num_params, site.max_basis_k, wire, f"basis v{version}"))
    cached = BasisCache(basis_cache_dir(site)).load()
    if cached is None or cached[0] != version:
        raise BasisTransportError(f"site '{site.site_id}': basis v{version} was neither sent nor cached")
    # checked when it arrived, in its wire dtype (not kept): again here, at the coarsest one's tolerance
    return check_basis(cached[1], num_params, site.max_basis_k, COARSEST_WIRE_DTYPE, f"cached basis v{version}")


# -- the round ---------------------------------------------------------------------------------------
def site_units(site: SiteConfig, dataset: Any, unit: str) -> Any:
    """The :class:`~fedpose.data.units.UnitIndex` of the site's training records at its protection
    unit; a clear error naming the site and its data when the records do not support that unit
    (e.g. the budget is per patient but some records have no patient_id)."""
    from fedpose.data.units import UnitIndex

    return UnitIndex.from_records(dataset.records, unit, f"site '{site.site_id}' data.train ({site.data.train})")  # type: ignore[arg-type]


def load_site_dataset(site: SiteConfig, input_size: tuple[int, int]) -> Any:
    """The site's training set (after input privacy, if configured) at the global model's input size."""
    from fedpose.data.canonical import canonical_windows
    from fedpose.data.dataset import DEFAULT_PADDING, PoseDataset, load_records
    from fedpose.privacy.input_privacy import prepare_site_input
    from fedpose.privacy.public_views import dataset_view_options

    from fedpose.data.image_check import check_images

    data_dir, _ = prepare_site_input(site.data.train, site.input_privacy, site.state_dir)
    records, root = load_records(data_dir)
    if not records:
        raise ValueError(f"site '{site.site_id}': no training records in {data_dir}")
    # every file decoded once (cached by size and mtime): a corrupt image is named before any spend
    check_images(records, root, Path(site.state_dir) / IMAGE_CHECK_CACHE)
    # FDP / FP-DP: ψ(x) once per record, before augmentation; MaskDP: full-size decodes
    view_options = dataset_view_options(site.privacy)
    # each record's crop source at one fixed size, so a round costs the same whatever the files
    windows = canonical_windows(records, root, input_size, site.data.scale_jitter, site.data.rotation_range,
                                DEFAULT_PADDING, Path(site.state_dir) / CANONICAL_WINDOWS_DIR,
                                reduced_decode=view_options["reduced_decode"])
    return PoseDataset(
        records, root, input_size=input_size, train=True, seed=site.train.seed, **site.data.augmentation_options(),
        windows=windows, **view_options,
    )


def _instruction_of_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[SiteConfig, site_audit.AuditInstruction]:
    """The site and the audit log's view of the instruction in a call of :func:`train_site_round`."""
    bound = inspect.signature(train_site_round).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    instruction = site_audit.instruction_of(a["local_steps"], a["basis_version"], a["model_spec"], a["global_state"],
                                            a["ledger_records"], a["site"].site_id)
    return a["site"], instruction


def _signed_and_recorded(train: Callable[P, SiteRoundResult]) -> Callable[P, SiteRoundResult]:
    """``train``, its reply signed with the site's identity when it has one
    (:mod:`~fedpose.federation.reply_signature`; the key is loaded before the round, so one that
    does not load costs nothing) and entered in the site's audit log before it is returned
    (:func:`~fedpose.federation.site_audit.record_reply`): a reply that cannot be logged raises, so
    its update is never sent."""

    @functools.wraps(train)
    def train_and_record(*args: P.args, **kwargs: P.kwargs) -> SiteRoundResult:
        signer = ReplySigner.of(args[0] if args else kwargs["site"])  # type: ignore[arg-type]
        result = train(*args, **kwargs)
        site, asked = _instruction_of_call(args, kwargs)
        # what left the site: Δ, or under secure aggregation the masked vector
        released = {MASKED_KEY: result.masked} if result.masked is not None else result.update
        if signer is not None:
            result = replace(result, reply=signer.sign(result.reply, released if result.reply.carries_update else {}))
        site_audit.record_reply(site.state_dir, result.reply, released, asked)
        return result

    return train_and_record


@_signed_and_recorded
def train_site_round(
    site: SiteConfig,
    run_id: str,
    round_id: int,
    global_state: dict[str, np.ndarray],
    model_spec: ModelSpec,
    local_steps: int,
    basis_version: int = -1,
    basis_message: tuple[dict[str, np.ndarray], dict[str, Any]] | None = None,
    threads: int | None = None,
    engine_hook: Callable[[Any], None] | None = None,
    ledger_records: Sequence[SpendRecord] = (),
    secagg: SiteSecAggSession | None = None,
    secagg_inbox: SecAggShareInbox | None = None,
    on_step: Callable[[int], None] | None = None,
) -> SiteRoundResult:
    """Guard the budget, run ``local_steps`` private steps from the global weights, return Δ — its
    reply signed and entered in the site's audit log first (:func:`_signed_and_recorded`).

    Training runs on ``site.train.device`` (resolved here, at the site: CUDA when available for
    "auto"); ``threads`` applies on the CPU only. Δ comes back to the host as numpy arrays.

    ``engine_hook`` (``fedpose audit`` only; never set by the ClientApp) receives the round's
    gradient engine before the first step, to attach audit canaries.

    ``on_step`` (``fedpose audit``'s console; never set by the ClientApp) is called with each step
    done, after the site's own progress file (:mod:`fedpose.federation.site_progress`) says so.

    ``ledger_records``: the instruction's record of the site's spends in this run (the coordinator's
    ledger as a witness, :mod:`fedpose.federation.witness`). A budget that lacks a spend on record
    refuses the round first (status "refused", reason "behind-federation-record"): nothing is read,
    spent, trained or released.

    The settings that change what the guarantee means are checked against those pinned in the
    site's state (:mod:`fedpose.federation.site_pins`), then the budget decision is made, from
    declared values only, before any data or basis work: a refused round (status "refused") spends
    nothing and touches no data. An affordable round builds the global model (its arrays
    checked), receives the basis (V checked) and loads and checks its data next, then records the
    spend durably, then trains — so a non-finite weight, a bad V or a corrupt image fails the
    round before anything is spent. Raises on operational failures (bad weights, unreadable data, a
    refused setting); :func:`run_site_round` turns those into a sanitized "error" reply.

    ``secagg`` / ``secagg_inbox``: the round is a secure-aggregation round (its session, past the
    share-keys stage, and the shares peers sent): the inbox is checked before anything else is read,
    and Δ — checked by the site itself (finite, ‖Δ‖₂ within the round's bound) — leaves only clipped,
    quantized and masked (``SiteRoundResult.masked``). Such a round's update is never kept for a
    re-send. A site with ``require_secure_aggregation`` refuses any other round first of all.
    """
    import torch

    from fedpose.model import build_model_from_spec, trainable_parameter_names
    from fedpose.model.grey_copies import records_with_gradient
    from fedpose.privacy.engine import build_engine
    from fedpose.privacy.noise import check_release_size
    from fedpose.runtime import configure_device, describe_device, resolve_device, subnormals_as_zero
    from fedpose.train.loop import TrainingDiverged, train_steps
    from fedpose.train.optim import build_optimizer, build_scheduler

    started = time.perf_counter()
    # The site caps the work it accepts per round at its own configured local_steps.
    local_steps = max(0, min(int(local_steps), site.local_steps))
    if local_steps < 1:
        raise ValueError(f"site '{site.site_id}': asked for {local_steps} local steps")
    # Before any spend: a device this machine lacks must fail the round, not cost ε every round.
    device = resolve_device(site.train.device, f"site '{site.site_id}' train.device")
    budget = open_budget(site)
    mechanism = get_mechanism(site.privacy.mechanism)
    secure = secagg is not None and secagg_inbox is not None
    clip_range = secagg.setup.clip_range if secure and secagg is not None else None

    def reply(status: ReplyStatus, reason: ReasonCode | None, affordable: bool,
              extra_events: Sequence[tuple[float, float, int]] = ()) -> SiteReply:
        privacy = privacy_report(site, budget, affordable, extra_events)
        if clip_range is not None and status == "ok":
            privacy = privacy.model_copy(update={"update_clip_range": clip_range})
        return SiteReply(site_id=site.site_id, run_id=run_id, round=int(round_id), status=status, reason=reason,
                         privacy=privacy, basis_version=cached_basis_version(site),
                         local_steps=local_steps, aggregation_weight=site.aggregation_weight,
                         spends=witness.spends_of_run(budget, run_id))

    if site.require_secure_aggregation and not secure:
        # before pins, witness, budget and data: a round whose Δ would leave in the clear costs nothing
        log.warning("site %s round %d: refused a round without secure aggregation (require_secure_aggregation)",
                    site.site_id, round_id)
        _log_round(site, run_id, round_id, "refused", started, note="secure aggregation required")
        return SiteRoundResult(reply("refused", "secure-aggregation-required", True))
    if (secagg is None) != (secagg_inbox is None):
        # a secure round without its session (or shares): never fall back to sending Δ in the clear
        _log_round(site, run_id, round_id, "refused", started, note="secure aggregation: no session or no shares for this round")
        return SiteRoundResult(reply("refused", "secure-aggregation-refused", True))
    if secure:
        assert secagg is not None and secagg_inbox is not None
        try:
            if (secagg.setup.run_id, secagg.setup.round) != (run_id, int(round_id)):
                raise SecAggRefused("out-of-order", f"session of ({secagg.setup.run_id}, {secagg.setup.round})")
            secagg.receive_shares(secagg_inbox)  # before any data work: forged or missing shares cost nothing
        except SecAggRefused as refused:
            _log_round(site, run_id, round_id, "refused", started, note=f"secure aggregation: {refused}")
            return SiteRoundResult(reply("refused", "secure-aggregation-refused", True))
    # Before any data work or spend: what changes the guarantee's meaning is the site's, not the coordinator's.
    check_pinned_settings(site.state_dir, site.site_id, mechanism.guarantee.name, site.privacy, model_spec,
                          state_has_rounds=budget is not None and bool(budget.entries))
    if budget is not None and site.privacy.accountant is None:
        # σ calibration and the engine's report use the accountant the budget enforces (an existing
        # budget keeps its own, e.g. RDP), so a target ε means the same thing to both.
        site = site.model_copy(update={"privacy": site.privacy.model_copy(update={"accountant": budget.accountant_name})})

    model: Any = None
    basis: np.ndarray | None = None
    dataset: Any = None
    units: Any = None
    engine: Any = None

    def prepare_model() -> None:
        """The coordinator's model at its global weights (checked), on the device, and V (checked)."""
        nonlocal model, basis
        configure_device(device, threads)
        model = build_model_from_spec(model_spec)
        expected = model.state_dict()
        check_global_arrays(expected, global_state)
        model.load_state_dict({k: torch.from_numpy(np.asarray(global_state[k]).reshape(expected[k].shape)).to(expected[k].dtype)
                               for k in expected})
        if mechanism.noisy:
            try:  # before the spend: a trainable set too large for the accounting would fail at its first noise draw
                check_release_size(model.num_trainable())
            except ValueError as too_large:
                raise GlobalModelRejected(f"the model spec's {model.num_trainable():,} trainable parameters: {too_large}") from None
        model.to(device)
        model.train_mode()
        if secure and secagg is not None and model.num_trainable() != secagg.setup.vector_length:
            # before the spend: a secure sum of vectors of another length could not be unmasked
            raise ValueError(f"site '{site.site_id}': the secure sum's vector has {secagg.setup.vector_length} values, "
                             f"the model {model.num_trainable()} trainable parameters")
        # The coordinator serves one basis to the whole federation; a site whose mechanism does not
        # project (dpsgd, fdp, maskdp, none) has no use for it and ignores it.
        basis = _site_basis(site, model, basis_version, basis_message) if mechanism.projects else None

    def prepare_engine() -> None:
        """The DP engine over the model and the site's data, with its basis: every way it can refuse the
        coordinator's model or basis shows here, before the spend."""
        nonlocal engine
        public_dataset = None
        if basis is None and mechanism.projects:
            if site.public_data is None:
                raise ValueError(f"site '{site.site_id}': privacy.mechanism '{mechanism.name}' projects onto a public basis, "
                                 "but the coordinator sent none and the site has no public_data to compute its own")
            # no coordinator basis: the engine computes its own from the site's copy of S_pub
            from fedpose.data.dataset import public_basis_dataset

            public_dataset = public_basis_dataset(site.public_data, model_spec.input_size,
                                                  site.privacy.basis.public_rotation, site.privacy.basis.public_grey)
        engine = build_engine(
            site.privacy, model, dataset_size=len(dataset), batch_size=site.train.batch_size,
            planned_steps=site.local_steps,  # σ's calibration: the site's own round length (declared_noise)
            public_dataset=public_dataset,
            seed=site.train.seed * 1_000_003 + int(round_id),  # public choices only (S_pub samples); DP noise is CSPRNG
            chunk_size=site.train.chunk_size, units=units,
            round_steps=local_steps,  # what an observer times is the round: its work is fixed per round (fixed_shape)
            # grey copies: a colour record's gradient is exactly 0, so a unit's row slots take its grey ones
            trainable_records=records_with_gradient(model.trainable_parameters(), dataset),
        )
        if basis is not None:
            engine.set_basis(basis, version=basis_version)

    affordable = True
    if budget is not None:
        sigma, rate = declared_noise(site)
        # The federation's record first: a state behind it would spend from an understated ε.
        shortfall = witness.check_record(budget, run_id, round_id, ledger_records)
        if shortfall is not None:
            log.warning(shortfall.message)
            _log_round(site, run_id, round_id, "refused", started, note=shortfall.message)
            larger = [(e.noise_multiplier, e.sample_rate, e.steps) for e in shortfall.events]
            books = budget.accountant()
            for event in larger:
                books.step(*event)
            fits = bool(books.epsilon_if(sigma, rate, local_steps, budget.delta) <= budget.eps_max)  # by the larger books
            return SiteRoundResult(reply("refused", "behind-federation-record", fits, larger))
        earlier = budget.entry(run_id, round_id)
        fresh_spend = (earlier is None or earlier.status != "spent") and budget.planned_epsilon(sigma, rate, local_steps) <= budget.eps_max
        if fresh_spend:
            # Check the global arrays and V, then load (and check) the data, before spending: a bad
            # input or a broken dataset must not cost ε. Only a round the budget already allows
            # gets here, so a refusal still touches no data.
            prepare_model()
            dataset = load_site_dataset(site, model_spec.input_size)
            units = site_units(site, dataset, budget.unit)  # records that lack the unit's id fail here, unspent
            prepare_engine()  # a projection without a basis, or one the trainable set refuses, fails here, unspent
            check_state_writable(site, model.num_trainable(), keeps_update=not secure)
        try:
            auth = budget.authorize_round(run_id, round_id, sigma, rate, local_steps)
        except BudgetExhausted as refusal:
            log.warning(refusal.reason)
            _log_round(site, run_id, round_id, "refused", started, note=refusal.reason)
            return SiteRoundResult(reply("refused", "budget-exhausted", False))
        affordable = bool(budget.planned_epsilon(sigma, rate, local_steps) <= budget.eps_max)
        if auth.replayed and secure:
            # Never a second masked release of one round: the sum of a second session over other
            # sites, minus the first sum, would be one site's update.
            _log_round(site, run_id, round_id, "replayed", started, note="secure aggregation: no re-send")
            return SiteRoundResult(reply("replayed", "secure-aggregation-no-resend", affordable))
        if auth.replayed:
            # The round was already spent (a duplicated message, or a coordinator that resumed after
            # the site had trained). A fresh noisy update would be a second release of the round:
            # re-send the update released then (no new privacy cost), or nothing if there is none.
            released, note = _load_released(site, run_id, round_id), ""
            if released is not None and set(released) != trainable_parameter_names(model_spec):
                # asked again for another trainable set: that release is not an update of the model asked
                # for (the egress guard would block it), and a fresh one would be a second release
                released, note = None, f"the release kept is of another trainable set than scenario {model_spec.scenario!r}'s"
            _log_round(site, run_id, round_id, "resent" if released is not None else "replayed", started, note=note)
            if released is not None:
                return SiteRoundResult(reply("ok", "resent-earlier-release", affordable), released)
            return SiteRoundResult(reply("replayed", "no-earlier-release", affordable))

    if model is None:
        prepare_model()
    log.info("site %s round %d: training on %s", site.site_id, round_id, describe_device(device))
    trainable = model.trainable_parameters()
    start_weights = {name: p.detach().clone() for name, p in trainable.items()}

    if dataset is None:
        dataset = load_site_dataset(site, model_spec.input_size)
    if units is None and budget is not None:
        units = site_units(site, dataset, budget.unit)
    if engine is None:
        prepare_engine()
    if budget is not None and (engine.noise_multiplier, engine.sample_rate) != (sigma, rate):
        raise RuntimeError(f"engine noise (σ={engine.noise_multiplier}, q={engine.sample_rate}) differs from the authorized (σ={sigma}, q={rate})")
    if engine.augmentation_cost is not None:
        log.info("site %s round %d: %s", site.site_id, round_id, engine.augmentation_cost)
    if engine_hook is not None:
        engine_hook(engine)

    optimizer = build_optimizer(model, site.optim)
    scheduler = build_scheduler(optimizer, site.optim, local_steps)
    record_progress = _progress_recorder(site, run_id, round_id, local_steps, on_step)
    try:
        # slow subnormal arithmetic would let a crafted model time the site's images (fedpose.runtime);
        # the accounting stays outside, in IEEE arithmetic
        with subnormals_as_zero() as every_thread:
            if not every_thread:
                log.warning("site %s: torch's CPU threads started without flush-to-zero; this round trains on one thread "
                            "(start the site from its ClientApp, which starts them with it)", site.site_id)
            history = train_steps(model, engine, dataset, optimizer, local_steps, scheduler=scheduler, progress=False,
                                  on_step=record_progress)
    except TrainingDiverged as failure:
        # Spent (recorded above) but nothing released: say so, with the spend, instead of vanishing.
        log.warning("site %s round %d: %s", site.site_id, round_id, failure)
        _log_round(site, run_id, round_id, "failed", started, note=_with_capacity_warning(str(failure), engine),
                   device=describe_device(device))
        return SiteRoundResult(reply("failed", "training-diverged", affordable))
    update = {name: (p.detach() - start_weights[name]).cpu().numpy() for name, p in model.trainable_parameters().items()}
    if secure:
        assert secagg is not None
        # The coordinator cannot check a masked Δ: the site checks its own, as the coordinator would a clear one.
        from fedpose.federation.validation import update_norm

        bound = secagg.setup.update_norm_bound
        if not all(np.isfinite(a).all() for a in update.values()) or (bound is not None and update_norm(update) > bound):
            _log_round(site, run_id, round_id, "failed", started, note="secure aggregation: update failed the site's check",
                       device=describe_device(device))
            return SiteRoundResult(reply("failed", "update-out-of-bounds", affordable))
        # flattened in the global model's parameter order, weighted by the site's declared weight;
        # never kept for a re-send (a replayed secure round sends nothing)
        flat = np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1) for a in update.values()])
        masked = secagg.mask(flat, site.aggregation_weight)
        # for the operator choosing clip_range (a statistic of Δ: local log only, never sent)
        clipped = f"secure aggregation: {float(np.mean(np.abs(flat) > secagg.setup.clip_range)):.2%} of Δ's coordinates clipped to ±r"
        _log_round(site, run_id, round_id, "ok", started, history=history, note=_with_capacity_warning(clipped, engine),
                   device=describe_device(device))
        return SiteRoundResult(reply("ok", None, affordable), update, masked=masked)
    if budget is not None:
        _save_released(site, run_id, round_id, update)
    _log_round(site, run_id, round_id, "ok", started, history=history, note=_with_capacity_warning("", engine),
               device=describe_device(device))
    return SiteRoundResult(reply("ok", None, affordable), update)


def run_site_round(site: SiteConfig, run_id: str, round_id: int, *args: Any, **kwargs: Any) -> SiteRoundResult:
    """:func:`train_site_round` that never raises: an exception becomes a status-"error" reply
    carrying only the exception's class name (its message may hold paths or private values; it
    goes to the site's local log with the traceback) and, when the site can read it, its privacy
    report — so the coordinator's ledger learns what the site has spent even when a round fails."""
    try:
        return train_site_round(site, run_id, round_id, *args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - every failure must become a sanitized reply
        log.error("site %s round %s failed:\n%s", site.site_id, round_id, traceback.format_exc())
        _log_round(site, run_id, round_id, "error", None, note=f"{type(exc).__name__}: {exc}")
        spends: list[Any] = []
        try:
            budget = open_budget(site)
            report: PrivacyReport | None = privacy_report(site, budget, True)
            spends = witness.spends_of_run(budget, str(run_id))  # a spend before the failure is witnessed too
        except Exception:  # noqa: BLE001 - an unreadable state is itself the error being reported
            report = None
        try:
            version = cached_basis_version(site)
        except Exception:  # noqa: BLE001
            version = -1
        reply = SiteReply(
            site_id=site.site_id, run_id=str(run_id), round=int(round_id), status="error", reason="site-error",
            error_class=error_class_name(exc), privacy=report, basis_version=version, local_steps=0,
            aggregation_weight=site.aggregation_weight, spends=spends,
        )
        try:  # signed when the identity loads (when it does not, that may be the error being reported)
            signer = ReplySigner.of(site)
            reply = signer.sign(reply, {}) if signer is not None else reply
        except Exception:  # noqa: BLE001
            pass
        # logged when the site has a state (a new site that failed before creating one has nothing to
        # audit, and a log alone would make its state dir look like a state that lost its budget)
        if (Path(site.state_dir) / GENESIS_FILE).exists():
            try:
                site_audit.record_reply(site.state_dir, reply, {}, _asked((site, run_id, round_id, *args), kwargs))
            except Exception:  # noqa: BLE001 - the error reply releases no update; the failure goes to the local log
                log.error("site %s round %s: cannot write its audit log:\n%s", site.site_id, round_id, traceback.format_exc())
        return SiteRoundResult(reply)


def _asked(args: tuple[Any, ...], kwargs: dict[str, Any]) -> site_audit.AuditInstruction | None:
    """The audit log's view of an instruction :func:`train_site_round` failed on (None: unreadable)."""
    try:
        return _instruction_of_call(args, kwargs)[1]
    except Exception:  # noqa: BLE001 - a malformed instruction is logged as unreadable
        return None


def _with_capacity_warning(note: str, engine: Any) -> str:
    """``note`` for rounds.jsonl, with the engine's warning for a training set beyond the timing
    protection's N_max (logged when the engine was built). It names N: local only, never in a reply,
    whose status stays what it would be for any N (a status one unit could flip would tell membership)."""
    warning = engine.capacity_warning
    return "; ".join(text for text in (note, warning) if text)


def _progress_recorder(site: SiteConfig, run_id: str, round_id: int, steps: int,
                       observer: Callable[[int], None] | None = None) -> Callable[[int, dict[str, Any]], None]:
    """Record that the round's training begins (0 steps done) and return the ``on_step`` callback that
    records each step done, in the site's progress file and its log (site-local, never sent:
    :mod:`fedpose.federation.site_progress`), then tells ``observer``."""
    from fedpose.federation.site_progress import RoundProgress, record_progress

    began = RoundProgress(run_id=run_id, round=int(round_id), steps_done=0, steps=int(steps), started=time.time())
    record_progress(site.state_dir, began)

    def on_step(step: int, record: dict[str, Any]) -> None:
        record_progress(site.state_dir, began.model_copy(update={"steps_done": int(step)}))
        log.info("site %s round %d: step %d/%d done", site.site_id, round_id, step, steps)
        if observer is not None:
            observer(step)

    return on_step


def _log_round(site: SiteConfig, run_id: str, round_id: int, outcome: str, started: float | None,
               history: list[dict[str, Any]] | None = None, note: str = "", device: str = "") -> None:
    """Append the round's site-local diagnostics (private-data statistics: never sent)."""
    entry: dict[str, Any] = {"run_id": run_id, "round": int(round_id), "outcome": outcome, "time": time.time()}
    if device:
        entry["device"] = device
    if started is not None:
        entry["seconds"] = time.perf_counter() - started
    if history:
        losses = [float(h["loss"]) for h in history if math.isfinite(float(h.get("loss", math.nan)))]
        entry["train_loss"] = float(np.mean(losses)) if losses else None
        entry["nonfinite_samples"] = int(sum(h.get("nonfinite_samples", 0) for h in history))
    if note:
        entry["note"] = note
    if not (Path(site.state_dir) / GENESIS_FILE).exists():
        # a round that failed before the site's state exists (data not mounted, no such device): a file
        # in the state dir would make the next round take it for a state whose budget was lost
        log.info("site %s round %s (no site state yet): %s", site.site_id, round_id, json.dumps(entry))
        return
    try:
        path = Path(site.state_dir) / ROUND_LOG
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry) + "\n")
    except OSError as exc:  # diagnostics must never decide a round's outcome
        log.warning("site %s: cannot write %s: %s", site.site_id, ROUND_LOG, exc)


class StateNotWritable(OSError):
    """What a round must write after its spend cannot be written (raised before the spend)."""


#: room a round needs in the state dir beyond the update it keeps: its audit entry, journal and budget lines
STATE_WRITE_MARGIN_BYTES = 1 << 20


def check_state_writable(site: SiteConfig, trainable: int, keeps_update: bool) -> None:
    """Before the spend: what the round writes after training — its audit entry, appended to a log that
    must parse, and the update it keeps for a re-send (written beside the last one, float32) — can be
    written. Otherwise every round would spend, train and then fail to release, until ε_max."""
    site_audit.read_log(site.state_dir)  # a malformed entry raises AuditLogError, naming it
    need = (2 * 4 * trainable if keeps_update else 0) + STATE_WRITE_MARGIN_BYTES
    free = shutil.disk_usage(site.state_dir).free
    if free < need:
        raise StateNotWritable(f"site '{site.site_id}': {free:,} bytes free where its state is ({site.state_dir}); a round "
                               f"writes about {need:,} after its spend. Nothing was spent: free some space")


def _released_path(site: SiteConfig) -> Path:
    return Path(site.state_dir) / "released_update.npz"


def _save_released(site: SiteConfig, run_id: str, round_id: int, update: dict[str, np.ndarray]) -> None:
    """Keep the last released update (already privatized), so a replayed round re-sends it."""
    from fedpose.federation.aggregation import save_array_checkpoint

    save_array_checkpoint(_released_path(site), update, {"run_id": run_id, "round": int(round_id)})


def _load_released(site: SiteConfig, run_id: str, round_id: int) -> dict[str, np.ndarray] | None:
    from fedpose.federation.aggregation import load_array_checkpoint

    if not _released_path(site).exists():
        return None
    arrays, meta = load_array_checkpoint(_released_path(site))
    if meta.get("run_id") != run_id or meta.get("round") != int(round_id):
        return None
    return arrays
