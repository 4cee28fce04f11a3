"""``fedpose deploy local``: a real Flower deployment on 127.0.0.1 — SuperLink, one SuperNode per
site, the coordinator submitted with ``flwr run`` — over gRPC with TLS and SuperNode
authentication, exactly as it would run across hospitals (separate processes, own ports).

Everything goes into ``--run-dir``: ``certs/`` (``fedpose certs``; with two or more sites also
``identities/``, each site's signing key, made once: its replies and secure-aggregation keys are
signed, and the coordinator's ``site_identities`` requires it), ``configs/`` (the coordinator
TOML and one site TOML per site), ``flwr-home/`` (the SuperLink connection for ``flwr``),
``logs/`` (one log per process), ``sites/<id>/`` (each site's persisted budget), ``coordinator/``
(global model, server-optimizer state, ledger, history, report) and ``commands.sh`` (every
command that was run — the same commands a multi-machine deployment uses). It prints each round's
line and, while a round runs, an indented line a minute with each site's steps done (from the
sites' ``progress.json``, which this command can read: it runs every site here).

Sites are the first ``--sites`` ``[[sites]]`` entries of the federation TOML, each with its own
``data.train`` (only ``state_dir`` moves into the run dir). ``[synthetic]`` is generated only when
data the configs point to is absent, into a directory without data: nothing is deleted.

Everything it started is stopped on exit, on error, on Ctrl-C and SIGTERM — and when it is
killed (SIGKILL), by a watchdog process (``fedpose.cli.process_sweep``). A run in which a site
failed ends with a failure summary and exit code 3 unless ``--allow-site-failures``. A site's
SuperNode or exporter that cannot start stops everything before the run is submitted (exit 1, its
log named); one that exits during the run is named in a warning, once.

One ``deploy local`` per run directory: it holds an exclusive lock on ``--run-dir`` while it
lives (the coordinator holds another on ``coordinator/``); a second one is refused naming the
holder, and so is a fresh start over a directory holding a previous run's state — both exit 2,
with a message beginning "refused:". A SuperLink that exits or stops answering (or no longer
knows the run) for ``--superlink-timeout`` seconds ends the run: everything is stopped, exit 1,
and ``--resume`` continues it; so does a coordinator killed outright (gone without its report), 10 s
after it died.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any, Callable, NamedTuple

from fedpose.cli.common import UserError, positive_float
from fedpose.cli.federation_run import (add_run_args, conclude_run, data_paths, ensure_federation_data, finished_run, pop_synthetic,
                                        printing_progress, site_progress)
from fedpose.cli.process_sweep import DEPLOY_TOKEN_ENV, start_watchdog, stop_tagged
from fedpose.federation.report import COORDINATOR_ERROR_PREFIX, REPORT_FILE
from fedpose.federation.run_guard import REFUSED, directory_lock, exclusive, probe, read_holder, refuse_fresh_start

CONNECTION = "fedpose-local"
DEFAULT_CONFIG = "configs/demo.toml"
STOP_GRACE_S = 10.0
HISTORY_POLL_S = 1.0  #: the coordinator's history.json and report.json are read this often (file reads: cheap)
#: `flwr ls` is a Python process (~1 s of CPU that the sites' training on the same machine would use): asked
#: this often while the coordinator runs, every LOST_POLL_S while the SuperLink does not answer, and every
#: ENDING_POLL_S once the coordinator has ended (its report.json written, or its process gone: a crash)
STATUS_POLL_S = 30.0
LOST_POLL_S = 5.0
ENDING_POLL_S = 2.0
#: a coordinator whose process is gone without its report (killed: the OOM killer, kill -9) is a failed
#: run this long after: Flower itself says so only when the ServerApp's heartbeats are missed (~50 s);
#: a ServerApp that raised reports its own failure, with its reason, well within this
CRASH_GRACE_S = 10.0
FINISHED = "finished"
SITE_START_TIMEOUT_S = 180.0  #: a site's SuperNode and exporter open their ports within this (imports on a loaded machine)
SUPERLINK_TIMEOUT_S = 60.0  #: default --superlink-timeout: a SuperLink restart or a loaded machine's slow `flwr ls` fits
FLWR_CLI_TIMEOUT_S = 30.0  #: at least this long for one `flwr ls` (a Python process: slow to start on a loaded machine)
COORDINATOR_DIR = "coordinator"  #: the coordinator's checkpoint_dir (and ledger) inside the run dir


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("deploy", help="run a real Flower deployment (SuperLink + SuperNodes + coordinator)")
    sub = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    local = sub.add_parser("local", help="everything on 127.0.0.1, separate processes, gRPC + TLS + SuperNode auth",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    local.add_argument("--sites", type=int, required=True,
                       help="number of sites: the first N [[sites]] of the config, each with its data.train (one SuperNode each)")
    local.add_argument("--rounds", type=int, default=None, help="override coordinator.rounds")
    local.add_argument("--config", default=DEFAULT_CONFIG,
                       help="federation TOML: coordinator + [[sites]] + optional [synthetic] (default: configs/demo.toml)")
    local.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a key of the federation TOML (repeatable)")
    local.add_argument("--run-dir", type=Path, default=Path("runs/deploy-local"), help="where everything is written")
    local.add_argument("--base-port", type=int, default=9092,
                       help="Fleet API port; Control API = +1, health = +3, coordinator metrics = +5, SuperNodes = +10+i, "
                       "site metrics = +20+i")
    local.add_argument("--timeout", type=float, default=None, help="give up (and stop everything) after this many seconds")
    local.add_argument("--superlink-timeout", type=positive_float, default=SUPERLINK_TIMEOUT_S, metavar="SECONDS",
                       help="stop everything and exit 1 when the SuperLink has exited, or has not answered or no longer "
                       f"knows the run, for this long (default {SUPERLINK_TIMEOUT_S:g}); --resume continues the run")
    add_run_args(local)
    local.set_defaults(handler=_handle)


# -- configs ---------------------------------------------------------------------------------------
class DeploymentConfigs(NamedTuple):
    coordinator_toml: Path
    site_tomls: list[Path]
    federation: Any  #: FederationConfig of the deployed sites (absolute paths)
    synthetic: dict[str, Any] | None  #: the [synthetic] table, if any
    config_sites: int  #: [[sites]] entries in the config (the [synthetic] dataset has that many)


def write_deployment_configs(args: argparse.Namespace, run_dir: Path) -> DeploymentConfigs:
    """One site TOML per site (the config's first ``--sites`` entries) + the coordinator TOML, all
    paths absolute (the SuperNodes and the ServerApp run elsewhere)."""
    import tomli_w

    from fedpose.config import absolute_paths, apply_overrides, load_toml, validate
    from fedpose.federation.config import CoordinatorConfig, FederationConfig, SiteConfig
    from fedpose.io import atomic_write_text

    raw = apply_overrides(load_toml(args.config), args.overrides)
    synthetic = pop_synthetic(raw, args.config)
    raw.pop("simulation", None)
    entries = raw.get("sites") or []
    if not 1 <= args.sites <= 10:
        raise UserError("--sites must be between 1 and 10 (ports base+10.. and base+20.. are per site)")
    if args.sites > len(entries):
        raise UserError(f"{args.config} has {len(entries)} [[sites]] entries; --sites {args.sites} needs one per site, "
                        "each with its own data.train")
    sites = []
    for entry in entries[: args.sites]:
        site = absolute_paths(entry, SiteConfig)
        if isinstance(site.get("site_id"), str):  # the run dir keeps every site's budget (a missing id: validation says so)
            site["state_dir"] = str(run_dir / "sites" / site["site_id"])
        sites.append(site)
    coordinator = absolute_paths(dict(raw.get("coordinator", {})), CoordinatorConfig)
    coordinator["checkpoint_dir"] = str(run_dir / COORDINATOR_DIR)
    coordinator.pop("ledger_db", None)
    coordinator["metrics_port"] = args.base_port + 5
    if args.rounds is not None:
        coordinator["rounds"] = args.rounds
    coordinator["min_sites"] = min(int(coordinator.get("min_sites", 1)), args.sites)
    coordinator["expected_sites"] = args.sites  # round 1 waits for every site this command starts
    _sign_replies(sites, coordinator, run_dir / "certs" / "identities")
    federation = validate(FederationConfig, {**raw, "sites": sites, "coordinator": coordinator}, str(args.config))

    config_dir = run_dir / "configs"
    site_paths = []
    for site in sites:
        path = config_dir / f"{site['site_id']}.toml"
        atomic_write_text(path, tomli_w.dumps(site))
        site_paths.append(path)
    coordinator_path = config_dir / "coordinator.toml"
    atomic_write_text(coordinator_path, tomli_w.dumps({"run_id": federation.run_id, "coordinator": coordinator}))
    return DeploymentConfigs(coordinator_path, site_paths, federation, synthetic, len(entries))


# -- processes -------------------------------------------------------------------------------------
def _sign_replies(sites: list[dict[str, Any]], coordinator: dict[str, Any], identities: Path) -> None:
    """Give each site an identity, as every site of a real federation should have (docs/deployment.md,
    *Signed replies*): it signs its train replies and secure-aggregation keys, and the coordinator
    uses a reply only when the site it names signed it. Kept in the run dir, made once (a resumed
    run's sites keep theirs). Left alone where the config names identities itself, and for a single
    site (a secure sum, whose peer list the identity carries, needs two)."""
    from fedpose.federation.config import SITE_ID_PATTERN
    from fedpose.federation.secagg import crypto
    from fedpose.io import atomic_write

    if (len(sites) < 2 or coordinator.get("site_identities") or any("identity" in site for site in sites)
            # an id validation will refuse (missing, or a path such as ../x): no key file is named after it
            or not all(isinstance(site.get("site_id"), str) and re.fullmatch(SITE_ID_PATTERN, site["site_id"]) for site in sites)):
        return
    key_paths = {site["site_id"]: identities / f"{site['site_id']}.pem" for site in sites}
    for key_path in key_paths.values():
        if not key_path.exists():
            pem = crypto.new_identity()
            atomic_write(key_path, lambda fh, pem=pem: fh.write(pem))  # owner-only (0600) from the start
    public_keys = {site_id: crypto.identity_public_key(crypto.load_identity(path)) for site_id, path in key_paths.items()}
    for site in sites:
        site["identity"] = {"key": str(key_paths[site["site_id"]]), "peers": public_keys}
    coordinator["site_identities"] = public_keys


class ProcessGroup:
    """Processes this command started. Each runs in its own session with the run's token in its
    environment (inherited by whatever Flower starts from it): stopping sweeps the token, so
    processes Flower detaches or re-parents go too; a watchdog does the same if we are killed."""

    def __init__(self, run_dir: Path, env: dict[str, str], lock_fd: int | None = None):
        self.run_dir = run_dir
        self.token = uuid.uuid4().hex
        self.env = {**env, DEPLOY_TOKEN_ENV: self.token}
        self.procs: dict[str, subprocess.Popen] = {}
        self.commands = run_dir / "commands.sh"
        self.commands.write_text("#!/bin/sh\n# commands run by `fedpose deploy local` (in this order)\n")
        # the watchdog shares the run dir's lock: killed, we hold the run dir until everything is stopped
        self.watchdog = start_watchdog(self.token, run_dir / "logs" / "watchdog.log", env,
                                       keep_fds=(lock_fd,) if lock_fd is not None else ())

    def record(self, name: str, argv: list[str]) -> None:
        with self.commands.open("a") as fh:
            fh.write(f"# {name}\n{shlex.join(argv)}\n")

    def record_background(self, name: str, argv: list[str]) -> None:
        with self.commands.open("a") as fh:
            fh.write(f"# {name}\n{shlex.join(argv)} &\n")

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        self.record_background(name, argv)
        log = (self.run_dir / "logs" / f"{name}.log").open("ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        log.close()
        self.procs[name] = proc
        self._write_pids()
        return proc

    def run(self, name: str, argv: list[str], timeout: float = 60.0, record: bool = True) -> subprocess.CompletedProcess:
        if record:
            self.record(name, argv)
        result = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        with (self.run_dir / "logs" / f"{name}.log").open("a") as fh:
            fh.write(result.stdout + result.stderr)
        if result.returncode != 0:
            raise RuntimeError(f"{name} failed ({result.returncode}): {(result.stderr or result.stdout).strip()[-2000:]}")
        return result

    def _write_pids(self) -> None:
        pids = {"watchdog": self.watchdog.pid, **{n: p.pid for n, p in self.procs.items()}}
        (self.run_dir / "pids.json").write_text(json.dumps(pids, indent=1))

    def stop_all(self) -> None:
        """SIGTERM every process we started and all they started (the token), SIGKILL what is left
        after STOP_GRACE_S; then release the watchdog (it finds nothing left). Idempotent."""
        stop_tagged(self.token, STOP_GRACE_S)
        for proc in self.procs.values():
            proc.poll()  # reap: no zombies of ours
        self.watchdog.stdin.close()  # type: ignore[union-attr]
        try:
            self.watchdog.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.watchdog.kill()


def _wait_port(port: int, proc: subprocess.Popen, name: str, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode}; see {log}")
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise RuntimeError(f"{name} did not open port {port} within {timeout:.0f} s; see {log}")


def port_free(port: int) -> bool:
    """Whether a server could bind ``port`` on 127.0.0.1 now. Bind, not connect: a port held by an
    outgoing connection (Linux draws those from 32768–60999) has no listener to answer a connect,
    yet a server cannot bind it. With SO_REUSEADDR, as the servers bind: a port left in TIME_WAIT by
    the last deployment is free to them."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class SuperLinkLost(Exception):
    """The deployment's SuperLink exited, or has not answered (or not known the run) for too long."""


class RunStatus(NamedTuple):
    """A run's status as ``flwr ls`` reports it, and Flower's details of it ("No heartbeat received
    from the task"): for a run Flower ended, the details are the only place that says why."""

    status: str
    details: str = ""


def run_status(group: ProcessGroup, run_id: str, timeout: float) -> tuple[RunStatus, str]:
    """(the run's status, '') from ``flwr ls``; (empty, why) when the SuperLink did not answer or does
    not know the run (``flwr ls --format json`` reports a failure as ``"success": false`` with exit code 0)."""
    try:
        result = group.run("flwr-ls", [_bin("flwr"), "ls", CONNECTION, "--run-id", run_id, "--format", "json"], timeout=timeout,
                           record=False)
        answer = json.loads(result.stdout[result.stdout.index("{"):])
    except subprocess.TimeoutExpired:
        return RunStatus(""), f"`flwr ls` got no answer within {timeout:.0f} s"
    except (RuntimeError, ValueError) as exc:
        return RunStatus(""), f"`flwr ls` failed: {' '.join(str(exc).split())[-300:]}"
    if not answer.get("success", True):
        return RunStatus(""), f"`flwr ls` failed: {' '.join(str(answer.get('error-message') or '').split())[-300:]}"
    runs = answer.get("runs") or []
    if not runs:  # restarted (it keeps runs in memory), or another deployment's SuperLink on its address
        return RunStatus(""), f"it does not know run {run_id}"
    details = " ".join(str(runs[0].get("status-details") or "").split())
    return RunStatus(str(runs[0]["status"]), "" if details == "N/A" else details[:300]), ""


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _handle(args: argparse.Namespace) -> int:
    repo = Path(__file__).resolve().parents[2]
    if not (repo / "pyproject.toml").exists() or not (repo / "coordinator" / "server_app.py").exists():
        raise UserError(f"the Flower app (pyproject.toml, coordinator/, sites/) was not found at {repo}")
    run_dir = args.run_dir.resolve()
    # before anything is written: two deployments would share configs/, flwr-home/ and the coordinator
    with exclusive(directory_lock(run_dir), f"the run directory {run_dir}", "deploy local") as lock:
        checkpoint_dir = run_dir / COORDINATOR_DIR
        # a coordinator still writing there (one a killed deploy local left, or a `flwr run` by hand)
        probe(directory_lock(checkpoint_dir), f"the coordinator's checkpoint_dir {checkpoint_dir}", "coordinator")
        if not args.resume:
            from fedpose.federation.config import CoordinatorConfig

            refuse_fresh_start(checkpoint_dir, CoordinatorConfig(checkpoint_dir=checkpoint_dir).ledger_path,
                               f"the run directory {run_dir}", "another --run-dir")
        return _deploy(args, repo, run_dir, lock.fileno())


def _deploy(args: argparse.Namespace, repo: Path, run_dir: Path, lock_fd: int) -> int:
    from fedpose.cli.certs import write_dev_certificates

    for sub in ("logs", "configs", "flwr-home"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)

    coordinator_toml, site_tomls, federation, synthetic, config_sites = write_deployment_configs(args, run_dir)
    checkpoint_dir = Path(federation.coordinator.checkpoint_dir)
    if args.resume:
        note = finished_run(checkpoint_dir, federation.run_id, federation.coordinator.rounds, "--resume --rounds {rounds}")
        if note is not None:
            print(note, flush=True)
            return 0
    ensure_federation_data(data_paths(federation.sites, federation.coordinator), synthetic, config_sites, args.config)
    fleet, control, health, metrics = args.base_port, args.base_port + 1, args.base_port + 3, args.base_port + 5
    node_ports = [args.base_port + 10 + i for i in range(args.sites)]
    site_metric_ports = [args.base_port + 20 + i for i in range(args.sites)]
    busy = [p for p in (fleet, control, health, metrics, *node_ports, *site_metric_ports) if not port_free(p)]
    if busy:
        raise UserError(f"ports already in use on 127.0.0.1: {busy} (choose another --base-port)")

    site_ids = [site.site_id for site in federation.sites]
    certs = run_dir / "certs"
    if not (certs / "ca.crt").exists():
        write_dev_certificates(certs, site_ids)
    else:
        missing = [s for s in site_ids if not (certs / "sites" / s).exists()]
        if missing:
            raise UserError(f"{certs} lacks SuperNode keys for {missing}; delete it to regenerate")

    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", FLWR_HOME=str(run_dir / "flwr-home"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1")
    (run_dir / "flwr-home" / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
        f'address = "127.0.0.1:{control}"\nroot-certificates = "{certs / "ca.crt"}"\n'
    )
    group = ProcessGroup(run_dir, env, lock_fd)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    started = time.monotonic()
    run_id = ""
    try:
        superlink = group.start("superlink", [
            _bin("flower-superlink"), "--ssl-ca-certfile", str(certs / "ca.crt"), "--ssl-certfile", str(certs / "server.crt"),
            "--ssl-keyfile", str(certs / "server.key"), "--enable-supernode-auth", "--disable-runtime-dependency-installation",
            "--fleet-api-type", "grpc-rere", "--fleet-api-address", f"127.0.0.1:{fleet}", "--host", "127.0.0.1",
            "--port", str(control), "--health-server-address", f"127.0.0.1:{health}",
            # in-memory SuperLink state: its SQLite backend hit "database is locked" (lost replies) on
            # a loaded machine; nothing the run needs lives there (the coordinator checkpoints itself)
        ])
        _wait_port(fleet, superlink, "SuperLink Fleet API", run_dir / "logs" / "superlink.log")
        _wait_port(control, superlink, "SuperLink Control API", run_dir / "logs" / "superlink.log")
        for site_id in site_ids:  # the SuperLink keeps registrations in memory: register at every start
            try:
                group.run(f"register-{site_id}", [_bin("flwr"), "supernode", "register", str(certs / "sites" / f"{site_id}.pub"),
                                                  CONNECTION, "--name", site_id])
            except RuntimeError as exc:
                if "already in use" not in str(exc):
                    raise
        for site_id, site_toml, port in zip(site_ids, site_tomls, node_ports):
            group.start(f"supernode-{site_id}", [
                _bin("flower-supernode"), "--superlink", f"127.0.0.1:{fleet}", "--grpc-rere",
                "--root-certificates", str(certs / "ca.crt"), "--auth-supernode-private-key", str(certs / "sites" / site_id),
                "--node-config", f'site-config="{site_toml}"', "--host", "127.0.0.1", "--port", str(port),
                "--isolation", "process",  # the site's own SuperExec runs its installed ClientApp (sites/pinned.py)
            ])
            group.start(f"superexec-{site_id}", [_bin("fedpose-site-superexec"), "--runtime-api-address",
                                                  f"127.0.0.1:{port}", "--insecure"])
        for site_id, site_toml, port in zip(site_ids, site_tomls, site_metric_ports):
            group.start(f"metrics-{site_id}", [sys.executable, "-m", "sites.metrics", "--site-config", str(site_toml),
                                                "--port", str(port)])
        # A site whose SuperNode cannot start (its port taken since the check above) would otherwise
        # be missing from every round, said only after round 1 waited out its timeout for it.
        for name, port in [*((f"supernode-{s}", p) for s, p in zip(site_ids, node_ports)),
                           *((f"metrics-{s}", p) for s, p in zip(site_ids, site_metric_ports))]:
            _wait_port(port, group.procs[name], name, run_dir / "logs" / f"{name}.log", timeout=SITE_START_TIMEOUT_S)
        run_config = f'coordinator-config="{coordinator_toml}" resume={"true" if args.resume else "false"}'
        out = group.run("flwr-run", [_bin("flwr"), "run", str(repo), CONNECTION, "--run-config", run_config, "--format", "json"],
                        timeout=120).stdout
        run_id = str(json.loads(out[out.index("{"):])["run-id"])
        print(f"run {run_id} submitted: {args.sites} sites, logs in {run_dir / 'logs'}", flush=True)
        (run_dir / "run_id").write_text(run_id)
        try:
            with printing_progress(site_progress(federation)):
                status, details = _follow(group, run_id, checkpoint_dir, started, args.timeout, superlink, args.superlink_timeout)
        except SuperLinkLost as exc:  # `flwr log` needs the SuperLink too: the coordinator's log is gone with it
            group.stop_all()  # before saying so
            print(f"fedpose: error: lost the SuperLink (127.0.0.1:{fleet}, control API :{control}): {exc}; everything "
                  f"this run started is stopped — continue with --resume (see {run_dir / 'logs' / 'superlink.log'})",
                  file=sys.stderr, flush=True)
            return 1
        print(f"run {run_id}: {status.replace(':', ': ', 1)}", flush=True)  # Flower's "finished:completed"
        coordinator_log = save_coordinator_log(group, run_id, run_dir)
        for line in coordinator_log.splitlines():
            if line.startswith(("stopping", "resuming", "--resume")) or "rejected update" in line:
                print(line, flush=True)
        if status != "finished:completed" or not (checkpoint_dir / REPORT_FILE).exists():
            return report_failed_run(status, coordinator_log, run_dir / "logs", details)
        return conclude_run(checkpoint_dir, args.allow_site_failures)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:  # a process that would not start (its log is named)
        group.stop_all()
        print(f"fedpose: error: {exc}; everything this run started is stopped", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        if run_id:
            save_coordinator_log(group, run_id, run_dir)
        raise
    finally:
        group.stop_all()
        signal.signal(signal.SIGTERM, previous)


def _round_printer(history_dir: Path) -> Callable[[list[Any]], None]:
    """Prints rounds as the coordinator's history gains them, round 0 (the initial model's PCKh,
    kept in the model checkpoint, written before the history) before round 1 — the lines simulate
    prints from the ServerApp itself."""
    from fedpose.federation.aggregation import load_checkpoint_meta
    from fedpose.federation.global_model import GLOBAL_CHECKPOINT
    from fedpose.federation.report import initial_line, round_line

    def print_rounds(rounds: list[Any]) -> None:
        for entry in rounds:
            if entry.round == 1:
                try:
                    initial = load_checkpoint_meta(history_dir / GLOBAL_CHECKPOINT)["state"].get("initial_pckh")
                except (OSError, ValueError, KeyError, zipfile.BadZipFile):  # no readable checkpoint: no line
                    initial = None
                if initial is not None:
                    print(initial_line(initial), flush=True)
            print(round_line(entry), flush=True)

    return print_rounds


def _follow(group: ProcessGroup, run_id: str, history_dir: Path, started: float, timeout: float | None,
            superlink: subprocess.Popen, superlink_timeout: float) -> RunStatus:
    """Print each finished round (from the coordinator's history.json) until the run finishes.
    Raises :class:`SuperLinkLost` when the SuperLink exits, or has not answered or not known the run
    for ``superlink_timeout`` seconds (without this, a lost SuperLink was polled for ever)."""
    from fedpose.federation.report import load_history

    printed = 0
    print_rounds = _round_printer(history_dir)
    status, lost_since, asked = RunStatus(""), None, -math.inf
    coordinator = _Coordinator(history_dir)
    exited: set[str] = set()
    while True:
        time.sleep(HISTORY_POLL_S)
        try:
            rounds = load_history(history_dir)
        except (OSError, ValueError):
            rounds = []
        print_rounds(rounds[printed:])
        printed = max(printed, len(rounds))
        _say_which_site_processes_exited(group, exited)
        if superlink.poll() is not None:
            raise SuperLinkLost(f"it exited with code {superlink.returncode} (pid {superlink.pid})")
        if timeout is not None and time.monotonic() - started > timeout:
            return RunStatus(f"timeout after {timeout:.0f} s (last status {status.status or 'unknown'})")
        ended = coordinator.ended()
        gone_for = coordinator.gone_for()
        if gone_for is not None and gone_for >= CRASH_GRACE_S:
            return RunStatus("finished:failed", f"the coordinator's process (pid {coordinator.seen}) exited {gone_for:.0f} s ago "
                             "without finishing the run, and Flower had not yet noticed")
        wait = ENDING_POLL_S if ended else LOST_POLL_S if lost_since is not None else STATUS_POLL_S
        if time.monotonic() - asked < wait:
            continue
        asked = time.monotonic()
        current, problem = run_status(group, run_id, timeout=max(superlink_timeout, FLWR_CLI_TIMEOUT_S))
        if problem:
            lost_since = asked if lost_since is None else lost_since
            if time.monotonic() - lost_since >= superlink_timeout:
                raise SuperLinkLost(f"{problem} — for {time.monotonic() - lost_since:.0f} s (--superlink-timeout {superlink_timeout:g})")
        else:
            status, lost_since = current, None
        if status.status.startswith(FINISHED):
            print_rounds(load_history(history_dir)[printed:])
            return status


#: what a site loses when one of its processes is gone (deploy local's process names: "<kind>-<site id>")
SITE_PROCESS_LOSS = {"supernode": "it takes no part in the rounds that follow (reported missing)",
                     "superexec": "it takes no part in the rounds that follow (reported missing)",
                     "metrics": "its metrics are no longer served"}


def _say_which_site_processes_exited(group: ProcessGroup, said: set[str]) -> None:
    """Tell the operator, once each, that a site's process is gone (a site may leave a federation: the
    run goes on; but only its rounds' lines would say so, and only as "missing")."""
    for name, proc in group.procs.items():
        kind, _, site_id = name.partition("-")
        if kind in SITE_PROCESS_LOSS and name not in said and proc.poll() is not None:
            said.add(name)
            print(f"fedpose: warning: {name} exited with code {proc.returncode} (see {group.run_dir / 'logs' / f'{name}.log'}): "
                  f"{site_id} goes on without it; {SITE_PROCESS_LOSS[kind]}", file=sys.stderr, flush=True)


class _Coordinator:
    """Whether the run's coordinator (its ServerApp, on this machine) has ended, from its files alone:
    its report.json written since this run was submitted (a report from before a --resume is older),
    or the process that held its checkpoint_dir's lock seen and gone (a crash: no report)."""

    def __init__(self, checkpoint_dir: Path):
        self.report, self.lock, self.submitted = checkpoint_dir / REPORT_FILE, directory_lock(checkpoint_dir), time.time()
        self.seen: int | None = None  # the pid of the coordinator that held the lock
        self.gone_since: float | None = None  # when it was first seen gone (time.monotonic)

    def ended(self) -> bool:
        if self.report.exists() and self.report.stat().st_mtime >= self.submitted:
            return True
        holder = read_holder(self.lock)  # a lock record left by an earlier, killed coordinator names a dead pid
        if holder is not None and holder.role == "coordinator" and holder.host == socket.gethostname() and _alive(holder.pid):
            self.seen, self.gone_since = holder.pid, None
            return False
        if self.seen is None or _alive(self.seen):
            return False
        self.gone_since = time.monotonic() if self.gone_since is None else self.gone_since
        return True

    def gone_for(self) -> float | None:
        """Seconds since :meth:`ended` first found the coordinator (``seen``) gone without its report —
        a crash (a process that reported was never looked at again); None while it runs or before it was seen."""
        return None if self.gone_since is None else time.monotonic() - self.gone_since


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs. A killed ServerApp stays a zombie until the SuperLink, its parent, reaps
    it, which Flower 1.39 does not do while the run lasts; ``kill(pid, 0)`` answers for a zombie too."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc (macOS), or it just ended
        return True
    return stat[stat.rindex(")") + 2:].split(maxsplit=1)[0] != "Z"  # the state follows "(command name)"


def report_failed_run(status: str, coordinator_log: str, log_dir: Path, details: str = "") -> int:
    """The coordinator's own error lines, then where to look: "the run failed" alone sends the
    operator digging through logs for the one line that says why. Where the coordinator said nothing
    (Flower ended the run: its ServerApp's heartbeats stopped reaching the SuperLink), Flower's
    ``details`` say why. The exit code: 2 when the coordinator refused to start (its state is
    another's, or would be overwritten), else 1."""
    errors = [line for line in coordinator_log.splitlines() if line.startswith(COORDINATOR_ERROR_PREFIX)]
    for line in errors:
        print(line, file=sys.stderr, flush=True)
    why = f"{status}: {details}" if details and not errors else status
    print(f"fedpose: error: the run did not complete ({why}); see {log_dir}", file=sys.stderr, flush=True)
    return 2 if any(REFUSED in line for line in errors) else 1


def save_coordinator_log(group: ProcessGroup, run_id: str, run_dir: Path) -> str:
    """The ServerApp's output (``flwr log --show``) → logs/coordinator.log; returns it."""
    try:
        result = subprocess.run([_bin("flwr"), "log", run_id, CONNECTION, "--show"], env=group.env, capture_output=True,
                                text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return ""
    text = result.stdout + result.stderr
    (run_dir / "logs" / "coordinator.log").write_text(text)
    return text
