"""Secure aggregation through the Flower apps without processes: the coordinator's GridTransport
talks to the real ClientApp (egress guard included) over a loopback Grid, each node keeping its
own Context (its session lives in ``context.state`` between messages, as in a SuperNode); and the
egress guard lets exactly the SecAgg stage records out and nothing else."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

import fedpose.federation.server.rounds as rounds_module
from fedpose.federation import protocol
from fedpose.federation.deployment import CoordinatorRunConfig
from fedpose.federation.report import load_history
from fedpose.federation.secagg import site as secagg_site
from fedpose.federation.secagg.coordinator import CoordinatorSecAggRound
from fedpose.federation.config import SecureAggregationConfig
from fedpose.federation.server.rounds import RoundRunner
from fedpose.train.central import to_toml
from sites.egress import egress_guard, violations
from site_round_helpers import PLACEHOLDER_SPEC, SMALL_SPEC, make_site_data, site_config, small_model_arrays

#: the masked vector's length: one value per parameter SMALL_SPEC's model trains
VECTOR_LENGTH = sum(small_model_arrays()[0][name].size for name in small_model_arrays()[1])


@pytest.fixture(autouse=True)
def no_node_settling(monkeypatch: pytest.MonkeyPatch, flower_task_identity: None) -> None:
    monkeypatch.setattr(rounds_module, "NODE_SETTLE_S", 0.0)


class LoopbackGrid:
    """Flower's Grid, minus the SuperLink: a pushed message is handled by ``app`` at once, in this process.
    ``drop(message)`` True: the node's reply never arrives (a dropout)."""

    def __init__(self, app: Callable[[Message, Context], Message], contexts: dict[int, Context],
                 drop: Callable[[Message], bool] = lambda m: False):
        self.app, self.contexts, self.drop = app, contexts, drop
        self.replies: dict[str, Message] = {}
        self.count = 0
        self.sent: list[Message] = []

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: list[Message]) -> list[str]:
        ids = []
        for message in messages:
            self.count += 1
            message.metadata.__dict__["_message_id"] = f"m{self.count}"
            self.sent.append(message)
            reply = self.app(message, self.contexts[message.metadata.dst_node_id])
            if not self.drop(message):
                self.replies[message.metadata.message_id] = reply
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, ids: list[str]) -> list[Message]:
        return [self.replies.pop(i) for i in ids if i in self.replies]


