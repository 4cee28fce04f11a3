"""Stopping every process ``fedpose deploy local`` started — also when it is killed.

Every process it starts gets ``FEDPOSE_DEPLOY_TOKEN=<token>`` in its environment and passes it on
to its own children (Flower's SuperExec, ServerApp and ClientApp processes inherit it), so
:func:`stop_tagged` finds them all in ``/proc`` however Flower re-parents or detaches them.

SIGKILL cannot be caught, so a small watchdog process (``python -m fedpose.cli.process_sweep
TOKEN``, in its own session) holds the read end of a pipe whose write end only ``deploy local``
holds: when ``deploy local`` ends for any reason the kernel closes it, the watchdog reads EOF and
stops everything tagged with the token. Standard library only: it must start fast.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

DEPLOY_TOKEN_ENV = "FEDPOSE_DEPLOY_TOKEN"
SWEEP_POLL_S = 0.2
SWEEP_LIMIT_S = 30.0  #: give up re-scanning after this long (a process that forks faster than we kill)


def tagged_processes(token: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose environment holds ``FEDPOSE_DEPLOY_TOKEN=token``."""
    marker = f"{DEPLOY_TOKEN_ENV}={token}".encode()
    found = []
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            if marker not in (proc_dir / "environ").read_bytes().split(b"\0"):
                continue
            state = (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone, or not ours to read
        if state != "Z":
            found.append(int(proc_dir.name))
    return [pid for pid in found if pid != os.getpid()]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_tagged(token: str, grace_s: float) -> list[int]:
    """SIGTERM every tagged process, SIGKILL what is left after ``grace_s``; re-scan until none is
    left (a dying parent may have started a child meanwhile). Returns the PIDs signalled."""
    signalled: list[int] = []
    deadline = time.monotonic() + SWEEP_LIMIT_S
    while time.monotonic() < deadline:
        pids = tagged_processes(token)
        if not pids:
            break
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        signalled += [pid for pid in pids if pid not in signalled]
        until = time.monotonic() + grace_s
        while time.monotonic() < until and tagged_processes(token):
            time.sleep(SWEEP_POLL_S)
        for pid in tagged_processes(token):
            _signal(pid, signal.SIGKILL)
        time.sleep(SWEEP_POLL_S)
    return signalled


def start_watchdog(token: str, log_path: Path, env: dict[str, str], keep_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start the watchdog; the caller keeps ``.stdin`` open for as long as it lives (never written).
    ``keep_fds`` stay open in the watchdog until it exits (a lock then lasts until everything is stopped)."""
    untagged = {k: v for k, v in env.items() if k != DEPLOY_TOKEN_ENV}  # the watchdog must not sweep itself
    with log_path.open("ab") as log:
        return subprocess.Popen([sys.executable, "-m", "fedpose.cli.process_sweep", token], stdin=subprocess.PIPE,
                                stdout=log, stderr=subprocess.STDOUT, env=untagged, start_new_session=True, pass_fds=keep_fds)


WATCHDOG_GRACE_S = 3.0  #: after ``deploy local`` died: processes get this long to exit on SIGTERM


def watch(token: str) -> None:
    """Block until stdin reaches EOF (``deploy local`` ended), then stop every tagged process."""
    while sys.stdin.buffer.read(65536):
        pass
    stopped = stop_tagged(token, WATCHDOG_GRACE_S)
    if stopped:
        print(f"deploy local ended without stopping everything: stopped {len(stopped)} process(es): {stopped}", flush=True)


if __name__ == "__main__":
    watch(sys.argv[1])
