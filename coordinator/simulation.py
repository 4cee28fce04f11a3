"""``fedpose simulate``'s Flower part: the coordinator's ServerApp and one ClientApp per site
(the same apps as in deployment) under Flower's simulation runtime (Ray). The fedpose CLI reaches
it through one lazy import: fedpose itself imports no Flower."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from flwr.clientapp.typing import Mod
from flwr.simulation import run_simulation

from coordinator.server_app import build_server_app
from fedpose.federation.config import FederationConfig
from sites.client_app import build_client_app


def run_federation_simulation(federation: FederationConfig, resolved: Path, *, gpus_per_site: float, resume: bool = False,
                              client_mods: Sequence[Mod] = (), worker_output_to_console: bool = True) -> None:
    """Run the federation of ``resolved`` (``federation``, validated) to its end.

    ``gpus_per_site``: Ray's GPU share of each ClientApp. ``client_mods`` run outside each site's
    egress guard (tests tamper with what leaves). ``worker_output_to_console`` False: Ray keeps
    its workers' output in its own session logs."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    # Flower's Ray backend keeps a pool of actors (worker processes) shared by all nodes: each
    # message takes whichever actor is idle, and an actor whose process died goes back into the
    # pool. Without restarts the dead actor then fails the next message it is given — any site's,
    # reported as that site's failure. Restarted (max_restarts = -1: as often as it dies; Flower
    # passes client_resources on as the actors' options), the actor serves the next message
    # normally; the interrupted one is not re-run (max_task_retries = 0): its site is reported
    # missing for that round, and its next reply carries what it spent.
    actor_restarts = {"max_restarts": -1, "max_task_retries": 0}
    run_simulation(
        server_app=build_server_app(resolved, resume=resume),
        client_app=build_client_app(resolved, outer_mods=client_mods),
        num_supernodes=len(federation.sites),
        backend_config={
            "client_resources": {"num_cpus": federation.simulation.cpus_per_site, "num_gpus": gpus_per_site, **actor_restarts},
            "init_args": {"num_cpus": os.cpu_count() or 1, "num_gpus": torch.cuda.device_count(), "logging_level": "ERROR",
                          "log_to_driver": worker_output_to_console},
        },
    )