def test_three_sites_through_the_client_app_one_dropping_after_masking(tmp_path: Path) -> None:
    from coordinator.grid import GridTransport
    from sites.client_app import SECAGG_STATE_RECORD, build_client_app

    from fedpose.federation.config import SiteIdentityConfig
    from fedpose.federation.secagg import crypto

    data = make_site_data(tmp_path / "data")
    contexts = {}
    peers = {}  # the sites' identities, exchanged out of band: their keys are signed and checked
    for node in (1, 2, 3):
        (tmp_path / f"site-{node}.pem").write_bytes(crypto.new_identity())
        peers[f"site-{node}"] = crypto.identity_public_key(crypto.load_identity(tmp_path / f"site-{node}.pem"))
    for node in (1, 2, 3):
        identity = SiteIdentityConfig(key=tmp_path / f"site-{node}.pem", peers=peers)
        site = site_config(data, tmp_path / f"site-{node}").model_copy(update={"site_id": f"site-{node}", "identity": identity})
        path = tmp_path / f"site-{node}.toml"
        path.write_text(to_toml(json.loads(site.model_dump_json())))
        contexts[node] = Context(run_id=1, node_id=node, node_config={"site-config": str(path)}, state=RecordDict(), run_config={})
    masked_replies: list[Message] = []

    def drop(message: Message) -> bool:  # site 3's masked vector is lost (it trained and spent)
        return message.metadata.dst_node_id == 3 and message.metadata.message_type == protocol.MESSAGE_TYPE_TRAIN

    app = build_client_app()
    grid = LoopbackGrid(lambda m, c: _recording(app(m, c), masked_replies), contexts, drop)
    lines: list[str] = []
    run = CoordinatorRunConfig.model_validate({"run_id": "r", "coordinator": {
        "checkpoint_dir": str(tmp_path / "coordinator"), "data": {"input_size": [64, 64]}, "rounds": 1, "min_sites": 1,
        "local_steps": 2, "round_timeout_s": 3, "model": {"backbone": "tiny_vit_test", "scenario": "scratch"},
        "secure_aggregation": {"enabled": True, "clip_range": 0.05, "bits": 16, "modulus_bits": 32, "max_sites": 8},
        "site_identities": peers}})  # the survivors' masked replies count only signed, over Flower's encoding
    runner = RoundRunner(run, echo=lines.append)
    runner.state.node_sites = {"1": "site-1", "2": "site-2", "3": "site-3"}
    before = {k: v.copy() for k, v in runner.global_state.items()}
    runner.run_rounds(GridTransport(grid))

    (entry,) = load_history(tmp_path / "coordinator")
    assert entry.aggregated and entry.secure_aggregation is not None and entry.secure_aggregation.survivors == 2
    assert entry.sites["site-3"].status == "missing" and "secure aggregation: sum of 2 of 3 sites" in lines[-1]
    assert entry.unidentified_missing_nodes == [] and not any("not used" in line for line in lines)
    assert any(not np.array_equal(runner.global_state[k], before[k]) for k in before)
    # what left the sites: stage records and masked vectors only, never an update
    assert all(protocol.UPDATE_RECORD not in m.content for m in masked_replies if m.has_content())
    keys = [protocol.decode_secagg_reply(dict(m.content[protocol.SECAGG_RECORD])) for m in masked_replies
            if m.has_content() and protocol.SECAGG_RECORD in m.content]
    assert sum(isinstance(k, protocol.SecAggPublicKeys) and k.signature is not None for k in keys) == 3
    trained = [m for m in masked_replies if m.has_content() and protocol.MASKED_RECORD in m.content]
    assert all(protocol.decode_reply(dict(m.content[protocol.REPLY_RECORD])).signature for m in trained)
    assert len(trained) == 3 and all(np.dtype(m.content[protocol.MASKED_RECORD][protocol.MASKED_KEY].dtype) == np.uint32
                                     for m in trained)  # M = 2^32: no more bytes than a float32 Δ
    # the session stayed in the node's memory for the round only: the survivors' secrets are gone after unmasking
    for node in (1, 2):
        state = json.loads(contexts[node].state[SECAGG_STATE_RECORD]["session"])
        assert state["stage"] == "unmasked" and state["seed"] == "" and state["seed_shares"] == {}
    # each survivor's audit log holds its stage answers after its state existed (the view it signed, the
    # shares it gave: the survivors' seed shares, the dropped site's key share, never both of one node),
    # each with the digest of the answer as it left, and the log verifies
    from fedpose.federation.site_audit import read_log, verify

    sent = {hashlib.sha256(json.dumps(dict(m.content[protocol.SECAGG_RECORD]), sort_keys=True).encode()).hexdigest()
            for m in masked_replies if m.has_content() and protocol.SECAGG_RECORD in m.content}
    for node in (1, 2):
        stages = [e.secagg_stage for e in read_log(tmp_path / f"site-{node}") if e.secagg_stage is not None]
        assert [(s.request, s.answer) for s in stages] == [("view", "view-signature"), ("unmask-request", "unmask-shares")]
        assert (stages[1].seed_share_nodes, stages[1].key_share_nodes) == ([1, 2], [3])
        assert {s.answer_sha256 for s in stages} <= sent
        assert verify(tmp_path / f"site-{node}").entries == 3  # the masked train reply and the two stages


def _recording(reply: Message, into: list[Message]) -> Message:
    into.append(reply)
    return reply


# -- the egress guard --------------------------------------------------------------------------------------
def _stage_messages() -> tuple[CoordinatorSecAggRound, dict[int, secagg_site.SiteSecAggSession]]:
    settings = SecureAggregationConfig(enabled=True, clip_range=1.0, bits=16, modulus_bits=32, max_sites=8)
    coordinator = CoordinatorSecAggRound(settings, "run", 1, [1, 2, 3], VECTOR_LENGTH)
    sessions, keys = {}, {}
    for node in (1, 2, 3):
        sessions[node], keys[node] = secagg_site.start(f"site-{node}", coordinator.setup(node), VECTOR_LENGTH)
    coordinator.receive_public_keys(keys)
    directory = coordinator.key_directory()
    coordinator.receive_shares({n: secagg_site.answer(s, s.site_id, directory) for n, s in sessions.items()})
    return coordinator, sessions


