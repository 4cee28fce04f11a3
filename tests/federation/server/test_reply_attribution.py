"""Who a reply counts for: a node may not answer in another site's name.

Flower tells the coordinator the node a reply came from; the site id is what the reply says. The
attack: a second node (another site's SuperNode, or any node the SuperLink admits) sends replies
naming site-1 — to put its own update into the model under site-1's name, to mark site-1 exhausted,
or to plant spends in site-1's ledger record. With ``coordinator.site_identities`` the coordinator
uses a reply only when the named site's identity signed it (with the digest of its update); without
keys, two nodes claiming one site in a round leave both out.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

import fedpose.federation.server.rounds as rounds_module
from fedpose.federation import protocol
from fedpose.federation.config import CoordinatorConfig, SiteIdentityConfig
from fedpose.federation.deployment import CoordinatorRunConfig
from fedpose.federation.ledger import BudgetLedger
from fedpose.federation.reply_signature import ReplySigner, attribution_problem
from fedpose.federation.report import load_history
from fedpose.federation.secagg import crypto
from fedpose.federation.server.rounds import NodeReply, RoundRunner, TrainRequest
from fedpose.federation.site_audit import arrays_sha256, read_log


@pytest.fixture(autouse=True)
def no_settle_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rounds_module, "NODE_SETTLE_S", 0.0)


def _identity(tmp_path: Path, name: str, site_id: str = "site-1") -> tuple[SiteIdentityConfig, str]:
    """A fresh identity key at ``name``.pem, configured for ``site_id``; (its config, its public key)."""
    path = tmp_path / f"{name}.pem"
    path.write_bytes(crypto.new_identity())
    public = crypto.identity_public_key(crypto.load_identity(path))
    other = crypto.identity_public_key(crypto.load_identity(_write(tmp_path / f"{name}-peer.pem", crypto.new_identity())))
    return SiteIdentityConfig(key=path, peers={site_id: public, "site-9": other}), public


def _write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def _run(tmp_path: Path, **coordinator: object) -> CoordinatorRunConfig:
    return CoordinatorRunConfig.model_validate({"run_id": "r", "coordinator": {
        "checkpoint_dir": str(tmp_path / "coordinator"), "data": {"input_size": [64, 64]}, "rounds": 1, "min_sites": 1,
        "local_steps": 2, "model": {"backbone": "tiny_vit_test", "scenario": "scratch"}, **coordinator}})


def _reply(status: str = "ok", **fields: object) -> protocol.SiteReply:
    privacy = protocol.PrivacyReport(guarantee="DP", unit="record", adjacency="add_remove", accountant="rdp", epsilon=1.0,
                                     delta=1e-5, eps_max=10.0, steps=2, rounds_spent=1, orders=[2.0], rdp=[0.5],
                                     next_round_affordable=True)
    return protocol.SiteReply(**{"site_id": "site-1", "run_id": "r", "round": 1, "status": status, "privacy": privacy,
                                 "local_steps": 2, **({"reason": "budget-exhausted"} if status == "refused" else {}), **fields})


def _one_round(tmp_path: Path, nodes: list[int], reply_of: Callable[[int], protocol.SiteReply | str],
               broken: tuple[int, ...] = (), node_sites: dict[str, str] | None = None) -> tuple[list[str], RoundRunner]:
    """One round in which each of ``nodes`` answers ``reply_of(node)`` (a reply with a zero update,
    or a transport failure's text); the updates of ``broken`` nodes cannot be decoded. The console
    lines and the runner, whose node → site map starts as ``node_sites``."""

    def update(request: TrainRequest) -> dict[str, np.ndarray]:
        if request.node in broken:
            raise ValueError("Failed to deserialize: not a .npy file")
        return {k: np.zeros_like(request.global_arrays[k]) for k in trainable}

    def answer(request: TrainRequest) -> NodeReply:
        reply = reply_of(request.node)
        return NodeReply(request.node, failure=reply) if isinstance(reply, str) else NodeReply(
            request.node, reply, update=lambda: update(request))

    class Scripted:
        def node_ids(self) -> list[int]:
            return list(nodes)

        def send_and_receive(self, requests: list[TrainRequest], timeout: float) -> list[NodeReply]:
            return [answer(r) for r in requests]

    lines: list[str] = []
    runner = RoundRunner(_run(tmp_path), echo=lines.append)
    runner.state.node_sites = dict(node_sites or {})
    trainable = list(runner.global_model().trainable_parameters())
    runner.run_rounds(Scripted())
    return lines, runner


def test_an_impostor_node_cannot_answer_in_a_site_s_name(tmp_path: Path) -> None:
    """Two nodes run real site rounds and both reply as site-1; only one holds site-1's identity key.
    The coordinator, given site-1's public key, uses that one's reply alone: the ledger holds one
    row for site-1 whose digest is the real site's update, and the impostor's node is named in the
    round as unattributed (nothing it sent reaches site-1's record or the model)."""
    from fedpose.federation.server.in_process import InProcessTransport
    from site_round_helpers import make_site_data, site_config

    data = make_site_data(tmp_path / "data")
    real_identity, real_key = _identity(tmp_path, "real")
    impostor_identity, _ = _identity(tmp_path, "impostor")  # its own key, listed under site-1 in its own config
    real = site_config(data, tmp_path / "real").model_copy(update={"identity": real_identity})
    impostor = site_config(data, tmp_path / "impostor").model_copy(update={"identity": impostor_identity})
    lines: list[str] = []
    runner = RoundRunner(_run(tmp_path, site_identities={"site-1": real_key}), echo=lines.append)
    runner.run_rounds(InProcessTransport([impostor, real]))  # the impostor answers first

    (entry,) = load_history(tmp_path / "coordinator")
    assert entry.aggregated and entry.sites["site-1"].status == "ok" and entry.unidentified_missing_nodes == [1]
    assert any("node 1 not used" in line and "not signed by that site's identity" in line for line in lines)
    assert runner.state.node_sites == {"2": "site-1"}
    with BudgetLedger(tmp_path / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        (row,) = ledger.entries("site-1")
    (real_sent,) = [e.update_sha256 for e in read_log(tmp_path / "real")]
    (impostor_sent,) = [e.update_sha256 for e in read_log(tmp_path / "impostor")]
    assert row.update_sha256 == real_sent != impostor_sent


def test_without_keys_two_nodes_claiming_one_site_leave_both_out(tmp_path: Path) -> None:
    """No identities configured: the coordinator cannot tell which of two replies naming site-1 is
    site-1's, so it uses neither — no update aggregated, no ledger row, no spends recorded — and
    says which nodes claimed it and how to make sites sign."""

    lines, _ = _one_round(tmp_path, [11, 12], lambda node: _reply(spends=[
        protocol.SpendEvent(round=1, noise_multiplier=1.0, sample_rate=0.1, steps=2 + 100 * (node == 12))]))
    (entry,) = load_history(tmp_path / "coordinator")
    assert not entry.aggregated and "site-1" not in entry.sites and entry.unidentified_missing_nodes == [11, 12]
    assert any("nodes 11, 12 all answered as site 'site-1'" in line and "site_identities" in line for line in lines)
    with BudgetLedger(tmp_path / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        assert ledger.entries("site-1") == [] and ledger.site_summaries() == []


@pytest.mark.parametrize("echo", [{"round": 7}, {"run_id": "another-run"}])
def test_a_reply_that_answers_another_round_or_run_is_attributed_to_no_site(tmp_path: Path, echo: dict) -> None:
    """A reply names the run and round it answers (both signed): one for another round or run (a
    replayed earlier reply, a stale answer) is not this round's, whoever signed it."""

    lines, _ = _one_round(tmp_path, [11], lambda node: _reply(**echo))
    (entry,) = load_history(tmp_path / "coordinator")
    assert not entry.aggregated and entry.sites == {} and entry.unidentified_missing_nodes == [11]
    assert any("node 11 not used: the reply answers run" in line and "not this one (run 'r' round 1)" in line for line in lines)


def test_a_node_whose_update_cannot_be_decoded_loses_its_reply_not_the_round(tmp_path: Path) -> None:
    """Found by a red-team: the digest was taken before any check, so one node's undecodable arrays
    (an unsigned reply would do) raised out of the round and stopped the coordinator, again after
    every resume. The node's reply counts for no site; the others' rounds go on."""
    lines, _ = _one_round(tmp_path, [11, 12], lambda node: _reply(site_id=f"site-{node - 10}"), broken=(11,))
    (entry,) = load_history(tmp_path / "coordinator")
    assert entry.aggregated and set(entry.sites) == {"site-2"} and entry.unidentified_missing_nodes == [11]
    assert any("node 11 not used: malformed update (ValueError" in line for line in lines)


def test_a_node_that_once_spoke_for_a_site_no_longer_does_once_the_site_answers_from_another(tmp_path: Path) -> None:
    """Found by a red-team: node 11 once answered as site-1 (a SuperNode the site has since replaced,
    or a node that claimed the site in a round it missed); site-1 now answers from node 12. Node 11's
    failure used to write a "missing" row for site-1 over its real reply of the same round. The
    site's real reply stands, and node 11 speaks for no site any more."""
    lines, runner = _one_round(tmp_path, [11, 12], lambda node: _reply() if node == 12 else "malformed reply: whatever",
                               node_sites={"11": "site-1"})
    (entry,) = load_history(tmp_path / "coordinator")
    assert entry.aggregated and entry.sites["site-1"].status == "ok" and entry.unidentified_missing_nodes == [11]
    assert runner.state.node_sites == {"12": "site-1"}
    with BudgetLedger(tmp_path / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        assert [row.status for row in ledger.entries("site-1")] == ["ok"]


def test_a_signature_binds_the_reply_and_its_update(tmp_path: Path) -> None:
    """A signed reply verifies with what came with it; a changed update, a changed field (the spends
    a node would plant, the status), another site's key, no signature, or a site the coordinator
    does not list each make it unattributable."""
    identity, public = _identity(tmp_path, "site")
    other = crypto.identity_public_key(crypto.load_identity(_write(tmp_path / "other.pem", crypto.new_identity())))
    site = type("Site", (), {"site_id": "site-1", "identity": identity})()
    signer = ReplySigner.of(site)  # type: ignore[arg-type]
    assert signer is not None
    update = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    signed = signer.sign(_reply(), update)
    keys = {"site-1": public}
    assert attribution_problem(signed, arrays_sha256(update), keys) is None
    assert attribution_problem(signed, arrays_sha256({"w": update["w"] + 1}), keys) is not None
    planted = signed.model_copy(update={"spends": [protocol.SpendEvent(round=1, noise_multiplier=0.1, sample_rate=1.0, steps=9)]})
    assert attribution_problem(planted, arrays_sha256(update), keys) is not None
    refused = signer.sign(_reply("refused"), {})
    assert attribution_problem(refused, None, keys) is None
    assert attribution_problem(refused.model_copy(update={"status": "ok", "reason": None}), None, keys) is not None
    assert "not signed" in attribution_problem(signed, arrays_sha256(update), {"site-1": other})
    assert "unsigned" in attribution_problem(_reply(), arrays_sha256(update), keys)
    assert "does not list" in attribution_problem(signed, arrays_sha256(update), {"site-2": public})
    assert attribution_problem(_reply(), None, {}) is None  # no keys given: taken at its word
    # the signature survives the wire: the reply as JSON and back verifies alike
    assert attribution_problem(protocol.decode_reply(protocol.encode_reply(signed)), arrays_sha256(update), keys) is None


def test_a_site_whose_identity_key_does_not_load_fails_before_any_spend(tmp_path: Path) -> None:
    """The key is loaded before the round: a missing key file is an "error" reply with nothing spent."""
    from fedpose.federation.local_training import run_site_round
    from site_round_helpers import global_model, make_site_data, site_config

    identity, _ = _identity(tmp_path, "site")
    identity.key.unlink()
    site = site_config(make_site_data(tmp_path / "data"), tmp_path / "state").model_copy(update={"identity": identity})
    arrays, spec = global_model()
    result = run_site_round(site, "r", 1, arrays, spec, 2)
    assert (result.reply.status, result.reply.error_class, result.reply.signature) == ("error", "FileNotFoundError", None)
    budget = tmp_path / "state" / "budget.json"
    assert not budget.exists() or not [e for e in json.loads(budget.read_text())["payload"]["entries"] if e["status"] == "spent"]


def test_site_identities_must_be_site_ids_and_public_keys() -> None:
    with pytest.raises(ValidationError, match=r"site_identities: the keys of \['site-1'\] are not Ed25519 public keys"):
        CoordinatorConfig.model_validate({"site_identities": {"site-1": "not a key"}})
    with pytest.raises(ValidationError, match="site_identities: .* are not site ids"):
        CoordinatorConfig.model_validate({"site_identities": {"../x": "A" * 43 + "="}})
