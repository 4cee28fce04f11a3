"""The coordinator's round loop, Flower-free: select, send, classify replies, aggregate, record.

Per round: pick the sites that are not exhausted, send them the global weights (+ the basis when
they lack its current version), wait at most the round timeout, validate and aggregate the
updates that came back (streaming, one in memory at a time), record every site's report in the
ledger (ok / rejected / refused / missing), evaluate the global model on the held-out split, then
checkpoint. How messages travel is a :class:`Transport` (``coordinator/grid.py`` adapts Flower's
Grid; tests use an in-process one).

Checkpoint order per round: ledger rows first (one transaction), then server-optimizer state,
then the global model + coordinator state (the commit point). A resume continues after the
highest round found in either, so a crash in between never re-runs a round a site already spent
on, and ledger rows are keyed by (site, round) so nothing is counted twice. The server optimizer
resumes from the state stamped with the model checkpoint's round (the one before it is kept until
the model is written): a round lost to the model is lost to the momentum too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from functools import partial
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fedpose.config import ModelSpec
from fedpose.federation import protocol, reply_signature, witness
from fedpose.federation.aggregation import (
    ServerOptimizer,
    aggregate_round,
    build_server_optimizer,
    load_array_checkpoint,
    load_checkpoint_meta,
    load_server_optimizer,
    save_array_checkpoint,
    save_server_optimizer,
)
from fedpose.federation.basis_transport import BasisMessage
from fedpose.federation.deployment import CoordinatorRunConfig
from fedpose.federation.ledger import BudgetLedger, LedgerEntry, LedgerError
from fedpose.federation.metrics import CoordinatorMetrics
from fedpose.federation.report import (
    RoundRecord,
    SecureAggregationRecord,
    SiteRoundRecord,
    epsilon_text,
    finished_run_note,
    initial_line,
    load_history,
    round_line,
    save_history,
    write_report,
)
from fedpose.federation.global_model import GLOBAL_CHECKPOINT
from fedpose.federation.secagg.coordinator import CoordinatorSecAggRound, RoundAbandoned
from fedpose.federation.site_audit import arrays_sha256
from fedpose.federation.validation import spec_of, validate_update
from fedpose.federation.weight_ema import EMA_CHECKPOINT, WeightEma
from fedpose.federation.server.basis_service import NO_BASIS, BasisService

log = logging.getLogger("fedpose.coordinator")

OPTIMIZER_CHECKPOINT = "server_optimizer.npz"
#: the server-optimizer state of the committed model while the next round's model is being written
PREVIOUS_OPTIMIZER_CHECKPOINT = "server_optimizer.previous.npz"
NODE_WAIT_POLL_S = 1.0
NODE_SETTLE_S = 5.0  #: a fresh run waits until the connected-node count is stable this long


# -- transport -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainRequest:
    """One node's share of a round: the instruction, the global weights, and the basis if it lacks it."""

    node: int
    instruction: protocol.TrainInstruction
    global_arrays: Mapping[str, np.ndarray]
    basis: BasisMessage | None = None
    #: secure aggregation: the shares peers encrypted for this node (the masked-vector stage)
    secagg_inbox: protocol.SecAggShareInbox | None = None

    @property
    def nbytes(self) -> int:
        inbox = len(self.secagg_inbox.model_dump_json()) if self.secagg_inbox is not None else 0
        return sum(a.nbytes for a in self.global_arrays.values()) + (self.basis.nbytes if self.basis is not None else 0) + inbox


@dataclass(frozen=True)
class NodeReply:
    """What came back from one node: a site reply (+ a lazily decoded Δ), or why there is none."""

    node: int
    reply: protocol.SiteReply | None = None
    update: Callable[[], dict[str, np.ndarray]] | None = None  #: decodes Δ when called (one in memory at a time)
    #: secure aggregation: decodes the masked vector (uint64) when called; ``update`` is then None
    masked: Callable[[], np.ndarray] | None = None
    bytes_up: int = 0
    failure: str = ""  #: set when ``reply`` is None: a transport error or a malformed reply

    def received_sha256(self) -> str | None:
        """The digest of what the node sent (Δ, or the masked vector) as the site's audit log states
        it for what it released (:func:`~fedpose.federation.site_audit.arrays_sha256`); None: nothing."""
        if self.masked is not None:
            return arrays_sha256({protocol.MASKED_KEY: self.masked()})
        return arrays_sha256(self.update()) if self.update is not None else None


class Transport(Protocol):
    def node_ids(self) -> list[int]:
        """Nodes connected now."""

    def send_and_receive(self, requests: list[TrainRequest], timeout: float) -> list[NodeReply]:
        """Send every request; return the replies that arrived within ``timeout`` (any order)."""

    def secagg_exchange(self, messages: Mapping[int, protocol.SecAggRequest], timeout: float) -> dict[int, protocol.SecAggSiteMessage]:
        """Secure aggregation's setup, share-keys and unmask stages: one message to each node, the
        replies that arrived within ``timeout`` by node (a malformed one is left out: a dropout)."""


