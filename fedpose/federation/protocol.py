"""The round protocol between coordinator and sites (Flower-free): the one typed definition of
what each side sends.

Coordinator → site, message type ``train``:
  ``global``        ArrayRecord: every tensor of the global model's state dict (name → array)
  ``basis``         ArrayRecord + ``basis-config`` ConfigRecord, only when the site lacks the
                    current basis version (pdp / fpdp): V itself, or a compact recipe
  ``config``        ConfigRecord with one key, ``instruction``: a :class:`TrainInstruction` as JSON

Site → coordinator — the reply, and nothing else ever leaves a site:
  ``update``        ArrayRecord: Δ = w_local − w_global of the trainable parameters (status "ok" only)
  ``reply``         ConfigRecord with one key, ``reply``: a :class:`SiteReply` as JSON

Under secure aggregation (``coordinator.secure_aggregation``; the stage messages are at the end of
this module) a train message also carries the ``secagg`` record (the site's share inbox) and its
"ok" reply carries ``masked`` (the clipped, quantized, masked Δ) instead of ``update``; the setup,
share-keys and unmask stages are ``query.secagg`` messages whose replies hold one ``secagg`` record.

Every field of :class:`SiteReply` says in a comment why it may leave the site. The rule: Δ is
the output of the privacy mechanism; everything else is a function of public values only (the
site's declared σ, q, C, δ, ε_max and step counts, the coordinator's own instruction), so the
coordinator learns nothing about a patient from it. In particular no loss or other statistic of
private data, no dataset size (q is declared, see ``privacy.sample_rate``), and no free text:
reasons are fixed codes, errors carry only their class name (details stay in the site's local
log). ``sites/egress.py`` checks every outgoing message against this schema.

The number of units N is therefore released only through Δ, where it is protected exactly like
any other statistic of the data — by the ε, no more: a coordinator that crafts the global model
so that every unit's clipped gradient points one known way reads N off one Δ within that ε. A
reply's timing (its arrival, Flower's ``created_at``): every DP step has a fixed shape
(:mod:`fedpose.privacy.fixed_shape`), so the steps' rows are a function of declared settings only,
and each row warps its record's canonical window (:mod:`fedpose.data.canonical`: one fixed shape for
every record, decoded before the first step, the input size pinned), so the steps cost the same
whatever the image files; the work outside the steps (reading annotations, checking the files, the
unit index, and once the window build) grows with N — a timing side channel outside the DP
guarantee that the site's reply hold (``reply_after_s``) hides (docs/privacy.md). The declared q and
step shape fix, in public, the N for which the steps' timing stays data-independent (N ≤ N_max in
the privacy report); a larger site trains under the same (ε, δ), warned in its local log only, so
no reply field or status depends on whether N is beyond it.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedpose.config import ModelSpec, validation_problems

MESSAGE_TYPE_TRAIN = "train"

GLOBAL_RECORD = "global"
BASIS_RECORD = "basis"
BASIS_CONFIG_RECORD = "basis-config"
CONFIG_RECORD = "config"
UPDATE_RECORD = "update"
REPLY_RECORD = "reply"
REPLY_KEY = "reply"
INSTRUCTION_KEY = "instruction"

#: every record name a site may send (the egress guard rejects anything else)
SITE_REPLY_RECORDS = frozenset({UPDATE_RECORD, REPLY_RECORD})

ReplyStatus = Literal["ok", "refused", "replayed", "failed", "error"]

#: Why a reply carries no fresh update. Fixed codes with fixed texts: a free-form reason could
#: carry a private value (a loss, a path, a record id) past the egress guard.
ReasonCode = Literal["budget-exhausted", "behind-federation-record", "resent-earlier-release", "no-earlier-release",
                     "training-diverged", "site-error", "secure-aggregation-required", "secure-aggregation-refused",
                     "secure-aggregation-no-resend", "update-out-of-bounds"]
REASON_TEXT: dict[str, str] = {
    "budget-exhausted": "the site's planned steps would pass its ε_max; nothing was spent",
    "behind-federation-record": ("the site's budget state lacks spends the coordinator's ledger has on record for it "
                                 "(restored, rolled back or lost state); it refused before any data work, nothing was "
                                 "spent — its operator must restore or adopt the record (docs/site-state.md)"),
    "resent-earlier-release": "round already spent; the site re-sent the update it released then (no new privacy cost)",
    "no-earlier-release": "round already spent and no released update is kept; no second release",
    "training-diverged": "local training diverged (non-finite weights); the spend is recorded, nothing released",
    "site-error": "the site's ClientApp failed; details are in the site's local log",
    "secure-aggregation-required": "the site requires secure aggregation and this round would send its update in the "
                                   "clear; it refused before any data work, nothing was spent",
    "secure-aggregation-refused": "the site refused the round's secure-aggregation messages (shares missing, forged or "
                                  "out of order) before any data work; nothing was spent",
    "secure-aggregation-no-resend": "round already spent under secure aggregation; its update is never sent again (two "
                                    "sums over different sites would reveal one site's update)",
    "update-out-of-bounds": "the site's own check of its update failed (‖Δ‖₂ above the round's bound); the spend is "
                            "recorded, nothing released",
}

#: Python identifier: the only shape an error class name may take on the wire
ERROR_CLASS_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"
SITE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


def error_class_name(exc: BaseException) -> str:
    """The exception's class name as it may go on the wire ('Exception' if it has an odd shape)."""
    name = type(exc).__name__
    return name if re.match(ERROR_CLASS_PATTERN, name) else "Exception"


