"""What ``fedpose simulate`` and ``fedpose deploy local`` share: the data a federation's configs
point to, ``--resume`` on a finished run, and how a run ends.

Data: every path the configs name (each site's ``data.train``/``data.val`` and public copy, the
coordinator's held-out and public splits) is used as it is. The optional ``[synthetic]`` table
names the synthetic dataset to generate when some of those paths are absent — only into a
directory that holds nothing yet, or an interrupted generation of the same dataset. Nothing that
exists is ever deleted or regenerated: another run's sites may be training on it (a directory
holding another synthetic dataset than ``[synthetic]`` describes is used with a warning).

While a round runs, a line a minute says how far each site is (:func:`site_progress`, from the
sites' own progress files: both commands run every site's state dir on this machine).

The end of a run: the final line says what the coordinator's ``report.json`` says (rounds
completed in total, why it stopped). A run in which any site failed ends with a summary of the
failures and exit code :data:`SITE_FAILURE_EXIT`, unless ``--allow-site-failures``.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedpose.cli.common import UserError
from fedpose.federation.report import REPORT_FILE, SITE_FAILURE_EXIT, failure_summary, finished_run_note, load_report

SYNTHETIC_KEYS = frozenset({"dir", "per_site", "public", "test", "size", "seed"})


def add_run_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resume", action="store_true", help="continue after the coordinator's last checkpointed round")
    parser.add_argument("--allow-site-failures", action="store_true",
                        help=f"exit 0 when a site failed a round (default: a failure summary and exit code {SITE_FAILURE_EXIT})")


# -- data --------------------------------------------------------------------------------------------
def pop_synthetic(raw: dict[str, Any], source: str | Path) -> dict[str, Any] | None:
    """Remove and check the ``[synthetic]`` table of a federation TOML (read by the CLIs only)."""
    synthetic = raw.pop("synthetic", None)
    if synthetic is not None:
        unknown = set(synthetic) - SYNTHETIC_KEYS
        if unknown or "dir" not in synthetic:
            raise UserError(f"{source}: [synthetic] needs 'dir' and accepts {sorted(SYNTHETIC_KEYS)}; unknown {sorted(unknown)}")
    return synthetic


def _synthetic_spec(synthetic: dict[str, Any], n_sites: int) -> dict[str, Any]:
    """The ``[synthetic]`` table as :func:`fedpose.data.synthetic.ensure_dataset`'s parameters."""
    return dict(sites=n_sites, per_site=int(synthetic.get("per_site", 200)), public=int(synthetic.get("public", 100)),
                test=int(synthetic.get("test", 100)), size=tuple(synthetic.get("size", (128, 96))), seed=int(synthetic.get("seed", 0)))


def ensure_synthetic(synthetic: dict[str, Any], n_sites: int) -> None:
    """Generate the ``[synthetic]`` dataset (``n_sites`` site splits) unless its directory holds
    data already: existing data is never deleted or replaced."""
    from fedpose.data.synthetic import SyntheticDataError, ensure_dataset

    try:
        ensure_dataset(synthetic["dir"], **_synthetic_spec(synthetic, n_sites), replace=False)
    except SyntheticDataError as exc:
        raise UserError(f"[synthetic]: {exc} — fedpose never deletes existing data: point the configs at it, "
                        "or set synthetic.dir to a new directory") from None


def synthetic_mismatch(synthetic: dict[str, Any], n_sites: int) -> str:
    """How the finished synthetic dataset in ``[synthetic]``'s directory differs from the one the
    table asks for ('' when it does not, or when none is there). More sites than asked is no
    difference: a 3-site dataset serves a 2-site run."""
    from fedpose.data.synthetic import MANIFEST_FILE, SyntheticDataError, dataset_params, params_differ

    if not (Path(synthetic["dir"]) / MANIFEST_FILE).is_file():
        return ""
    try:
        wanted = dataset_params(**_synthetic_spec(synthetic, n_sites))
    except SyntheticDataError as exc:
        return f"unreadable: {exc}"
    return params_differ(synthetic["dir"], wanted, more_sites_serve=True)


def data_paths(sites: list[Any], coordinator: Any) -> dict[str, Path]:
    """Every dataset path the sites' and the coordinator's configs name (what → path)."""
    paths: dict[str, Path | None] = {}
    for site in sites:
        paths |= {f"site '{site.site_id}' data.train": site.data.train,
                  f"site '{site.site_id}' public_data": site.public_data,
                  f"site '{site.site_id}' privacy.basis.public_data": site.privacy.basis.public_data}
    paths |= {"coordinator data.val": coordinator.data.val, "coordinator public_data": coordinator.public_data}
    return {what: Path(path) for what, path in paths.items() if path is not None}


