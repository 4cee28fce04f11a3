"""``fedpose simulate``: the whole federation on one machine (Flower's simulation runtime, Ray).

One coordinator (ServerApp) and one ClientApp per ``[[sites]]`` entry of the federation TOML, the
same apps as in deployment. The optional ``[synthetic]`` table (read by this command only) names
the synthetic dataset to generate if absent: ``dir``, ``per_site``, ``public``, ``test``,
``size = [H, W]``, ``seed``; the sites' ``data.train`` are then ``<dir>/site-<k>``, the
coordinator's held-out split ``<dir>/test`` and the public set ``<dir>/public``.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any

from fedpose.cli.common import UserError, add_config_args

SYNTHETIC_KEYS = {"dir", "per_site", "public", "test", "size", "seed"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate", help="run a whole federation (coordinator + sites) on this machine",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(parser)
    parser.add_argument("--resume", action="store_true", help="continue after the coordinator's last checkpointed round")
    parser.set_defaults(handler=_handle)


def resolve_federation(config: str | Path, overrides: list[str]) -> tuple[Any, dict[str, Any] | None, Path]:
    """(FederationConfig, synthetic spec or None, path of the resolved TOML the apps read)."""
    import tomli_w

    from fedpose.config import apply_overrides, load_toml, validate
    from fedpose.federation.config import FederationConfig

    raw = apply_overrides(load_toml(config), overrides)
    synthetic = raw.pop("synthetic", None)
    if synthetic is not None:
        unknown = set(synthetic) - SYNTHETIC_KEYS
        if unknown or "dir" not in synthetic:
            raise UserError(f"{config}: [synthetic] needs 'dir' and accepts {sorted(SYNTHETIC_KEYS)}; unknown {sorted(unknown)}")
    federation = validate(FederationConfig, raw, str(config))
    resolved = Path(federation.coordinator.checkpoint_dir) / "federation.resolved.toml"
    resolved.parent.mkdir(parents=True, exist_ok=True)
    from fedpose.io import atomic_write_text

    atomic_write_text(resolved, tomli_w.dumps(_tomlable(raw)))
    return federation, synthetic, resolved


def _tomlable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _tomlable(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_tomlable(v) for v in value]
    return value


def ensure_synthetic(synthetic: dict[str, Any], n_sites: int) -> None:
    from fedpose.data.synthetic import ensure_dataset

    size = tuple(synthetic.get("size", (128, 96)))
    ensure_dataset(
        synthetic["dir"], sites=n_sites, per_site=int(synthetic.get("per_site", 200)), public=int(synthetic.get("public", 100)),
        test=int(synthetic.get("test", 100)), size=size, seed=int(synthetic.get("seed", 0)),
    )


def gpus_per_site(federation: Any, visible_gpus: int) -> float:
    """Ray's ``num_gpus`` for each simulated site: ``simulation.gpus_per_site``, or the visible GPUs
    shared evenly among the sites (at most one each; 0 without GPUs or when every site trains on
    the CPU). Ray then sets each site's CUDA_VISIBLE_DEVICES, so ``train.device = "auto"`` finds its
    share; a site given no GPU sees none and trains on the CPU."""
    requested = federation.simulation.gpus_per_site
    if requested is not None:
        if requested > 0 and visible_gpus == 0:
            raise UserError(f"simulation.gpus_per_site = {requested:g}, but no CUDA GPU is visible here; set it to 0")
        return float(requested)
    if visible_gpus == 0 or all(site.train.device == "cpu" for site in federation.sites):
        return 0.0
    # rounded down, so that n fractions never sum past the GPUs Ray was given
    return math.floor(min(1.0, visible_gpus / len(federation.sites)) * 10_000) / 10_000


def run_federation_simulation(federation: Any, resolved: Path, resume: bool = False, client_mods: tuple = ()) -> None:
    """Run coordinator + one ClientApp per site under Flower's simulation runtime (Ray)."""
    import torch
    from flwr.simulation import run_simulation

    from coordinator.server_app import build_server_app
    from sites.client_app import build_client_app

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    cpus = os.cpu_count() or 1
    visible_gpus = torch.cuda.device_count()
    run_simulation(
        server_app=build_server_app(resolved, resume=resume),
        client_app=build_client_app(resolved, outer_mods=client_mods),
        num_supernodes=len(federation.sites),
        backend_config={
            "client_resources": {"num_cpus": federation.simulation.cpus_per_site,
                                 "num_gpus": gpus_per_site(federation, visible_gpus)},
            "init_args": {"num_cpus": cpus, "num_gpus": visible_gpus, "logging_level": "ERROR", "log_to_driver": True},
        },
    )


def _handle(args: argparse.Namespace) -> int:
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    federation, synthetic, resolved = resolve_federation(args.config, args.overrides)
    if synthetic is not None:
        ensure_synthetic(synthetic, len(federation.sites))
    for site in federation.sites:
        if site.data.train is not None and not Path(site.data.train).exists():
            raise UserError(f"site '{site.site_id}': data.train {site.data.train} does not exist")

    checkpoint_dir = Path(federation.coordinator.checkpoint_dir)
    if (checkpoint_dir / "global.npz").exists() and not args.resume:
        raise UserError(f"{checkpoint_dir} holds a previous run of '{federation.run_id}': add --resume, or delete it to start over")
    started = time.time()
    import torch

    gpus = gpus_per_site(federation, torch.cuda.device_count())
    per_site = f"{federation.simulation.cpus_per_site:g} CPU" + (f" + {gpus:g} GPU" if gpus else "")
    print(f"simulating run '{federation.run_id}': {len(federation.sites)} sites, {federation.coordinator.rounds} rounds, "
          f"{per_site} per site; state in {federation.coordinator.checkpoint_dir}", flush=True)
    run_federation_simulation(federation, resolved, resume=args.resume)
    report = checkpoint_dir / "report.json"
    if not report.exists() or report.stat().st_mtime < started:
        print("fedpose: error: the federation did not finish (no report written); see the log above")
        return 1
    return 0