# -- state -------------------------------------------------------------------------------------------
@dataclass
class CoordinatorState:
    """Everything the coordinator must remember between rounds (checkpointed every round)."""

    model_spec: ModelSpec  #: the global model's architecture (fixed for the run)
    round: int = 0  #: last finished round
    node_sites: dict[str, str] = field(default_factory=dict)  #: transport node id → site id (learned from replies)
    basis: dict[str, Any] = field(default_factory=dict)  #: BasisService.state_dict()
    stopped_reason: str = ""
    initial_pckh: float | None = None  #: PCKh@0.5 Mean of the initial global model (before any site data)

    def to_meta(self) -> dict[str, Any]:
        return {"round": self.round, "model_spec": self.model_spec.model_dump(mode="json"), "node_sites": self.node_sites, "basis": self.basis,
                "stopped_reason": self.stopped_reason,
                "initial_pckh": self.initial_pckh}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> "CoordinatorState":
        # checkpoints before the basis service kept its fields at the top level
        basis = meta.get("basis") or {"current_version": meta.get("basis_version", NO_BASIS), "held": meta.get("site_basis", {})}
        return cls(model_spec=ModelSpec.model_validate(meta["model_spec"]), round=int(meta["round"]),
                   node_sites=dict(meta["node_sites"]), basis=dict(basis), stopped_reason=str(meta.get("stopped_reason", "")),
                   initial_pckh=meta.get("initial_pckh"))