def is_site_id(value: object) -> bool:
    return isinstance(value, str) and re.match(SITE_ID_PATTERN, value) is not None


class ProtocolError(ValueError):
    """A message does not follow the round protocol (names what is wrong)."""


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputPrivacyStatement(_Wire):
    """The site's local DP on its inputs (LDP-Slicing, ``input_privacy`` in its config): every training
    image was privatized once, at load, before any training (docs/input-privacy.md). A guarantee of
    its own beside the DP-SGD one; its values are the site's declared settings, public."""

    mechanism: Literal["ldp-slicing"]
    epsilon_total: float = Field(gt=0)  #: ε per privatized pixel (its 3 channel values; config input_privacy.epsilon)
    #: LL pruning (config): each privatized pixel then depends on a whole 2×2 block of the original, so the
    #: guarantee per original pixel (and per 2×2 block) is 4 · epsilon_total
    ll_prune: bool

    @property
    def epsilon_per_original_pixel(self) -> float:
        return 4 * self.epsilon_total if self.ll_prune else self.epsilon_total


class PrivacyReport(_Wire):
    """The site's cumulative privacy state after this round.

    Every field is computed from the site's declared parameters (σ, q, C, δ, ε_max) and the
    steps it ran — public values — never from its data."""

    guarantee: str  #: "DP", "FDP", "MaskDP" or "none": which statement ε belongs to
    unit: str  #: what one neighbouring dataset changes (the unit protected), in words
    #: the site's protection unit (its config, or the coarsest its annotation schema supports, pinned
    #: in its budget state); "record" is what sites from before units sent
    protection_unit: Literal["record", "image", "patient"] = "record"
    adjacency: str  #: the accountant's neighbouring relation ("add_remove", ...)
    accountant: Literal["rdp", "pld", "prv", "none"]  #: the accountant that computed epsilon
    epsilon: float | None  #: cumulative ε at delta; None = no guarantee (non-private training)
    delta: float
    eps_max: float  #: the site's own budget (its config)
    steps: int = Field(ge=0)  #: local DP steps composed so far
    rounds_spent: int = Field(ge=0)
    orders: list[float]  #: RDP orders (accountant constants)
    rdp: list[float]  #: cumulative RDP per order: a function of (σ, q, steps) only
    next_round_affordable: bool  #: would one more identical round fit ε_max (same public inputs)
    #: secure aggregation only: r, the public per-coordinate range [−r, r] the site clipped its privatized Δ
    #: to before quantizing (post-processing of Δ: the guarantee is unchanged); None: Δ was not clipped
    update_clip_range: float | None = None
    #: the site's inputs privatized by LDP-Slicing (its declared settings); None: images used as they are
    input_privacy: InputPrivacyStatement | None = None

    @model_validator(mode="after")
    def _curve(self) -> "PrivacyReport":
        if len(self.orders) != len(self.rdp):
            raise ValueError(f"privacy report: {len(self.orders)} orders but {len(self.rdp)} RDP values")
        return self


