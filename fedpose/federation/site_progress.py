"""A site's progress through its round, for the people who run it: ``<state_dir>/progress.json``.

A round of the main job runs minutes without a word: the coordinator hears from a site only when
its reply arrives. The site therefore keeps its own progress, rewritten before its first step and
after every step: the run, the round, the steps done of the round's steps and when the round's
training began. Like ``rounds.jsonl`` it is site-local and never sent, nor exported (the site's
metrics exporter publishes its budget only). It holds no statistic of the data, but *when* it
changes does: a round's work is fixed, not a step's (:mod:`fedpose.privacy.fixed_shape`), so each
step's duration tells how many chunks that step's sample took — a function of the number of units
N, which only the round's fixed work hides from whoever times the replies.

Who reads it: the site's operator, and the commands that run a whole federation on one machine for
one operator (``fedpose simulate``, ``fedpose deploy local``), which own every site's state dir and
print a line a minute while a round runs (:class:`ProgressLines`). A deployed coordinator cannot: it
holds no site's state dir.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedpose.io import atomic_write_text

log = logging.getLogger(__name__)

PROGRESS_FILE = "progress.json"
#: seconds between two progress lines of a federation's console
LINE_INTERVAL_S = 60.0
#: a file's modification time may lag the clock read just before the write (the kernel stamps it
#: with a coarse clock): progress this much older than a run's start still counts as the run's
MTIME_SLACK_S = 2.0


class RoundProgress(BaseModel):
    """Where a site's training in one round stands."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    round: int = Field(ge=1)
    steps_done: int = Field(ge=0)
    steps: int = Field(ge=1)
    started: float  #: Unix time the round's training began (this machine's clock)

    @property
    def finished(self) -> bool:
        return self.steps_done >= self.steps


def record_progress(state_dir: str | Path, progress: RoundProgress) -> None:
    """Rewrite the site's progress file; a failure is logged, never raised (progress must not decide
    a round's outcome)."""
    try:
        atomic_write_text(Path(state_dir) / PROGRESS_FILE, progress.model_dump_json())
    except OSError as exc:
        log.warning("cannot write %s in %s: %s", PROGRESS_FILE, state_dir, exc)


def read_progress(state_dir: str | Path, since: float | None = None) -> RoundProgress | None:
    """The site's progress, or None: no file, an unreadable one, or (``since``, Unix time) one last
    written before that moment (another run's, or this run's before a restart)."""
    path = Path(state_dir) / PROGRESS_FILE
    try:
        if since is not None and os.stat(path).st_mtime < since:
            return None
        return RoundProgress.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, ValidationError):
        return None


def _duration(seconds: float) -> str:
    minutes, rest = divmod(int(max(0.0, seconds)), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


class ProgressLines:
    """One console line a minute about the round in progress, read from every site's progress file:

          round 1 running for 2 min 0 s | site-1: 9/16 steps | site-2: 8/16 steps | site-3: 10/16 steps

    ``sites``: (site id, state dir) of every site of the run; progress written before ``since`` (Unix
    time; default: now) is ignored. The round shown is the latest any site of ``run_id`` is in; a
    site not (yet) in it is left out, and so is a round every one of whose sites has finished (the
    coordinator is aggregating or evaluating: its own round line comes next)."""

    def __init__(self, run_id: str, sites: Sequence[tuple[str, str | Path]], since: float | None = None,
                 interval: float = LINE_INTERVAL_S, clock: Callable[[], float] = time.time) -> None:
        self.run_id, self.sites, self.interval, self.clock = run_id, list(sites), float(interval), clock
        self.since = clock() if since is None else float(since)
        self.last_line = self.since

    def line(self) -> str | None:
        """The line to print now, or None (not due yet, or no round running)."""
        now = self.clock()
        if now - self.last_line < self.interval:
            return None
        progress = [(site_id, read_progress(state_dir, self.since - MTIME_SLACK_S)) for site_id, state_dir in self.sites]
        current = [(site_id, p) for site_id, p in progress if p is not None and p.run_id == self.run_id]
        if not current:
            return None
        latest = max(p.round for _, p in current)
        in_round = [(site_id, p) for site_id, p in current if p.round == latest]
        if all(p.finished for _, p in in_round):
            return None
        self.last_line = now
        began = min(p.started for _, p in in_round)
        steps = [f"{site_id}: {p.steps_done}/{p.steps} steps" for site_id, p in in_round]
        # indented, and not "round N |": scripts that read the coordinator's round lines skip it
        return "  " + " | ".join([f"round {latest} running for {_duration(now - began)}", *steps])
