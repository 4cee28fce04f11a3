"""A site's side of one secure-aggregation round: setup → share keys → masked vector → unmask.

One :class:`SiteSecAggSession` per (run, round), holding the round's secrets — two EC key pairs,
the self-mask seed, the shares peers sent — in memory only, for that round only. Each stage
method checks the coordinator's message and either answers or raises :class:`SecAggRefused`
with a fixed code (the caller sends :class:`~fedpose.federation.protocol.SecAggRefusal`).

Checks a site makes that Flower's ``secaggplus_mod`` does not:

* setup: threshold t > n/2 (so that no split of the sites into two views of "who dropped" can
  gather t seed shares and t key shares of one site: (t − 1) + t > n − 1), n ≥ 2 (a sum of one is
  the update), n ≤ n_max and n_max·(2^bits − 1) < M (no wrap-around), the model's vector length;
* share keys, with an identity (:class:`Identity`, the site's ``identity`` config): every key in
  the directory is signed by the identity its site id was given out of band, and no site id
  appears twice — a coordinator cannot put its own keys in a site's place or invent sites, which
  is what would let it gather the shares that unmask one site's Δ. The signature also covers the
  digest of the round's setup (:func:`setup_digest`: participants, threshold, encoding), checked
  against the site's own: every site of a round has the same t. Before 2026-12-07 it did not, and
  a coordinator could give one site a higher t than its peers — seven sites, the victim at t 5
  accepting a mask set of four peers, the others at t 4 — and recover that site's Δ alone with
  every other check passing (``tests/federation/test_secagg_core.py``);
* receive shares, with an identity: the site masks with the m − 1 peers whose shares reached it,
  and refuses a mask set too small for the federation's N identities (:func:`mask_set_isolates`).
  A coordinator that hands one site the shares of only a few peers, then tells every other site
  its own story of who dropped, needs t key shares of each of those peers (every other site
  reveals at most N − t key shares, the site itself m − t): possible only if
  m·(t − 1) ≤ (N − 1)·(N − t). Before 2026-12-06 nothing stopped it: five sites, t 3, a mask set
  of the site and two peers (6 ≤ 8) unmasked the site's Δ alone with every other check passing
  (``tests/federation/test_secagg_core.py``);
* view (the consistency check of Bonawitz et al.): the site signs, once, the view of who survived
  that it is shown; with an identity it then answers an unmask request only for that same view and
  only when t surviving sites' signatures of it come with the request. Each site signs one view and
  t > n/2, so no two views can both be certified: every site that reveals shares reveals them for
  one view. Before 2026-12-07 there was no such check, and a coordinator showing each site its own
  view — the victims surviving in every view, each other site dropped in at least t views — rebuilt
  the victims' seeds and every other site's key, and with them the sum of two sites' updates (five
  or seven sites), every per-site check passing (``tests/federation/test_secagg_core.py``);
* unmask, **SecAgg's security rule**: for one peer the site reveals the share of its mask seed
  (peer survived) or of its secret key (peer dropped), never both — in one request or over
  several (it answers one unmask request per round); a node outside the round, the site itself
  listed as dropped, or fewer survivors than t is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel, ConfigDict

from fedpose.federation import protocol
from fedpose.federation.config import SiteIdentityConfig
from fedpose.federation.secagg import crypto
from fedpose.federation.secagg.quantization import WIRE_DTYPE, Quantizer, wire_dtype

log = logging.getLogger(__name__)


class SecAggRefused(Exception):
    """The site refuses a stage request; ``code`` is what goes on the wire."""

    def __init__(self, code: protocol.SecAggRefusalCode, detail: str):
        super().__init__(f"{code}: {detail}")
        self.code = code


@dataclass(frozen=True)
class Identity:
    """A site's long-term signing key and its peers' public keys (site id → base64 Ed25519)."""

    key: Ed25519PrivateKey
    peers: Mapping[str, str]
    max_colluding: int = 0  #: c: other sites that may collude with the coordinator (the site's own config)

    @classmethod
    def from_config(cls, site_id: str, config: SiteIdentityConfig | None) -> "Identity | None":
        """The configured identity, its key checked against the site's own entry in the peer list."""
        if config is None:
            return None
        key = crypto.load_identity(config.key)
        if crypto.identity_public_key(key) != config.peers.get(site_id):
            raise ValueError(f"site '{site_id}': the key in {config.key} is not the one identity.peers lists for this site")
        return cls(key, dict(config.peers), config.max_colluding_sites)


