"""A site's progress through its round: written by the real site round before its first step and
after each step (site-local, public values only), and the line a minute that `fedpose simulate` and
`fedpose deploy local` print from every site's progress file while a round runs."""

from __future__ import annotations

import io
import json
import os
import time
from contextlib import redirect_stdout
from pathlib import Path

from fedpose.cli.federation_run import printing_progress
from fedpose.federation.local_training import run_site_round
from fedpose.federation.site_progress import PROGRESS_FILE, ProgressLines, RoundProgress, read_progress, record_progress
from site_round_helpers import global_model, make_site_data, site_config


def test_the_site_round_records_each_step_done_and_nothing_of_the_data(tmp_path: Path) -> None:
    site = site_config(make_site_data(tmp_path / "data"), tmp_path / "state")
    weights, spec = global_model()
    seen: list[RoundProgress | None] = []

    def watch(engine) -> None:  # read the progress file as each step begins
        step = engine.step

        def observed_step(*args, **kwargs):
            seen.append(read_progress(site.state_dir))
            return step(*args, **kwargs)

        engine.step = observed_step

    from fedpose.federation.local_training import train_site_round

    before = time.time()
    result = train_site_round(site, "run", 1, weights, spec, 2, engine_hook=watch)
    assert result.reply.status == "ok"
    final = read_progress(site.state_dir)
    assert [p.steps_done for p in seen] == [0, 1] and final is not None and final.steps_done == 2
    assert all(p.model_dump(exclude={"steps_done"}) == final.model_dump(exclude={"steps_done"}) for p in seen)
    assert (final.run_id, final.round, final.steps, final.finished) == ("run", 1, 2, True)
    assert before <= final.started <= time.time()
    # the run, the round, step counts and a time: no loss, size or other statistic of the data
    assert set(json.loads((Path(site.state_dir) / PROGRESS_FILE).read_text())) == {"run_id", "round", "steps_done", "steps", "started"}

    # a refused round (over budget) trains nothing and leaves the progress as it was
    refused = run_site_round(site.model_copy(update={"eps_max": 1e-3}), "run", 2, weights, spec, 2)
    assert refused.reply.status == "refused" and read_progress(site.state_dir) == final


def test_progress_that_cannot_be_read_or_is_older_than_the_run_is_none(tmp_path: Path) -> None:
    assert read_progress(tmp_path) is None
    progress = RoundProgress(run_id="r", round=2, steps_done=5, steps=16, started=time.time())
    record_progress(tmp_path, progress)
    assert read_progress(tmp_path) == progress
    os.utime(tmp_path / PROGRESS_FILE, (time.time() - 100, time.time() - 100))
    assert read_progress(tmp_path, since=time.time() - 50) is None
    (tmp_path / PROGRESS_FILE).write_text('{"run_id": "r", "round": 2')
    assert read_progress(tmp_path) is None
    record_progress(tmp_path / "missing" / "file-not-dir", progress)  # a write that fails is logged, not raised
    (tmp_path / "blocked").write_text("")
    record_progress(tmp_path / "blocked", progress)


def test_the_console_line_shows_the_latest_round_of_this_run_once_a_minute(tmp_path: Path) -> None:
    now = [time.time()]
    states = {name: tmp_path / name for name in ("site-1", "site-2", "site-3", "site-4")}
    lines = ProgressLines("demo", list(states.items()), clock=lambda: now[0])
    began = now[0] - 5

    def write(site: str, run_id: str, round_id: int, done: int) -> None:
        record_progress(states[site], RoundProgress(run_id=run_id, round=round_id, steps_done=done, steps=16, started=began))

    write("site-1", "demo", 2, 9)
    write("site-2", "demo", 2, 16)
    write("site-3", "demo", 1, 16)   # not in round 2 (refused, or not started yet): left out
    write("site-4", "other", 7, 3)   # another run's state: left out
    assert lines.line() is None      # not a minute yet
    now[0] += 60
    assert lines.line() == "  round 2 running for 1 min 5 s | site-1: 9/16 steps | site-2: 16/16 steps"
    now[0] += 30
    assert lines.line() is None      # the next one a minute after
    now[0] += 30
    write("site-1", "demo", 2, 16)
    assert lines.line() is None      # every site of the round has finished: the coordinator's line comes next
    write("site-1", "demo", 3, 0)
    assert lines.line() == "  round 3 running for 2 min 5 s | site-1: 0/16 steps"


def test_a_run_ignores_progress_written_before_it_began(tmp_path: Path) -> None:
    record_progress(tmp_path / "site-1", RoundProgress(run_id="demo", round=4, steps_done=3, steps=16, started=time.time() - 300))
    os.utime(tmp_path / "site-1" / PROGRESS_FILE, (time.time() - 200, time.time() - 200))  # an interrupted earlier invocation
    lines = ProgressLines("demo", [("site-1", tmp_path / "site-1")], interval=0)
    assert lines.line() is None


def test_printing_progress_prints_each_line_while_the_block_runs() -> None:
    class TwoLines:
        def __init__(self) -> None:
            self.left = ["  round 1 running for 1 min 0 s | site-1: 3/16 steps", None, "  round 1 running for 2 min 0 s | site-1: 7/16 steps"]

        def line(self):
            return self.left.pop(0) if self.left else None

    out = io.StringIO()
    with redirect_stdout(out):
        source = TwoLines()
        with printing_progress(source, poll_s=0.01):
            deadline = time.monotonic() + 10
            while source.left and time.monotonic() < deadline:
                time.sleep(0.01)
    assert out.getvalue().splitlines() == ["  round 1 running for 1 min 0 s | site-1: 3/16 steps",
                                           "  round 1 running for 2 min 0 s | site-1: 7/16 steps"]