class SpendEvent(_Wire):
    """One round's accountant event: the whole input the accountant composes for that round.

    σ and q are the site's declared parameters and ``steps`` the steps it ran (sent as
    ``local_steps`` anyway): public values, nothing about the data."""

    round: int = Field(ge=1)
    noise_multiplier: float = Field(ge=0)
    sample_rate: float = Field(gt=0, le=1)
    steps: int = Field(ge=1)


class SiteReply(_Wire):
    """Everything a site sends for one round besides Δ (which travels in the ``update`` record)."""

    site_id: str = Field(pattern=SITE_ID_PATTERN)  #: the site's configured id (budgets are keyed by it)
    run_id: str  #: echoed from the coordinator's instruction
    round: int  #: echoed from the coordinator's instruction
    status: ReplyStatus  #: decided by the budget guard and the noisy update only (non-finite samples are zeroed)
    reason: ReasonCode | None = None  #: fixed code; None for a fresh "ok"
    error_class: str | None = Field(None, pattern=ERROR_CLASS_PATTERN)  #: "error" only: the exception's class name
    privacy: PrivacyReport | None = None  #: None only for "error" when the site could not read its own state
    basis_version: int = -1  #: projection-basis version the site holds (-1: none); the coordinator ships only news
    local_steps: int = Field(0, ge=0)  #: steps this round ran: min(asked, the site's configured cap)
    aggregation_weight: float = Field(1.0, gt=0)  #: the site's declared FedAvg weight (config, not its data size)
    #: every round of this run the site's budget holds as spent (this one included): the accountant's
    #: events, built from its declared σ, q and the steps it ran — public values. The ledger keeps them
    #: so it can witness the site's spends (rounds whose reply was lost are reconciled by the next one)
    spends: list[SpendEvent] = Field(default_factory=list)
    #: Ed25519 signature (base64) by the site's identity key over this reply without the signature and
    #: the digest of the update that leaves with it (:mod:`fedpose.federation.reply_signature`), so the
    #: coordinator attributes the reply to the site it names only if that site made it; a signature
    #: of values that leave anyway. None: the site has no identity configured
    signature: str | None = Field(None, pattern=r"^[A-Za-z0-9+/]{86}==$")

    @model_validator(mode="after")
    def _consistent(self) -> "SiteReply":
        if self.status == "error":
            if self.error_class is None or self.reason != "site-error":
                raise ValueError("an 'error' reply needs error_class and reason 'site-error'")
        else:
            if self.error_class is not None:
                raise ValueError(f"error_class is only sent with status 'error', not {self.status!r}")
            if self.privacy is None:
                raise ValueError(f"a {self.status!r} reply must carry the site's privacy report")
        expected = {"ok": (None, "resent-earlier-release"),
                    "refused": ("budget-exhausted", "behind-federation-record", "secure-aggregation-required",
                                "secure-aggregation-refused"),
                    "replayed": ("no-earlier-release", "secure-aggregation-no-resend"),
                    "failed": ("training-diverged", "update-out-of-bounds"), "error": ("site-error",)}
        if self.reason not in expected[self.status]:
            raise ValueError(f"reason {self.reason!r} does not fit status {self.status!r}")
        return self

    @property
    def carries_update(self) -> bool:
        return self.status == "ok"

    def describe(self) -> str:
        """One line for logs and the round record (the coordinator side renders the codes)."""
        text = REASON_TEXT[self.reason] if self.reason else "ok"
        if self.error_class:
            text = f"{self.error_class}: {text}"
        return text


def encode_reply(reply: SiteReply) -> dict[str, str]:
    """The ``reply`` ConfigRecord's content."""
    return {REPLY_KEY: reply.model_dump_json()}


