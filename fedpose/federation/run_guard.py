"""One writer per run: an exclusive lock on a run's state, and the refusal to start a fresh run over
a previous one's state. Flower-free: ``fedpose deploy local`` locks its run directory, the
coordinator (ServerApp) its checkpoint_dir and ledger.

Two coordinators on one checkpoint_dir drive one ledger: each sees some sites' replies, and a
released update ends up recorded as ``missing`` — an understated spend. The lock is
``fcntl.flock`` on a lock file, held for the life of the process: the kernel releases it when the
holder dies however it dies, so a crashed holder never blocks a restart (its holder record stays
in the file, stale, until the next holder overwrites it). The lock is advisory: it keeps fedpose
processes apart, not an operator who edits the files by hand.

A refused start raises :class:`RunStateRefused` (exit code 2 on the CLI), whose message always
begins with ``refused:`` and names what it protects and how to proceed.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from fedpose.config import Strict

LOCK_FILE = ".fedpose.lock"  #: in a locked directory; a locked file gets ``<name>.lock`` beside it
REFUSED = "refused: "  #: how every message of a RunStateRefused begins (deploy local maps it to exit 2)


class RunStateRefused(Exception):
    """Starting would put a run's saved state at risk (overwrite it, or share it with a live writer)."""

    def __init__(self, message: str):
        super().__init__(message if message.startswith(REFUSED) else REFUSED + message)


class LockHolder(Strict):
    """Who holds a lock: written into the lock file by the holder, read by whoever is refused."""

    pid: int
    host: str
    started: str  #: UTC, ISO 8601
    command: str
    role: str  #: "deploy local", "coordinator", …

    def describe(self) -> str:
        return f"{self.role} pid {self.pid} on {self.host}, started {self.started}: {self.command}"


def directory_lock(directory: str | Path) -> Path:
    """The lock file of a directory (inside it; the directory is created if absent)."""
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    return directory / LOCK_FILE


def file_lock(path: str | Path) -> Path:
    """The lock file of a file (beside it: the file itself may be replaced or not exist yet)."""
    path = Path(path).resolve()
    return path.with_name(path.name + ".lock")


# Locks this process holds: lock file → [open file, nesting depth]. flock conflicts between two open
# files of one process too, so a nested request (a ServerApp run in-process by a command that holds
# its checkpoint_dir already) reuses the lock.
_held: dict[Path, list[Any]] = {}
_held_guard = threading.Lock()


@contextmanager
def exclusive(path: Path, what: str, role: str) -> Iterator[BinaryIO]:
    """Hold the exclusive lock of lock file ``path`` (:func:`directory_lock`, :func:`file_lock`) for
    the block (it yields the open lock file: a child given its descriptor holds the lock too, until
    it exits); ``what`` names what it protects in a refusal ("the run directory /x"). Raises
    :class:`RunStateRefused` naming the holder when another process holds it."""
    with _held_guard:
        if path in _held:
            _held[path][1] += 1
        else:
            _held[path] = [_acquire(path, what, role), 1]
    try:
        yield _held[path][0]
    finally:
        with _held_guard:
            _held[path][1] -= 1
            if _held[path][1] == 0:
                handle = _held.pop(path)[0]
                handle.truncate(0)  # before the unlock: the next holder writes its own record
                handle.close()  # closing the last descriptor releases the flock


def _acquire(path: Path, what: str, role: str) -> BinaryIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a+b")  # never truncated before we hold it: the holder's record stays readable
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = read_holder(path)
        handle.close()
        by = holder.describe() if holder is not None else "another process (it is starting: no holder record yet)"
        raise RunStateRefused(f"{what} is in use by {by} — one {role} at a time may write a run's state; wait for it to "
                              f"end or stop it (the lock ends with the holder, however it ends: a crashed one blocks nothing; lock file {path})") from None
    record = LockHolder(pid=os.getpid(), host=socket.gethostname(), role=role,
                        started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), command=_command_line())
    handle.truncate(0)
    handle.write(record.model_dump_json().encode())
    handle.flush()
    return handle


