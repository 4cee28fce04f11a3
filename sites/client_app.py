"""The site's Flower ClientApp: receive the global model, train privately, send Δ back.

Configured entirely by the SuperNode's node config (deployment)::

    flower-supernode ... --node-config 'site-config="/etc/fedpose/site-0.toml"'

or, under ``fedpose simulate``, by the federation TOML (site = ``sites[partition-id]``).
All logic lives in :mod:`fedpose.federation.local_training`; this module only converts Flower
records. Deployment starts a new ClientApp process per message, so nothing is kept in memory:
the budget and the basis cache are on disk in the site's ``state_dir``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod

from fedpose.config import ConfigError, load_config
from fedpose.federation import protocol
from fedpose.federation.config import FederationConfig, SiteConfig
from fedpose.federation.local_training import run_site_round
from sites.egress import egress_guard

log = logging.getLogger("fedpose.site")

SiteResolver = Callable[[Context], SiteConfig]


def site_from_context(context: Context, federation_config: str | Path | None = None) -> SiteConfig:
    """The site's config: node config ``site-config`` (a SiteConfig TOML), or — in simulation —
    ``sites[partition-id]`` of the federation TOML (argument, or run config ``federation-config``)."""
    node = context.node_config
    if "site-config" in node:
        return load_config(str(node["site-config"]), model=SiteConfig)
    federation_path = federation_config or context.run_config.get("federation-config") or os.environ.get("FEDPOSE_FEDERATION_CONFIG")
    if federation_path and "partition-id" in node:
        federation = load_config(str(federation_path), model=FederationConfig)
        index = int(node["partition-id"])
        if not 0 <= index < len(federation.sites):
            raise ConfigError(f"{federation_path}: no site for partition-id {index} ({len(federation.sites)} sites)")
        return federation.sites[index]
    raise ConfigError("site not configured: start the SuperNode with --node-config 'site-config=\"<site.toml>\"'")


def _arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: array.numpy() for name, array in record.items()}


def handle_train(msg: Message, context: Context, site: SiteConfig) -> Message:
    run_id, round_id, local_steps, model_spec, basis_version = protocol.parse_train_config(
        dict(msg.content[protocol.CONFIG_RECORD])
    )
    basis_message = None
    if protocol.BASIS_RECORD in msg.content:
        basis_message = (_arrays(msg.content[protocol.BASIS_RECORD]), dict(msg.content[protocol.BASIS_CONFIG_RECORD]))
    result = run_site_round(
        site, run_id, round_id, _arrays(msg.content[protocol.GLOBAL_RECORD]), model_spec, local_steps,
        basis_version=basis_version, basis_message=basis_message, threads=site.train.threads,
    )
    content = RecordDict({protocol.REPLY_RECORD: ConfigRecord(protocol.encode_reply(result.reply))})
    if result.reply.carries_update:
        content[protocol.UPDATE_RECORD] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in result.update.items()})
    log.info("site %s round %d: %s (%s)", site.site_id, round_id, result.reply.status, result.reply.describe())
    return Message(content, reply_to=msg)


def build_client_app(federation_config: str | Path | None = None, outer_mods: Sequence[Mod] = ()) -> ClientApp:
    """A ClientApp whose sites come from node config (or ``federation_config`` in simulation).

    ``outer_mods`` run outside the egress guard (tests use them to tamper with what leaves)."""
    client_app = ClientApp(mods=[*outer_mods, egress_guard])

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        return handle_train(msg, context, site_from_context(context, federation_config))

    return client_app


app = build_client_app()
