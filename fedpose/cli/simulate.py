"""``fedpose simulate``: the whole federation on one machine (Flower's simulation runtime, Ray).

One coordinator (ServerApp) and one ClientApp per ``[[sites]]`` entry of the federation TOML, the
same apps as in deployment. The optional ``[synthetic]`` table (read by this command only) names
the synthetic dataset to generate when data the configs point to is absent: ``dir``,
``per_site``, ``public``, ``test``, ``size = [H, W]``, ``seed`` (it writes ``<dir>/site-<k>``,
``<dir>/test`` and ``<dir>/public``). Existing data is never deleted or regenerated; a first generation that was
interrupted (Ctrl-C) is completed by the next run.
While a round runs, an indented line a minute says how many of its steps each site has done (from
each site's ``<state_dir>/progress.json``). Flower's log goes to ``<checkpoint_dir>/simulation.log``,
and so do the notices Ray prints (e.g. a worker that died); Ray keeps its workers' output in its
session logs.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedpose.cli.common import UserError, add_config_args
from fedpose.cli.federation_run import (add_run_args, conclude_run, data_paths, ensure_federation_data, finished_run, pop_synthetic,
                                        printing_progress, repeating_on_a_thread, site_progress)
from fedpose.federation.report import REPORT_FILE

SIMULATION_LOG = "simulation.log"  #: Flower's log and Python warnings, in the coordinator's checkpoint_dir


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate", help="run a whole federation (coordinator + sites) on this machine",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(parser)
    add_run_args(parser)
    parser.set_defaults(handler=_handle)


def load_federation(config: str | Path, overrides: list[str]) -> tuple[Any, dict[str, Any] | None, dict[str, Any]]:
    """(FederationConfig, synthetic spec or None, the table it was validated from) of a federation
    TOML with ``--set`` overrides applied; writes nothing."""
    from fedpose.config import apply_overrides, load_toml, validate
    from fedpose.federation.config import FederationConfig

    raw = apply_overrides(load_toml(config), overrides)
    synthetic = pop_synthetic(raw, config)
    return validate(FederationConfig, raw, str(config)), synthetic, raw


def resolve_federation(config: str | Path, overrides: list[str]) -> tuple[Any, dict[str, Any] | None, Path]:
    """(FederationConfig, synthetic spec or None, path of the resolved TOML the apps read)."""
    import tomli_w

    federation, synthetic, raw = load_federation(config, overrides)
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


#: ANSI colour codes (Ray colours its "(raylet)" prefix), dropped in the log file
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class _RayThreadsTo:
    """A console stream whose writes from Ray's driver threads (named ``ray_…``: the listener that
    prints the raylet's error notices, the worker-log printer) go to ``log`` instead: worker ids,
    ports and troubleshooting tips are Ray's details, the round lines say what happened to a site."""

    def __init__(self, console: Any, log: Any):
        self._console, self._log = console, log

    def write(self, text: str) -> int:
        if threading.current_thread().name.startswith("ray_"):
            self._log.write(_ANSI.sub("", text))
            self._log.flush()
            return len(text)
        return self._console.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, … of the console
        return getattr(self._console, name)