# -- the runner --------------------------------------------------------------------------------------
class RoundRunner:
    def __init__(self, run: CoordinatorRunConfig, resume: bool = False, echo: Callable[[str], Any] = print):
        self.run = run
        self.cfg = run.coordinator
        self.dir = Path(self.cfg.checkpoint_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        from fedpose.runtime import configure_device, describe_device, resolve_device

        #: where the warm start, the basis computation and evaluation run (coordinator.device)
        self.device = resolve_device(self.cfg.device, "coordinator.device")
        configure_device(self.device)
        self.device_text = describe_device(self.device)
        parts = [*(["warm start"] if self.warm_starts else []),
                 *(["basis"] if self.serves_basis else [])]
        evaluation = "evaluation (flip test)" if self.cfg.data.val_flip_test else "evaluation (no flip test)"
        jobs = f"{', '.join(parts)} and {evaluation}" if parts else evaluation
        basis_note = "" if self.serves_basis or self.cfg.public_data is None else " (no basis service: projecting sites compute their own)"
        self.echo(f"coordinator: {jobs} on {self.device_text}{basis_note}")
        if self.serves_basis:
            from fedpose.data.dataset import load_records
            from fedpose.privacy.projection import public_shortfall

            shortfall = public_shortfall(len(load_records(self.cfg.public_data)[0]), self.cfg.basis.public_samples, self.cfg.basis.k)
            if shortfall is not None:
                log.warning("coordinator basis: %s", shortfall)
        resuming = resume and (self.dir / GLOBAL_CHECKPOINT).exists()
        ledger_path = Path(self.cfg.ledger_path)
        if resuming and (not ledger_path.exists() or ledger_path.stat().st_size == 0):
            # A lost ledger must not be recreated empty: the rounds it held (and what each site
            # reported it spent) would vanish from `fedpose ledger show` without a word.
            raise LedgerError(f"resuming run '{run.run_id}': the budget ledger {ledger_path} is missing or empty; restore it from a backup")
        self.ledger = BudgetLedger(ledger_path)
        recorded = self.ledger.last_round()
        if not resuming and recorded > 0:
            # Starting at round 1 would overwrite these rows: what each site reported it spent.
            self.ledger.close()
            how = (f"its model checkpoint {self.dir / GLOBAL_CHECKPOINT} is missing: restore it from a backup" if resume
                   else "continue it with --resume")
            raise LedgerError(f"the budget ledger {ledger_path} already holds site reports up to round {recorded}; {how}, "
                              "or use another checkpoint_dir — a new run never overwrites a ledger")
        # served over HTTP when a port is configured; otherwise kept in memory only
        self.metrics = (CoordinatorMetrics.serve(self.cfg.metrics_port, self.cfg.metrics_addr) if self.cfg.metrics_port is not None
                        else CoordinatorMetrics())
        self._eval_dataset: Any = None
        self._nodes_settled = False  #: the first round of this process waits for the federation to reconnect
        self._node_wait_seconds = 0.0  #: how long the current round waited for sites to connect (history)
        if resuming:
            arrays, meta = load_array_checkpoint(self.dir / GLOBAL_CHECKPOINT)
            if meta.get("run_id") != run.run_id:
                raise ValueError(f"checkpoint in {self.dir} is of run '{meta.get('run_id')}', config says '{run.run_id}'")
            self.state = CoordinatorState.from_meta(meta["state"])
            self.global_state = arrays
            self.optimizer = self._committed_optimizer()
            self.history = [r for r in load_history(self.dir) if r.round <= self.state.round]
            if recorded > self.state.round:
                # Killed after recording the ledger but before the model checkpoint: that round's
                # updates are lost, but sites did spend — never ask them for that round again.
                log.warning("ledger has round %d, model checkpoint round %d: continuing after round %d", recorded, self.state.round, recorded)
                self.state.round = recorded
            if self.state.round > 0 and recorded == 0:
                self.ledger.close()
                raise LedgerError(f"resuming run '{run.run_id}' after round {self.state.round}: the budget ledger "
                                  f"{ledger_path} holds no rounds; restore it from a backup")
            self.echo(f"resuming run '{run.run_id}' after round {self.state.round}")
            if self.state.round >= self.cfg.rounds:
                self.echo(finished_run_note(run.run_id, self.state.round, self.cfg.rounds,
                                            "coordinator.rounds = {rounds} in the coordinator config, then resume=true"))
        else:
            if resume:
                self.echo(f"--resume: no checkpoint in {self.dir}, starting at round 1")
            elif (self.dir / GLOBAL_CHECKPOINT).exists():
                raise ValueError(f"{self.dir} already holds a checkpoint of run '{run.run_id}': resume it or use another checkpoint_dir")
            self.state, self.global_state = self._initial_model()
            self.optimizer = build_server_optimizer(self.cfg.aggregation, rounds=self.cfg.rounds)
            self.history: list[RoundRecord] = []
        self.basis = BasisService.from_state(self.state.basis, self.cfg.basis.refresh_every_rounds)
        # post-processing of the released global models; None when coordinator.ema is off
        self.ema = (WeightEma.resume(self.dir, self.cfg.ema.decay, self.state.round, self.echo) if resuming
                    else WeightEma(self.cfg.ema.decay)) if self.cfg.ema.on else None

    # -- model --------------------------------------------------------------------------------------
    @property
    def warm_starts(self) -> bool:
        """Whether the first global model takes steps on the coordinator's public data (no privacy cost)."""
        return self.cfg.public_data is not None and self.cfg.warm_start.steps > 0

    def _initial_model(self) -> tuple[CoordinatorState, dict[str, np.ndarray]]:
        import torch

        from fedpose.federation.warm_start import warm_start
        from fedpose.model import build_model
        from fedpose.model.checkpoint import check_start_checkpoint, model_spec

        torch.manual_seed(self.cfg.seed)
        model = build_model(self.cfg.model, tuple(self.cfg.data.input_size)).to(self.device)
        from_scratch = self.cfg.model.init_checkpoint is None
        if not from_scratch:
            check_start_checkpoint(self.cfg.model.init_checkpoint, model_spec(model), "coordinator.model.init_checkpoint")
        # a model built from scratch gets its BatchNorm statistics from public images even with 0 steps
        if self.warm_starts or (from_scratch and self.cfg.public_data is not None):
            done = warm_start(model, self.cfg.public_data, self.cfg.warm_start.steps, self.cfg.warm_start.optim,
                              self.cfg.warm_start.batch_size, self.cfg.seed, calibrate=from_scratch, echo=self.echo)
            if done["steps"]:
                self.echo(f"warm start: {int(done['steps'])} steps on public data in {done['seconds']:.0f} s (no privacy cost)")
        spec = model_spec(model)
        state = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
        return CoordinatorState(model_spec=spec), state

    def global_model(self, weights: dict[str, np.ndarray] | None = None) -> Any:
        """The current global model (or ``weights`` in its architecture) as a torch module, on the coordinator's device."""
        import torch

        from fedpose.model import build_model_from_spec

        model = build_model_from_spec(self.state.model_spec)
        model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in (weights or self.global_state).items()})
        return model.to(self.device)

    def evaluate(self) -> dict[str, float] | None:
        """PCKh of the global model — its moving average when coordinator.ema is on — on the held-out split
        (``coordinator.data.val``; flip test unless ``coordinator.data.val_flip_test`` is off)."""
        if self.cfg.data.val is None:
            return None
        from fedpose.train.evaluate import evaluate

        if self._eval_dataset is None:
            from fedpose.data.dataset import PoseDataset, load_records

            records, root = load_records(self.cfg.data.val)
            self._eval_dataset = PoseDataset(records, root, input_size=self.state.model_spec.input_size, train=False)
        model = self.global_model(self.ema.weights if self.ema else None)
        scores = evaluate(model, self._eval_dataset, batch_size=16, flip_test=self.cfg.data.val_flip_test)
        return {k: float(v) for k, v in scores.items() if isinstance(v, (int, float))}

    # -- selection ------------------------------------------------------------------------------------
    def exhausted_sites(self) -> set[str]:
        return self.ledger.exhausted_sites()

    def wait_for_nodes(self, transport: Transport) -> list[int]:
        """Connected nodes. Before the first round of this process: once ≥ min_sites are connected
        and as many nodes as known, non-exhausted sites are back (after a restart nodes reconnect
        one by one) or, on a fresh run, ``expected_sites`` are connected (without it: the count has
        been stable for a few seconds — on a slow machine a late site misses round 1); never longer
        than the round timeout. Later rounds: as soon as ≥ min_sites are connected."""
        if self._nodes_settled:  # steady state: a site that dropped out is reported missing, not waited for
            nodes = sorted(transport.node_ids())
            if len(nodes) >= self.cfg.min_sites:
                return nodes
        self._nodes_settled = True
        exhausted = self.exhausted_sites()
        # Count sites, not node ids: a restarted SuperLink or a new simulation hands out new ids, so
        # waiting for the checkpoint's ids would sit out the whole round timeout.
        known = set(self.state.node_sites.values())
        expected = len(known - exhausted) if known else self.cfg.expected_sites
        deadline = time.monotonic() + self.cfg.round_timeout_s
        stable_since, last = time.monotonic(), -1
        while True:
            nodes = sorted(transport.node_ids())
            now = time.monotonic()
            if len(nodes) != last:
                stable_since, last = now, len(nodes)
            enough = len(nodes) >= self.cfg.min_sites
            known_back = len(nodes) >= expected if expected else now - stable_since >= NODE_SETTLE_S
            if (enough and known_back) or now > deadline:
                return nodes
            time.sleep(NODE_WAIT_POLL_S)

    def select(self, nodes: list[int], round_id: int) -> list[int]:
        exhausted = self.exhausted_sites()
        candidates = [n for n in nodes if self.state.node_sites.get(str(n)) not in exhausted]
        if not candidates:
            return []
        count = max(min(self.cfg.min_sites, len(candidates)), math.ceil(self.cfg.fraction_train * len(candidates)))
        return sorted(random.Random(self.cfg.seed * 7919 + round_id).sample(candidates, count))

    # -- the loop --------------------------------------------------------------------------------------
    def run_rounds(self, transport: Transport) -> dict[str, Any]:
        self._trainable = list(self.global_model().trainable_parameters())
        if self.state.round == 0 and self.state.initial_pckh is None:
            scores = self.evaluate()
            if scores is not None:  # the reference every private round is compared with
                self.state.initial_pckh = float(scores["Mean"])
                self.echo(initial_line(self.state.initial_pckh))
        try:
            for round_id in range(self.state.round + 1, self.cfg.rounds + 1):
                waiting = time.monotonic()
                nodes = self.wait_for_nodes(transport)
                self._node_wait_seconds = time.monotonic() - waiting
                selected = self.select(nodes, round_id)
                if not selected:
                    known = set(self.state.node_sites.values())
                    self.state.stopped_reason = f"all sites exhausted their privacy budget ({', '.join(sorted(known)) or 'none connected'})"
                    self.echo(f"stopping before round {round_id}: {self.state.stopped_reason}")
                    break
                self.run_round(transport, round_id, selected)
            else:  # a resumed run's checkpoint holds the previous process's reason: replace it
                self.state.stopped_reason = f"completed {self.cfg.rounds} rounds"
            self._save_checkpoint()
            return self.finish()
        finally:
            self.ledger.close()
            self.metrics.close()

    @property
    def serves_basis(self) -> bool:
        """Whether this coordinator computes and ships V (it needs S_pub and basis.source = "coordinator")."""
        return self.cfg.public_data is not None and self.cfg.basis.source == "coordinator"

    def _basis_for_round(self, round_id: int, selected: list[int]) -> tuple[int, BasisMessage | None]:
        """(version, message) of the projection basis for pdp / fpdp; (-1, None) when none is used."""
        if not self.serves_basis:
            return NO_BASIS, None
        from fedpose.federation.public_basis import compute_basis

        def compute(version: int) -> BasisMessage:
            basis = self.cfg.basis
            return compute_basis(self.global_model(), self.cfg.public_data, k=basis.k, m=basis.public_samples, version=version,
                                 transport=basis.transport, dtype=basis.dtype)

        return self.basis.for_round(round_id, [self.state.node_sites.get(str(n)) for n in selected], compute)

    def requests(self, round_id: int, selected: list[int]) -> tuple[list[TrainRequest], int]:
        """This round's requests (the basis only to sites lacking its version) and the basis bytes sent."""
        basis_version, basis_message = self._basis_for_round(round_id, selected)
        instruction = protocol.TrainInstruction(run_id=self.run.run_id, round=round_id, local_steps=self.cfg.local_steps,
                                                model_spec=self.state.model_spec, basis_version=basis_version,
                                                secure_aggregation=self.cfg.secure_aggregation.enabled)
        # the ledger as a witness: each site gets its record of spends (fedpose.federation.witness)
        spends = self.ledger.spend_events(self.run.run_id)
        attributed = {site for site in (self.state.node_sites.get(str(n)) for n in selected) if site is not None}
        requests = [TrainRequest(node, instruction.model_copy(update={"ledger_records": witness.records_for_node(
                                     spends, self.state.node_sites.get(str(node)), attributed)}), self.global_state,
                                 basis_message if self.basis.needs_basis(self.state.node_sites.get(str(node))) else None)
                    for node in selected]
        return requests, sum(r.basis.nbytes for r in requests if r.basis is not None)

    # -- secure aggregation (fedpose.federation.secagg) -----------------------------------------------------
    def _secure_setup(self, transport: Transport, round_id: int, requests: list[TrainRequest],
                      secure: CoordinatorSecAggRound) -> list[TrainRequest]:
        """Stages 1–2 (setup, share keys): the train requests of the sites that shared their keys,
        each with its share inbox. Raises :class:`RoundAbandoned` before anyone trains."""
        timeout = self.cfg.round_timeout_s
        secure.check_collusion_bound()
        setups = {node: secure.setup(node) for node in secure.participants}
        keys = transport.secagg_exchange(setups, timeout)
        secure.bytes += _stage_bytes(setups.values(), keys.values())
        secure.receive_public_keys(keys)
        directory = secure.key_directory()
        asked = {node: directory for node in secure.keys}
        shares = transport.secagg_exchange(asked, timeout)
        secure.bytes += _stage_bytes(asked.values(), shares.values())
        secure.receive_shares(shares)
        return [replace(r, secagg_inbox=secure.inbox(r.node)) for r in requests if r.node in secure.sealed]

    def _aggregate_secure(self, transport: Transport, round_id: int, secure: CoordinatorSecAggRound, updates: list[NodeReply],
                          sites: dict[str, SiteRoundRecord], entries: list[LedgerEntry]) -> tuple[bool, int, int]:
        """Stages 3–4: collect the masked vectors, have the survivors sign one view of who survived,
        unmask their sum, validate it, step the optimizer.
        An abandoned round aggregates nothing; its sites trained, so each is recorded as spent
        (ledger "rejected", the reason saying the secure sum was abandoned)."""
        replies = {u.node: u.reply for u in updates if u.reply is not None}
        try:
            secure.receive_masked({u.node: u.masked() for u in updates if u.masked is not None})
            view = secure.view_request()  # the consistency check: every survivor signs the one view
            shown = {node: view for node in secure.masked}
            signed = transport.secagg_exchange(shown, self.cfg.round_timeout_s)
            secure.bytes += _stage_bytes(shown.values(), signed.values())
            secure.receive_view_signatures(signed)
            request = secure.unmask_request()
            asked = {node: request for node in secure.view_signatures}
            answers = transport.secagg_exchange(asked, self.cfg.round_timeout_s)
            secure.bytes += _stage_bytes(asked.values(), answers.values())
            for node, refusal in secure.refusals.items():
                log.warning("round %d: node %d refused a secure-aggregation stage: %s", round_id, node, refusal.describe())
            result = secure.unmask(answers)
        except (RoundAbandoned, ValueError) as abandoned:
            secure.abandoned = str(abandoned)
            for reply in replies.values():
                reason = f"secure aggregation abandoned: {abandoned}; spent, nothing aggregated"
                site = sites[reply.site_id]
                site.status, site.reason, site.reject_reason = "rejected", reason, "secure_aggregation_abandoned"
                entries.append(LedgerEntry.from_reply(round_id, reply, status="rejected", reason=reason))
            self.echo(f"round {round_id}: secure aggregation abandoned ({abandoned}): global model unchanged")
            return False, 0, len(replies)
        survivors = [replies[node] for node in result.survivors]
        dropped = [replies[node] for node in replies if node not in result.survivors]
        for reply in dropped:  # trained, but its vector is not in the sum (its masks were removed with its key)
            reason = "secure aggregation: masked vector not in the sum (malformed); spent, nothing aggregated"
            site = sites[reply.site_id]
            site.status, site.reason, site.reject_reason = "rejected", reason, "secure_aggregation_dropped"
            entries.append(LedgerEntry.from_reply(round_id, reply, status="rejected", reason=reason))
        total_weight = sum(reply.aggregation_weight for reply in survivors)
        heavy = sorted(r.site_id for r in survivors if r.aggregation_weight > self.cfg.secure_aggregation.max_weight)
        if heavy:  # their w·Δ was clipped to ±W·r: the mean under-weights them
            self.echo(f"round {round_id}: sites {heavy} declare aggregation weights above secure_aggregation.max_weight = "
                      f"{self.cfg.secure_aggregation.max_weight:g}: their weighted updates were clipped; raise max_weight")
        mean = _unflatten(result.total / total_weight, {k: self.global_state[k] for k in self._trainable})
        secure.survivors, secure.error_bound = len(survivors), result.error_bound / total_weight
        # the sum is all the coordinator can check: finite, and within the norm bound (each site checked
        # its own ‖Δ‖₂ ≤ bound, so their mean is, up to the quantization error)
        slack = secure.error_bound * math.sqrt(result.total.size)
        bound = self.cfg.update_norm_bound + slack if self.cfg.update_norm_bound is not None else None
        check = validate_update("secure sum", mean, spec_of(mean), max_norm=bound)
        secure.mean_norm = check.norm
        if not check.ok:
            secure.abandoned = f"the unmasked sum failed validation ({check.reason}: {check.detail})"
            for reply in survivors:
                site = sites[reply.site_id]
                site.status, site.reason, site.reject_reason = "rejected", secure.abandoned, check.reason
                entries.append(LedgerEntry.from_reply(round_id, reply, status="rejected", reason=secure.abandoned))
            self.echo(f"round {round_id}: {secure.abandoned}: global model unchanged")
            return False, 0, len(replies)
        for reply in survivors:
            entries.append(LedgerEntry.from_reply(round_id, reply, status="ok"))
        if len(survivors) < self.cfg.min_sites:
            self.echo(f"round {round_id}: {len(survivors)} site(s) in the secure sum < min_sites = {self.cfg.min_sites}: global model unchanged")
            return False, len(survivors), len(dropped)
        trainable = {k: self.global_state[k] for k in self._trainable}
        self.global_state.update(self.optimizer.step(trainable, mean))
        return True, len(survivors), len(dropped)

    def run_round(self, transport: Transport, round_id: int, selected: list[int]) -> None:
        started = time.perf_counter()
        requests, basis_bytes = self.requests(round_id, selected)
        secure: CoordinatorSecAggRound | None = None
        not_trained: dict[int, str] = {}  # secure aggregation: nodes never asked to train (nothing spent)
        if self.cfg.secure_aggregation.enabled:
            secure = CoordinatorSecAggRound(self.cfg.secure_aggregation, self.run.run_id, round_id, selected,
                                            sum(int(self.global_state[k].size) for k in self._trainable), self.cfg.update_norm_bound)
            try:
                requests = self._secure_setup(transport, round_id, requests, secure)
            except RoundAbandoned as abandoned:
                secure.abandoned = f"{abandoned}; abandoned before training, nothing spent"
                self.echo(f"round {round_id}: secure aggregation abandoned ({secure.abandoned})")
                requests = []
            asked = {r.node for r in requests}
            for node in selected:
                if node not in asked:
                    refusal = secure.refusals.get(node)
                    not_trained[node] = ("not asked to train: " + (f"refused secure aggregation ({refusal.describe()})" if refusal
                                         else "left secure aggregation before masking") + "; nothing spent")
        bytes_down = {r.node: r.nbytes for r in requests}
        replies = transport.send_and_receive(requests, timeout=self.cfg.round_timeout_s) if requests else []
        round_seconds = time.perf_counter() - started

        entries: list[LedgerEntry] = []
        sites: dict[str, SiteRoundRecord] = {}
        answered: set[int] = set()
        failures = {r.node: r.failure for r in replies if r.reply is None}  # counted as missing below: spent or not, unknown
        attributed, unattributed = self._attribute(round_id, replies)
        failures.update(unattributed)
        received = {site_id: digest for site_id, (_, digest) in attributed.items()}
        updates: list[NodeReply] = []
        for node_reply, _ in attributed.values():
            node, site_reply = node_reply.node, node_reply.reply
            assert site_reply is not None
            answered.add(node)
            site_id = site_reply.site_id
            for stale in [n for n, s in self.state.node_sites.items() if s == site_id and n != str(node)]:
                del self.state.node_sites[stale]  # the site answers from this node now: the old one speaks for no site
            self.state.node_sites[str(node)] = site_id
            self.basis.mark_held(site_id, site_reply.basis_version)
            privacy = site_reply.privacy
            info = SiteRoundRecord(status=site_reply.status, epsilon=privacy.epsilon if privacy else None,
                                   delta=privacy.delta if privacy else None, guarantee=privacy.guarantee if privacy else None,
                                   accountant=privacy.accountant if privacy else None,
                                   unit=privacy.protection_unit if privacy else None,
                                   adjacency=privacy.adjacency if privacy else None,
                                   eps_max=privacy.eps_max if privacy else None,
                                   reason=site_reply.describe() if site_reply.reason else "",
                                   local_steps=site_reply.local_steps, bytes_down=bytes_down.get(node, 0))
            sites[site_id] = info
            # what the site says it spent in this run becomes part of the witness (never lowers a row)
            self.ledger.record_spends(site_id, self.run.run_id, witness.spend_tuples(site_reply.spends))
            behind = site_reply.reason == "behind-federation-record"  # refused before any spend: no regression to judge
            regression = "" if behind else self._epsilon_regression(site_reply)
            if regression:
                # A cumulative ε never decreases: a lower one means the site's budget state was
                # reset or replaced. Keep the ledger's higher value authoritative and use nothing.
                log.error("round %d: site %s: %s", round_id, site_id, regression)
                self.echo(f"round {round_id}: rejected site '{site_id}': {regression}")
                info.status, info.reason, info.reject_reason = "rejected", regression, "epsilon_regressed"
                entries.append(LedgerEntry.from_reply(round_id, site_reply, status="rejected", reason=regression))
                continue
            if not site_reply.carries_update:
                # refused: nothing spent; replayed / failed / error: spent (or unknown), nothing to aggregate
                # a budget refusal is the guard working (the round line shows it), not a fault; a site
                # behind the ledger's record is not exhausted: it is asked again (its operator may fix it)
                refused = site_reply.status == "refused" and not behind
                log.log(logging.INFO if refused else logging.WARNING, "round %d: site %s %s: %s", round_id, site_id,
                        site_reply.status, info.reason)
                status = "refused" if refused else "missing"
                entries.append(LedgerEntry.from_reply(round_id, site_reply, status=status, reason=info.reason))
                continue
            info.bytes_up = node_reply.bytes_up
            updates.append(node_reply)

        unidentified: list[int] = []
        for node in selected:
            if node in answered:
                continue
            reason = failures.get(node) or _no_reply_reason(round_seconds, self.cfg.round_timeout_s)
            # a node whose reply named a site it could not prove it is stays unattributed
            site_id = None if node in unattributed else self.state.node_sites.get(str(node))
            if node in not_trained:
                # never sent a train message this round: no spend to mirror, nothing for the ledger
                log.warning("round %d: %s %s", round_id, f"site {site_id}" if site_id else f"node {node}", not_trained[node])
                if site_id is None:
                    unidentified.append(node)
                else:
                    sites[site_id] = SiteRoundRecord(status="missing", reason=not_trained[node])
                continue
            if site_id is None:
                # A node that never told us its site id (e.g. its ClientApp cannot start) has no
                # budget to mirror: report it in the round, keep it out of the site ledger.
                log.warning("round %d: unidentified node %d missing: %s", round_id, node, reason)
                unidentified.append(node)
                continue
            log.warning("round %d: site %s missing: %s", round_id, site_id, reason)
            sites[site_id] = SiteRoundRecord(status="missing", reason=reason, bytes_down=bytes_down.get(node, 0))
            entries.append(LedgerEntry(site_id=site_id, round=round_id, status="missing", reason=reason))

        if secure is None:
            aggregated, accepted, rejected = self._aggregate(round_id, updates, sites, entries)
        elif secure.abandoned:
            aggregated, accepted, rejected = False, 0, 0
        else:
            aggregated, accepted, rejected = self._aggregate_secure(transport, round_id, secure, updates, sites, entries)
        self.ledger.record_many(replace(e, update_sha256=received.get(e.site_id)) for e in entries)  # 1) ledger
        self.state.round = round_id
        if self.ema is not None and aggregated:  # an unchanged model is not averaged in again
            self.ema.update(self.global_state, round_id)
        entry = RoundRecord(
            round=round_id, pckh=self.evaluate(), averaged_from_round=self.ema.first_round if self.ema else None,
            averaged_to_round=self.ema.round if self.ema and self.ema.averaged else None,
            aggregated=aggregated, accepted=accepted, rejected=rejected,
            selected=len(selected), basis_version=self.basis.current_version, wall_seconds=time.perf_counter() - started,
            exchange_seconds=round_seconds, sites=sites, exhausted=len(self.exhausted_sites()), basis_bytes=basis_bytes,
            not_asked_exhausted=sorted(self.exhausted_sites() - set(sites)),
            basis_transport=self.cfg.basis.transport, unidentified_missing_nodes=unidentified,
            node_wait_seconds=self._node_wait_seconds,
            secure_aggregation=None if secure is None else SecureAggregationRecord(
                participants=len(secure.participants), threshold=secure.threshold, survivors=secure.survivors,
                abandoned=secure.abandoned, error_bound=None if secure.abandoned else secure.error_bound, stage_bytes=secure.bytes,
                mean_update_norm=secure.mean_norm),
        )
        self.history.append(entry)
        self._save_checkpoint()  # 2) optimizer, 3) model + state (commit point)
        save_history(self.dir, self.history)
        self.metrics.observe_round(entry)
        self.echo(round_line(entry))

    def _aggregate(self, round_id: int, updates: list[NodeReply], sites: dict[str, SiteRoundRecord],
                   entries: list[LedgerEntry]) -> tuple[bool, int, int]:
        """Validate + fold the updates (decoded one at a time), step the server optimizer, add their
        ledger rows; → (global model changed, accepted, rejected)."""
        replies = {u.reply.site_id: u.reply for u in updates if u.reply is not None}
        decoded = ((u.reply.site_id, u.update() if u.update is not None else {}, u.reply.aggregation_weight)
                   for u in updates if u.reply is not None)
        trainable = {k: self.global_state[k] for k in self._trainable}
        result = aggregate_round(trainable, decoded, self.optimizer, max_norm=self.cfg.update_norm_bound)
        for check in result.accepted + result.rejected:
            sites[check.site_id].update_norm = check.norm
        for check in result.accepted:
            entries.append(LedgerEntry.from_reply(round_id, replies[check.site_id], status="ok"))
        for check in result.rejected:
            log.warning("round %d: %s", round_id, check)
            self.echo(f"round {round_id}: rejected update from site '{check.site_id}': {check.reason}: {check.detail}")
            site = sites[check.site_id]
            site.status, site.reason, site.reject_reason = "rejected", f"{check.reason}: {check.detail}", check.reason
            entries.append(LedgerEntry.from_reply(round_id, replies[check.site_id], status="rejected",
                                                  reason=f"{check.reason}: {check.detail}"))
        if result.weights is not None and len(result.accepted) >= self.cfg.min_sites:
            self.global_state.update(result.weights)
            return True, len(result.accepted), len(result.rejected)
        self.echo(f"round {round_id}: {len(result.accepted)} accepted update(s) < min_sites = {self.cfg.min_sites}: global model unchanged")
        return False, len(result.accepted), len(result.rejected)

    def _attribute(self, round_id: int, replies: list[NodeReply]) -> tuple[dict[str, tuple[NodeReply, str | None]], dict[int, str]]:
        """The replies the round may attribute to the site they name, by site id, each with the digest
        of what came with it; and why each other node's reply is attributed to no site. A reply
        counts only when it answers this run's round, is signed by its site's identity
        (``coordinator.site_identities``; without keys, at its word) and no other node's reply in
        this round claims the same site: two claims leave both out (the ledger keeps what the
        site's next reply says it spent)."""
        claims: dict[str, list[tuple[NodeReply, str | None]]] = {}
        unattributed: dict[int, str] = {}
        for node_reply in replies:
            if node_reply.reply is None:
                continue
            reply = node_reply.reply
            try:
                digest = node_reply.received_sha256()
            except Exception as exc:  # noqa: BLE001 - one node's undecodable arrays must not end the round
                unattributed[node_reply.node] = f"malformed update ({type(exc).__name__}: {str(exc)[:200]})"
                continue
            if (reply.run_id, reply.round) != (self.run.run_id, round_id):  # both are in what a site signs
                problem = (f"the reply answers run '{reply.run_id}' round {reply.round}, not this one "
                           f"(run '{self.run.run_id}' round {round_id})")
            else:
                problem = reply_signature.attribution_problem(reply, digest, self.cfg.site_identities)
            if problem is None:
                claims.setdefault(reply.site_id, []).append((node_reply, digest))
            else:
                unattributed[node_reply.node] = problem
        for site_id, claimed in list(claims.items()):
            if len(claimed) > 1:
                nodes = sorted(r.node for r, _ in claimed)
                problem = (f"nodes {', '.join(map(str, nodes))} all answered as site '{site_id}' in this round: none is used"
                           + ("" if self.cfg.site_identities else " (coordinator.site_identities makes sites sign their replies)"))
                unattributed.update(dict.fromkeys(nodes, problem))
                del claims[site_id]
        for node, problem in sorted(unattributed.items()):
            log.error("round %d: node %d: %s", round_id, node, problem)
            self.echo(f"round {round_id}: node {node} not used: {problem}")
        return {site_id: claimed[0] for site_id, claimed in claims.items()}, unattributed

    def _epsilon_regression(self, reply: protocol.SiteReply) -> str:
        """Why a reply's cumulative ε cannot be true ('' when it can): it is below what the ledger
        holds from the same accountant. (A state rolled back under another accountant is the
        witness's to catch: the site refuses before any spend, fedpose.federation.witness.)"""
        privacy = reply.privacy
        if privacy is None or privacy.epsilon is None:
            return ""
        recorded = self.ledger.recorded_epsilon(reply.site_id, privacy.guarantee, privacy.accountant)
        # relative slack for float round-off of the same spend reported again
        if recorded is None or privacy.epsilon >= recorded * (1 - 1e-9):
            return ""
        statement = partial(epsilon_text, delta=privacy.delta, guarantee=privacy.guarantee, accountant=privacy.accountant,
                            unit=privacy.protection_unit, relation=privacy.adjacency)
        return (f"reported cumulative {statement(privacy.epsilon)} is below the {statement(recorded)} the ledger already "
                f"holds from the same accountant: the site's budget state was reset or replaced — restore its state_dir "
                f"from a backup")

    # -- persistence -----------------------------------------------------------------------------------
    def _save_checkpoint(self) -> None:
        self.state.basis = self.basis.state_dict()
        current = self.dir / OPTIMIZER_CHECKPOINT
        if current.exists():  # the committed model's state, until the new model is written
            os.replace(current, self.dir / PREVIOUS_OPTIMIZER_CHECKPOINT)
        save_server_optimizer(current, self.optimizer, round_id=self.state.round)
        meta = {"run_id": self.run.run_id, "state": self.state.to_meta()}
        if self.ema is not None:
            self.ema.save(self.dir, meta)
        save_array_checkpoint(self.dir / GLOBAL_CHECKPOINT, self.global_state, meta)

    def _committed_optimizer(self) -> ServerOptimizer:
        """The server optimizer as it was when the model checkpoint (round ``state.round``) was
        written. A kill between the two writes leaves a newer state, whose momentum / moments hold
        updates the model never took: the previous one is used then. (Unstamped: a checkpoint from
        before the stamp, read as it always was.)"""
        for path in (self.dir / OPTIMIZER_CHECKPOINT, self.dir / PREVIOUS_OPTIMIZER_CHECKPOINT):
            if path.exists() and load_checkpoint_meta(path).get("round", self.state.round) == self.state.round:
                return load_server_optimizer(path, self.cfg.aggregation, self.cfg.rounds)
        self.ledger.close()
        raise ValueError(f"resuming run '{self.run.run_id}': no server-optimizer state in {self.dir} goes with its model checkpoint "
                         f"(round {self.state.round}); restore {OPTIMIZER_CHECKPOINT} from a backup")

    def finish(self) -> dict[str, Any]:
        summary = json.loads(self.ledger.to_json())
        summary.pop("entries", None)
        path = write_report(self.dir, {"run_id": self.run.run_id, "stopped_reason": self.state.stopped_reason,
                                       "aggregation": self.cfg.aggregation.strategy, "model_spec": self.state.model_spec.model_dump(mode="json"),
                                       "initial_pckh": self.state.initial_pckh, "coordinator_device": self.device_text,
                                       "flip_test": self.cfg.data.val_flip_test,
                                       # which model each round's PCKh is of: the iterate, or its moving average
                                       "evaluated_model": self.ema.meta() | {"file": EMA_CHECKPOINT} if self.ema else "global iterate"},
                            self.history, summary)
        # no line of its own: the ServerApp's closing line names the curves, the CLI's the report
        return {"report": str(path), "curves": str(path.with_name("curves.png")), "rounds": len(self.history),
                "stopped_reason": self.state.stopped_reason}


