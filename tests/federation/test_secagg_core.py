"""Secure aggregation's library pieces with real cryptography: the quantizer's guarantees (no
overflow, unbiased, the error bound), the four stages end to end with dropouts, and a malicious
coordinator trying to break the sites' security rule."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from fedpose.federation import protocol
from fedpose.federation.config import SecureAggregationConfig
from fedpose.federation.secagg import crypto
from fedpose.federation.secagg.coordinator import CoordinatorSecAggRound, RoundAbandoned
from fedpose.federation.secagg.quantization import Quantizer
from fedpose.federation.secagg.site import SecAggRefused, SiteSecAggSession, answer, setup_digest, start


# -- quantization ---------------------------------------------------------------------------------------
def test_config_refuses_a_modulus_the_sum_could_wrap() -> None:
    SecureAggregationConfig(bits=16, modulus_bits=32, max_sites=65537)  # 65537 · 65535 = 2^32 − 1 < 2^32
    with pytest.raises(ValidationError, match="must be < 2\\^modulus_bits"):
        SecureAggregationConfig(bits=16, modulus_bits=32, max_sites=65538)


def test_no_overflow_at_the_extremes() -> None:
    q = Quantizer(clip_range=1.0, bits=8, modulus_bits=16, max_sites=257)  # 257 · 255 = 65535 < 2^16
    top = q.quantize(np.full(10, 5.0))  # clipped to +R: the top level exactly
    assert (top == q.levels).all()
    total = np.zeros(10, dtype=np.uint64)
    for _ in range(q.max_sites):
        total = (total + top) & np.uint64(q.modulus - 1)
    assert (total == q.max_sites * q.levels).all()  # no wrap: the modular sum is the integer sum
    assert np.allclose(q.dequantize_sum(total, q.max_sites), q.max_sites * 1.0)
    bottom = q.quantize(np.full(10, -5.0))
    assert (bottom == 0).all() and np.allclose(q.dequantize_sum(bottom, 1), -1.0)


def test_stochastic_rounding_is_unbiased_and_within_one_step() -> None:
    q = Quantizer(clip_range=0.5, bits=4, modulus_bits=16, max_sites=4)  # step 1/15: coarse on purpose
    x = np.linspace(-0.5, 0.5, 41)
    draws = 4000
    estimates = np.stack([q.dequantize_sum(q.quantize(x), 1) for _ in range(draws)])
    assert (np.abs(estimates - x) < q.step).all()  # each draw errs by less than one step
    # mean of Bernoulli rounding: standard error ≤ step / (2 √draws); 5 standard errors
    assert np.abs(estimates.mean(axis=0) - x).max() < 5 * q.step / (2 * np.sqrt(draws))


def test_dequantized_sum_is_within_the_stated_bound() -> None:
    q = Quantizer(clip_range=0.1, bits=6, modulus_bits=16, max_sites=8)
    rng = np.random.default_rng(0)  # the test's inputs only; rounding coins come from the CSPRNG
    xs = rng.uniform(-0.2, 0.2, size=(8, 1000))
    total = sum(q.quantize(x) for x in xs) & np.uint64(q.modulus - 1)
    error = np.abs(q.dequantize_sum(total, 8) - np.clip(xs, -0.1, 0.1).sum(axis=0))
    assert error.max() < q.error_bound(8) == pytest.approx(8 * 2 * 0.1 / 63)


# -- the protocol ---------------------------------------------------------------------------------------
SETTINGS = SecureAggregationConfig(enabled=True, clip_range=1.0, bits=16, modulus_bits=32, max_sites=16)


def _round(n: int, length: int = 50, deliver: bool = True) -> tuple[CoordinatorSecAggRound, dict[int, SiteSecAggSession]]:
    coordinator = CoordinatorSecAggRound(SETTINGS, "run", 1, list(range(1, n + 1)), length)
    sessions, replies = {}, {}
    for node in coordinator.participants:
        session, replies[node] = start(f"site-{node}", coordinator.setup(node), length)
        assert session is not None
        sessions[node] = session
    coordinator.receive_public_keys(replies)
    directory = coordinator.key_directory()
    coordinator.receive_shares({node: answer(s, s.site_id, directory) for node, s in sessions.items()})
    for node, session in sessions.items():
        if deliver:
            session.receive_shares(coordinator.inbox(node))
    return coordinator, sessions


def _updates(n: int, length: int = 50) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(1)
    return {node: rng.uniform(-0.9, 0.9, length) for node in range(1, n + 1)}


def _sign_view(coordinator: CoordinatorSecAggRound, sessions: dict[int, SiteSecAggSession], nodes, identities=None) -> None:
    """Stage 4a as the coordinator runs it: every node in ``nodes`` signs the one view."""
    view = coordinator.view_request()
    coordinator.receive_view_signatures({n: answer(sessions[n], sessions[n].site_id, view, (identities or {}).get(n))
                                         for n in nodes})


def _view_then_unmask(session: SiteSecAggSession, request: protocol.SecAggUnmaskRequest,
                      identity=None) -> protocol.SecAggSiteMessage:
    """One site shown ``request``'s view (4a), then asked to unmask it (4b): its refusal, or its shares."""
    view = protocol.SecAggViewRequest(run_id=request.run_id, round=request.round, survivors=request.survivors,
                                      dropped=request.dropped)
    signed = answer(session, session.site_id, view, identity)
    return signed if isinstance(signed, protocol.SecAggRefusal) else answer(session, session.site_id, request, identity)