def _query(message: object) -> Message:
    msg = Message(RecordDict({protocol.SECAGG_RECORD: ConfigRecord(protocol.encode_secagg(message))}), dst_node_id=1,
                  message_type=protocol.MESSAGE_TYPE_SECAGG)
    msg.metadata.__dict__["_message_id"] = "q1"
    return msg


def _answer(msg: Message, message: object, **extra: object) -> Message:
    return Message(RecordDict({protocol.SECAGG_RECORD: ConfigRecord(protocol.encode_secagg(message)), **extra}), reply_to=msg)


def _secure_train_message(inbox: protocol.SecAggShareInbox) -> Message:
    instruction = protocol.TrainInstruction(run_id="run", round=1, local_steps=2, model_spec=SMALL_SPEC, secure_aggregation=True)
    msg = Message(RecordDict({
        protocol.GLOBAL_RECORD: ArrayRecord({k: Array(v) for k, v in small_model_arrays()[0].items()}),
        protocol.CONFIG_RECORD: ConfigRecord(protocol.encode_instruction(instruction)),
        protocol.SECAGG_RECORD: ConfigRecord(protocol.encode_secagg(inbox))}), dst_node_id=1, message_type=protocol.MESSAGE_TYPE_TRAIN)
    msg.metadata.__dict__["_message_id"] = "t1"
    return msg


def _ok_reply() -> ConfigRecord:
    privacy = protocol.PrivacyReport(guarantee="DP", unit="one record", adjacency="add_remove", accountant="rdp", epsilon=0.5,
                                     delta=1e-5, eps_max=8.0, steps=4, rounds_spent=1, orders=[2.0], rdp=[0.1],
                                     next_round_affordable=True, update_clip_range=1.0)
    return ConfigRecord(protocol.encode_reply(protocol.SiteReply(site_id="site-1", run_id="run", round=1, status="ok",
                                                                 privacy=privacy, local_steps=2)))


def test_the_egress_guard_lets_every_secagg_stage_answer_out() -> None:
    coordinator, sessions = _stage_messages()
    setup = _query(coordinator.setup(1))
    assert violations(setup, _answer(setup, secagg_site.SiteSecAggSession("site-1", coordinator.setup(1)).public_keys())) == []
    refusal = protocol.SecAggRefusal(site_id="site-1", run_id="run", round=1, reason="settings-refused")
    assert violations(setup, _answer(setup, refusal)) == []
    sessions[1].receive_shares(coordinator.inbox(1))
    train = _secure_train_message(coordinator.inbox(1))
    vector = sessions[1].mask(np.zeros(VECTOR_LENGTH))
    masked = Message(RecordDict({protocol.REPLY_RECORD: _ok_reply(),
                                 protocol.MASKED_RECORD: ArrayRecord({protocol.MASKED_KEY: Array(vector)})}), reply_to=train)
    assert violations(train, masked) == []
    view = protocol.SecAggViewRequest(run_id="run", round=1, survivors=[1, 2], dropped=[3])
    signed = sessions[1].sign_view(view)
    assert violations(_query(view), _answer(_query(view), signed)) == []
    unmask = _query(protocol.SecAggUnmaskRequest(run_id="run", round=1, survivors=[1, 2], dropped=[3]))
    shares = sessions[1].unmask(protocol.SecAggUnmaskRequest(run_id="run", round=1, survivors=[1, 2], dropped=[3]))
    assert violations(unmask, _answer(unmask, shares)) == []
    assert violations(unmask, _answer(unmask, signed)) == ["a 'view-signature' answer to a 'unmask-request' request"]


def _shares(survivors: list[tuple[int, bytes]], dropped: list[tuple[int, bytes]]) -> protocol.SecAggUnmaskShares:
    return protocol.SecAggUnmaskShares(site_id="site-1", run_id="run", round=1,
                                       seed_shares=[protocol.NodeShare(node=n, share=s) for n, s in survivors],
                                       key_shares=[protocol.NodeShare(node=n, share=s) for n, s in dropped])