def mask_set_isolates(mask_set: int, threshold: int, members: int) -> bool:
    """Whether a coordinator could unmask alone a site that masks with ``mask_set`` − 1 peers (m,
    itself included) of ``members`` sites (N) at threshold t: by counting (module docstring), only
    when m·(t − 1) ≤ (N − 1)·(N − t). Every site in the mask set (m = N, t > N/2): never."""
    return mask_set * (threshold - 1) <= (members - 1) * (members - threshold)


def setup_digest(setup: protocol.SecAggSetup) -> str:
    """The digest of what every site of a round must be told alike: the setup without the receiving
    node (each site's own). Signed with the site's keys (crypto.key_statement)."""
    return crypto.settings_digest(setup.model_dump(mode="json", exclude={"node", "kind"}))


def threshold_for(sites: int, colluding: int = 0) -> int:
    """t = ⌊(n + c)/2⌋ + 1: the smallest threshold sites allowing c colluders accept (t > (n + c)/2:
    two sets of t signers of a view share more than c sites, so the colluders cannot certify two)."""
    return (sites + colluding) // 2 + 1


def quantizer_of(setup: protocol.SecAggSetup) -> Quantizer:
    """The round's encoding: range R = W·r on w·Δ."""
    return Quantizer(setup.clip_range * setup.max_weight, setup.bits, setup.modulus_bits, setup.max_sites)