@pytest.mark.parametrize(("n", "drop"), [(3, 0), (3, 1), (5, 2)])
def test_the_sum_of_the_survivors_comes_back_within_the_bound(n: int, drop: int) -> None:
    coordinator, sessions = _round(n)
    updates = _updates(n)
    survivors = list(sessions)[drop:]  # the first `drop` sites vanish after sharing keys
    coordinator.receive_masked({node: sessions[node].mask(updates[node]) for node in survivors})
    _sign_view(coordinator, sessions, survivors)
    request = coordinator.unmask_request()
    assert request.dropped == list(sessions)[:drop]
    result = coordinator.unmask({node: answer(sessions[node], sessions[node].site_id, request) for node in survivors})
    expected = sum(updates[node] for node in survivors)
    assert result.survivors == survivors
    assert np.abs(result.total - expected).max() < result.error_bound == pytest.approx(len(survivors) * 2 / 65535)


def test_a_masked_vector_alone_looks_uniform() -> None:
    coordinator, sessions = _round(3, length=20000)
    masked = sessions[1].mask(np.zeros(20000))  # a constant update: the mask alone must hide it
    counts = np.bincount((masked >> np.uint64(28)).astype(np.int64), minlength=16)  # top 4 of 32 bits
    assert counts.min() > 20000 / 16 * 0.85 and counts.max() < 20000 / 16 * 1.15


def test_too_many_dropouts_abandon_the_round_before_any_share_is_asked() -> None:
    coordinator, sessions = _round(5)
    updates = _updates(5)
    with pytest.raises(RoundAbandoned, match="2 of 5 sites after masking < threshold t = 3"):
        coordinator.receive_masked({node: sessions[node].mask(updates[node]) for node in (4, 5)})


def test_too_few_unmask_answers_abandon_the_round() -> None:
    coordinator, sessions = _round(3)
    updates = _updates(3)
    coordinator.receive_masked({node: sessions[node].mask(updates[node]) for node in (1, 2, 3)})
    _sign_view(coordinator, sessions, (1, 2, 3))
    request = coordinator.unmask_request()
    with pytest.raises(RoundAbandoned, match="after unmasking") as abandoned:
        coordinator.unmask({1: answer(sessions[1], "site-1", request)})
    assert "refused" not in str(abandoned.value)  # lost answers, no refusal


def test_an_abandoned_round_names_the_sites_that_refused_and_why() -> None:
    coordinator, sessions = _round(3)
    updates = _updates(3)
    coordinator.receive_masked({node: sessions[node].mask(updates[node]) for node in (1, 2, 3)})
    honest = coordinator.view_request()
    both = honest.model_copy(update={"dropped": [1]})  # node 1 as survivor and dropped
    with pytest.raises(RoundAbandoned) as abandoned:
        coordinator.receive_view_signatures({node: answer(s, s.site_id, both) for node, s in sessions.items()})
    assert str(abandoned.value) == ("0 of 3 sites after the view check < threshold t = 2; "
                                    "refused by site-1, site-2, site-3 (both-shares-of-one-peer)")


# -- a malicious coordinator --------------------------------------------------------------------------------
def _masked_round() -> tuple[CoordinatorSecAggRound, dict[int, SiteSecAggSession]]:
    coordinator, sessions = _round(5)
    updates = _updates(5)
    coordinator.receive_masked({node: sessions[node].mask(updates[node]) for node in sessions})
    return coordinator, sessions


