"""An in-process transport for the round runner: every site's round runs in this process.

For benchmarks and tests that need the real coordinator (:class:`~fedpose.federation.server.rounds.RoundRunner`:
selection, basis service, validation, aggregation, ledger, checkpoints) and the real site round
(:func:`~fedpose.federation.local_training.run_site_round`: budget guard, private training) without
Flower's messaging. What it skips is transport only: no serialization of the arrays, no egress
guard, no ClientApp process per message. Sites run one after the other.

Secure aggregation runs for real here (keys, shares, masks, the security rule): each node's
:class:`~fedpose.federation.secagg.site.SiteSecAggSession` lives in this object for its round, as
it lives in the SuperNode's memory under Flower.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fedpose.federation import protocol
from fedpose.federation.config import SiteConfig
from fedpose.federation.local_training import run_site_round
from fedpose.federation.secagg import site as secagg_site
from fedpose.federation.server.rounds import NodeReply, TrainRequest


class InProcessTransport:
    """Node ``i + 1`` is ``sites[i]``; each request runs that site's round here and now."""

    def __init__(self, sites: Sequence[SiteConfig]):
        self.sites: Mapping[int, SiteConfig] = {index + 1: site for index, site in enumerate(sites)}
        self.sessions: dict[int, secagg_site.SiteSecAggSession] = {}  #: this round's secure-aggregation state per node

    def node_ids(self) -> list[int]:
        return list(self.sites)

    def send_and_receive(self, requests: list[TrainRequest], timeout: float) -> list[NodeReply]:
        replies = []
        for request in requests:
            site = self.sites[request.node]
            instruction = request.instruction
            basis = (dict(request.basis.arrays), dict(request.basis.config)) if request.basis is not None else None
            result = run_site_round(site, instruction.run_id, instruction.round, dict(request.global_arrays),
                                    instruction.model_spec, instruction.local_steps, basis_version=instruction.basis_version,
                                    basis_message=basis, threads=site.train.threads,
                                    ledger_records=instruction.ledger_records,
                                    secagg=self.sessions.get(request.node) if request.secagg_inbox is not None else None,
                                    secagg_inbox=request.secagg_inbox)
            update, masked = result.update, result.masked
            if masked is not None:  # secure aggregation: only the masked vector leaves
                replies.append(NodeReply(request.node, result.reply, masked=lambda m=masked: m, bytes_up=int(masked.nbytes)))
                continue
            replies.append(NodeReply(request.node, result.reply, update=(lambda u=update: u) if result.reply.carries_update else None,
                                     bytes_up=sum(int(a.nbytes) for a in update.values())))
        return replies

    def secagg_exchange(self, messages: Mapping[int, protocol.SecAggRequest], timeout: float) -> dict[int, protocol.SecAggSiteMessage]:
        answers: dict[int, protocol.SecAggSiteMessage] = {}
        for node, message in messages.items():
            site_id = self.sites[node].site_id
            if isinstance(message, protocol.SecAggSetup):
                session, answers[node] = secagg_site.start(site_id, message)
                if session is None:
                    self.sessions.pop(node, None)
                else:
                    self.sessions[node] = session
            else:
                answers[node] = secagg_site.answer(self.sessions.get(node), site_id, message)
        return answers