class SessionState(BaseModel):
    """A session as the site keeps it between messages (Flower starts a ClientApp process per message:
    the SuperNode holds this in its memory, ``context.state``, for the round). Site-internal: never sent."""

    model_config = ConfigDict(extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")

    site_id: str
    setup: protocol.SecAggSetup
    stage: str
    mask_private: bytes
    share_private: bytes
    peers: list[protocol.NodeKeys]
    seed: bytes
    seed_shares: dict[int, bytes]
    key_shares: dict[int, bytes]
    mask_with: list[int]
    #: N, the sites that could reveal shares: the round's participants listed in its identity config (None: no identity)
    members: int | None = None
    #: the view of who survived the site signed (stage 4a): (survivors, dropped); None before
    view: tuple[list[int], list[int]] | None = None
    #: c, colluding sites the site allows (its identity config)
    colluding: int = 0


class SiteSecAggSession:
    """One site's secure-aggregation state for one round (see the module docstring)."""

    def __init__(self, site_id: str, setup: protocol.SecAggSetup, vector_length: int | None = None, colluding: int = 0):
        """Stage 1: check the setup (``vector_length``: the site's own count of trainable parameters,
        when it knows it already; ``colluding``: c, its identity's max_colluding_sites) and make the
        round's key pairs."""
        self.site_id = site_id
        self.setup = setup
        self._colluding = colluding
        n = len(setup.participants)
        if n < 2:
            self._refuse("settings-refused", f"{n} participant: a secure sum of one site is its update")
        if 2 * setup.threshold <= n + colluding:
            self._refuse("settings-refused", f"threshold {setup.threshold} ≤ (n + c)/2 = {(n + colluding) / 2:g} "
                                             f"(n = {n} sites, c = {colluding} colluding sites allowed)")
        if n > setup.max_sites:
            self._refuse("settings-refused", f"{n} participants > max_sites {setup.max_sites}")
        try:
            self.quantizer = quantizer_of(setup)
        except ValueError as exc:
            self._refuse("settings-refused", str(exc))
        if vector_length is not None and vector_length != setup.vector_length:
            self._refuse("settings-refused", f"vector length {setup.vector_length}, the model has {vector_length}")
        self._mask_pair = crypto.new_key_pair()  # c: pairwise masks
        self._share_pair = crypto.new_key_pair()  # s: share encryption
        self._stage = "keys-sent"
        self._peers: dict[int, protocol.NodeKeys] = {}
        self._seed = b""
        self._seed_shares: dict[int, bytes] = {}  # node → its share of that node's self-mask seed, held here
        self._key_shares: dict[int, bytes] = {}  # node → its share of that node's mask secret key, held here
        self._mask_with: list[int] = []
        self._members: int | None = None
        self._view: tuple[list[int], list[int]] | None = None

    @property
    def node(self) -> int:
        return self.setup.node

    @property
    def stage(self) -> str:
        return self._stage

    def to_json(self) -> str:
        """The session's state, secrets included (for the site's own memory between messages)."""
        return SessionState(site_id=self.site_id, setup=self.setup, stage=self._stage,
                            mask_private=self._mask_pair.private_bytes(), share_private=self._share_pair.private_bytes(),
                            peers=list(self._peers.values()), seed=self._seed, seed_shares=self._seed_shares,
                            key_shares=self._key_shares, mask_with=self._mask_with,
                            members=self._members, view=self._view, colluding=self._colluding).model_dump_json()

    @classmethod
    def from_json(cls, raw: str) -> "SiteSecAggSession":
        state = SessionState.model_validate_json(raw)
        session = cls.__new__(cls)
        session.site_id, session.setup, session._stage = state.site_id, state.setup, state.stage
        session.quantizer = quantizer_of(state.setup)
        session._mask_pair = crypto.key_pair_from_private(state.mask_private)
        session._share_pair = crypto.key_pair_from_private(state.share_private)
        session._peers = {entry.node: entry for entry in state.peers}
        session._seed, session._seed_shares, session._key_shares = state.seed, dict(state.seed_shares), dict(state.key_shares)
        session._mask_with = list(state.mask_with)
        session._members = state.members
        session._view = (list(state.view[0]), list(state.view[1])) if state.view is not None else None
        session._colluding = state.colluding
        return session

    def _refuse(self, code: protocol.SecAggRefusalCode, detail: str) -> None:
        log.warning("site %s round %d: secure aggregation refused (%s): %s", self.site_id, self.setup.round, code, detail)
        self._stage = "refused"
        raise SecAggRefused(code, detail)

    def _expect(self, stage: str, message: protocol.SecAggKeyDirectory | protocol.SecAggShareInbox | protocol.SecAggUnmaskRequest) -> None:
        if (message.run_id, message.round) != (self.setup.run_id, self.setup.round):
            self._refuse("out-of-order", f"message for ({message.run_id}, round {message.round}) in round {self.setup.round}")
        if self._stage != stage:
            self._refuse("out-of-order", f"{message.kind} while the session is at '{self._stage}'")

    def public_keys(self, identity: Identity | None = None) -> protocol.SecAggPublicKeys:
        """The round's public keys, signed by ``identity`` when the site has one."""
        signature = None
        if identity is not None:
            signature = crypto.sign_keys(identity.key, crypto.key_statement(
                self.setup.run_id, self.setup.round, self.node, self.site_id, self._mask_pair.public, self._share_pair.public,
                setup_digest(self.setup)))
        return protocol.SecAggPublicKeys(site_id=self.site_id, run_id=self.setup.run_id, round=self.setup.round,
                                         mask_key=self._mask_pair.public, share_key=self._share_pair.public, signature=signature)

    def _check_signatures(self, directory: protocol.SecAggKeyDirectory, identity: Identity) -> None:
        """Every entry signed by the listed identity of the site it names; each site once, this one at its own node."""
        site_ids = [entry.site_id for entry in directory.keys]
        if len(set(site_ids)) != len(site_ids):
            self._refuse("unsigned-keys", "a site id appears twice in the key directory")
        for entry in directory.keys:
            public = identity.peers.get(entry.site_id) if entry.site_id is not None else None
            if public is None or entry.signature is None:
                self._refuse("unsigned-keys", f"node {entry.node}: site {entry.site_id!r} is not in identity.peers, or unsigned")
            statement = crypto.key_statement(self.setup.run_id, self.setup.round, entry.node, entry.site_id,
                                             entry.mask_key, entry.share_key, setup_digest(self.setup))
            if not crypto.verify_keys(public, entry.signature, statement):
                self._refuse("unsigned-keys", f"node {entry.node}: the keys are not signed by site {entry.site_id!r} "
                             "for this round's setup (another identity, or a setup unlike this site's)")
            if (entry.site_id == self.site_id) != (entry.node == self.node):
                self._refuse("unsigned-keys", f"node {entry.node}: this site's id at another node, or another's at its own")

    # -- stage 2 ---------------------------------------------------------------------------------------
    def share_keys(self, directory: protocol.SecAggKeyDirectory, identity: Identity | None = None) -> protocol.SecAggEncryptedShares:
        """Check the key directory (its signatures too, with an ``identity``), draw the self-mask seed,
        share it and the mask secret key (t of n), and encrypt each peer's pair of shares to that peer."""
        self._expect("keys-sent", directory)
        if identity is not None:
            self._check_signatures(directory, identity)
            # who could reveal shares: the round's participants (the signed setup digest gives every site
            # the same list) that hold an identity — never more than the federation's N
            self._members = min(len(identity.peers), len(self.setup.participants))
        entries = {entry.node: entry for entry in directory.keys}
        if len(entries) != len(directory.keys) or not set(entries) <= set(self.setup.participants):
            self._refuse("inconsistent-keys", "repeated nodes, or nodes outside the round")
        own = entries.get(self.node)
        if own is None or (own.mask_key, own.share_key) != (self._mask_pair.public, self._share_pair.public):
            self._refuse("inconsistent-keys", "the directory does not hold this site's own keys")
        keys = [k for e in directory.keys for k in (e.mask_key, e.share_key)]
        if len(set(keys)) != len(keys):
            self._refuse("inconsistent-keys", "a public key appears twice")
        if len(entries) < self.setup.threshold:
            self._refuse("inconsistent-keys", f"{len(entries)} sites < threshold {self.setup.threshold}")
        for entry in directory.keys:
            try:
                crypto.check_public_key(entry.mask_key)
                crypto.check_public_key(entry.share_key)
            except ValueError:
                self._refuse("inconsistent-keys", f"node {entry.node}: not a P-384 public key")
        self._peers = entries
        self._seed = crypto.new_seed()
        nodes = sorted(entries)
        seed_shares = crypto.create_shares(self._seed, self.setup.threshold, len(nodes))
        key_shares = crypto.create_shares(self._mask_pair.private_bytes(), self.setup.threshold, len(nodes))
        sealed = []
        for node, seed_share, key_share in zip(nodes, seed_shares, key_shares, strict=True):
            if node == self.node:
                self._seed_shares[node], self._key_shares[node] = seed_share, key_share
                continue
            key = self._share_pair.agree(entries[node].share_key)
            sealed.append(protocol.EncryptedShare(peer=node, ciphertext=crypto.seal_share_pair(key, self.node, node, seed_share, key_share)))
        self._stage = "shares-sent"
        return protocol.SecAggEncryptedShares(site_id=self.site_id, run_id=self.setup.run_id, round=self.setup.round, shares=sealed)

    # -- stage 3 ---------------------------------------------------------------------------------------
    def receive_shares(self, inbox: protocol.SecAggShareInbox) -> None:
        """Decrypt and authenticate the shares peers sent; before any training, so a bad inbox costs nothing."""
        self._expect("shares-sent", inbox)
        sources = [share.peer for share in inbox.shares]
        if len(set(sources)) != len(sources) or self.node in sources or not set(sources) <= set(self._peers):
            self._refuse("inconsistent-shares", "repeated sources, the site itself, or sources outside the key directory")
        if len(sources) + 1 < self.setup.threshold:
            self._refuse("inconsistent-shares", f"{len(sources) + 1} sites < threshold {self.setup.threshold}")
        if self._colluding and len(sources) + 1 < len(self._peers):  # colluders reveal all they hold: mask with everyone
            self._refuse("inconsistent-shares", f"shares from {len(sources)} of {len(self._peers) - 1} peers: with "
                                                f"{self._colluding} colluding sites allowed, every key holder's must arrive")
        if self._members is not None and mask_set_isolates(len(sources) + 1, self.setup.threshold, self._members):
            self._refuse("inconsistent-shares", f"shares from {len(sources)} peers: a mask set of {len(sources) + 1} of "
                                                f"{self._members} sites at threshold {self.setup.threshold} could be unmasked alone")
        for share in inbox.shares:
            try:
                src, dst, seed_share, key_share = crypto.open_share_pair(
                    self._share_pair.agree(self._peers[share.peer].share_key), share.ciphertext)
            except Exception:  # noqa: BLE001 - a forged or garbled token; the class of failure is all that matters
                self._refuse("inconsistent-shares", f"the share from node {share.peer} does not decrypt")
            if (src, dst) != (share.peer, self.node):
                self._refuse("inconsistent-shares", f"the share from node {share.peer} names {src} → {dst}")
            self._seed_shares[src], self._key_shares[src] = seed_share, key_share
        self._mask_with = sorted(sources)
        self._stage = "shares-received"

    def mask(self, update: np.ndarray, weight: float = 1.0) -> np.ndarray:
        """Clip Δ (flattened, already checked by the site) to [−r, r] per coordinate, weight it by the
        site's declared w, quantize it (range W·r) and add the self mask and the pairwise masks
        modulo M: the masked vector (uint32 for M ≤ 2^32, else uint64)."""
        if self._stage != "shares-received":
            self._refuse("out-of-order", f"masking while the session is at '{self._stage}'")
        flat = np.asarray(update, dtype=np.float64).reshape(-1)
        if flat.size != self.setup.vector_length:
            raise ValueError(f"secure aggregation: update has {flat.size} values, the round's vector {self.setup.vector_length}")
        r = self.setup.clip_range
        vector = self.quantizer.quantize(np.clip(flat, -r, r) * float(weight))  # w > W is clipped again to ±W·r
        m = self.setup.modulus_bits
        vector += crypto.mask(self._seed, flat.size, m)
        for peer in self._mask_with:
            pairwise = crypto.mask(self._mask_pair.agree(self._peers[peer].mask_key), flat.size, m)
            if self.node > peer:  # Flower's sign convention: the larger node id adds, the smaller subtracts
                vector += pairwise
            else:
                vector -= pairwise  # uint64 wraps modulo 2^64, a multiple of M
        vector &= WIRE_DTYPE(2**m - 1)
        self._stage = "masked"
        return vector.astype(wire_dtype(m))

    # -- stage 4 ---------------------------------------------------------------------------------------
    def sign_view(self, request: protocol.SecAggViewRequest, identity: Identity | None = None) -> protocol.SecAggViewSignature:
        """Stage 4a, the consistency check: sign the view of who survived (with ``identity``; without
        one the coordinator is trusted and the signature is None), once per round."""
        self._expect("masked", request)  # only a site whose vector is in the sum helps unmask it
        self._check_view(request.survivors, request.dropped)
        self._view = (sorted(request.survivors), sorted(request.dropped))
        self._stage = "view-signed"  # one view per round: a second (another story of who dropped) is refused
        signature = None
        if identity is not None:
            signature = crypto.sign_keys(identity.key, crypto.view_statement(
                self.setup.run_id, self.setup.round, setup_digest(self.setup), *self._view))
        return protocol.SecAggViewSignature(site_id=self.site_id, run_id=self.setup.run_id, round=self.setup.round,
                                            signature=signature)

    def _check_view_signatures(self, request: protocol.SecAggUnmaskRequest, identity: Identity) -> None:
        """At least t survivors signed this very view: as each site signs one view and t > n/2, no
        two views can both be certified, so every site that answers reveals shares for the same one."""
        statement = crypto.view_statement(self.setup.run_id, self.setup.round, setup_digest(self.setup),
                                          request.survivors, request.dropped)
        signers = set()
        for entry in request.view_signatures:
            keys = self._peers.get(entry.node)
            public = identity.peers.get(keys.site_id) if keys is not None and keys.site_id is not None else None
            if entry.node in request.survivors and public is not None and crypto.verify_keys(public, entry.signature, statement):
                signers.add(entry.node)
        if len(signers) < self.setup.threshold:
            self._refuse("inconsistent-view", f"{len(signers)} surviving sites signed this view < threshold {self.setup.threshold}")

    def unmask(self, request: protocol.SecAggUnmaskRequest, identity: Identity | None = None) -> protocol.SecAggUnmaskShares:
        """The shares asked for, under the security rule (module docstring), for the view the site
        signed and, with an identity, t survivors signed too. Answers once per round."""
        self._expect("view-signed", request)
        if (sorted(request.survivors), sorted(request.dropped)) != self._view:
            self._refuse("inconsistent-view", "the request's view of who survived is not the one this site signed")
        if identity is not None:
            self._check_view_signatures(request, identity)
        survivors, dropped = set(request.survivors), set(request.dropped)
        self._stage = "unmasked"  # one answer per round: a second request (another view of who dropped) is refused
        shares = protocol.SecAggUnmaskShares(
            site_id=self.site_id, run_id=self.setup.run_id, round=self.setup.round,
            seed_shares=[protocol.NodeShare(node=n, share=self._seed_shares[n]) for n in sorted(survivors)],
            key_shares=[protocol.NodeShare(node=n, share=self._key_shares[n]) for n in sorted(dropped)])
        self._forget()
        return shares

    def _check_view(self, survivor_list: list[int], dropped_list: list[int]) -> None:
        survivors, dropped = set(survivor_list), set(dropped_list)
        if len(survivors) != len(survivor_list) or len(dropped) != len(dropped_list):
            self._refuse("unknown-node", "a node is listed twice")
        both = survivors & dropped
        if both:
            self._refuse("both-shares-of-one-peer", f"nodes {sorted(both)} listed as survivor and dropped")
        held = set(self._mask_with) | {self.node}
        unknown = (survivors | dropped) - held
        if unknown:
            self._refuse("unknown-node", f"nodes {sorted(unknown)} sent this site no shares this round")
        if self.node in dropped:
            self._refuse("own-key-share", "the site itself is listed as dropped")
        if self.node not in survivors:
            self._refuse("own-key-share", "the site sent its vector but is not listed as a survivor")
        if len(survivors) < self.setup.threshold:
            self._refuse("below-threshold", f"{len(survivors)} survivors < threshold {self.setup.threshold}")

    def _forget(self) -> None:
        """Drop the round's secrets (Python cannot wipe memory; this ends the references)."""
        self._seed = b""
        self._seed_shares.clear()
        self._key_shares.clear()


def refusal(site_id: str, run_id: str, round_id: int, refused: SecAggRefused) -> protocol.SecAggRefusal:
    return protocol.SecAggRefusal(site_id=site_id, run_id=run_id, round=round_id, reason=refused.code)


def answer(session: SiteSecAggSession | None, site_id: str,
           message: protocol.SecAggKeyDirectory | protocol.SecAggViewRequest | protocol.SecAggUnmaskRequest,
           identity: Identity | None = None) -> protocol.SecAggSiteMessage:
    """The session's reply to a stage-2 or stage-4 message, a refusal when it refuses (or has no session)."""
    try:
        if session is None:
            raise SecAggRefused("out-of-order", "no secure-aggregation session for this round")
        if isinstance(message, protocol.SecAggKeyDirectory):
            return session.share_keys(message, identity)
        if isinstance(message, protocol.SecAggViewRequest):
            return session.sign_view(message, identity)
        return session.unmask(message, identity)
    except SecAggRefused as refused:
        return refusal(site_id, message.run_id, message.round, refused)


def start(site_id: str, setup: protocol.SecAggSetup, vector_length: int | None = None, identity: Identity | None = None,
          ) -> tuple[SiteSecAggSession | None, protocol.SecAggSiteMessage]:
    """Stage 1: a new session and its public keys (signed with ``identity``), or a refusal."""
    try:
        session = SiteSecAggSession(site_id, setup, vector_length, identity.max_colluding if identity is not None else 0)
    except SecAggRefused as refused:
        return None, refusal(site_id, setup.run_id, setup.round, refused)
    return session, session.public_keys(identity)