def _reason(reply: protocol.SecAggSiteMessage) -> str:
    assert isinstance(reply, protocol.SecAggRefusal), reply
    return reply.reason


def test_a_site_refuses_both_shares_of_one_peer_in_one_request() -> None:
    _, sessions = _masked_round()
    greedy = protocol.SecAggUnmaskRequest(run_id="run", round=1, survivors=[1, 2, 3, 4], dropped=[4])
    assert _reason(_view_then_unmask(sessions[1], greedy)) == "both-shares-of-one-peer"


def test_a_site_refuses_a_second_view_of_who_dropped() -> None:
    """Two requests to one site (peer 4 survived, then dropped) would hand over both of 4's shares."""
    _, sessions = _masked_round()
    first = protocol.SecAggUnmaskRequest(run_id="run", round=1, survivors=[1, 2, 3, 4, 5], dropped=[])
    assert isinstance(_view_then_unmask(sessions[1], first), protocol.SecAggUnmaskShares)
    second = protocol.SecAggUnmaskRequest(run_id="run", round=1, survivors=[1, 2, 3], dropped=[4, 5])
    assert _reason(answer(sessions[1], "site-1", second)) == "out-of-order"
    assert _reason(_view_then_unmask(sessions[1], second)) == "out-of-order"  # nor a second view to sign


def test_a_site_unmasks_only_the_view_it_signed() -> None:
    _, sessions = _masked_round()
    signed = protocol.SecAggViewRequest(run_id="run", round=1, survivors=[1, 2, 3, 4, 5], dropped=[])
    assert isinstance(answer(sessions[1], "site-1", signed), protocol.SecAggViewSignature)
    other = protocol.SecAggUnmaskRequest(run_id="run", round=1, survivors=[1, 2, 3, 4], dropped=[5])
    assert _reason(answer(sessions[1], "site-1", other)) == "inconsistent-view"


def test_split_views_cannot_rebuild_both_secrets_of_one_site() -> None:
    """The coordinator tells sites 1, 2 (and 5) that site 5 survived and sites 3, 4 that it dropped,
    then asks everyone again: with t > n/2 it gets t seed shares of 5 but fewer than t key shares."""
    coordinator, sessions = _masked_round()
    seed_view = protocol.SecAggUnmaskRequest(run_id="run", round=1, survivors=[1, 2, 3, 4, 5], dropped=[])
    key_view = protocol.SecAggUnmaskRequest(run_id="run", round=1, survivors=[1, 2, 3, 4], dropped=[5])
    answers = [_view_then_unmask(sessions[n], seed_view) for n in (1, 2, 5)]
    answers += [_view_then_unmask(sessions[n], key_view) for n in (3, 4)]
    answers += [_view_then_unmask(sessions[n], key_view) for n in (1, 2)] + [_view_then_unmask(sessions[5], key_view)]
    shares = [a for a in answers if isinstance(a, protocol.SecAggUnmaskShares)]
    seed_of_5 = [s.share for a in shares for s in a.seed_shares if s.node == 5]
    key_of_5 = [s.share for a in shares for s in a.key_shares if s.node == 5]
    assert len(seed_of_5) >= coordinator.threshold > len(key_of_5) == 2
    with pytest.raises(ValueError):  # two shares of a 3-of-5 sharing rebuild garbage, not 5's key
        crypto.key_pair_from_private(crypto.combine_shares(key_of_5))


@pytest.mark.parametrize(("survivors", "dropped", "code"), [
    ([1, 2, 3, 4], [5, 9], "unknown-node"),  # 9 was never in the round
    ([2, 3, 4, 5], [1], "own-key-share"),  # the site itself as dropped
    ([1, 2], [3], "below-threshold"),
])
def test_a_site_refuses_requests_outside_the_rule(survivors: list[int], dropped: list[int], code: str) -> None:
    _, sessions = _masked_round()
    request = protocol.SecAggUnmaskRequest(run_id="run", round=1, survivors=survivors, dropped=dropped)
    assert _reason(_view_then_unmask(sessions[1], request)) == code


def test_a_site_refuses_a_threshold_at_or_below_half() -> None:
    setup = protocol.SecAggSetup(run_id="r", round=1, node=1, participants=[1, 2, 3, 4], threshold=2, clip_range=1.0,
                                 max_weight=1.0, bits=16, modulus_bits=32, max_sites=16, vector_length=5)
    session, reply = start("site-1", setup, 5)
    assert session is None and _reason(reply) == "settings-refused"