def decode_reply(record: Mapping[str, Any]) -> SiteReply:
    """Parse a ``reply`` ConfigRecord; :class:`ProtocolError` names what is wrong."""
    keys = set(record)
    if keys != {REPLY_KEY}:
        raise ProtocolError(f"reply record must hold exactly the key '{REPLY_KEY}', got {sorted(keys)}")
    raw = record[REPLY_KEY]
    if not isinstance(raw, str):
        raise ProtocolError(f"reply record: '{REPLY_KEY}' must be a JSON string, got {type(raw).__name__}")
    try:
        return SiteReply.model_validate_json(raw)
    except ValidationError as exc:
        raise ProtocolError(f"malformed site reply: {validation_problems(exc)}") from None


# -- coordinator → site -----------------------------------------------------------------------------
class SpendRecord(_Wire):
    """The coordinator ledger's record of one site's spends in this run (what the site itself reported).

    Why it may be sent: every event is one the site sent in a reply (declared σ, q and the steps
    it ran), so it tells a site nothing about anyone's data. Why it cannot weaken a guarantee: the
    site takes its spend as the *larger* of its own state and this record
    (:mod:`fedpose.federation.witness`) — a record behind the site's state changes nothing, a
    record ahead of it (or differing from it) makes the site refuse before any data work. So a
    coordinator can only *inflate* it, which denies service and never lowers an ε."""

    site_id: str = Field(pattern=SITE_ID_PATTERN)
    events: list[SpendEvent] = Field(default_factory=list)


class TrainInstruction(_Wire):
    """What the coordinator asks of a site for one round (the ``config`` record, one JSON key).

    Every field (and every field of the model spec) is classified in
    :mod:`fedpose.federation.site_pins`: pinned by the site, or unable to change its guarantee."""

    run_id: str  #: site budgets key rounds by (run, round)
    round: int = Field(ge=1)
    local_steps: int = Field(ge=1)  #: asked for; the site caps it at its own configured local_steps
    model_spec: ModelSpec  #: how to build the global model the arrays belong to
    basis_version: int = -1  #: projection basis of this round (-1: none); sent only to sites lacking it
    #: the ledger as a witness of the site's earlier spends in this run: the record of the site this
    #: node is known to be, or — for a node the coordinator cannot attribute yet (new node ids after a
    #: restart) — of every recorded site no other node is known to be. A site absent from the list has
    #: nothing on record. Cannot change what a guarantee means or costs (see :class:`SpendRecord`);
    #: what a site may learn from it is which sites the ledger knows and their declared σ, q and steps.
    ledger_records: list[SpendRecord] = Field(default_factory=list)
    #: the update goes into a secure sum (its share inbox travels in the ``secagg`` record): the site
    #: clips, quantizes and masks Δ instead of sending it. Cannot change what the guarantee means or
    #: costs (Δ is post-processed either way); a site that requires it refuses a round without it
    secure_aggregation: bool = False


def encode_instruction(instruction: TrainInstruction) -> dict[str, str]:
    """The ``config`` ConfigRecord's content."""
    return {INSTRUCTION_KEY: instruction.model_dump_json()}


def decode_instruction(record: Mapping[str, Any]) -> TrainInstruction:
    """Parse a train message's ``config`` record; :class:`ProtocolError` names what is wrong."""
    raw = record.get(INSTRUCTION_KEY)
    if not isinstance(raw, str):
        raise ProtocolError(f"train instruction: the '{CONFIG_RECORD}' record must hold a JSON string under '{INSTRUCTION_KEY}'")
    try:
        return TrainInstruction.model_validate_json(raw)
    except ValidationError as exc:
        raise ProtocolError(f"malformed train instruction: {validation_problems(exc)}") from None


