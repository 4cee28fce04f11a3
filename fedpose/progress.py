"""Progress for long loops: a tqdm bar on a terminal, plain periodic lines anywhere else.

tqdm redraws its bar with carriage returns; written into a log file or a CI console (stderr not a
TTY) that becomes one endless line of ``\\r``-joined bars. There, :class:`PlainProgress` writes one
ordinary line every :data:`PLAIN_INTERVAL_S` seconds and one at the end.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

#: seconds between two plain progress lines
PLAIN_INTERVAL_S = 30.0


class PlainProgress:
    """The part of tqdm's interface fedpose uses (update, set_postfix, set_postfix_str, close), as lines."""

    def __init__(self, total: int, desc: str, unit: str = "it", stream: TextIO | None = None,
                 interval: float = PLAIN_INTERVAL_S) -> None:
        self.total, self.desc, self.unit = int(total), desc, unit
        self.stream = sys.stderr if stream is None else stream
        self.interval = float(interval)
        self.count = 0
        self.postfix = ""
        self.started = self.last = time.monotonic()
        self.closed = False

    def set_postfix(self, refresh: bool = False, **values: Any) -> None:
        self.postfix = ", ".join(f"{key} {value}" for key, value in values.items())

    def set_postfix_str(self, text: str, refresh: bool = False) -> None:
        self.postfix = text

    def update(self, n: int = 1) -> None:
        self.count += n
        now = time.monotonic()
        if now - self.last >= self.interval and self.count < self.total:
            self._line(now)

    def close(self) -> None:
        if not self.closed and self.count:
            self._line(time.monotonic())
        self.closed = True

    def _line(self, now: float) -> None:
        self.last = now
        elapsed = now - self.started
        rate = f", {elapsed / self.count:.3g} s/{self.unit}" if self.count else ""
        percent = f" ({100 * self.count / self.total:.0f}%)" if self.total else ""
        extra = f"; {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {self.count}/{self.total} {self.unit}{percent}, {elapsed:.0f} s{rate}{extra}",
              file=self.stream, flush=True)


def progress_bar(total: int, desc: str, unit: str = "it", disable: bool = False, stream: TextIO | None = None) -> Any:
    """A tqdm bar when ``stream`` (default stderr) is a terminal, else :class:`PlainProgress`."""
    from tqdm.auto import tqdm

    stream = sys.stderr if stream is None else stream
    if disable:
        return tqdm(total=total, disable=True)
    is_tty = getattr(stream, "isatty", lambda: False)()
    if is_tty:
        return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=False, file=stream)
    return PlainProgress(total, desc, unit, stream)