def test_a_site_refuses_a_vector_length_unlike_its_model() -> None:
    setup = protocol.SecAggSetup(run_id="r", round=1, node=1, participants=[1, 2, 3], threshold=2, clip_range=1.0,
                                 max_weight=1.0, bits=16, modulus_bits=32, max_sites=16, vector_length=5)
    with pytest.raises(SecAggRefused, match="settings-refused"):
        SiteSecAggSession("site-1", setup, vector_length=6)


def test_a_forged_share_is_refused_before_masking() -> None:
    coordinator, sessions = _round(3, deliver=False)
    inbox = coordinator.inbox(1)
    # the coordinator swaps in a token sealed under a key site 1 never agreed to
    forged = protocol.SecAggShareInbox(run_id="run", round=1, shares=[inbox.shares[0].model_copy(update={
        "ciphertext": crypto.encrypt(crypto.new_key_pair().agree(crypto.new_key_pair().public), b"x" * 40)})] + inbox.shares[1:])
    with pytest.raises(SecAggRefused, match="inconsistent-shares"):
        sessions[1].receive_shares(forged)
    with pytest.raises(SecAggRefused, match="out-of-order"):
        sessions[1].mask(np.zeros(50))  # a refused session masks nothing
    # one site's shares replayed as another's: authenticated, but the names inside do not match
    swapped = protocol.SecAggShareInbox(run_id="run", round=1, shares=[
        protocol.EncryptedShare(peer=3, ciphertext=inbox.shares[0].ciphertext)])
    with pytest.raises(SecAggRefused, match="inconsistent-shares"):
        sessions[2].receive_shares(swapped)


def test_wire_messages_round_trip_through_their_records() -> None:
    coordinator, sessions = _round(3)
    for message in (coordinator.setup(1), coordinator.key_directory(), coordinator.inbox(2), coordinator.view_request(),
                    coordinator.unmask_request().model_copy(update={"view_signatures": [
                        protocol.NodeSignature(node=1, signature=b"s" * 64)]})):
        assert protocol.decode_secagg_request(protocol.encode_secagg(message)) == message
    keys = sessions[1].public_keys()
    assert protocol.decode_secagg_reply(protocol.encode_secagg(keys)) == keys
    with pytest.raises(protocol.ProtocolError, match="exactly one JSON string"):
        protocol.decode_secagg_reply({"secagg": "{}", "extra": "x"})


# -- signed keys: a coordinator that substitutes keys or invents a site ------------------------------------
def _identities(n: int, tmp_path) -> dict:
    """Sites 1..n with identity keys on disk and each other's public keys listed (as exchanged out of band)."""
    from fedpose.federation.config import SiteIdentityConfig
    from fedpose.federation.secagg.site import Identity

    public = {}
    for node in range(1, n + 1):
        (tmp_path / f"site-{node}.pem").write_bytes(crypto.new_identity())
        public[f"site-{node}"] = crypto.identity_public_key(crypto.load_identity(tmp_path / f"site-{node}.pem"))
    return {node: Identity.from_config(f"site-{node}", SiteIdentityConfig(key=tmp_path / f"site-{node}.pem", peers=public))
            for node in range(1, n + 1)}


def _signed_setup(n: int, tmp_path) -> tuple[CoordinatorSecAggRound, dict[int, SiteSecAggSession], dict, dict]:
    identities = _identities(n, tmp_path)
    coordinator = CoordinatorSecAggRound(SETTINGS, "run", 1, list(range(1, n + 1)), 50)
    sessions, replies = {}, {}
    for node in coordinator.participants:
        sessions[node], replies[node] = start(f"site-{node}", coordinator.setup(node), 50, identities[node])
    coordinator.receive_public_keys(replies)
    return coordinator, sessions, identities, replies


