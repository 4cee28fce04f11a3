"""The site's Flower ClientApp: receive the global model, train privately, send Δ back.

Configured entirely by the SuperNode's node config (deployment)::

    flower-supernode ... --node-config 'site-config="/etc/fedpose/site-0.toml"'

or, under ``fedpose simulate``, by the federation TOML (site = ``sites[partition-id]``).
All logic lives in :mod:`fedpose.federation.local_training`; this module only converts Flower
records. Deployment starts a new ClientApp process per message, so nothing is kept in memory:
the budget and the basis cache are on disk in the site's ``state_dir``. The one exception is a
secure-aggregation round's session (its key pairs, self-mask seed and the shares peers sent):
it is kept in ``context.state`` — the SuperNode's memory, never the disk — from the setup to the
unmask stage of that round, and replaced by the next round's.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import time
import tomllib
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod

from fedpose.config import ConfigError, load_config
from fedpose.federation import protocol
from fedpose.federation.config import FederationConfig, SiteConfig
from fedpose.federation.secagg import site as secagg_site
from fedpose.federation.site_audit import record_secagg_stage
from fedpose.federation.site_budget import SITE_LOG_FILE
from sites.egress import egress_guard

log = logging.getLogger("fedpose.site")

SITE_LOG = SITE_LOG_FILE  #: the site's local log, in its state_dir (error details stay here)

SiteResolver = Callable[[Context], SiteConfig]


def site_from_context(context: Context, federation_config: str | Path | None = None) -> SiteConfig:
    """The site's config: node config ``site-config`` (a SiteConfig TOML), or — in simulation —
    ``sites[partition-id]`` of the federation TOML (argument, or run config ``federation-config``)."""
    node = context.node_config
    if "site-config" in node:
        return load_config(str(node["site-config"]), model=SiteConfig)
    federation_path = _federation_path(context, federation_config)
    if federation_path and "partition-id" in node:
        federation = _federation(str(federation_path), Path(federation_path).stat().st_mtime_ns)
        index = int(node["partition-id"])
        if not 0 <= index < len(federation.sites):
            raise ConfigError(f"{federation_path}: no site for partition-id {index} ({len(federation.sites)} sites)")
        return federation.sites[index]
    raise ConfigError("site not configured: start the SuperNode with --node-config 'site-config=\"<site.toml>\"'")


def _federation_path(context: Context, federation_config: str | Path | None) -> str | Path | None:
    """Simulation: the federation TOML the sites come from (argument, run config or environment)."""
    return federation_config or context.run_config.get("federation-config") or os.environ.get("FEDPOSE_FEDERATION_CONFIG")


@functools.lru_cache(maxsize=4)
def _federation(path: str, mtime_ns: int) -> FederationConfig:
    """The federation TOML, validated once per version of the file (simulation sends many messages
    to each worker process; ``mtime_ns`` makes an edited file count as new)."""
    return load_config(path, model=FederationConfig)


def declared_site_id(context: Context, federation_config: str | Path | None = None) -> str | None:
    """The site id as written in the site's config file, read without validating the rest (None if
    unreadable). Used only to attribute a config failure: the id is the site's public name."""
    try:
        node = context.node_config
        if "site-config" in node:
            site_id = tomllib.loads(Path(str(node["site-config"])).read_text()).get("site_id")
        else:
            path = _federation_path(context, federation_config)
            site_id = tomllib.loads(Path(str(path)).read_text())["sites"][int(node["partition-id"])].get("site_id")
    except Exception:  # noqa: BLE001 - best effort: an unreadable file leaves the failure unattributed
        return None
    return site_id if protocol.is_site_id(site_id) else None


def config_failure_reply(msg: Message, context: Context, exc: Exception, federation_config: str | Path | None) -> Message:
    """A typed "error" reply for a site whose config cannot be loaded, attributed to the site id
    its config declares (re-raises when even that is unreadable: the egress guard then sends the
    class name only and the coordinator reports an unidentified node)."""
    site_id = declared_site_id(context, federation_config)
    if site_id is None:
        raise exc
    log.error("site %s: its config cannot be loaded; the coordinator gets the class name only:\n%s", site_id, traceback.format_exc())
    instruction = protocol.decode_instruction(dict(msg.content[protocol.CONFIG_RECORD]))
    reply = protocol.SiteReply(site_id=site_id, run_id=instruction.run_id, round=instruction.round, status="error", reason="site-error",
                               error_class=protocol.error_class_name(exc))
    return Message(RecordDict({protocol.REPLY_RECORD: ConfigRecord(protocol.encode_reply(reply))}), reply_to=msg)