# -- secure aggregation (SecAgg+ over the full graph: fedpose.federation.secagg) ---------------------
# Four stages per round, each one message each way. Coordinator → site in a ``secagg`` ConfigRecord
# (one JSON key, ``secagg``); site → coordinator likewise, plus the masked vector in the ``masked``
# ArrayRecord in the masked-vector stage (with the usual ``reply`` record: the privacy report still
# travels in the clear). What a site sends, and why it may: public keys (fresh per round, random, no
# data), Shamir shares of its two round secrets encrypted for one peer each (the coordinator cannot
# read them), the masked vector (uniform modulo M to anyone lacking the masks: it reveals nothing
# alone), and in unmasking the shares the coordinator asked for — never both of one peer's
# (the site's security rule). A refusal carries a fixed code. No stage message holds data statistics.
SECAGG_RECORD = "secagg"
SECAGG_KEY = "secagg"
MASKED_RECORD = "masked"
MASKED_KEY = "vector"
MESSAGE_TYPE_SECAGG = "query.secagg"
#: record names a site may send in the secure-aggregation stages (setup, share keys, unmask)
SITE_SECAGG_RECORDS = frozenset({SECAGG_RECORD})
#: record names a site may send in the masked-vector stage (an "ok" reply carries ``masked``, never ``update``)
SITE_MASKED_REPLY_RECORDS = frozenset({MASKED_RECORD, REPLY_RECORD})

SecAggRefusalCode = Literal["settings-refused", "out-of-order", "inconsistent-keys", "unsigned-keys", "inconsistent-shares",
                            "both-shares-of-one-peer", "unknown-node", "own-key-share", "below-threshold", "inconsistent-view"]
SECAGG_REFUSAL_TEXT: dict[str, str] = {
    "settings-refused": "the site refused the round's secure-aggregation settings (threshold ≤ n/2, overflow, "
                        "fewer than 2 sites, or a vector length unlike the model's)",
    "out-of-order": "a stage message arrived out of order, for another round, or after the round's unmasking",
    "inconsistent-keys": "the key directory lacks the site's own keys, repeats a key, names nodes outside the round, "
                         "or has fewer entries than the threshold",
    "unsigned-keys": "a key in the directory is not signed by the identity the site was given for its site id, or "
                     "names a site outside that list (a coordinator's key in a site's place)",
    "inconsistent-shares": "a share did not decrypt, was not from its claimed peer or not for this site, or too few arrived "
                           "(with identities: a mask set small enough for a coordinator to unmask the site alone)",
    "both-shares-of-one-peer": "asked for both the mask-seed share and the secret-key share of one peer (SecAgg's "
                               "security rule: that would unmask the peer's individual update)",
    "unknown-node": "asked for shares of a node that was not in the round",
    "own-key-share": "listed the site itself as dropped (its secret-key share would unmask its own update)",
    "below-threshold": "fewer surviving sites than the threshold: unmasking would reveal too little to hide",
    "inconsistent-view": "the unmask request's view of who survived is not the one the site signed, or fewer than t "
                         "surviving sites signed that same view (a coordinator showing sites different views could "
                         "unmask the sum of a few sites)",
}


class _BytesWire(_Wire):
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_bytes="base64", val_json_bytes="base64")


class SecAggSetup(_Wire):
    """Stage 1, coordinator → site: who is in the round and the public settings of the secure sum.

    Every value is public (the coordinator's config and its choice of sites). The site checks them
    before making keys: threshold > n/2, n ≥ 2, n·(2^bits − 1) < M, the vector length its model has."""

    kind: Literal["setup"] = "setup"
    run_id: str
    round: int = Field(ge=1)
    node: int = Field(ge=0)  #: the receiving site's node id in this round (its index in shares and masks)
    participants: list[int] = Field(min_length=1)  #: every node asked to join, sorted
    threshold: int = Field(ge=1)  #: t: shares needed to reconstruct a secret; at most n − t dropouts are recovered
    clip_range: float = Field(gt=0)  #: r (per coordinate, on Δ)
    max_weight: float = Field(gt=0)  #: W: w·Δ is clipped to [−W·r, W·r]
    bits: int = Field(ge=2, le=30)
    modulus_bits: int = Field(ge=8, le=62)
    max_sites: int = Field(ge=2)
    vector_length: int = Field(ge=1)  #: number of trainable parameters (Δ flattened in the model's order)
    update_norm_bound: float | None = Field(None, gt=0)  #: the site checks ‖Δ‖₂ ≤ this before masking

    @model_validator(mode="after")
    def _shape(self) -> "SecAggSetup":
        if self.participants != sorted(set(self.participants)) or self.node not in self.participants:
            raise ValueError("participants must be sorted, unique, and include the receiving node")
        if self.threshold > len(self.participants):
            raise ValueError(f"threshold {self.threshold} exceeds the {len(self.participants)} participants")
        return self