def test_signed_keys_run_the_round_to_the_sum(tmp_path) -> None:
    coordinator, sessions, identities, _ = _signed_setup(3, tmp_path)
    directory = coordinator.key_directory()
    assert all(entry.signature is not None and entry.site_id == f"site-{entry.node}" for entry in directory.keys)
    coordinator.receive_shares({node: answer(s, s.site_id, directory, identities[node]) for node, s in sessions.items()})
    updates = _updates(3)
    for node, session in sessions.items():
        session.receive_shares(coordinator.inbox(node))
    coordinator.receive_masked({node: s.mask(updates[node]) for node, s in sessions.items()})
    _sign_view(coordinator, sessions, sessions, identities)
    request = coordinator.unmask_request()
    assert len(request.view_signatures) == 3
    result = coordinator.unmask({node: answer(s, s.site_id, request, identities[node]) for node, s in sessions.items()})
    assert np.abs(result.total - sum(updates.values())).max() < result.error_bound


def _directory_with(directory: protocol.SecAggKeyDirectory, node: int, **change) -> protocol.SecAggKeyDirectory:
    keys = [entry.model_copy(update=change) if entry.node == node else entry for entry in directory.keys]
    return directory.model_copy(update={"keys": keys})


def test_a_coordinator_substituting_a_sites_keys_is_refused(tmp_path) -> None:
    """The man in the middle: the coordinator replaces site-2's keys with its own (so that it could
    decrypt the shares the others send site-2). Unsigned, with a copied signature, or signed by an
    identity of its own: every honest site refuses before it shares anything."""
    coordinator, sessions, identities, _ = _signed_setup(3, tmp_path)
    directory = coordinator.key_directory()
    own = crypto.new_key_pair(), crypto.new_key_pair()
    swapped = {"mask_key": own[0].public, "share_key": own[1].public}
    (tmp_path / "coordinator.pem").write_bytes(crypto.new_identity())
    coordinator_key = crypto.load_identity(tmp_path / "coordinator.pem")
    forged = crypto.sign_keys(coordinator_key, crypto.key_statement("run", 1, 2, "site-2", own[0].public, own[1].public,
                                                                    setup_digest(sessions[2].setup)))
    for attack in ({**swapped, "signature": None}, swapped, {**swapped, "signature": forged}):
        tampered = _directory_with(directory, 2, **attack)
        for node in (1, 3):
            fresh = SiteSecAggSession.from_json(sessions[node].to_json())
            assert _reason(answer(fresh, f"site-{node}", tampered, identities[node])) == "unsigned-keys"


def test_a_coordinator_inventing_a_site_or_moving_one_is_refused(tmp_path) -> None:
    """A site the peers were never told of (the coordinator's own, to reach the threshold with
    shares it can read), one site's signed keys at another node, or one site twice: refused."""
    coordinator, sessions, identities, replies = _signed_setup(3, tmp_path)
    directory = coordinator.key_directory()
    (tmp_path / "stranger.pem").write_bytes(crypto.new_identity())
    stranger = crypto.load_identity(tmp_path / "stranger.pem")
    own = crypto.new_key_pair(), crypto.new_key_pair()
    invented = _directory_with(directory, 3, site_id="site-9", mask_key=own[0].public, share_key=own[1].public,
                               signature=crypto.sign_keys(stranger, crypto.key_statement(
                                   "run", 1, 3, "site-9", own[0].public, own[1].public, setup_digest(sessions[3].setup))))
    def signed_keys_of(node: int) -> dict:
        return {"site_id": f"site-{node}", **{k: getattr(replies[node], k) for k in ("mask_key", "share_key", "signature")}}

    moved = _directory_with(_directory_with(directory, 2, **signed_keys_of(3)), 3, **signed_keys_of(2))  # 2 and 3 swapped
    twice = _directory_with(directory, 3, site_id="site-2", signature=replies[2].signature)
    for tampered in (invented, moved, twice):
        fresh = SiteSecAggSession.from_json(sessions[1].to_json())
        assert _reason(answer(fresh, "site-1", tampered, identities[1])) == "unsigned-keys"


def _shares_delivered_but_site_1s(tmp_path) -> tuple[dict[int, SiteSecAggSession], protocol.SecAggShareInbox]:
    """Five signed sites, t 3, every inbox delivered but site 1's: the sessions and site 1's full inbox."""
    coordinator, sessions, identities, _ = _signed_setup(5, tmp_path)
    directory = coordinator.key_directory()
    coordinator.receive_shares({node: answer(s, s.site_id, directory, identities[node]) for node, s in sessions.items()})
    for node in (2, 3, 4, 5):
        sessions[node].receive_shares(coordinator.inbox(node))
    return sessions, coordinator.inbox(1)


