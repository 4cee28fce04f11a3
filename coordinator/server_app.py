"""The coordinator's Flower ServerApp.

Deployment: ``flwr run . <connection> --run-config 'coordinator-config="/abs/coordinator.toml"'``
(add ``resume=true`` to continue after the last checkpointed round). Simulation:
``fedpose simulate`` builds the app with :func:`build_server_app` and the federation TOML.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from coordinator.grid import GridTransport
from fedpose.config import ConfigError
from fedpose.federation.ledger import LedgerError
from fedpose.federation.report import COORDINATOR_ERROR_PREFIX
from fedpose.federation.deployment import load_coordinator_run
from fedpose.federation.run_guard import RunStateRefused, coordinator_lock
from fedpose.federation.server.rounds import RoundRunner


def _flag(value: object) -> bool:
    return value is True or str(value).lower() in ("true", "1", "yes")


@contextmanager
def _console_log() -> Iterator[None]:
    """fedpose warnings (rejected updates, missing sites, site failures) to stderr for one run; Flower
    keeps its own console handler (it must not also propagate to a root handler some library
    installed). Per run, not per process: the handler writes to the stderr of the run that made it
    (a simulation runs several ServerApps in one process)."""
    logging.getLogger("flwr").propagate = False
    logger = logging.getLogger("fedpose")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.WARNING)  # what the round lines already say (e.g. a budget refusal) stays off the console
    previous = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous[0])
        logger.propagate = previous[1]


def build_server_app(config_path: str | Path | None = None, resume: bool | None = None, overrides: list[str] | None = None) -> ServerApp:
    """A ServerApp for ``config_path`` (default: run config ``coordinator-config``)."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        with _console_log():
            try:
                path = config_path or context.run_config.get("coordinator-config")
                if not path:
                    raise ConfigError("no coordinator config: pass --run-config 'coordinator-config=\"/abs/path.toml\"'")
                run = load_coordinator_run(str(path), overrides)
                do_resume = resume if resume is not None else _flag(context.run_config.get("resume", False))
                # one coordinator per checkpoint_dir and ledger, for as long as this one runs
                with coordinator_lock(run.coordinator.checkpoint_dir, run.coordinator.ledger_path):
                    result = RoundRunner(run, resume=do_resume, echo=lambda line: print(line, flush=True)).run_rounds(GridTransport(grid))
            except (ConfigError, LedgerError, RunStateRefused, ValueError, OSError) as exc:
                # one line the operator sees (deploy local and simulate print it), then fail the run
                print(f"{COORDINATOR_ERROR_PREFIX}{type(exc).__name__}: {exc}", flush=True)
                raise
            print(f"federation finished: {result['stopped_reason']}; report: {result['report']} (curves: {result['curves']})", flush=True)

    return server_app


app = build_server_app()