def read_holder(path: Path) -> LockHolder | None:
    """The holder record in a lock file (None: empty or unreadable)."""
    try:
        return LockHolder.model_validate(json.loads(path.read_bytes() or b"null"))
    except (OSError, ValueError):
        return None


def probe(path: Path, what: str, role: str) -> None:
    """Raise :class:`RunStateRefused` if another process holds lock file ``path`` (holds nothing)."""
    with exclusive(path, what, role):
        pass


_SECRET_OPTION = re.compile(r"^--?[\w-]*(token|secret|password|key)[\w-]*$", re.IGNORECASE)


def _command_line() -> str:
    """This process's command line, one line, with the values of secret-looking options hidden
    (Flower's ServerApp process gets its runtime token as ``--token``)."""
    try:
        argv = [a.decode(errors="replace") for a in Path("/proc/self/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        argv = [sys.executable, *sys.argv]
    shown: list[str] = []
    for arg in argv:
        name, eq, _ = arg.partition("=")
        if eq and _SECRET_OPTION.match(name):
            arg = f"{name}=***"
        elif shown and _SECRET_OPTION.match(shown[-1]):
            arg = "***"
        shown.append(arg)
    text = " ".join(" ".join(shown).split())  # one line (a `python -c` program has several)
    return text if len(text) <= 300 else text[:297] + "…"


@contextmanager
def coordinator_lock(checkpoint_dir: str | Path, ledger_path: str | Path) -> Iterator[None]:
    """The coordinator's locks: its checkpoint_dir, and its ledger when that lives elsewhere."""
    checkpoint_dir, ledger_path = Path(checkpoint_dir).resolve(), Path(ledger_path).resolve()
    with ExitStack() as stack:
        stack.enter_context(exclusive(directory_lock(checkpoint_dir), f"the coordinator's checkpoint_dir {checkpoint_dir}",
                                      "coordinator"))
        if ledger_path.parent != checkpoint_dir:
            stack.enter_context(exclusive(file_lock(ledger_path), f"the budget ledger {ledger_path}", "coordinator"))
        yield


# -- a fresh start over a previous run --------------------------------------------------------------------
#: files of a coordinator's checkpoint_dir that only a run that got somewhere writes
_RUN_STATE_FILES = ("global.npz", "server_optimizer.npz", "history.json", "report.json")


def previous_run_state(checkpoint_dir: str | Path, ledger_path: str | Path) -> list[str]:
    """What a fresh start would overwrite: the checkpoint files present and a ledger holding rounds
    (or one that cannot be read: it is not ours to judge as empty)."""
    from fedpose.federation.ledger import BudgetLedger, LedgerError

    checkpoint_dir, ledger_path = Path(checkpoint_dir), Path(ledger_path)
    found = [name for name in _RUN_STATE_FILES if (checkpoint_dir / name).exists()]
    if ledger_path.exists() and ledger_path.stat().st_size > 0:
        try:
            with BudgetLedger(ledger_path, read_only=True) as ledger:
                last = ledger.last_round()
            if last > 0:
                found.append(f"{ledger_path.name} with site reports up to round {last}")
        except (LedgerError, OSError, ValueError) as exc:
            found.append(f"{ledger_path.name}, unreadable ({exc})")
    return found


def refuse_fresh_start(checkpoint_dir: str | Path, ledger_path: str | Path, where: str, elsewhere: str) -> None:
    """Raise :class:`RunStateRefused` when ``checkpoint_dir`` / the ledger hold a previous run's state.
    ``where`` names the place to the user ("the run directory /x"), ``elsewhere`` how to choose another."""
    found = previous_run_state(checkpoint_dir, ledger_path)
    if found:
        raise RunStateRefused(f"a fresh start would overwrite the state of a previous run in {where} ({', '.join(found)}): "
                              f"continue that run with --resume, or use {elsewhere}; nothing was changed")
