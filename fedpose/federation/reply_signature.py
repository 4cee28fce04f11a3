"""Signed train replies: the coordinator attributes a reply to the site it names only when that
site's identity signed it.

Flower tells the coordinator which *node* a reply came from, not which site: the site id is what
the reply says. Without signatures any node the SuperLink admits (another site's authenticated
SuperNode, or any SuperNode where authentication is off) could answer in a site's name: add its
own update under that site's name and weight, mark the site exhausted, or plant spends in the
site's ledger record — the witness the real site is then held to (it refuses rounds until its
operator adopts the higher spend). ε is never understated that way, but the federation's record
and model are no longer the sites' own.

A site with an ``identity`` (the Ed25519 key it already uses for secure aggregation) signs every
train reply: the reply without its signature, as JSON, and the digest of what leaves with it (Δ,
or the masked vector; :func:`~fedpose.federation.site_audit.arrays_sha256`, the digest its audit
log and the coordinator's ledger keep). A coordinator that lists the sites' public keys
(``coordinator.site_identities``) uses only replies signed by the site they name; the others are
counted as the node's failure, attributed to no site.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedpose.federation.config import SiteConfig
from fedpose.federation.protocol import SiteReply
from fedpose.federation.secagg import crypto
from fedpose.federation.secagg.site import Identity
from fedpose.federation.site_audit import arrays_sha256


def _statement(reply: SiteReply, released_sha256: str | None) -> bytes:
    return crypto.reply_statement(reply.model_copy(update={"signature": None}).model_dump_json(), released_sha256)


@dataclass(frozen=True)
class ReplySigner:
    """A site's identity key, loaded (and checked against its own entry in ``identity.peers``)
    before the round, so a key that does not load fails the round before anything is spent."""

    key: Ed25519PrivateKey

    @classmethod
    def of(cls, site: SiteConfig) -> "ReplySigner | None":
        identity = Identity.from_config(site.site_id, site.identity)
        return None if identity is None else cls(identity.key)

    def sign(self, reply: SiteReply, released: Mapping[str, np.ndarray]) -> SiteReply:
        """``reply`` with its signature over it and ``released`` (what leaves with it; empty: nothing)."""
        statement = _statement(reply, arrays_sha256(released) if released else None)
        return reply.model_copy(update={"signature": base64.b64encode(self.key.sign(statement)).decode()})


def attribution_problem(reply: SiteReply, received_sha256: str | None, identities: Mapping[str, str]) -> str | None:
    """Why the coordinator may not attribute ``reply`` (with what came with it, digest
    ``received_sha256``) to the site it names, given the sites' public keys; None: it may. No
    ``identities``: replies are taken at their word (the coordinator was given no keys)."""
    if not identities:
        return None
    public_key = identities.get(reply.site_id)
    if public_key is None:
        return f"the reply names site '{reply.site_id}', which coordinator.site_identities does not list"
    if reply.signature is None:
        return f"the reply naming site '{reply.site_id}' is unsigned (the site has no identity configured)"
    signature = base64.b64decode(reply.signature)
    if not crypto.verify_keys(public_key, signature, _statement(reply, received_sha256)):
        return (f"the reply naming site '{reply.site_id}' is not signed by that site's identity "
                "(another node answering in its name, or a reply or update changed on the way)")
    return None
