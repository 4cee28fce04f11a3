"""One writer per run (fedpose/federation/run_guard.py): the exclusive lock — a second holder is
refused naming the first, a holder that dies releases it — and the refusal to start a fresh run
over a previous run's state. The lock is held by real processes (fcntl locks are per process); the
coordinator's refusal is the real ServerApp's."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from fedpose.federation.ledger import BudgetLedger, LedgerEntry
from fedpose.federation.run_guard import (
    REFUSED,
    RunStateRefused,
    coordinator_lock,
    directory_lock,
    exclusive,
    file_lock,
    read_holder,
    refuse_fresh_start,
)
from file_trees import tree_bytes

REPO = Path(__file__).resolve().parents[2]


def _hold_in_another_process(lock_file: Path, role: str = "deploy local") -> subprocess.Popen:
    """A process that takes the lock, says so, and holds it until killed."""
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from fedpose.federation.run_guard import exclusive
        with exclusive(Path({str(lock_file)!r}), "the thing", {role!r}):
            print("held", flush=True)
            time.sleep(600)
    """)
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    script = lock_file.parent / f"hold-{time.monotonic_ns()}.py"
    script.write_text(code)
    proc = subprocess.Popen([sys.executable, str(script), "--marker-arg", "--token", "s3cret"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_holder_is_refused_naming_the_first_and_a_killed_holder_blocks_nothing(tmp_path: Path) -> None:
    lock = directory_lock(tmp_path / "run")
    holder = _hold_in_another_process(lock)
    try:
        with pytest.raises(RunStateRefused) as refused:
            with exclusive(lock, f"the run directory {tmp_path / 'run'}", "deploy local"):
                pytest.fail("two holders at once")
        message = str(refused.value)
        assert message.startswith(REFUSED) and f"the run directory {tmp_path / 'run'} is in use by deploy local" in message
        # the holder by pid, host, start time and command
        assert f"pid {holder.pid} on {socket.gethostname()}, started 20" in message and "--marker-arg" in message, message
        assert "--token ***" in message and "s3cret" not in message  # Flower's ServerApp gets its runtime token so
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: no cleanup runs
        holder.wait(timeout=30)
    with exclusive(lock, "the run directory", "deploy local"):  # the kernel released it with the process
        record = read_holder(lock)
        assert record is not None and record.pid == os.getpid()
    assert read_holder(lock) is None  # released: no stale holder named


def test_one_process_may_nest_its_own_lock_and_releases_it_at_the_end(tmp_path: Path) -> None:
    lock = file_lock(tmp_path / "ledger.sqlite")
    assert lock.name == "ledger.sqlite.lock"
    with exclusive(lock, "the ledger", "coordinator"):
        with exclusive(lock, "the ledger", "coordinator"):  # simulate's CLI, then its in-process ServerApp
            pass
        assert read_holder(lock) is not None  # still held by the outer block
        probe = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                                "from fedpose.federation.run_guard import probe, RunStateRefused\n"
                                f"try: probe(Path({str(lock)!r}), 'the ledger', 'coordinator')\n"
                                "except RunStateRefused as e: print(e); sys.exit(7)"],
                               capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert probe.returncode == 7 and f"pid {os.getpid()}" in probe.stdout, probe.stdout + probe.stderr
    holder = _hold_in_another_process(lock, role="coordinator")  # released at the end of the outer block
    holder.kill()
    holder.wait(timeout=30)


def test_the_coordinator_locks_a_ledger_kept_outside_its_checkpoint_dir(tmp_path: Path) -> None:
    ledger = tmp_path / "elsewhere" / "ledger.sqlite"
    holder = _hold_in_another_process(file_lock(ledger), role="coordinator")
    try:
        with pytest.raises(RunStateRefused, match=f"the budget ledger {ledger} is in use by coordinator pid {holder.pid}"):
            with coordinator_lock(tmp_path / "ckpt", ledger):
                pytest.fail("two coordinators on one ledger")
        # … and the checkpoint_dir lock it took first was given back
        with exclusive(directory_lock(tmp_path / "ckpt"), "the checkpoint_dir", "coordinator"):
            pass
    finally:
        holder.kill()
        holder.wait(timeout=30)


def _ledger_with_round(path: Path, round_id: int) -> None:
    with BudgetLedger(path) as ledger:
        ledger.record(LedgerEntry(site_id="site-1", round=round_id, status="missing", reason="no reply"))


def test_a_fresh_start_over_a_previous_run_is_refused_with_one_message(tmp_path: Path) -> None:
    ckpt = tmp_path / "coordinator"
    ckpt.mkdir()
    ledger = ckpt / "ledger.sqlite"
    refuse_fresh_start(ckpt, ledger, "the run directory", "another --run-dir")  # nothing there: fine
    BudgetLedger(ledger).close()  # a ledger that never recorded a round (a start that failed early)
    refuse_fresh_start(ckpt, ledger, "the run directory", "another --run-dir")

    _ledger_with_round(ledger, 1)  # a round recorded, killed before its model checkpoint
    before = ledger.read_bytes()
    with pytest.raises(RunStateRefused) as refused:
        refuse_fresh_start(ckpt, ledger, f"the run directory {tmp_path}", "another --run-dir")
    assert str(refused.value) == (
        f"refused: a fresh start would overwrite the state of a previous run in the run directory {tmp_path} "
        "(ledger.sqlite with site reports up to round 1): continue that run with --resume, or use another --run-dir; "
        "nothing was changed")
    assert ledger.read_bytes() == before

    np.savez(ckpt / "global.npz", w=np.zeros(2))
    with pytest.raises(RunStateRefused, match=r"\(global.npz, ledger.sqlite with site reports up to round 1\)"):
        refuse_fresh_start(ckpt, ledger, "the run directory", "another --run-dir")

    ledger.write_bytes(b"garbage, not SQLite" * 10)  # unreadable: never judged empty
    with pytest.raises(RunStateRefused, match=r"ledger.sqlite, unreadable"):
        refuse_fresh_start(ckpt, ledger, "the run directory", "another --run-dir")


def test_the_serverapp_refuses_a_checkpoint_dir_another_coordinator_holds(tmp_path: Path, capsys) -> None:
    import tomli_w
    from flwr.app import Context, RecordDict

    from coordinator.server_app import build_server_app
    from fedpose.federation.report import COORDINATOR_ERROR_PREFIX

    ckpt = tmp_path / "coordinator"
    config = tmp_path / "coordinator.toml"
    config.write_text(tomli_w.dumps({"run_id": "itest", "coordinator": {"checkpoint_dir": str(ckpt), "rounds": 1}}))
    holder = _hold_in_another_process(directory_lock(ckpt), role="coordinator")
    try:
        app = build_server_app(config, resume=True)
        started = time.monotonic()
        with pytest.raises(RunStateRefused):
            app(None, Context(1, 0, {}, RecordDict(), {}))  # refused before it touches the grid
        assert time.monotonic() - started < 20
    finally:
        holder.kill()
        holder.wait(timeout=30)
    (line,) = [l for l in capsys.readouterr().out.splitlines() if l.startswith(COORDINATOR_ERROR_PREFIX)]
    assert f"RunStateRefused: refused: the coordinator's checkpoint_dir {ckpt.resolve()} is in use by coordinator pid {holder.pid}" in line
    assert not (ckpt / "ledger.sqlite").exists()  # it touched nothing of the other coordinator's state


# -- `fedpose deploy local`: exit 2, one line, nothing written ----------------------------------------------
def _files(root: Path) -> dict[str, bytes]:
    return {name: data for name, data in tree_bytes(root).items() if Path(name).name != ".fedpose.lock"}


def _deploy(tmp_path: Path, run_dir: Path, *extra: str) -> int:
    from fedpose.cli import main
    from federation_helpers import free_base_port, tiny_federation

    config = tiny_federation(tmp_path, tmp_path / "no-data-needed", sites=2)  # refused before data is looked at
    return main(["deploy", "local", "--sites", "2", "--config", str(config), "--run-dir", str(run_dir),
                 "--base-port", str(free_base_port()), *extra])


@pytest.mark.parametrize("previous", ["ledger rows only", "model checkpoint"])
def test_deploy_local_refuses_a_fresh_start_over_a_previous_run_with_exit_2(tmp_path: Path, capsys, previous: str) -> None:
    """Both kinds of leftover state once gave different exits (2 "holds a previous run" for a model
    checkpoint; 1 and the coordinator's LedgerError for a ledger without one): now one of each."""
    run_dir = tmp_path / "run"
    _ledger_with_round(run_dir / "coordinator" / "ledger.sqlite", 2)
    if previous == "model checkpoint":
        np.savez(run_dir / "coordinator" / "global.npz", w=np.zeros(2))
    before = _files(run_dir)
    assert _deploy(tmp_path, run_dir) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    found = ("global.npz, " if previous == "model checkpoint" else "") + "ledger.sqlite with site reports up to round 2"
    assert line == (f"fedpose: error: refused: a fresh start would overwrite the state of a previous run in the run directory "
                    f"{run_dir} ({found}): continue that run with --resume, or use another --run-dir; nothing was changed")
    assert _files(run_dir) == before  # no configs, certs, logs written


def test_deploy_local_refuses_a_run_dir_or_checkpoint_dir_in_use_with_exit_2(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    for lock, what, extra in ((directory_lock(run_dir), f"the run directory {run_dir}", ()),
                              (directory_lock(run_dir / "coordinator"), f"the coordinator's checkpoint_dir {run_dir / 'coordinator'}",
                               ("--resume",))):
        holder = _hold_in_another_process(lock, role="deploy local" if extra == () else "coordinator")
        try:
            assert _deploy(tmp_path, run_dir, *extra) == 2
        finally:
            holder.kill()
            holder.wait(timeout=30)
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"fedpose: error: refused: {what} is in use by ") and f"pid {holder.pid} on " in line, line
        assert not (run_dir / "configs").exists()  # refused before writing anything


def test_a_coordinator_that_refused_to_start_makes_deploy_local_exit_2(tmp_path: Path, capsys) -> None:
    from fedpose.cli.deploy import report_failed_run
    from fedpose.federation.report import COORDINATOR_ERROR_PREFIX

    refused = f"{COORDINATOR_ERROR_PREFIX}RunStateRefused: refused: the coordinator's checkpoint_dir /x is in use by coordinator pid 7"
    assert report_failed_run("finished:failed", f"{refused}\nTraceback ...\n", tmp_path) == 2
    assert report_failed_run("finished:failed", f"{COORDINATOR_ERROR_PREFIX}LedgerError: the ledger is garbage\n", tmp_path) == 1
    assert capsys.readouterr().err.splitlines()[0] == refused


def test_simulate_refuses_a_fresh_start_over_a_previous_run_and_a_checkpoint_dir_in_use_with_exit_2(tmp_path: Path, capsys) -> None:
    """`fedpose simulate` answers as deploy local does (issue 25, item 7): one 'refused:' line,
    exit 2, before any data is generated — for a ledger without a model checkpoint (once exit 1,
    "the federation did not finish") and for a checkpoint_dir another coordinator holds."""
    from fedpose.cli import main
    from federation_helpers import tiny_federation

    config = tiny_federation(tmp_path, tmp_path / "no-data-needed", sites=2)  # refused before data is looked at
    ckpt = tmp_path / "coordinator"
    _ledger_with_round(ckpt / "ledger.sqlite", 2)
    assert main(["simulate", "--config", str(config)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"fedpose: error: refused: a fresh start would overwrite the state of a previous run in the "
                           f"coordinator's checkpoint_dir {ckpt} (ledger.sqlite with site reports up to round 2)")
    assert not (tmp_path / "no-data-needed").exists()

    holder = _hold_in_another_process(directory_lock(ckpt), role="coordinator")
    try:
        assert main(["simulate", "--config", str(config), "--resume"]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"fedpose: error: refused: the coordinator's checkpoint_dir {ckpt} is in use by coordinator pid {holder.pid}")
    finally:
        holder.kill()
        holder.wait()