class SecAggPublicKeys(_BytesWire):
    """Stage 1, site → coordinator: two fresh P-384 public keys (PEM), made for this round only.

    Why they may leave: random values independent of any data; the secret halves never leave."""

    kind: Literal["public-keys"] = "public-keys"
    site_id: str = Field(pattern=SITE_ID_PATTERN)
    run_id: str
    round: int = Field(ge=1)
    mask_key: bytes = Field(max_length=1024)  #: c^PK: pairwise masks are derived from it (ECDH)
    share_key: bytes = Field(max_length=1024)  #: s^PK: shares for this site are encrypted to it
    #: Ed25519 signature of the keys (crypto.key_statement: run, round, node, site id, setup digest) by the site's
    #: long-term identity, so its peers can tell its keys from a coordinator's; a signature of public
    #: values (None: the site has no identity configured)
    signature: bytes | None = Field(None, max_length=64)


class NodeKeys(_BytesWire):
    node: int = Field(ge=0)
    mask_key: bytes = Field(max_length=1024)
    share_key: bytes = Field(max_length=1024)
    site_id: str | None = Field(None, pattern=SITE_ID_PATTERN)  #: who the keys' signature says they are from
    signature: bytes | None = Field(None, max_length=64)  #: as the site sent it (SecAggPublicKeys)


class SecAggKeyDirectory(_BytesWire):
    """Stage 2, coordinator → site: the public keys of every site that answered the setup."""

    kind: Literal["key-directory"] = "key-directory"
    run_id: str
    round: int = Field(ge=1)
    keys: list[NodeKeys]


class EncryptedShare(_BytesWire):
    peer: int = Field(ge=0)  #: the destination (site → coordinator) or the source (coordinator → site)
    ciphertext: bytes = Field(max_length=16384)  #: Fernet token of src ‖ dst ‖ seed share ‖ key share


class SecAggEncryptedShares(_BytesWire):
    """Stage 2, site → coordinator: for each peer, its shares of this site's two round secrets
    (the self-mask seed and the pairwise-mask secret key), encrypted and authenticated for that
    peer. Why they may leave: the coordinator cannot decrypt them, and a share below the threshold
    reveals nothing of its secret (Shamir); the secrets are random, made for this round."""

    kind: Literal["encrypted-shares"] = "encrypted-shares"
    site_id: str = Field(pattern=SITE_ID_PATTERN)
    run_id: str
    round: int = Field(ge=1)
    shares: list[EncryptedShare]


class SecAggShareInbox(_BytesWire):
    """Stage 3, coordinator → site (with the train instruction): the shares peers encrypted for it."""

    kind: Literal["share-inbox"] = "share-inbox"
    run_id: str
    round: int = Field(ge=1)
    shares: list[EncryptedShare]


class SecAggViewRequest(_Wire):
    """Stage 4a, coordinator → site (the consistency check of Bonawitz et al.): which sites' masked
    vectors arrived (survivors) and which did not (dropped). Each site signs the view it is shown,
    once; the unmask request must then carry t survivors' signatures of that same view."""

    kind: Literal["view"] = "view"
    run_id: str
    round: int = Field(ge=1)
    survivors: list[int]
    dropped: list[int]


class SecAggViewSignature(_BytesWire):
    """Stage 4a, site → coordinator: the site's signature of the view it was shown (crypto.view_statement).
    Why it may leave: a signature of public values (node ids); None when the site has no identity."""

    kind: Literal["view-signature"] = "view-signature"
    site_id: str = Field(pattern=SITE_ID_PATTERN)
    run_id: str
    round: int = Field(ge=1)
    signature: bytes | None = Field(None, max_length=64)


class NodeSignature(_BytesWire):
    node: int = Field(ge=0)
    signature: bytes = Field(max_length=64)


