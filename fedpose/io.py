"""Crash-safe file writes: readers see the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, IO


def umask_mode() -> int:
    """The mode a plain ``open()`` would give a new file under the process umask (0644 under 0022)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None], shared: bool = False) -> None:
    """Call ``write(fh)`` on a temp file in the same directory, fsync it, then rename over ``path``.

    The file is owner-only (0600, as the temp file is made) unless ``shared``: then it gets the
    mode the umask gives any new file — for outputs meant to be handed on (privatized images)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        if shared:
            os.chmod(tmp, umask_mode())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda fh: fh.write(text.encode()))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2))


def append_lines(path: str | Path, text: str, complete: Callable[[bytes], bool]) -> None:
    """Append ``text`` (whole lines, each ending in a newline) to an append-only log and fsync it.

    A last line without its newline is an earlier append cut short (a crash, a full disk): kept, its
    newline added, when ``complete(line)`` says it holds a whole entry (readers count it), cut off
    otherwise (readers skip it) — never fused with the new line into one malformed line."""
    with open(path, "a+b") as fh:
        fh.seek(0)
        data = fh.read()
        if data and not data.endswith(b"\n"):
            start = data.rfind(b"\n") + 1
            if complete(data[start:]):
                fh.write(b"\n")
            else:
                fh.truncate(start)
        fh.write(text.encode())
        fh.flush()
        os.fsync(fh.fileno())
