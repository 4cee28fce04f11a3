"""Egress guard: a ClientApp mod that checks every message before it leaves the site.

Only what the round protocol allows may leave (:mod:`fedpose.federation.protocol`): a ``reply``
record holding one valid :class:`~fedpose.federation.protocol.SiteReply`, and — with status "ok"
only — an ``update`` ArrayRecord whose arrays are named like the trainable parameters of the model
the instruction names (the ones the DP engine clips and noises), with the global arrays' shapes and
dtypes. Under secure aggregation, a train reply carries the ``masked``
ArrayRecord (one 1-D uint32/uint64 vector, one value per trainable parameter) instead of ``update``, and a
stage reply exactly one ``secagg`` record holding the stage's answer to what was asked (public
keys to a setup, encrypted shares to a key directory, the asked shares to an unmask request —
never both shares of one node — or a refusal code). Anything else (an image, a per-sample gradient, an extra array or
field, free text) is replaced by an error reply, so a bug elsewhere cannot leak it.

Failures are sanitized here too: an exception raised by the ClientApp would otherwise reach the
coordinator as Flower's error message, with its text (file paths, values) and traceback. The
guard logs it locally and sends only the exception's class name and a fixed sentence.

Set ``FEDPOSE_EGRESS_LOG`` to a file path to also append a JSON line describing every outgoing
message (used by the tests).
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from collections.abc import Callable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message
from flwr.clientapp.typing import ClientAppCallable

from fedpose.federation import protocol

log = logging.getLogger("fedpose.site.egress")

#: why nothing trained may leave when the instruction's model cannot be built (its trainable parameters unknown)
UNLISTED_MODEL = "the instruction names no model whose trainable parameters can be listed: no update may leave"
EGRESS_ERROR_CODE = 451  #: the reply broke the protocol and was blocked
SITE_ERROR_CODE = 500  #: the ClientApp raised; only the class name leaves


def sanitized_error(exc: BaseException) -> Error:
    """An error reply that names the exception's class only (details stay in the local log)."""
    return Error(code=SITE_ERROR_CODE, reason=f"{protocol.error_class_name(exc)}: {protocol.REASON_TEXT['site-error']}")


def describe_outgoing(reply: Message) -> dict:
    """A JSON-able description of what a reply carries (record → kind, keys, array shapes)."""
    if reply.has_error():
        return {"error": reply.error.reason}
    records = {}
    for name, record in reply.content.items():
        if isinstance(record, ArrayRecord):
            records[name] = {"kind": "arrays", "arrays": {k: {"shape": list(a.shape), "dtype": a.dtype} for k, a in record.items()}}
        elif isinstance(record, ConfigRecord):
            records[name] = {"kind": "config", "values": {k: v if not isinstance(v, bytes) else f"<{len(v)} bytes>" for k, v in record.items()}}
        else:
            records[name] = {"kind": type(record).__name__}
    return {"records": records}


#: the answer kinds a site may give to each secure-aggregation request
_SECAGG_ANSWERS = {"setup": "public-keys", "key-directory": "encrypted-shares", "view": "view-signature",
                   "unmask-request": "unmask-shares"}


def secagg_violations(incoming: Message, reply: Message) -> list[str]:
    """Why a secure-aggregation stage reply may not leave (empty list: it may)."""
    problems = [f"record '{name}' is not part of a secure-aggregation stage reply" for name in reply.content
                if name not in protocol.SITE_SECAGG_RECORDS]
    record = reply.content.get(protocol.SECAGG_RECORD)
    if not isinstance(record, ConfigRecord):
        return problems + [f"record '{protocol.SECAGG_RECORD}' must be a ConfigRecord holding the stage's answer"]
    try:
        request = protocol.decode_secagg_request(dict(incoming.content[protocol.SECAGG_RECORD]))
        answer = protocol.decode_secagg_reply(dict(record))
    except (KeyError, protocol.ProtocolError) as exc:
        return problems + [str(exc)]
    if answer.kind != "refusal" and answer.kind != _SECAGG_ANSWERS.get(request.kind):
        return problems + [f"a '{answer.kind}' answer to a '{request.kind}' request"]
    if (answer.run_id, answer.round) != (request.run_id, request.round):
        problems.append("the answer is for another run or round than the request")
    if isinstance(answer, protocol.SecAggUnmaskShares) and isinstance(request, protocol.SecAggUnmaskRequest):
        seeds, keys = {s.node for s in answer.seed_shares}, {s.node for s in answer.key_shares}
        if seeds & keys:  # SecAgg's security rule, enforced again at the boundary
            problems.append(f"both shares of nodes {sorted(seeds & keys)}")
        if seeds != set(request.survivors) or keys != set(request.dropped):
            problems.append("shares other than the ones asked for")
    return problems


def _masked_violations(incoming: Message, reply: Message, site_reply: protocol.SiteReply) -> list[str]:
    """A secure-aggregation train reply: ``masked`` (status "ok" only), never ``update``."""
    problems = [f"record '{name}' is not part of a secure-aggregation train reply" for name in reply.content
                if name not in protocol.SITE_MASKED_REPLY_RECORDS]
    masked = reply.content.get(protocol.MASKED_RECORD)
    if site_reply.carries_update != (masked is not None):
        problems.append(f"status '{site_reply.status}' {'needs' if site_reply.carries_update else 'forbids'} a masked record")
    if masked is None:
        return problems
    if not isinstance(masked, ArrayRecord) or set(masked) != {protocol.MASKED_KEY}:
        return problems + [f"record '{protocol.MASKED_RECORD}' must be an ArrayRecord of one array '{protocol.MASKED_KEY}'"]
    vector = masked[protocol.MASKED_KEY]
    trainable = _trainable_of(incoming)
    if trainable is None:
        return problems + [UNLISTED_MODEL]
    # one value per trainable parameter (the site checked the setup's vector_length against the same count)
    length = sum(int(np.prod(a.shape)) for k, a in incoming.content[protocol.GLOBAL_RECORD].items() if k in trainable)
    if len(vector.shape) != 1 or np.dtype(vector.dtype) not in (np.uint32, np.uint64) or vector.shape[0] != length:
        problems.append(f"the masked vector has shape {tuple(vector.shape)}/{vector.dtype}, expected 1-D uint32/uint64 of {length} "
                        "(the trainable parameters)")
    return problems