def _arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in record.items()}


#: ``context.state`` record holding this round's secure-aggregation session (SuperNode memory only)
SECAGG_STATE_RECORD = "fedpose-secagg"
SECAGG_STATE_KEY = "session"


def _load_session(context: Context) -> secagg_site.SiteSecAggSession | None:
    record = context.state.get(SECAGG_STATE_RECORD) if SECAGG_STATE_RECORD in context.state else None
    return secagg_site.SiteSecAggSession.from_json(str(record[SECAGG_STATE_KEY])) if record is not None else None


def _keep_session(context: Context, session: secagg_site.SiteSecAggSession | None) -> None:
    if session is None:
        if SECAGG_STATE_RECORD in context.state:
            del context.state[SECAGG_STATE_RECORD]
        return
    context.state[SECAGG_STATE_RECORD] = ConfigRecord({SECAGG_STATE_KEY: session.to_json()})


def handle_secagg(msg: Message, context: Context, site: SiteConfig) -> Message:
    """A secure-aggregation stage (setup, share keys, unmask): the session answers or refuses."""
    request = protocol.decode_secagg_request(dict(msg.content[protocol.SECAGG_RECORD]))
    if isinstance(request, protocol.SecAggShareInbox):
        raise protocol.ProtocolError("a share inbox travels with the train message, not as a stage of its own")
    identity = secagg_site.Identity.from_config(site.site_id, site.identity)
    if isinstance(request, protocol.SecAggSetup):
        session, answer = secagg_site.start(site.site_id, request, identity=identity)  # a new round's session replaces the last one
    else:
        session = _load_session(context)
        answer = secagg_site.answer(session, site.site_id, request, identity)
    _keep_session(context, session)
    log.info("site %s round %d: secure aggregation %s → %s", site.site_id, request.round, request.kind, answer.kind)
    encoded = protocol.encode_secagg(answer)
    # entered in the audit log before it leaves, as a train reply is (an answer that cannot be logged is not sent)
    record_secagg_stage(site.state_dir, request, answer, hashlib.sha256(json.dumps(encoded, sort_keys=True).encode()).hexdigest())
    return Message(RecordDict({protocol.SECAGG_RECORD: ConfigRecord(encoded)}), reply_to=msg)


@functools.cache
def start_training_threads() -> None:
    """Before a process's first training work: torch's CPU threads start flushing subnormal floats to
    zero (they copy the flag from the thread that starts them), so no crafted global model can make a
    round's time count the site's images (fedpose.runtime). Here, not at import: each message is a
    fresh ClientApp process, and a secure-aggregation stage needs no torch (importing it took 2.3 of
    the 3.5 s a stage's process spent loading this module)."""
    from fedpose.runtime import start_cpu_threads

    start_cpu_threads()


def handle_train(msg: Message, context: Context, site: SiteConfig) -> Message:
    start_training_threads()  # first, before any module that computes with torch is imported
    from fedpose.federation.local_training import run_site_round  # here, not at import: see start_training_threads

    instruction = protocol.decode_instruction(dict(msg.content[protocol.CONFIG_RECORD]))
    basis_message = None
    if protocol.BASIS_RECORD in msg.content:
        basis_message = (_arrays(msg.content[protocol.BASIS_RECORD]), dict(msg.content[protocol.BASIS_CONFIG_RECORD]))
    inbox, session = None, None
    if protocol.SECAGG_RECORD in msg.content or instruction.secure_aggregation:
        if protocol.SECAGG_RECORD not in msg.content or not instruction.secure_aggregation:
            raise protocol.ProtocolError("a secure-aggregation train message needs both the instruction's flag and the share inbox")
        inbox = protocol.decode_secagg_request(dict(msg.content[protocol.SECAGG_RECORD]))
        if not isinstance(inbox, protocol.SecAggShareInbox):
            raise protocol.ProtocolError(f"the train message's '{protocol.SECAGG_RECORD}' record must be a share inbox")
        session = _load_session(context)
    result = run_site_round(
        site, instruction.run_id, instruction.round, _arrays(msg.content[protocol.GLOBAL_RECORD]), instruction.model_spec,
        instruction.local_steps, basis_version=instruction.basis_version, basis_message=basis_message, threads=site.train.threads,
        ledger_records=instruction.ledger_records, secagg=session, secagg_inbox=inbox,
    )
    if session is not None:
        _keep_session(context, session)  # the shares it received and the stage it reached, for unmasking
    content = RecordDict({protocol.REPLY_RECORD: ConfigRecord(protocol.encode_reply(result.reply))})
    if result.masked is not None:
        content[protocol.MASKED_RECORD] = ArrayRecord({protocol.MASKED_KEY: Array(np.ascontiguousarray(result.masked))})
    elif result.reply.carries_update:
        content[protocol.UPDATE_RECORD] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in result.update.items()})
    log.info("site %s round %d: %s (%s)", site.site_id, instruction.round, result.reply.status, result.reply.describe())
    return Message(content, reply_to=msg)


