"""The coordinator's side of one secure-aggregation round: route keys and shares, unmask the sum.

The graph is the **full graph** (SecAgg+ with k = n − 1, i.e. Bonawitz et al.'s SecAgg): every pair
of sites shares a pairwise mask. SecAgg+'s sparse k-regular graph (Bell et al. 2020) cuts a site's
work from O(n) to O(log n) peers, which matters at thousands of phones; a federation of hospitals
has tens of sites, where the full graph costs a few key agreements per site and keeps the
simplest security argument (any two honest sites' masks cancel only in the full sum).

Sets, as in the paper: U1 answered the setup with keys, U2 sent their encrypted shares, U3 sent a
masked vector (the survivors), U4 signed the view of who survived (the consistency check: sites
with identities unmask only a view t survivors signed), U5 answered the unmask request. Each must hold at least t =
⌊n/2⌋ + 1 sites (n = sites asked), else the round is **abandoned**: nothing is unmasked, nothing
aggregated. Sites in U2 \\ U3 (dropped after sharing keys: offline, refused, failed) are the
dropped: their pairwise masks are removed with their secret keys, rebuilt from t key shares; each
survivor's self mask with its seed, rebuilt from t seed shares. What the coordinator learns is
Σ_{i∈U3} q_i mod M, which is the integer sum (no wrap-around: see ``quantization``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from fedpose.federation import protocol
from fedpose.federation.config import SecureAggregationConfig
from fedpose.federation.secagg import crypto
from fedpose.federation.secagg.quantization import WIRE_DTYPE, Quantizer, wire_dtype
from fedpose.federation.secagg.site import threshold_for


class RoundAbandoned(Exception):
    """Too few sites remain for the secure sum (the message says at which stage)."""


@dataclass
class SecureSum:
    """The unmasked result: Σ over the survivors of the quantized w·Δ, dequantized."""

    total: np.ndarray  #: float64, Σ_i x̂_i with x̂_i ≈ clip(w_i·Δ_i)
    survivors: list[int]
    dropped: list[int]
    error_bound: float  #: per-coordinate bound on |total − Σ clip(w_i·Δ_i)|


@dataclass
class CoordinatorSecAggRound:
    """One round's secure aggregation at the coordinator (module docstring)."""

    settings: SecureAggregationConfig
    run_id: str
    round: int
    participants: list[int]
    vector_length: int
    update_norm_bound: float | None = None
    keys: dict[int, protocol.NodeKeys] = field(default_factory=dict)  #: U1
    sealed: dict[int, dict[int, bytes]] = field(default_factory=dict)  #: U2: src → dst → ciphertext
    masked: dict[int, np.ndarray] = field(default_factory=dict)  #: U3
    view_signatures: dict[int, bytes | None] = field(default_factory=dict)  #: U3 members that signed the view (4a)
    refusals: dict[int, protocol.SecAggRefusal] = field(default_factory=dict)
    bytes: int = 0  #: stage messages both ways (setup, share keys, unmask), counted by the caller
    abandoned: str = ""  #: why the round was abandoned ('' while it is not)
    survivors: int = 0  #: sites whose vectors are in the unmasked sum
    error_bound: float = 0.0  #: per-coordinate bound on the mean's quantization error (set by the caller)
    mean_norm: float | None = None  #: ‖mean update‖₂ after unmasking (set by the caller)

    def __post_init__(self) -> None:
        self.participants = sorted(set(self.participants))
        if len(self.participants) > self.settings.max_sites:
            raise ValueError(f"secure aggregation: {len(self.participants)} sites selected > "
                             f"coordinator.secure_aggregation.max_sites = {self.settings.max_sites} (the overflow bound's n)")
        self.threshold = threshold_for(len(self.participants), self.settings.max_colluding_sites)
        self.quantizer = Quantizer(self.settings.clip_range * self.settings.max_weight, self.settings.bits,
                                   self.settings.modulus_bits, self.settings.max_sites)

    def _enough(self, count: int, stage: str) -> None:
        if count < self.threshold:
            # the refusals say why: without them, sites refusing a (buggy or malicious) request read as lost sites
            refused: dict[str, list[str]] = {}
            for refusal in self.refusals.values():
                refused.setdefault(refusal.reason, []).append(refusal.site_id)
            why = "".join(f"; refused by {', '.join(sorted(sites))} ({reason})" for reason, sites in sorted(refused.items()))
            raise RoundAbandoned(f"{count} of {len(self.participants)} sites after {stage} < threshold t = {self.threshold}{why}")

    def _note_refusal(self, node: int, message: protocol.SecAggSiteMessage) -> bool:
        if isinstance(message, protocol.SecAggRefusal):
            self.refusals[node] = message
            return True
        return False

    # -- stage 1 ---------------------------------------------------------------------------------------
    def check_collusion_bound(self) -> None:
        """Before any setup: with c colluders allowed, t = ⌊(n + c)/2⌋ + 1 may exceed the n sites selected."""
        if self.threshold > len(self.participants):
            raise RoundAbandoned(f"{len(self.participants)} sites cannot hide an update from a coordinator colluding with "
                                 f"{self.settings.max_colluding_sites} of them (threshold {self.threshold}); lower "
                                 "secure_aggregation.max_colluding_sites or select more sites")

    def setup(self, node: int) -> protocol.SecAggSetup:
        s = self.settings
        return protocol.SecAggSetup(run_id=self.run_id, round=self.round, node=node, participants=self.participants,
                                    threshold=self.threshold, clip_range=s.clip_range, max_weight=s.max_weight, bits=s.bits,
                                    modulus_bits=s.modulus_bits, max_sites=s.max_sites, vector_length=self.vector_length,
                                    update_norm_bound=self.update_norm_bound)

    def receive_public_keys(self, replies: Mapping[int, protocol.SecAggSiteMessage]) -> None:
        for node, message in replies.items():
            if node not in self.participants or self._note_refusal(node, message):
                continue
            if isinstance(message, protocol.SecAggPublicKeys) and (message.run_id, message.round) == (self.run_id, self.round):
                self.keys[node] = protocol.NodeKeys(node=node, mask_key=message.mask_key, share_key=message.share_key,
                                                    site_id=message.site_id, signature=message.signature)
        # a key two nodes claim is dropped for both (the sites would refuse the directory)
        seen: dict[bytes, list[int]] = {}
        for node, entry in self.keys.items():
            for key in (entry.mask_key, entry.share_key):
                seen.setdefault(key, []).append(node)
        for nodes in seen.values():
            if len(nodes) > 1:
                for node in nodes:
                    self.keys.pop(node, None)
        self._enough(len(self.keys), "setup")

    # -- stage 2 ---------------------------------------------------------------------------------------
    def key_directory(self) -> protocol.SecAggKeyDirectory:
        return protocol.SecAggKeyDirectory(run_id=self.run_id, round=self.round, keys=[self.keys[n] for n in sorted(self.keys)])

    def receive_shares(self, replies: Mapping[int, protocol.SecAggSiteMessage]) -> None:
        for node, message in replies.items():
            if node not in self.keys or self._note_refusal(node, message):
                continue
            if not isinstance(message, protocol.SecAggEncryptedShares) or (message.run_id, message.round) != (self.run_id, self.round):
                continue
            destinations = {share.peer: share.ciphertext for share in message.shares}
            if set(destinations) != set(self.keys) - {node} or len(destinations) != len(message.shares):
                continue  # a site must share with every other key holder; one that did not is left out
            self.sealed[node] = destinations
        self._enough(len(self.sealed), "share keys")

    # -- stage 3 ---------------------------------------------------------------------------------------
    def inbox(self, node: int) -> protocol.SecAggShareInbox:
        """What ``node`` (in U2) receives with its train instruction: every other U2 member's share for it."""
        return protocol.SecAggShareInbox(run_id=self.run_id, round=self.round, shares=[
            protocol.EncryptedShare(peer=src, ciphertext=by_dst[node]) for src, by_dst in sorted(self.sealed.items()) if src != node])

    def receive_masked(self, vectors: Mapping[int, np.ndarray]) -> None:
        """The masked vectors that arrived (a wrong shape or dtype counts as no vector: a dropout)."""
        for node, vector in vectors.items():
            if node in self.sealed and isinstance(vector, np.ndarray) and vector.dtype == wire_dtype(self.settings.modulus_bits) \
                    and vector.shape == (self.vector_length,) and (vector.size == 0 or int(vector.max()) < self.quantizer.modulus):
                self.masked[node] = vector.astype(WIRE_DTYPE)
        self._enough(len(self.masked), "masking")

    # -- stage 4 ---------------------------------------------------------------------------------------
    def view_request(self) -> protocol.SecAggViewRequest:
        """4a, the consistency check: every survivor is shown the same view and signs it."""
        return protocol.SecAggViewRequest(run_id=self.run_id, round=self.round, survivors=sorted(self.masked),
                                          dropped=sorted(set(self.sealed) - set(self.masked)))

    def receive_view_signatures(self, replies: Mapping[int, protocol.SecAggSiteMessage]) -> None:
        for node, message in replies.items():
            if node not in self.masked or self._note_refusal(node, message):
                continue
            if isinstance(message, protocol.SecAggViewSignature) and (message.run_id, message.round) == (self.run_id, self.round):
                self.view_signatures[node] = message.signature
        self._enough(len(self.view_signatures), "the view check")

    def unmask_request(self) -> protocol.SecAggUnmaskRequest:
        """4b: the view, with the signatures of it the survivors sent (sites with identities check t of them)."""
        view = self.view_request()
        return protocol.SecAggUnmaskRequest(run_id=self.run_id, round=self.round, survivors=view.survivors, dropped=view.dropped,
                                            view_signatures=[protocol.NodeSignature(node=n, signature=sig)
                                                             for n, sig in sorted(self.view_signatures.items()) if sig is not None])

    def unmask(self, replies: Mapping[int, protocol.SecAggSiteMessage]) -> SecureSum:
        """Rebuild the survivors' seeds and the dropped sites' mask keys from t shares each; the sum."""
        request = self.unmask_request()
        seed_shares: dict[int, list[bytes]] = {n: [] for n in request.survivors}
        key_shares: dict[int, list[bytes]] = {n: [] for n in request.dropped}
        answered = 0
        for node, message in replies.items():
            if node not in self.view_signatures or self._note_refusal(node, message):
                continue
            if not isinstance(message, protocol.SecAggUnmaskShares) or (message.run_id, message.round) != (self.run_id, self.round):
                continue
            if {s.node for s in message.seed_shares} != set(seed_shares) or {s.node for s in message.key_shares} != set(key_shares):
                continue
            answered += 1
            for share in message.seed_shares:
                seed_shares[share.node].append(share.share)
            for share in message.key_shares:
                key_shares[share.node].append(share.share)
        self._enough(answered, "unmasking")
        m = self.settings.modulus_bits
        total = np.zeros(self.vector_length, dtype=WIRE_DTYPE)
        for vector in self.masked.values():
            total += vector
        for node, shares in seed_shares.items():
            total -= crypto.mask(crypto.combine_shares(shares[: self.threshold]), self.vector_length, m)
        for dropped, shares in key_shares.items():
            pair = crypto.key_pair_from_private(crypto.combine_shares(shares[: self.threshold]))
            for survivor in request.survivors:
                pairwise = crypto.mask(pair.agree(self.keys[survivor].mask_key), self.vector_length, m)
                if survivor > dropped:  # the survivor added it: take it off; else it subtracted: put it back
                    total -= pairwise
                else:
                    total += pairwise
        total &= WIRE_DTYPE(2**m - 1)
        n = len(request.survivors)
        return SecureSum(self.quantizer.dequantize_sum(total, n), request.survivors, request.dropped, self.quantizer.error_bound(n))