def violations(incoming: Message, reply: Message) -> list[str]:
    """Why ``reply`` may not leave the site (empty list: it may)."""
    if reply.has_error():
        return [] if reply.error.code in (SITE_ERROR_CODE, EGRESS_ERROR_CODE) else ["error replies must come from the guard"]
    if incoming.metadata.message_type == protocol.MESSAGE_TYPE_SECAGG:
        return secagg_violations(incoming, reply)
    secure = incoming.has_content() and protocol.SECAGG_RECORD in incoming.content
    if secure:
        record = reply.content.get(protocol.REPLY_RECORD)
        try:
            site_reply = protocol.decode_reply(dict(record)) if isinstance(record, ConfigRecord) else None
        except protocol.ProtocolError as exc:
            return [str(exc)]
        if site_reply is None:
            return [f"record '{protocol.REPLY_RECORD}' must be a ConfigRecord holding the site reply"]
        return _masked_violations(incoming, reply, site_reply)
    problems = [f"record '{name}' is not part of the protocol" for name in reply.content if name not in protocol.SITE_REPLY_RECORDS]
    record = reply.content.get(protocol.REPLY_RECORD)
    if not isinstance(record, ConfigRecord):
        return problems + [f"record '{protocol.REPLY_RECORD}' must be a ConfigRecord holding the site reply"]
    try:
        site_reply = protocol.decode_reply(dict(record))
    except protocol.ProtocolError as exc:
        return problems + [str(exc)]
    update = reply.content.get(protocol.UPDATE_RECORD)
    if site_reply.carries_update != (update is not None):
        problems.append(f"status '{site_reply.status}' {'needs' if site_reply.carries_update else 'forbids'} an update record")
    if update is None:
        return problems
    if not isinstance(update, ArrayRecord):
        return problems + [f"record '{protocol.UPDATE_RECORD}' must be an ArrayRecord"]
    allowed_arrays = {}
    if incoming.has_content() and protocol.GLOBAL_RECORD in incoming.content:
        allowed_arrays = {k: (tuple(a.shape), a.dtype) for k, a in incoming.content[protocol.GLOBAL_RECORD].items()}
    trainable = _trainable_of(incoming)
    if trainable is None:
        return problems + [UNLISTED_MODEL]
    for key, array in update.items():
        expected = allowed_arrays.get(key)
        if expected is None:
            problems.append(f"array '{key}' is not a parameter of the global model")
        elif key not in trainable:
            problems.append(f"array '{key}' is not a trainable parameter of the model the instruction names")
        elif (tuple(array.shape), array.dtype) != expected:
            problems.append(f"array '{key}' has shape {tuple(array.shape)}/{array.dtype}, global has {expected}")
    return problems


def _trainable_of(incoming: Message) -> frozenset[str] | None:
    """Names of the parameters the instruction's model trains — the only ones the DP engine clips and
    noises, so the only ones whose Δ may leave (a frozen weight, or a BatchNorm statistic, is among the
    global arrays too: a Δ of a statistic computed on the site's images would be released without
    noise). None when the instruction or its model spec cannot be read."""
    from fedpose.model import trainable_parameter_names  # here: a stage answer or a refusal needs no model (timm's import is slow)

    try:
        return trainable_parameter_names(protocol.decode_instruction(dict(incoming.content[protocol.CONFIG_RECORD])).model_spec)
    except Exception:  # noqa: BLE001 - whatever cannot be read lets no update through
        log.error("egress guard: the instruction's model spec could not be built:\n%s", traceback.format_exc())
        return None


BlockedHook = Callable[[Message, Context, list[str]], None]


def egress_guard(msg: Message, context: Context, call_next: ClientAppCallable, on_blocked: BlockedHook | None = None) -> Message:
    """The mod. ``on_blocked(msg, context, problems)`` runs after a reply to ``msg`` is blocked (the site's
    ClientApp enters it in its audit log); a failure there is logged locally, the error still leaves."""
    try:
        reply = call_next(msg, context)
    except Exception as exc:  # noqa: BLE001 - nothing unsanitized may leave, whatever failed
        log.error("the ClientApp failed; the coordinator gets the class name only:\n%s", traceback.format_exc())
        reply = Message(sanitized_error(exc), reply_to=msg)
    problems = violations(msg, reply)
    if problems:
        # the problems name keys and shapes, which the coordinator needs to see a protocol bug;
        # they come from fixed checks, never from values
        log.error("egress guard blocked a reply: %s", "; ".join(problems))
        reply = Message(Error(code=EGRESS_ERROR_CODE, reason="egress guard blocked the reply: " + "; ".join(problems)[:1000]), reply_to=msg)
        if on_blocked is not None:
            try:
                on_blocked(msg, context, problems)
            except Exception:  # noqa: BLE001 - the blocked reply must not leave, whatever the hook does
                log.error("cannot record the blocked reply:\n%s", traceback.format_exc())
    log_path = os.environ.get("FEDPOSE_EGRESS_LOG")
    if log_path:
        with open(log_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"message_type": msg.metadata.message_type, **describe_outgoing(reply)}) + "\n")
    return reply