def _stage_bytes(sent: Any, received: Any) -> int:
    """Bytes of one secure-aggregation stage's messages, both ways (their JSON, as they travel)."""
    return sum(len(m.model_dump_json()) for m in sent) + sum(len(m.model_dump_json()) for m in received)


def _unflatten(flat: np.ndarray, like: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A flat vector (the global model's trainable parameters in order) as named arrays like ``like``."""
    out, offset = {}, 0
    for name, array in like.items():
        out[name] = flat[offset: offset + array.size].reshape(array.shape).astype(array.dtype)
        offset += array.size
    if offset != flat.size:
        raise ValueError(f"secure sum: {flat.size} values for {offset} trainable parameters")
    return out


def checkpointed_round(checkpoint_dir: str | Path) -> int | None:
    """The last round the run checkpointed in ``checkpoint_dir`` finished (None: no checkpoint)."""
    path = Path(checkpoint_dir) / GLOBAL_CHECKPOINT
    return int(load_checkpoint_meta(path)["state"]["round"]) if path.exists() else None


def _no_reply_reason(round_seconds: float, timeout_s: float) -> str:
    """Why a selected node sent nothing: it timed out, or the round ended without it (node gone)."""
    if round_seconds >= 0.99 * timeout_s:
        return f"no reply within the round timeout ({timeout_s:g} s)"
    return f"no reply: the node disconnected (the round ended after {round_seconds:.0f} s, before the {timeout_s:g} s timeout)"
