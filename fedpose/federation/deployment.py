"""Deployment-side config files (Flower-free): the coordinator's TOML for a real SuperLink run.

A simulated federation keeps coordinator and sites in one file (:class:`FederationConfig`); a
deployment gives the coordinator its own file (this model) and every site its own
:class:`~fedpose.federation.config.SiteConfig` TOML, read by the site's SuperNode.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from fedpose.config import Strict, load_config
from fedpose.federation.config import SITE_ID_PATTERN, CoordinatorConfig, FederationConfig


class CoordinatorRunConfig(Strict):
    """``configs/coordinator.toml``: the run id (site budgets key rounds by it) and the coordinator."""

    run_id: str = Field("fedpose", pattern=SITE_ID_PATTERN, description="stable run id; keep it when resuming")
    coordinator: CoordinatorConfig = CoordinatorConfig()


def load_coordinator_run(path: str | Path, overrides: list[str] | None = None) -> CoordinatorRunConfig:
    """A coordinator TOML, or the coordinator part of a federation TOML (it has a ``sites`` list)."""
    import tomllib

    raw = tomllib.loads(Path(path).read_text()) if Path(path).exists() else None
    if raw is not None and "sites" in raw:
        federation = load_config(path, overrides, model=FederationConfig)
        return CoordinatorRunConfig(run_id=federation.run_id, coordinator=federation.coordinator)
    return load_config(path, overrides, model=CoordinatorRunConfig)