@contextmanager
def flower_log_to(path: Path | None) -> Iterator[None]:
    """Flower's logger ("flwr", by name: fedpose imports no Flower), Python warnings (Ray's among
    them) and what Ray's driver threads print write to ``path`` only, for the duration of the block
    (None: leave everything as it is)."""
    if path is None:
        yield
        return
    flower, warnings_logger = logging.getLogger("flwr"), logging.getLogger("py.warnings")
    consoles = [h for h in flower.handlers if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for console in consoles:
        flower.removeHandler(console)
    flower.addHandler(handler)
    warnings_logger.addHandler(handler)
    warnings_propagate, warnings_logger.propagate = warnings_logger.propagate, False
    logging.captureWarnings(True)
    streams = sys.stdout, sys.stderr
    ray_log = path.open("a", encoding="utf-8")
    sys.stdout, sys.stderr = _RayThreadsTo(sys.stdout, ray_log), _RayThreadsTo(sys.stderr, ray_log)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = streams
        ray_log.close()
        logging.captureWarnings(False)
        warnings_logger.propagate = warnings_propagate
        warnings_logger.removeHandler(handler)
        flower.removeHandler(handler)
        handler.close()
        for console in consoles:
            flower.addHandler(console)


#: an environment variable set, with a value of this run's own, for the simulation's Ray processes
#: (they inherit the environment): an interrupted run ends exactly those
SIMULATION_MARKER = "FEDPOSE_SIMULATION"


def _descendants(root: int) -> set[int]:
    """The PIDs of every live descendant of ``root`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    found, stack = set(), [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def _marked(wanted: bytes) -> set[int]:
    """The PIDs of the processes whose environment holds ``wanted`` (this process excluded)."""
    found = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if int(environ.parent.name) != os.getpid() and wanted in environ.read_bytes().split(b"\0"):
                found.add(int(environ.parent.name))
        except (OSError, ValueError):
            continue
    return found


def stop_interrupted_simulation(config: str | Path, marker: str) -> None:
    """End the process after Ctrl-C. Flower's ``run_simulation`` stops its Ray backend but leaves the
    ServerApp's thread waiting for replies (up to the round timeout), and the interpreter would wait
    for that thread; Ray's agents whose raylet the terminal's SIGINT killed stay behind. So every
    descendant and every process carrying this run's ``marker`` is killed and the process exits
    (130) at once. Every
    finished round is already on disk (the coordinator writes its state atomically after each), so
    ``--resume`` continues from the last one; a site whose round was cut may have spent on it,
    which its next reply reports (as after any crash)."""
    print(f"fedpose: interrupted: the simulation stopped; `fedpose simulate --config {config} --resume` continues "
          "from the last finished round", file=sys.__stderr__, flush=True)
    wanted = f"{SIMULATION_MARKER}={marker}".encode()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:  # again until none is left: Ray may be starting a worker meanwhile
        # every descendant (taken before any is killed: a killed raylet's agents would leave the tree)
        # and every process with this run's marker; Linux (/proc), elsewhere Ray's own shutdown is all there is
        doomed = _descendants(os.getpid()) | _marked(wanted)
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
        if not doomed:
            break
        time.sleep(0.2)
    sys.stdout.flush()
    os._exit(130)


@contextmanager
def interrupt_stops_simulation(config: str | Path, marker: str) -> Iterator[None]:
    """Ctrl-C ends the simulation whatever the main thread is doing. A KeyboardInterrupt alone is not
    enough: Ray defers SIGINT while it submits work and drops it when that work fails — as it does
    when the same Ctrl-C has killed Ray's workers — and the run then goes on. Python writes every
    signal it handles to the wakeup file descriptor, so a watcher thread sees the SIGINT however the
    main thread's handler treats it. (Outside the main thread, e.g. some test runners, only the
    KeyboardInterrupt path is left.)"""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        os.close(read_end)
        os.close(write_end)
        yield
        return
    def watch() -> None:  # waits up to 0.5 s itself, so the block's end is seen within that
        if select.select([read_end], [], [], 0.5)[0] and signal.SIGINT in os.read(read_end, 64):
            stop_interrupted_simulation(config, marker)

    try:
        with repeating_on_a_thread("fedpose-interrupt", watch, 0.0):
            yield
    finally:
        signal.set_wakeup_fd(previous)
        os.close(read_end)
        os.close(write_end)


def _handle(args: argparse.Namespace) -> int:
    from fedpose.federation.run_guard import directory_lock, probe, refuse_fresh_start

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    # Ray holds back a notice that repeats an earlier one and prints it at shutdown, from the
    # thread that stops Ray (not one of its own): print each at once, where flower_log_to routes it
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    federation, synthetic, resolved = resolve_federation(args.config, args.overrides)
    checkpoint_dir = Path(federation.coordinator.checkpoint_dir)
    # The ServerApp takes the coordinator's locks itself (run_guard.coordinator_lock); refusing here
    # too says so before any data is generated, with the same exit code (2) as deploy local.
    probe(directory_lock(checkpoint_dir), f"the coordinator's checkpoint_dir {checkpoint_dir}", "coordinator")
    if not args.resume:
        refuse_fresh_start(checkpoint_dir, federation.coordinator.ledger_path, f"the coordinator's checkpoint_dir {checkpoint_dir}",
                           "another coordinator.checkpoint_dir (or delete it to start over)")
    if args.resume:
        note = finished_run(checkpoint_dir, federation.run_id, federation.coordinator.rounds, "--resume --set coordinator.rounds={rounds}")
        if note is not None:
            print(note, flush=True)
            return 0
    ensure_federation_data(data_paths(federation.sites, federation.coordinator), synthetic, len(federation.sites), args.config)

    started = time.time()
    log_path = checkpoint_dir / SIMULATION_LOG
    import torch

    from coordinator.simulation import run_federation_simulation  # the apps layer: the one place Flower runs

    gpus = gpus_per_site(federation, torch.cuda.device_count())
    per_site = f"{federation.simulation.cpus_per_site:g} CPU" + (f" + {gpus:g} GPU" if gpus else "")
    sites, rounds = len(federation.sites), federation.coordinator.rounds
    print(f"simulating run '{federation.run_id}': {sites} site{'' if sites == 1 else 's'}, "
          f"{rounds} round{'' if rounds == 1 else 's'}, "
          f"{per_site} per site; state in {checkpoint_dir}; Flower's log in {log_path}", flush=True)
    marker = os.environ[SIMULATION_MARKER] = f"{os.getpid()}-{time.time_ns()}"
    try:
        # Flower's log (its tracebacks of failed ClientApps included) goes to the log file; the
        # coordinator's round lines still reach the console
        with flower_log_to(log_path), printing_progress(site_progress(federation)), \
                interrupt_stops_simulation(args.config, marker):
            run_federation_simulation(federation, resolved, gpus_per_site=gpus, resume=args.resume, worker_output_to_console=False)
    except KeyboardInterrupt:  # the watcher's path is first; this one where there is no watcher
        stop_interrupted_simulation(args.config, marker)
    except Exception:  # noqa: BLE001 - the coordinator printed its error line; the traceback goes to the log
        with log_path.open("a", encoding="utf-8") as log:
            log.write(f"fedpose simulate: the simulation raised\n{traceback.format_exc()}")
    report = checkpoint_dir / REPORT_FILE
    if not report.exists() or report.stat().st_mtime < started:
        print(f"fedpose: error: the federation did not finish (no report written); see {log_path}", file=sys.stderr, flush=True)
        return 1
    return conclude_run(checkpoint_dir, args.allow_site_failures)