class SecAggUnmaskRequest(_BytesWire):
    """Stage 4b, coordinator → site: which sites' masked vectors arrived (survivors: their seed
    shares are needed) and which did not (dropped after sharing keys: their key shares are needed),
    with the survivors' signatures of that view (stage 4a)."""

    kind: Literal["unmask-request"] = "unmask-request"
    run_id: str
    round: int = Field(ge=1)
    survivors: list[int]
    dropped: list[int]
    view_signatures: list[NodeSignature] = Field(default_factory=list)


class NodeShare(_BytesWire):
    node: int = Field(ge=0)
    share: bytes = Field(max_length=4096)


class SecAggUnmaskShares(_BytesWire):
    """Stage 4, site → coordinator: the asked shares — seed shares of survivors, key shares of the
    dropped — never both for one node. Why they may leave: each reconstructs a random round secret
    whose only use is removing a mask the protocol means to remove (a survivor's self mask, a
    dropped site's pairwise masks); together they reveal only the sum of the survivors' vectors."""

    kind: Literal["unmask-shares"] = "unmask-shares"
    site_id: str = Field(pattern=SITE_ID_PATTERN)
    run_id: str
    round: int = Field(ge=1)
    seed_shares: list[NodeShare]
    key_shares: list[NodeShare]


class SecAggRefusal(_Wire):
    """A site's refusal of a stage request: a fixed code (details stay in its local log)."""

    kind: Literal["refusal"] = "refusal"
    site_id: str = Field(pattern=SITE_ID_PATTERN)
    run_id: str
    round: int = Field(ge=0)
    reason: SecAggRefusalCode

    def describe(self) -> str:
        return SECAGG_REFUSAL_TEXT[self.reason]


SecAggRequest = SecAggSetup | SecAggKeyDirectory | SecAggViewRequest | SecAggUnmaskRequest
SecAggSiteMessage = SecAggPublicKeys | SecAggEncryptedShares | SecAggViewSignature | SecAggUnmaskShares | SecAggRefusal


class _CoordinatorEnvelope(_BytesWire):
    message: SecAggSetup | SecAggKeyDirectory | SecAggShareInbox | SecAggViewRequest | SecAggUnmaskRequest = Field(
        discriminator="kind")


class _SiteEnvelope(_BytesWire):
    message: SecAggPublicKeys | SecAggEncryptedShares | SecAggViewSignature | SecAggUnmaskShares | SecAggRefusal = Field(
        discriminator="kind")


def encode_secagg(message: SecAggRequest | SecAggShareInbox | SecAggSiteMessage) -> dict[str, str]:
    """The ``secagg`` ConfigRecord's content (either direction)."""
    site_kinds = (SecAggPublicKeys, SecAggEncryptedShares, SecAggViewSignature, SecAggUnmaskShares, SecAggRefusal)
    envelope = (_SiteEnvelope if isinstance(message, site_kinds) else _CoordinatorEnvelope)(message=message)  # type: ignore[arg-type]
    return {SECAGG_KEY: envelope.model_dump_json()}


def _decode_secagg(record: Mapping[str, Any], envelope: type[_BytesWire], what: str) -> Any:
    keys = set(record)
    if keys != {SECAGG_KEY} or not isinstance(record[SECAGG_KEY], str):
        raise ProtocolError(f"{what}: the '{SECAGG_RECORD}' record must hold exactly one JSON string under '{SECAGG_KEY}', got {sorted(keys)}")
    try:
        return envelope.model_validate_json(record[SECAGG_KEY]).message  # type: ignore[attr-defined]
    except ValidationError as exc:
        raise ProtocolError(f"malformed {what}: {validation_problems(exc)}") from None


def decode_secagg_request(record: Mapping[str, Any]) -> SecAggRequest | SecAggShareInbox:
    """A coordinator's secure-aggregation message; :class:`ProtocolError` names what is wrong."""
    return _decode_secagg(record, _CoordinatorEnvelope, "secure-aggregation request")


def decode_secagg_reply(record: Mapping[str, Any]) -> SecAggSiteMessage:
    """A site's secure-aggregation message; :class:`ProtocolError` names what is wrong."""
    return _decode_secagg(record, _SiteEnvelope, "secure-aggregation reply")