def hold_reply(site: SiteConfig, received: float) -> None:
    """Keep the reply until ``site.reply_after_s`` after the instruction arrived (``received``,
    ``time.monotonic()``): its arrival time then says nothing of how long the site's work took.

    A round longer than the hold replies at the next whole multiple of it, so its arrival tells only
    how many holds the work took, not how long it took to the millisecond (sending when done would)."""
    if site.reply_after_s is None:
        return
    elapsed = time.monotonic() - received
    holds = max(1, math.ceil(elapsed / site.reply_after_s))
    if holds > 1:
        # local log only: how late the work was is what the hold is there to hide
        log.warning("site %s: the round took %.1f s, over reply_after_s = %g s: the reply waits for %d × reply_after_s, "
                    "so its arrival tells that the work took more than one hold (raise reply_after_s)",
                    site.site_id, elapsed, site.reply_after_s, holds)
    time.sleep(max(0.0, received + holds * site.reply_after_s - time.monotonic()))


@contextmanager
def site_log(site: SiteConfig) -> Iterator[None]:
    """Send fedpose's log records to ``<state_dir>/site.log`` for the duration of one message.

    The site's log holds what may not leave it (error details, paths, private statistics). Per
    message, not per process: under simulation one worker process serves several sites in turn."""
    path = Path(site.state_dir) / SITE_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # fedpose's records, and Python warnings (one may name a private count: they printed to the
    # SuperNode's console, which an operator may ship to a central log service)
    loggers = [logging.getLogger("fedpose"), logging.getLogger("py.warnings")]
    previous = [(logger.level, logger.propagate) for logger in loggers]
    logging.captureWarnings(True)
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        # only here: a root handler of the host process (a Ray worker's, forwarded to the simulation's
        # console) would otherwise print the details too
        logger.propagate = False
    try:
        yield
    finally:
        logging.captureWarnings(False)
        for logger, (level, propagate) in zip(loggers, previous):
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate
        handler.close()


def record_blocked_reply(msg: Message, context: Context, problems: list[str], federation_config: str | Path | None = None) -> None:
    """Enter in the site's audit log that the egress guard blocked its reply to a training instruction
    or a secure-aggregation stage (the log's line for that reply was written before the guard looked).
    An instruction or config that cannot be read left no line to correct."""
    from fedpose.federation.site_audit import record_blocked

    site = site_from_context(context, federation_config)
    if msg.metadata.message_type == protocol.MESSAGE_TYPE_SECAGG:
        asked = protocol.decode_secagg_request(dict(msg.content[protocol.SECAGG_RECORD]))
    else:
        asked = protocol.decode_instruction(dict(msg.content[protocol.CONFIG_RECORD]))
    with site_log(site):
        logged = record_blocked(site.state_dir, site.site_id, asked.run_id, asked.round)
        log.error("site %s round %d: the egress guard blocked the reply (%s)%s", site.site_id, asked.round,
                  "; ".join(problems), f"; audit.jsonl entry {logged.seq} records it" if logged else "")


def build_client_app(federation_config: str | Path | None = None, outer_mods: Sequence[Mod] = ()) -> ClientApp:
    """A ClientApp whose sites come from node config (or ``federation_config`` in simulation).

    ``outer_mods`` run outside the egress guard (tests use them to tamper with what leaves)."""
    guard = functools.partial(egress_guard, on_blocked=functools.partial(record_blocked_reply, federation_config=federation_config))
    client_app = ClientApp(mods=[*outer_mods, guard])

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        received = time.monotonic()
        try:
            site = site_from_context(context, federation_config)
        except Exception as exc:  # noqa: BLE001 - a broken config is reported, attributed to its site
            return config_failure_reply(msg, context, exc, federation_config)
        with site_log(site):
            try:
                return handle_train(msg, context, site)
            finally:  # every train reply, an error's included
                hold_reply(site, received)

    @client_app.query("secagg")
    def secagg(msg: Message, context: Context) -> Message:
        site = site_from_context(context, federation_config)  # a broken config: the guard sends its class name
        with site_log(site):
            return handle_secagg(msg, context, site)

    return client_app


app = build_client_app()