def test_a_coordinator_cannot_unmask_one_site_by_shrinking_its_mask_set_and_splitting_the_views(tmp_path) -> None:
    """The attack that worked until 2026-12-06, every other check passing: site 1 is handed the
    shares of sites 2 and 3 only, so it masks with them alone; then 2 and 3 are each told the other
    dropped, 4 and 5 that both did, and all that 1 survived: t seed shares of site 1 and t key shares
    of 2 and of 3 strip every mask off site 1's vector. Now site 1 refuses that inbox before it masks
    (so before it trains); with every peer's shares it goes on."""
    sessions, inbox = _shares_delivered_but_site_1s(tmp_path)
    shrunk = inbox.model_copy(update={"shares": [share for share in inbox.shares if share.peer in (2, 3)]})
    with pytest.raises(SecAggRefused, match="inconsistent-shares: shares from 2 peers"):
        sessions[1].receive_shares(shrunk)
    with pytest.raises(SecAggRefused, match="out-of-order"):
        sessions[1].mask(np.zeros(50))

    (tmp_path / "again").mkdir()
    sessions, inbox = _shares_delivered_but_site_1s(tmp_path / "again")
    restored = SiteSecAggSession.from_json(sessions[1].to_json())  # N travels with the session between messages
    restored.receive_shares(inbox)
    assert restored.stage == "shares-received"


def test_a_coordinator_cannot_give_one_site_a_higher_threshold_than_its_peers(tmp_path) -> None:
    """The attack a red-team found on 2026-12-07, every per-site check passing: seven sites, the victim
    (node 1) told t = 5, the others t = 4. At t 5 the victim accepts the shares of four peers
    (5·4 > 6·2), while each other site, at t 4, may reveal three key shares: enough to rebuild the
    four peers' keys and, with the victim's seed, its vector alone. The signed key statement now
    covers the round's setup, and each site checks its peers' signatures against its own setup: the
    split is refused before any site shares a secret."""
    identities = _identities(7, tmp_path)
    coordinator = CoordinatorSecAggRound(SETTINGS, "run", 1, list(range(1, 8)), 50)
    assert coordinator.threshold == 4
    sessions, replies = {}, {}
    for node in coordinator.participants:
        setup = coordinator.setup(node).model_copy(update={"threshold": 5 if node == 1 else 4})
        sessions[node], replies[node] = start(f"site-{node}", setup, 50, identities[node])
        assert sessions[node] is not None  # each setup alone passes the site's checks (t > n/2)
    coordinator.receive_public_keys(replies)
    directory = coordinator.key_directory()  # the honest, fully signed directory
    for node, session in sessions.items():
        assert _reason(answer(session, session.site_id, directory, identities[node])) == "unsigned-keys", node
    # the same round with one setup for all goes on
    (tmp_path / "honest").mkdir()
    coordinator, sessions, identities, _ = _signed_setup(7, tmp_path / "honest")
    directory = coordinator.key_directory()
    assert all(isinstance(answer(s, s.site_id, directory, identities[n]), protocol.SecAggEncryptedShares)
               for n, s in sessions.items())


def test_a_coordinator_showing_each_site_its_own_view_cannot_unmask_a_pair(tmp_path) -> None:
    """The attack a red-team found on 2026-12-07, every per-site check passing: five sites, t 3, every
    directory and inbox honest; each site is told that sites 1 and 2 survived and a different pair of
    the others dropped, so that every site's seed share of 1 and 2 and t key shares of each of 3, 4, 5
    reach the coordinator — the sum of sites 1 and 2 alone (and with site 2 colluding, site 1's Δ).
    Now each site signs the view it is shown and unmasks only a view t survivors signed: the
    coordinator can certify at most one view, and a site shown another refuses."""
    coordinator, sessions, identities, _ = _signed_setup(5, tmp_path)
    directory = coordinator.key_directory()
    coordinator.receive_shares({node: answer(s, s.site_id, directory, identities[node]) for node, s in sessions.items()})
    updates = _updates(5)
    for node, session in sessions.items():
        session.receive_shares(coordinator.inbox(node))
    coordinator.receive_masked({node: s.mask(updates[node]) for node, s in sessions.items()})
    views = {1: ([1, 2, 3], [4, 5]), 2: ([1, 2, 4], [3, 5]), 3: ([1, 2, 3], [4, 5]), 4: ([1, 2, 4], [3, 5]), 5: ([1, 2, 5], [3, 4])}
    signatures: dict[tuple, list[protocol.NodeSignature]] = {}
    for node, (survivors, dropped) in views.items():
        signed = answer(sessions[node], f"site-{node}", protocol.SecAggViewRequest(
            run_id="run", round=1, survivors=survivors, dropped=dropped), identities[node])
        assert isinstance(signed, protocol.SecAggViewSignature) and signed.signature is not None
        signatures.setdefault((tuple(survivors), tuple(dropped)), []).append(
            protocol.NodeSignature(node=node, signature=signed.signature))
    every_signature = [sig for sigs in signatures.values() for sig in sigs]
    refused = {}
    for node, (survivors, dropped) in views.items():
        # the coordinator hands each site every signature it holds: no view has t = 3 signers
        request = protocol.SecAggUnmaskRequest(run_id="run", round=1, survivors=survivors, dropped=dropped,
                                               view_signatures=every_signature)
        refused[node] = _reason(answer(sessions[node], f"site-{node}", request, identities[node]))
    assert refused == {node: "inconsistent-view" for node in views}


