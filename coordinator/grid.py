"""Flower's Grid as the round runner's transport: protocol objects ↔ Flower Messages.

Everything the round does is in :mod:`fedpose.federation.server.rounds`; this file only builds a
``train`` Message per request (records named by :mod:`fedpose.federation.protocol`, TTL = the
round timeout) and turns what comes back into :class:`NodeReply` — a decoded site reply with a lazy
Δ, or the reason there is none.

A node that leaves during the round ends its wait. Flower says so twice: the node drops out of
``get_node_ids()``, and the SuperLink answers the message in its place with a NODE_UNAVAILABLE
error (whose source is the SuperLink, not the node: it is matched to the node by the message it
replies to). Flower declares a SuperNode gone when it has sent no heartbeat for 2 × 30 s (it sends
one every ~20 s): a round whose timeout falls earlier still ends at the timeout.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE, ErrorCode
from flwr.serverapp import Grid

from fedpose.federation import protocol
from fedpose.federation.server.rounds import NodeReply, TrainRequest

#: Flower error codes that mean the site's own ClientApp failed; the others come from the SuperLink
_SITE_FAILURES = (ErrorCode.LOAD_CLIENT_APP_EXCEPTION, ErrorCode.CLIENT_APP_RAISED_EXCEPTION, ErrorCode.CLIENT_APP_CRASHED)
REPLY_POLL_S = 0.5  #: how often the round asks the SuperLink for replies and connected nodes
#: Flower's simulation runtime reports an exception of Ray's own (not the ClientApp's) as error code
#: UNKNOWN with reason ``"<class 'ray.exceptions.X'>:<'…'>"``
_RAY_ERROR = re.compile(r"<class 'ray\.exceptions\.(\w+)'>")
#: Ray's exceptions for a worker process that is gone: killed, crashed, out of memory, or its machine lost
_RAY_WORKER_LOST = {"RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError", "OutOfMemoryError",
                    "NodeDiedError"}


class GridTransport:
    def __init__(self, grid: Grid):
        self.grid = grid

    def node_ids(self) -> list[int]:
        return list(self.grid.get_node_ids())

    def send_and_receive(self, requests: list[TrainRequest], timeout: float) -> list[NodeReply]:
        encoded: dict[int, ArrayRecord] = {}  # one encoding of each distinct array set (global, basis)

        def record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
            if id(arrays) not in encoded:
                encoded[id(arrays)] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})
            return encoded[id(arrays)]

        messages = []
        for request in requests:
            content = RecordDict({protocol.CONFIG_RECORD: ConfigRecord(protocol.encode_instruction(request.instruction)),
                                  protocol.GLOBAL_RECORD: record(request.global_arrays)})
            if request.basis is not None:
                content[protocol.BASIS_RECORD] = record(request.basis.arrays)
                content[protocol.BASIS_CONFIG_RECORD] = ConfigRecord(dict(request.basis.config))
            if request.secagg_inbox is not None:
                content[protocol.SECAGG_RECORD] = ConfigRecord(protocol.encode_secagg(request.secagg_inbox))
            messages.append(Message(content, dst_node_id=request.node, message_type=protocol.MESSAGE_TYPE_TRAIN,
                                    group_id=str(request.instruction.round), ttl=timeout))
        return self._exchange(messages, timeout)

    def secagg_exchange(self, messages: Mapping[int, protocol.SecAggRequest], timeout: float) -> dict[int, protocol.SecAggSiteMessage]:
        """One secure-aggregation stage: a ``query.secagg`` message per node; the decoded answers by
        node (an error reply, a malformed answer or no answer leaves the node out: a dropout)."""
        out = [Message(RecordDict({protocol.SECAGG_RECORD: ConfigRecord(protocol.encode_secagg(message))}), dst_node_id=node,
                       message_type=protocol.MESSAGE_TYPE_SECAGG, group_id=str(message.round), ttl=timeout)
               for node, message in messages.items()]
        answers: dict[int, protocol.SecAggSiteMessage] = {}
        for node, reply, _ in self._collect(out, timeout):
            if reply is None or reply.has_error():
                continue
            try:
                answers[node] = protocol.decode_secagg_reply(dict(reply.content[protocol.SECAGG_RECORD]))
            except (KeyError, protocol.ProtocolError):
                continue
        return answers

    def _exchange(self, messages: list[Message], timeout: float) -> list[NodeReply]:
        return [NodeReply(node, failure=disconnected_reason(seconds)) if reply is None else node_reply(reply, node, seconds)
                for node, reply, seconds in self._collect(messages, timeout)]

    def _collect(self, messages: list[Message], timeout: float) -> list[tuple[int, Message | None, float]]:
        """Push the messages, then collect replies until each node has answered or left the
        federation, or ``timeout`` has passed: (node, its reply or None if it left, seconds into the
        exchange); a node that neither answered nor left is not listed."""
        started = time.monotonic()
        pushed = set(self.grid.push_messages(messages))
        deadline = time.monotonic() + timeout  # from the end of the push, as Flower's send_and_receive
        pending = {m.metadata.message_id: m.metadata.dst_node_id for m in messages if m.metadata.message_id in pushed}
        replies: list[tuple[int, Message | None, float]] = []
        while pending:
            for reply in self.grid.pull_messages(list(pending)):
                node = pending.pop(reply.metadata.reply_to_message_id, None)
                seconds = time.monotonic() - started
                if reply.has_error() and reply.error.code == ErrorCode.MESSAGE_UNAVAILABLE and seconds >= 0.99 * timeout:
                    continue  # its TTL (= the round timeout, from before the push) ran out: "no reply within the timeout"
                if node is not None:  # by the message it answers: the SuperLink's error replies come from the SuperLink
                    replies.append((node, reply, seconds))
            if not pending:
                break
            connected = set(self.grid.get_node_ids())
            for message_id, node in list(pending.items()):
                if node not in connected:
                    del pending[message_id]
                    replies.append((node, None, time.monotonic() - started))
            if time.monotonic() >= deadline:
                break
            time.sleep(REPLY_POLL_S)
        return replies


def disconnected_reason(seconds: float) -> str:
    return (f"the site disconnected: Flower declared its node gone {seconds:.0f} s into the round "
            f"(no heartbeat for {HEARTBEAT_PATIENCE} × {HEARTBEAT_DEFAULT_INTERVAL} s)")


def node_reply(reply: Message, node: int, seconds: float) -> NodeReply:
    """``reply`` to the message sent to ``node``, ``seconds`` into the round."""
    if reply.has_error():
        if reply.error.code == ErrorCode.NODE_UNAVAILABLE:
            return NodeReply(node, failure=disconnected_reason(seconds))
        return NodeReply(node, failure=failure_reason(reply))
    try:
        site_reply = protocol.decode_reply(dict(reply.content[protocol.REPLY_RECORD]))
    except (KeyError, protocol.ProtocolError) as exc:
        return NodeReply(node, failure=f"malformed reply: {exc}")
    masked = reply.content.get(protocol.MASKED_RECORD) if site_reply.carries_update else None
    if masked is not None:  # secure aggregation: the masked vector instead of Δ
        return NodeReply(node, site_reply, masked=lambda: masked[protocol.MASKED_KEY].numpy(), bytes_up=masked.count_bytes())
    record = reply.content.get(protocol.UPDATE_RECORD) if site_reply.carries_update else None
    if record is None:
        return NodeReply(node, site_reply)
    return NodeReply(node, site_reply, update=lambda: {k: a.numpy() for k, a in record.items()}, bytes_up=record.count_bytes())


def failure_reason(reply: Message) -> str:
    """Why an error reply carries no update, for the round record and the ledger."""
    error = reply.error
    ray_error = _RAY_ERROR.match(str(error.reason).strip())
    if ray_error is not None:
        # Ray's text (actor ids, worker ports, troubleshooting tips) is in the simulation log,
        # where Flower logs the exception; the round record says what happened to this site
        if ray_error.group(1) in _RAY_WORKER_LOST:
            return ("the site's simulation worker died before replying — killed or crashed, e.g. out of memory; "
                    "Ray's report is in the simulation log")
        return "the simulation runtime (Ray) could not run the site's ClientApp; Ray's report is in the simulation log"
    detail = " ".join(str(error.reason).split())
    if len(detail) > 600:  # a traceback (Ray's, in simulation) ends with the exception's message
        detail = "…" + detail[-600:]
    if error.code in _SITE_FAILURES:
        return f"the site's ClientApp failed: {detail}"
    return f"no update (Flower error {error.code}): {detail}"