def ensure_federation_data(paths: dict[str, Path], synthetic: dict[str, Any] | None, n_sites: int, source: str | Path) -> None:
    """Every path in ``paths`` exists afterwards: when some is absent, or the ``[synthetic]`` dataset's
    generation was interrupted, and ``[synthetic]`` is given, that dataset is generated or completed
    (into a directory without other data only); otherwise a UserError names the missing paths. A
    ``[synthetic]`` directory holding a dataset of other parameters is used, with a warning saying so."""
    from fedpose.data.synthetic import interrupted_dataset

    def not_found() -> str:
        return "; ".join(f"{what} {path}" for what, path in paths.items() if not path.exists())

    if synthetic is not None and (not_found() or interrupted_dataset(synthetic["dir"])):
        try:
            ensure_synthetic(synthetic, n_sites)
        except UserError as exc:
            raise UserError(f"{source}: data not found: {not_found()}; {exc}") from None
    if not_found():
        raise UserError(f"{source}: data not found: {not_found()}")
    if synthetic is not None and (differ := synthetic_mismatch(synthetic, n_sites)):
        # not silently another dataset than [synthetic] names (e.g. after --set synthetic.seed=7)
        print(f"warning: {synthetic['dir']} holds another synthetic dataset than [synthetic] describes ({differ}); the run "
              "uses the data the configs point to, as it is ([synthetic] only generates data that is absent): to run on "
              "the one described, remove that directory or set synthetic.dir to a new one", file=sys.stderr, flush=True)


# -- progress while a round runs ------------------------------------------------------------------------
#: seconds between two looks at the sites' progress files
PROGRESS_POLL_S = 5.0


def site_progress(federation: Any) -> Any:
    """The :class:`~fedpose.federation.site_progress.ProgressLines` of a federation whose sites' state
    dirs are on this machine, counting progress written from now on."""
    from fedpose.federation.site_progress import ProgressLines

    return ProgressLines(federation.run_id, [(site.site_id, site.state_dir) for site in federation.sites])


@contextmanager
def repeating_on_a_thread(name: str, tick: Callable[[], None], every_s: float) -> Iterator[None]:
    """Call ``tick()`` every ``every_s`` seconds (0: back to back — a tick that waits itself) from a
    daemon thread named ``name``, for the duration of the block; the thread is joined when it ends."""
    done = threading.Event()

    def repeat() -> None:
        while not done.wait(every_s):
            tick()

    thread = threading.Thread(target=repeat, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@contextmanager
def printing_progress(lines: Any, poll_s: float = PROGRESS_POLL_S) -> Iterator[None]:
    """Print ``lines.line()`` whenever it has one, from a thread, for the duration of the block."""
    def show() -> None:
        if (line := lines.line()) is not None:
            sys.stdout.write(line + "\n")  # one write: the coordinator's round lines come from another thread
            sys.stdout.flush()

    with repeating_on_a_thread("fedpose-progress", show, poll_s):
        yield


# -- resume and the end of a run -----------------------------------------------------------------------
def finished_run(checkpoint_dir: Path, run_id: str, rounds: int, how: str) -> str | None:
    """The note for ``--resume`` on a run that already did ``rounds`` rounds (None: rounds are left).
    ``how``: the option that raises coordinator.rounds here, with ``{rounds}``."""
    from fedpose.federation.server.rounds import checkpointed_round

    done = checkpointed_round(checkpoint_dir)
    if done is None or done < rounds:
        return None
    return finished_run_note(run_id, done, rounds, how)


def conclude_run(checkpoint_dir: Path, allow_site_failures: bool) -> int:
    """Print the failure summary (if a site failed) and the final line, both from report.json;
    the exit code: 0, or SITE_FAILURE_EXIT when a site failed and that is not allowed."""
    report = load_report(checkpoint_dir)
    summary = failure_summary(report.site_failures)
    failed = bool(summary) and not allow_site_failures
    for line in summary:
        print(line, file=sys.stderr if failed else sys.stdout, flush=True)
    if failed:
        print(f"fedpose: error: a site failed (exit code {SITE_FAILURE_EXIT}); --allow-site-failures accepts that",
              file=sys.stderr, flush=True)
    # The coordinator's own closing line said what this invocation did; this one the run's total
    # (over every resume), and why it stopped only where that is not "completed N rounds".
    done = report.rounds_completed
    why = "" if report.stopped_reason.startswith("completed ") else f" ({report.stopped_reason})"
    print(f"run '{report.run_id}': {done} round{'' if done == 1 else 's'} completed in total{why}; "
          f"report: {checkpoint_dir / REPORT_FILE}", flush=True)
    return SITE_FAILURE_EXIT if failed else 0
