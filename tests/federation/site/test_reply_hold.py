"""``reply_after_s``: a site holds every train reply until a fixed time after its instruction
arrived, so whoever times the replies (the coordinator, anyone on the path) sees the same round time
whatever the site's data — the work outside the DP steps grows with N (docs/privacy.md, timing).
Through the real ClientApp and its egress guard; only lower bounds and the local log are asserted
(a loaded machine may be slower, never faster)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedpose.federation import protocol
from fedpose.train.central import to_toml
from site_round_helpers import PLACEHOLDER_SPEC, make_site_data, site_config

HOLD_S = 1.5


pytestmark = pytest.mark.usefixtures("flower_task_identity")


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return make_site_data(tmp_path_factory.mktemp("hold-data"))


def _site_context(data_root: Path, tmp_path: Path, **settings: object) -> Context:
    """A node whose site refuses plain rounds (a reply with no data work: the fastest there is)."""
    site = site_config(data_root, tmp_path / "state").model_copy(
        update={"require_secure_aggregation": True, **settings})
    path = tmp_path / "site.toml"
    path.write_text(to_toml(json.loads(site.model_dump_json())))
    return Context(run_id=1, node_id=1, node_config={"site-config": str(path)}, state=RecordDict(), run_config={})


def _train_message(with_model: bool = True) -> Message:
    instruction = protocol.TrainInstruction(run_id="run", round=1, local_steps=2, model_spec=PLACEHOLDER_SPEC)
    content = {protocol.CONFIG_RECORD: ConfigRecord(protocol.encode_instruction(instruction))}
    if with_model:
        content[protocol.GLOBAL_RECORD] = ArrayRecord({"head.b": Array(np.zeros(3, np.float32))})
    msg = Message(RecordDict(content), dst_node_id=1, message_type=protocol.MESSAGE_TYPE_TRAIN)
    msg.metadata.__dict__["_message_id"] = "t1"
    return msg


def _timed(context: Context, msg: Message) -> tuple[Message, float]:
    from sites.client_app import build_client_app

    started = time.monotonic()
    reply = build_client_app()(msg, context)
    return reply, time.monotonic() - started


def test_a_fast_reply_is_held_until_reply_after_s(data_root: Path, tmp_path: Path) -> None:
    context = _site_context(data_root, tmp_path, reply_after_s=HOLD_S)
    reply, elapsed = _timed(context, _train_message())
    assert elapsed >= HOLD_S
    answer = protocol.decode_reply(dict(reply.content[protocol.REPLY_RECORD]))
    assert answer.status == "refused"  # the same typed reply, only later


def test_a_failed_round_is_held_too(data_root: Path, tmp_path: Path) -> None:
    """An error's timing could tell as much as a success's: the hold covers the crash path (the
    egress guard then sends the class name only)."""
    context = _site_context(data_root, tmp_path, reply_after_s=HOLD_S)
    reply, elapsed = _timed(context, _train_message(with_model=False))
    assert elapsed >= HOLD_S and reply.has_error()


def test_without_reply_after_s_the_site_replies_when_done(data_root: Path, tmp_path: Path) -> None:
    reply, elapsed = _timed(_site_context(data_root, tmp_path), _train_message())
    assert elapsed < HOLD_S, "no hold was asked for"
    assert protocol.decode_reply(dict(reply.content[protocol.REPLY_RECORD])).status == "refused"


def test_a_round_longer_than_the_hold_is_noted_in_the_local_log_only(data_root: Path, tmp_path: Path) -> None:
    context = _site_context(data_root, tmp_path, reply_after_s=1e-6)
    reply, _ = _timed(context, _train_message())
    site_log = (tmp_path / "state" / "site.log").read_text()
    assert "over reply_after_s" in site_log
    assert "reply_after_s" not in json.dumps(dict(reply.content[protocol.REPLY_RECORD]))


def test_a_round_longer_than_the_hold_replies_at_the_next_whole_hold(tmp_path: Path) -> None:
    """A late reply sent when done would time the work to the millisecond; held to the next multiple
    of reply_after_s, its arrival tells only how many holds the work took."""
    from sites.client_app import hold_reply

    site = site_config(tmp_path, tmp_path / "state").model_copy(update={"reply_after_s": 0.5})
    received = time.monotonic() - 0.65  # the work took 1.3 holds
    hold_reply(site, received)
    waited = time.monotonic() - received
    assert waited >= 1.0, "held to two holds after the instruction arrived"
    received = time.monotonic() - 1.01  # just past two holds: three
    hold_reply(site, received)
    assert time.monotonic() - received >= 1.5
