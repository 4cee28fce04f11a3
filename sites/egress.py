"""Egress guard: a ClientApp mod that checks every message before it leaves the site.

Only what the round protocol allows may leave (``fedpose.federation.protocol``): an ``update``
ArrayRecord whose arrays are named like the global model's parameters with the same shapes and
dtypes, numeric ``metrics`` from a fixed key list, and short ``site`` strings from a fixed key
list. Anything else — an image, a per-sample gradient, an extra array, a free-form record — is
replaced by an error reply, so a bug elsewhere cannot leak it. Set ``FEDPOSE_EGRESS_LOG`` to a
file path to also append a JSON line describing every outgoing message (used by the tests).
"""

from __future__ import annotations

import json
import os

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord
from flwr.clientapp.typing import ClientAppCallable

from fedpose.federation import protocol

MAX_STRING_LENGTH = 2000  # a refusal reason is ~250 characters; nothing a site says is longer
EGRESS_ERROR_CODE = 451


def describe_outgoing(reply: Message) -> dict:
    """A JSON-able description of what a reply carries (record → kind, keys, array shapes)."""
    if reply.has_error():
        return {"error": reply.error.reason}
    records = {}
    for name, record in reply.content.items():
        if isinstance(record, ArrayRecord):
            records[name] = {"kind": "arrays", "arrays": {k: {"shape": list(a.shape), "dtype": a.dtype} for k, a in record.items()}}
        elif isinstance(record, MetricRecord):
            records[name] = {"kind": "metrics", "values": dict(record)}
        elif isinstance(record, ConfigRecord):
            records[name] = {"kind": "config", "values": {k: v if not isinstance(v, bytes) else f"<{len(v)} bytes>" for k, v in record.items()}}
        else:
            records[name] = {"kind": type(record).__name__}
    return {"records": records}


def violations(incoming: Message, reply: Message) -> list[str]:
    """Why ``reply`` may not leave the site (empty list: it may)."""
    if reply.has_error():
        return []
    problems = []
    allowed_arrays = {}
    if incoming.has_content() and protocol.GLOBAL_RECORD in incoming.content:
        allowed_arrays = {k: (tuple(a.shape), a.dtype) for k, a in incoming.content[protocol.GLOBAL_RECORD].items()}
    for name, record in reply.content.items():
        if name not in protocol.SITE_REPLY_RECORDS:
            problems.append(f"record '{name}' is not part of the protocol")
        elif name == protocol.UPDATE_RECORD:
            if not isinstance(record, ArrayRecord):
                problems.append(f"record '{name}' must be an ArrayRecord")
                continue
            for key, array in record.items():
                expected = allowed_arrays.get(key)
                if expected is None:
                    problems.append(f"array '{key}' is not a parameter of the global model")
                elif (tuple(array.shape), array.dtype) != expected:
                    problems.append(f"array '{key}' has shape {tuple(array.shape)}/{array.dtype}, global has {expected}")
        elif name == protocol.METRICS_RECORD:
            if not isinstance(record, MetricRecord):
                problems.append(f"record '{name}' must be a MetricRecord")
                continue
            problems += [f"metric '{k}' is not part of the protocol" for k in record if k not in protocol.SITE_METRIC_KEYS]
        elif name == protocol.SITE_RECORD:
            if not isinstance(record, ConfigRecord):
                problems.append(f"record '{name}' must be a ConfigRecord")
                continue
            for key, value in record.items():
                if key not in protocol.SITE_STRING_KEYS:
                    problems.append(f"field '{key}' is not part of the protocol")
                elif not isinstance(value, str) or len(value) > MAX_STRING_LENGTH:
                    problems.append(f"field '{key}' must be a short string")
    return problems


def egress_guard(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    reply = call_next(msg, context)
    problems = violations(msg, reply)
    if problems:
        reply = Message(Error(code=EGRESS_ERROR_CODE, reason="egress guard blocked the reply: " + "; ".join(problems)), reply_to=msg)
    log_path = os.environ.get("FEDPOSE_EGRESS_LOG")
    if log_path:
        with open(log_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"message_type": msg.metadata.message_type, **describe_outgoing(reply)}) + "\n")
    return reply