def test_an_unmask_request_needs_t_survivors_signatures_of_its_view(tmp_path) -> None:
    """Signatures of the same view by fewer than t survivors, by a dropped node, or forged: refused."""
    coordinator, sessions, identities, _ = _signed_setup(3, tmp_path)
    directory = coordinator.key_directory()
    coordinator.receive_shares({node: answer(s, s.site_id, directory, identities[node]) for node, s in sessions.items()})
    for node, session in sessions.items():
        session.receive_shares(coordinator.inbox(node))
    updates = _updates(3)
    coordinator.receive_masked({node: s.mask(updates[node]) for node, s in sessions.items()})
    _sign_view(coordinator, sessions, sessions, identities)
    request = coordinator.unmask_request()
    one = request.model_copy(update={"view_signatures": request.view_signatures[:1]})
    forged = request.model_copy(update={"view_signatures": [protocol.NodeSignature(node=n, signature=b"x" * 64) for n in (1, 2, 3)]})
    for bad in (one, forged):
        fresh = SiteSecAggSession.from_json(sessions[1].to_json())  # the signed view travels with the session
        assert _reason(answer(fresh, "site-1", bad, identities[1])) == "inconsistent-view"
    result = coordinator.unmask({node: answer(s, s.site_id, request, identities[node]) for node, s in sessions.items()})
    assert np.abs(result.total - sum(updates.values())).max() < result.error_bound


def _keys_shared(coordinator: CoordinatorSecAggRound, identities: dict) -> dict[int, SiteSecAggSession]:
    """Stages 1–2 with identities, every site honest: the sessions, their shares at the coordinator."""
    sessions, replies = {}, {}
    for node in coordinator.participants:
        sessions[node], replies[node] = start(f"site-{node}", coordinator.setup(node), 50, identities[node])
    coordinator.receive_public_keys(replies)
    directory = coordinator.key_directory()
    coordinator.receive_shares({node: answer(s, s.site_id, directory, identities[node]) for node, s in sessions.items()})
    return sessions


def test_a_round_of_fewer_sites_than_the_federation_holds_is_not_refused(tmp_path) -> None:
    """With identities, N for the mask-set rule is the round's participants (the signed setup gives
    every site the same list), not every identity listed: six of ten sites run an honest round."""
    identities = _identities(10, tmp_path)
    coordinator = CoordinatorSecAggRound(SETTINGS, "run", 1, list(range(1, 7)), 50)
    sessions = _keys_shared(coordinator, identities)
    for node, session in sessions.items():
        session.receive_shares(coordinator.inbox(node))
        assert session.stage == "shares-received"