@pytest.mark.parametrize("case, expected", [
    ("extra record", "record 'images'"),
    ("keys to an unmask request", "'public-keys' answer to a 'unmask-request'"),
    ("both shares of one node", "both shares of nodes [3]"),
    ("shares not asked for", "shares other than the ones asked for"),
    ("another round", "another run or round"),
    ("free text", "malformed secure-aggregation reply"),
])
def test_the_egress_guard_blocks_anything_else_in_a_stage(case: str, expected: str) -> None:
    coordinator, sessions = _stage_messages()
    unmask = _query(protocol.SecAggUnmaskRequest(run_id="run", round=1, survivors=[1, 2], dropped=[3]))
    keys = sessions[1].public_keys()
    answers = {
        "extra record": _answer(unmask, _shares([(1, b"a"), (2, b"b")], [(3, b"c")]),
                                images=ArrayRecord({"x": Array(np.zeros((2, 8, 8), np.float32))})),
        "keys to an unmask request": _answer(unmask, keys),
        "both shares of one node": _answer(unmask, _shares([(1, b"a"), (2, b"b"), (3, b"x")], [(3, b"c")])),
        "shares not asked for": _answer(unmask, _shares([(1, b"a")], [(3, b"c")])),
        "another round": _answer(unmask, protocol.SecAggRefusal(site_id="site-1", run_id="run", round=2, reason="out-of-order")),
        "free text": Message(RecordDict({protocol.SECAGG_RECORD: ConfigRecord({protocol.SECAGG_KEY: json.dumps(
            {"message": {"kind": "refusal", "site_id": "site-1", "run_id": "run", "round": 1, "reason": "patient 17's loss 2.5"}})})}),
            reply_to=unmask),
    }
    reply = answers[case]
    problems = violations(unmask, reply)
    assert problems and any(expected in p for p in problems), problems
    out = egress_guard(unmask, Context(1, 1, {}, RecordDict(), {}), lambda m, c: reply)
    assert out.has_error() and not out.has_content() and "patient" not in out.error.reason


@pytest.mark.parametrize("case, expected", [
    ("the update in the clear", "record 'update'"),
    ("a float vector", "expected 1-D uint32/uint64"),
    ("a longer vector", f"of {VECTOR_LENGTH} (the trainable parameters)"),
    ("a shorter vector", f"of {VECTOR_LENGTH} (the trainable parameters)"),
    ("no vector with ok", "needs a masked record"),
])
def test_the_egress_guard_blocks_anything_but_the_masked_vector_in_a_secure_round(case: str, expected: str) -> None:
    coordinator, _ = _stage_messages()
    train = _secure_train_message(coordinator.inbox(1))
    records: dict = {protocol.REPLY_RECORD: _ok_reply(),
                     protocol.MASKED_RECORD: ArrayRecord({protocol.MASKED_KEY: Array(np.zeros(VECTOR_LENGTH, np.uint64))})}
    if case == "the update in the clear":
        records[protocol.UPDATE_RECORD] = ArrayRecord({"head.w": Array(np.ones((4, 3), np.float32))})
    elif case == "a float vector":
        records[protocol.MASKED_RECORD] = ArrayRecord({protocol.MASKED_KEY: Array(np.zeros(VECTOR_LENGTH, np.float32))})
    elif case in ("a longer vector", "a shorter vector"):
        # a longer vector (or one of every global value) would carry values the engine never noised
        length = VECTOR_LENGTH + 1 if case == "a longer vector" else VECTOR_LENGTH - 1
        records[protocol.MASKED_RECORD] = ArrayRecord({protocol.MASKED_KEY: Array(np.zeros(length, np.uint64))})
    else:
        del records[protocol.MASKED_RECORD]
    problems = violations(train, Message(RecordDict(records), reply_to=train))
    assert problems and any(expected in p for p in problems), problems


def test_a_masked_vector_cannot_leave_in_a_plain_round() -> None:
    instruction = protocol.TrainInstruction(run_id="run", round=1, local_steps=2, model_spec=PLACEHOLDER_SPEC)
    train = Message(RecordDict({
        protocol.GLOBAL_RECORD: ArrayRecord({"head.w": Array(np.zeros((4, 3), np.float32))}),
        protocol.CONFIG_RECORD: ConfigRecord(protocol.encode_instruction(instruction))}), dst_node_id=1,
        message_type=protocol.MESSAGE_TYPE_TRAIN)
    train.metadata.__dict__["_message_id"] = "t2"
    reply = Message(RecordDict({protocol.REPLY_RECORD: _ok_reply(),
                                protocol.UPDATE_RECORD: ArrayRecord({"head.w": Array(np.ones((4, 3), np.float32))}),
                                protocol.MASKED_RECORD: ArrayRecord({protocol.MASKED_KEY: Array(np.zeros(12, np.uint64))})}),
                    reply_to=train)
    assert any("record 'masked' is not part of the protocol" in p for p in violations(train, reply))
