"""``fedpose deploy local``: a real Flower deployment on 127.0.0.1 — SuperLink, one SuperNode per
site, the coordinator submitted with ``flwr run`` — over gRPC with TLS and SuperNode
authentication, exactly as it would run across hospitals (separate processes, own ports).

Everything goes into ``--run-dir``: ``certs/`` (``fedpose certs``), ``configs/`` (the coordinator
TOML and one site TOML per site), ``flwr-home/`` (the SuperLink connection for ``flwr``),
``logs/`` (one log per process), ``sites/<id>/`` (each site's persisted budget), ``coordinator/``
(global model, server-optimizer state, ledger, history, report) and ``commands.sh`` (every
command that was run — the same commands a multi-machine deployment uses). Processes are stopped
by PID on exit, on error and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fedpose.cli.common import UserError

CONNECTION = "fedpose-local"
DEFAULT_CONFIG = "configs/demo.toml"
STOP_GRACE_S = 10.0
STATUS_POLL_S = 5.0  # each poll runs the flwr CLI (a Python process): not too often
FINISHED = "finished"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("deploy", help="run a real Flower deployment (SuperLink + SuperNodes + coordinator)")
    sub = parser.add_subparsers(dest="target", metavar="TARGET", required=True)
    local = sub.add_parser("local", help="everything on 127.0.0.1, separate processes, gRPC + TLS + SuperNode auth",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    local.add_argument("--sites", type=int, required=True, help="number of sites (one SuperNode each)")
    local.add_argument("--rounds", type=int, default=None, help="override coordinator.rounds")
    local.add_argument("--config", default=DEFAULT_CONFIG,
                       help="federation TOML: coordinator + site template(s) + [synthetic] (default: configs/demo.toml)")
    local.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a key of the federation TOML (repeatable)")
    local.add_argument("--run-dir", type=Path, default=Path("runs/deploy-local"), help="where everything is written")
    local.add_argument("--base-port", type=int, default=9092,
                       help="Fleet API port; Control API = +1, health = +3, coordinator metrics = +5, SuperNodes = +10+i, "
                       "site metrics = +20+i")
    local.add_argument("--resume", action="store_true", help="continue the run in --run-dir after its last checkpointed round")
    local.add_argument("--timeout", type=float, default=None, help="give up (and stop everything) after this many seconds")
    local.set_defaults(handler=_handle)


# -- configs ---------------------------------------------------------------------------------------
def write_deployment_configs(args: argparse.Namespace, run_dir: Path) -> tuple[Path, list[Path], list[str], Any]:
    """Site TOMLs (site-1..N from the template sites) + the coordinator TOML, all with absolute paths."""
    import tomli_w

    from fedpose.cli.simulate import SYNTHETIC_KEYS, ensure_synthetic
    from fedpose.config import apply_overrides, load_toml, validate
    from fedpose.federation.config import CoordinatorConfig, SiteConfig
    from fedpose.federation.deployment import CoordinatorRunConfig
    from fedpose.io import atomic_write_text

    if not 1 <= args.sites <= 10:
        raise UserError("--sites must be between 1 and 10 (ports base+10.. and base+20.. are per site)")
    raw = apply_overrides(load_toml(args.config), args.overrides)
    synthetic = raw.pop("synthetic", None)
    raw.pop("simulation", None)
    templates = raw.get("sites") or []
    if not templates:
        raise UserError(f"{args.config}: needs at least one [[sites]] entry as a template")
    if synthetic is not None:
        if set(synthetic) - SYNTHETIC_KEYS:
            raise UserError(f"{args.config}: unknown [synthetic] keys {sorted(set(synthetic) - SYNTHETIC_KEYS)}")
        if args.sites != len(templates):
            synthetic = {**synthetic, "dir": f"{synthetic['dir']}-{args.sites}sites"}
        ensure_synthetic(synthetic, args.sites)
        data_dir = Path(synthetic["dir"]).resolve()

    config_dir = run_dir / "configs"
    site_paths, site_ids = [], []
    for index in range(1, args.sites + 1):
        site = json.loads(json.dumps(templates[(index - 1) % len(templates)]))
        site["site_id"] = f"site-{index}"
        site["state_dir"] = str((run_dir / "sites" / site["site_id"]).resolve())
        site.setdefault("data", {})
        if synthetic is not None:
            site["data"]["train"] = str(data_dir / f"site-{index}")
            if site.get("public_data"):
                site["public_data"] = str(data_dir / "public")
        else:
            site["data"]["train"] = str(Path(site["data"]["train"]).resolve())
        validate(SiteConfig, site, f"site {index} of {args.config}")
        path = config_dir / f"site-{index}.toml"
        atomic_write_text(path, tomli_w.dumps(site))
        site_paths.append(path.resolve())
        site_ids.append(site["site_id"])

    coordinator = dict(raw.get("coordinator", {}))
    coordinator["checkpoint_dir"] = str((run_dir / "coordinator").resolve())
    coordinator.pop("ledger_db", None)
    coordinator["metrics_port"] = args.base_port + 5
    if args.rounds is not None:
        coordinator["rounds"] = args.rounds
    coordinator["min_sites"] = min(int(coordinator.get("min_sites", 1)), args.sites)
    data = dict(coordinator.get("data", {}))
    if synthetic is not None:
        data["val"] = str(data_dir / "test")
        if coordinator.get("public_data"):
            coordinator["public_data"] = str(data_dir / "public")
    coordinator["data"] = data
    run_raw = {"run_id": raw.get("run_id", "fedpose"), "coordinator": coordinator}
    run_cfg = validate(CoordinatorRunConfig, run_raw, f"coordinator of {args.config}")
    assert isinstance(run_cfg.coordinator, CoordinatorConfig)
    coordinator_path = (config_dir / "coordinator.toml").resolve()
    atomic_write_text(coordinator_path, tomli_w.dumps(run_raw))
    return coordinator_path, site_paths, site_ids, run_cfg


# -- processes -------------------------------------------------------------------------------------
class ProcessGroup:
    """Processes this command started, stopped by PID (their own session, so children go too)."""

    def __init__(self, run_dir: Path, env: dict[str, str]):
        self.run_dir = run_dir
        self.env = env
        self.procs: dict[str, subprocess.Popen] = {}
        self.seen: set[int] = set()  #: descendant PIDs observed while running (Flower re-parents some)
        self.commands = run_dir / "commands.sh"
        self.commands.write_text("#!/bin/sh\n# commands run by `fedpose deploy local` (in this order)\n")

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

    def observe(self) -> None:
        """Remember the current descendants (called while following the run, and before stopping)."""
        for proc in self.procs.values():
            self.seen.update(_descendants(proc.pid))

    def _write_pids(self) -> None:
        (self.run_dir / "pids.json").write_text(json.dumps({n: p.pid for n, p in self.procs.items()}, indent=1))

    def stop_all(self) -> None:
        """SIGTERM each process group we started (reverse start order) and every descendant PID
        (Flower's SuperExec detaches into its own session), then SIGKILL stragglers."""
        self.observe()
        descendants = [pid for pid in sorted(self.seen) if _is_flower_process(pid)]  # a dead PID may be reused
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGTERM)
        for pid in descendants:
            _signal_pid(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for pid in descendants:
            _signal_pid(pid, signal.SIGKILL)
        for proc in self.procs.values():
            _signal_group(proc.pid, signal.SIGKILL)  # the group may hold children that outlived the leader
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _descendants(pid: int) -> list[int]:
    """PIDs of all live descendants of ``pid``, plus every process in a session one of them leads
    (Flower's SuperExec starts its app processes in its own session; they outlive it when
    reparented). From /proc; empty where /proc is absent."""
    children: dict[int, list[int]] = {}
    sessions: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            child = int(stat.parent.name)
            children.setdefault(int(fields[1]), []).append(child)
            sessions.setdefault(int(fields[3]), []).append(child)
        except (OSError, IndexError, ValueError):
            continue
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    for leader in list(found):
        found += [p for p in sessions.get(leader, []) if p not in found and p != pid]
    return found


def _is_flower_process(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return any(name in cmdline for name in ("flwr", "flower-", "sites.metrics"))


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the group id is the PID of the leader we started (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


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


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def run_status(group: ProcessGroup, run_id: str) -> str:
    result = group.run("flwr-ls", [_bin("flwr"), "ls", CONNECTION, "--run-id", run_id, "--format", "json"], timeout=120, record=False)
    runs = json.loads(result.stdout).get("runs", [])
    return str(runs[0]["status"]) if runs else "unknown"


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _handle(args: argparse.Namespace) -> int:
    from fedpose.cli.certs import write_dev_certificates

    repo = Path(__file__).resolve().parents[2]
    if not (repo / "pyproject.toml").exists() or not (repo / "coordinator" / "server_app.py").exists():
        raise UserError(f"the Flower app (pyproject.toml, coordinator/, sites/) was not found at {repo}")
    run_dir = args.run_dir.resolve()
    if run_dir.exists() and any((run_dir / "coordinator").glob("global.npz")) and not args.resume:
        raise UserError(f"{run_dir} holds a previous run: use --resume, or another --run-dir")
    for sub in ("logs", "configs", "flwr-home"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    fleet, control, health, metrics = args.base_port, args.base_port + 1, args.base_port + 3, args.base_port + 5
    node_ports = [args.base_port + 10 + i for i in range(args.sites)]
    site_metric_ports = [args.base_port + 20 + i for i in range(args.sites)]
    busy = [p for p in (fleet, control, health, metrics, *node_ports, *site_metric_ports) if not _port_free(p)]
    if busy:
        raise UserError(f"ports already in use on 127.0.0.1: {busy} (choose another --base-port)")

    coordinator_toml, site_tomls, site_ids, run_cfg = write_deployment_configs(args, run_dir)
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
    group = ProcessGroup(run_dir, env)
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
            ])
        for index, (site_id, site_toml) in enumerate(zip(site_ids, site_tomls)):
            group.start(f"metrics-{site_id}", [sys.executable, "-m", "sites.metrics", "--site-config", str(site_toml),
                                                "--port", str(args.base_port + 20 + index)])
        run_config = f'coordinator-config="{coordinator_toml}" resume={"true" if args.resume else "false"}'
        out = group.run("flwr-run", [_bin("flwr"), "run", str(repo), CONNECTION, "--run-config", run_config, "--format", "json"],
                        timeout=120).stdout
        run_id = str(json.loads(out[out.index("{"):])["run-id"])
        print(f"run {run_id} submitted: {args.sites} sites, logs in {run_dir / 'logs'}", flush=True)
        (run_dir / "run_id").write_text(run_id)
        status = _follow(group, run_id, run_dir, Path(run_cfg.coordinator.checkpoint_dir), started, args.timeout)
        print(f"run {run_id}: {status}", flush=True)
        for line in save_coordinator_log(group, run_id, run_dir).splitlines():
            if line.startswith(("stopping", "resuming", "federation finished", "--resume")) or "rejected update" in line:
                print(line, flush=True)
        report = Path(run_cfg.coordinator.checkpoint_dir) / "report.json"
        if status != "finished:completed" or not report.exists():
            print(f"fedpose: error: the run did not complete ({status}); see {run_dir / 'logs'}", file=sys.stderr)
            return 1
        print(f"report: {report}", flush=True)
        return 0
    except KeyboardInterrupt:
        if run_id:
            save_coordinator_log(group, run_id, run_dir)
        raise
    finally:
        group.stop_all()
        signal.signal(signal.SIGTERM, previous)


def _follow(group: ProcessGroup, run_id: str, run_dir: Path, history_dir: Path, started: float, timeout: float | None) -> str:
    """Print each finished round (from the coordinator's history.json) until the run finishes."""
    from fedpose.federation.report import load_history, round_line

    printed = 0
    while True:
        time.sleep(STATUS_POLL_S)
        try:
            rounds = load_history(history_dir)
        except (OSError, ValueError):
            rounds = []
        for entry in rounds[printed:]:
            print(round_line(entry), flush=True)
        printed = max(printed, len(rounds))
        group.observe()
        status = run_status(group, run_id)
        if status.startswith(FINISHED):
            for entry in load_history(history_dir)[printed:]:
                print(round_line(entry), flush=True)
            return status
        if timeout is not None and time.monotonic() - started > timeout:
            return f"timeout after {timeout:.0f} s (last status {status})"


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