def test_with_colluders_allowed_two_views_cannot_both_be_certified(tmp_path) -> None:
    """The attack a red-team found on 2026-12-07 against the view check: five sites at t 3, site 5
    colluding, signs view A (survivors 1, 2, 5) with sites 1 and 2 and view B (3, 4, 5) with 3 and 4 —
    two certified views, and every honest site's Δ alone. A site that allows c colluders refuses
    t ≤ (n + c)/2; the coordinator's t = ⌊(n + c)/2⌋ + 1 (4 of 5 at c = 1) leaves no two views three
    signers (the c colluders and 2t − n − c honest sites) could share, and the honest round still sums."""
    from fedpose.federation.secagg.site import Identity

    plain = _identities(5, tmp_path)
    identities = {n: Identity(i.key, i.peers, max_colluding=1) for n, i in plain.items()}
    lenient = CoordinatorSecAggRound(SETTINGS, "run", 1, list(range(1, 6)), 50)
    assert lenient.threshold == 3
    session, reply = start("site-1", lenient.setup(1), 50, identities[1])
    assert session is None and _reason(reply) == "settings-refused"  # t 3 ≤ (5 + 1)/2

    settings = SETTINGS.model_copy(update={"max_colluding_sites": 1})
    coordinator = CoordinatorSecAggRound(settings, "run", 1, list(range(1, 6)), 50)
    assert coordinator.threshold == 4
    sessions = _keys_shared(coordinator, identities)
    short = coordinator.inbox(1).model_copy(update={"shares": coordinator.inbox(1).shares[:3]})
    with pytest.raises(SecAggRefused, match="every key holder's must arrive"):  # colluders reveal all they hold
        SiteSecAggSession.from_json(sessions[1].to_json()).receive_shares(short)
    updates = _updates(5)
    for node, session in sessions.items():
        session.receive_shares(coordinator.inbox(node))
    coordinator.receive_masked({node: s.mask(updates[node]) for node, s in sessions.items()})
    view_a = protocol.SecAggViewRequest(run_id="run", round=1, survivors=[1, 2, 5], dropped=[3, 4])
    assert _reason(answer(SiteSecAggSession.from_json(sessions[1].to_json()), "site-1", view_a, identities[1])) == "below-threshold"
    _sign_view(coordinator, sessions, sessions, identities)
    request = coordinator.unmask_request()
    result = coordinator.unmask({node: answer(s, s.site_id, request, identities[node]) for node, s in sessions.items()})
    assert np.abs(result.total - sum(updates.values())).max() < result.error_bound
    with pytest.raises(RoundAbandoned, match="cannot hide an update"):  # 3 sites, c 3: t = 4 > n
        CoordinatorSecAggRound(SETTINGS.model_copy(update={"max_colluding_sites": 3}), "run", 1, [1, 2, 3], 50).check_collusion_bound()


@pytest.mark.parametrize(("members", "threshold", "smallest_safe"), [(3, 2, 3), (5, 3, 5), (5, 4, 4), (10, 6, 8), (16, 9, 14)])
def test_the_smallest_mask_set_a_site_accepts_is_where_the_counting_rules_isolation_out(
        members: int, threshold: int, smallest_safe: int) -> None:
    """m·(t − 1) > (N − 1)·(N − t): the other N − 1 sites can reveal at most N − t key shares each and
    the site itself m − t, fewer than the t for each of its m − 1 peers that stripping its masks takes."""
    from fedpose.federation.secagg.site import mask_set_isolates

    accepted = [m for m in range(threshold, members + 1) if not mask_set_isolates(m, threshold, members)]
    assert accepted == list(range(smallest_safe, members + 1))
    for m in range(threshold, members + 1):  # the bound is the counting: drop slots against drops needed
        slots = (members - 1) * (members - threshold) + (m - threshold)
        assert mask_set_isolates(m, threshold, members) == (slots >= (m - 1) * threshold)


def test_an_identity_must_be_the_one_its_peers_list(tmp_path) -> None:
    from fedpose.federation.config import SiteIdentityConfig
    from fedpose.federation.secagg.site import Identity

    identities = _identities(2, tmp_path)
    peers = dict(identities[1].peers)
    with pytest.raises(ValueError, match="not the one identity.peers lists"):
        Identity.from_config("site-1", SiteIdentityConfig(key=tmp_path / "site-2.pem", peers=peers))


def test_a_garbled_peer_key_is_refused_when_the_config_loads(tmp_path) -> None:
    """Not mid-round, as that peer's keys "unsigned": the site's config names the peer and the format."""
    from pydantic import ValidationError

    from fedpose.federation.config import SiteIdentityConfig

    (tmp_path / "site-1.pem").write_bytes(crypto.new_identity())
    good = crypto.identity_public_key(crypto.load_identity(tmp_path / "site-1.pem"))
    for garbled in (good[:-4], "not base64!", good + good):  # truncated, not base64, 64 bytes
        with pytest.raises(ValidationError, match=r"the keys of \['site-2'\] are not Ed25519 public keys"):
            SiteIdentityConfig(key=tmp_path / "site-1.pem", peers={"site-1": good, "site-2": garbled})
    SiteIdentityConfig(key=tmp_path / "site-1.pem", peers={"site-1": good, "site-2": good})  # well-formed: accepted
