"""What `fedpose deploy local` and the coordinator's transport make of a SuperLink or SuperNode that
goes away, without a whole deployment (tests/federation/test_federation_deploy_faults.py and
test_federation_deploy.py run those): `flwr ls` against a SuperLink that does not answer, a
SuperLink that exits or cannot start, the watchdog's share of the run dir's lock, and Flower's own
error replies for a node that left (built by the SuperLink's code)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fedpose.cli import deploy


def _group(tmp_path: Path, address: str) -> deploy.ProcessGroup:
    """A ProcessGroup whose `flwr` connection points at ``address`` (nothing answers there)."""
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "{deploy.CONNECTION}"\n\n[superlink.{deploy.CONNECTION}]\n'
                                      f'address = "{address}"\ninsecure = true\n')
    (tmp_path / "logs").mkdir()
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", FLWR_HOME=str(home))
    return deploy.ProcessGroup(tmp_path, env)


def _closed_port() -> int:
    from federation_helpers import free_base_port

    return free_base_port()  # bindable, so nothing listens there


def test_a_superlink_that_stops_answering_ends_the_follow_loop_within_the_timeout(tmp_path: Path, monkeypatch) -> None:
    """Before: `flwr ls` failed, the status read "unknown" and the loop polled for ever."""
    for poll in ("HISTORY_POLL_S", "LOST_POLL_S"):
        monkeypatch.setattr(deploy, poll, 0.2)
    group = _group(tmp_path, f"127.0.0.1:{_closed_port()}")
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # alive, never answers (a hung SuperLink)
    try:
        started = time.monotonic()
        with pytest.raises(deploy.SuperLinkLost, match=r"^`flwr ls` failed: .*Connection to the SuperLink is unavailable") as lost:
            deploy._follow(group, "42", tmp_path / "coordinator", started, None, hung, superlink_timeout=2.0)
        assert str(lost.value).endswith("(--superlink-timeout 2)")
        assert time.monotonic() - started < 60  # two or three `flwr ls` at most
    finally:
        hung.kill()
        hung.wait()
        group.stop_all()


def test_a_superlink_that_exits_ends_the_follow_loop_at_the_next_poll(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(deploy, "HISTORY_POLL_S", 0.2)
    group = _group(tmp_path, f"127.0.0.1:{_closed_port()}")
    gone = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    gone.wait()
    try:
        with pytest.raises(deploy.SuperLinkLost, match=rf"^it exited with code -9 \(pid {gone.pid}\)$"):
            deploy._follow(group, "42", tmp_path / "coordinator", time.monotonic(), None, gone, superlink_timeout=600)
    finally:
        group.stop_all()


def _lock_holding_coordinator(checkpoint_dir: Path) -> subprocess.Popen:
    """A process that holds ``checkpoint_dir``'s lock as the real coordinator (the ServerApp) does."""
    holds_lock = ("import sys, time\nfrom fedpose.federation.run_guard import directory_lock, exclusive\n"
                  "with exclusive(directory_lock(sys.argv[1]), 'its checkpoint_dir', 'coordinator'):\n"
                  "    print('held', flush=True)\n    time.sleep(600)\n")
    coordinator = subprocess.Popen([sys.executable, "-c", holds_lock, str(checkpoint_dir)], stdout=subprocess.PIPE, text=True)
    assert coordinator.stdout.readline().strip() == "held"
    return coordinator


@pytest.mark.parametrize("ending", ["report", "crash"])
def test_flwr_ls_is_asked_rarely_while_the_coordinator_runs_and_soon_after_it_ends(tmp_path: Path, monkeypatch, ending: str) -> None:
    """Each `flwr ls` is a Python process (~1 s of CPU the sites' training needs on the same machine):
    the follow loop reads the coordinator's files every HISTORY_POLL_S and asks the SuperLink every
    STATUS_POLL_S — and within ENDING_POLL_S once the coordinator has ended: its report.json written
    (one from before the run, a --resume's, does not count), or the process holding its checkpoint_dir's
    lock killed (a crash writes no report). The coordinator here is a process that takes that lock as
    the real one does; the status source is the one thing replaced (no run is submitted)."""
    monkeypatch.setattr(deploy, "HISTORY_POLL_S", 0.05)
    history_dir = tmp_path / "coordinator"
    history_dir.mkdir()
    report = history_dir / "report.json"
    report.write_text("{}")
    os.utime(report, (time.time() - 3600, time.time() - 3600))  # the previous invocation's
    coordinator = _lock_holding_coordinator(history_dir)
    asked: list[float] = []
    ended: list[float] = []

    def run_status(group, run_id, timeout):
        asked.append(time.monotonic())
        return deploy.RunStatus("finished:completed" if ended else "running"), ""

    def end() -> None:
        ended.append(time.monotonic())  # first: from here on the SuperLink would say the run finished
        if ending == "report":
            report.write_text('{"written": "now"}')
        else:  # not reaped: a killed ServerApp stays a zombie of the SuperLink, which answers kill(pid, 0)
            coordinator.kill()

    monkeypatch.setattr(deploy, "run_status", run_status)
    group = _group(tmp_path, f"127.0.0.1:{_closed_port()}")
    superlink = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    ender = threading.Timer(1.5, end)
    try:
        ender.start()
        status = deploy._follow(group, "42", history_dir, time.monotonic(), None, superlink, superlink_timeout=60)
        assert status.status == "finished:completed"
        assert len(asked) == 2, asked  # once at the start, once after the coordinator ended — not every 0.05 s
        assert asked[1] - ended[0] < deploy.ENDING_POLL_S + 1.0
    finally:
        ender.cancel()
        for proc in (superlink, coordinator):
            proc.kill()
            proc.wait()
        group.stop_all()


def test_a_killed_coordinator_ends_the_run_without_waiting_for_flower_to_notice(tmp_path: Path, monkeypatch) -> None:
    """A coordinator killed outright (the OOM killer, kill -9) writes no report and tells Flower
    nothing: Flower marks the run failed only when its heartbeats are missed (~50 s, measured). The
    follow loop sees the lock holder's process gone and, CRASH_GRACE_S later, ends the run as failed
    itself, naming the process; a coordinator that is merely slow is not taken for dead."""
    monkeypatch.setattr(deploy, "HISTORY_POLL_S", 0.05)
    monkeypatch.setattr(deploy, "CRASH_GRACE_S", 1.0)
    history_dir = tmp_path / "coordinator"
    history_dir.mkdir()
    coordinator = _lock_holding_coordinator(history_dir)
    killed: list[float] = []

    def kill() -> None:  # not reaped: a killed ServerApp stays a zombie of the SuperLink, which answers kill(pid, 0)
        coordinator.kill()
        killed.append(time.monotonic())

    monkeypatch.setattr(deploy, "run_status", lambda group, run_id, timeout: (deploy.RunStatus("running"), ""))
    group = _group(tmp_path, f"127.0.0.1:{_closed_port()}")
    superlink = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    killer = threading.Timer(2.0, kill)
    try:
        killer.start()
        status = deploy._follow(group, "42", history_dir, time.monotonic(), 20.0, superlink, superlink_timeout=60)
        assert killed, "the run was declared failed while its coordinator still ran"
        assert status.status == "finished:failed"
        assert f"the coordinator's process (pid {coordinator.pid}) exited" in status.details
        assert deploy.CRASH_GRACE_S <= time.monotonic() - killed[0] < deploy.CRASH_GRACE_S + 1.0
    finally:
        killer.cancel()
        for proc in (superlink, coordinator):
            proc.kill()
            proc.wait()
        group.stop_all()


def _train_metadata(node: int, ttl: float = 100.0):
    from flwr.common import Metadata

    return Metadata(run_id=1, message_id="m-1", src_node_id=1, dst_node_id=node, reply_to_message_id="", group_id="2",
                    message_type="train", created_at=time.time(), ttl=ttl)


def test_the_superlinks_node_unavailable_reply_is_the_sites_disconnect() -> None:
    """The SuperLink answers for a node it declared gone; the reply comes from the SuperLink (node 1),
    so only the message it answers names the site's node."""
    from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

    from coordinator.grid import node_reply

    reply = create_message_error_unavailable_res_message(_train_metadata(node=7), "node_unavail")
    assert reply.metadata.src_node_id != 7 and reply.metadata.reply_to_message_id == "m-1"
    answer = node_reply(reply, 7, 42.4)
    assert answer.node == 7 and answer.reply is None
    assert answer.failure == "the site disconnected: Flower declared its node gone 42 s into the round (no heartbeat for 2 × 30 s)"

    expired = create_message_error_unavailable_res_message(_train_metadata(node=7), "msg_unavail")
    assert node_reply(expired, 7, 5.0).failure.startswith("no update (Flower error 4): Error: Reply Message Unavailable")


def test_the_watchdog_holds_the_run_dirs_lock_until_everything_is_stopped(tmp_path: Path) -> None:
    """deploy local SIGKILLed: its run dir stays locked while its watchdog stops what it started."""
    from fedpose.federation.run_guard import RunStateRefused, directory_lock, exclusive, probe

    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    lock = directory_lock(run_dir)
    with exclusive(lock, "the run directory", "deploy local") as handle:
        group = deploy.ProcessGroup(run_dir, dict(os.environ), handle.fileno())
    try:  # this process let go (as a killed deploy local would): the watchdog still holds it
        with pytest.raises(RunStateRefused, match="the run directory is in use"):
            probe(lock, "the run directory", "deploy local")
    finally:
        group.stop_all()  # the watchdog exits
    probe(lock, "the run directory", "deploy local")


@pytest.mark.slow
@pytest.mark.integration  # a real SuperLink that fails to start (and the synthetic data it needs, ~30 s here)
def test_a_superlink_that_cannot_start_is_named_with_exit_1_and_no_traceback(tmp_path: Path, capsys) -> None:
    from fedpose.cli import main
    from fedpose.cli.certs import write_dev_certificates
    from federation_helpers import free_base_port, no_leftover_processes, tiny_federation

    run_dir = tmp_path / "run"
    write_dev_certificates(run_dir / "certs", ["site-1"])
    (run_dir / "certs" / "server.key").write_text("not a key")
    config = tiny_federation(tmp_path, tmp_path / "data", sites=1)
    code = main(["deploy", "local", "--sites", "1", "--config", str(config), "--run-dir", str(run_dir),
                 "--base-port", str(free_base_port())])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.strip().splitlines()[-1] == (f"fedpose: error: SuperLink Fleet API exited with code 1; see {run_dir / 'logs' / 'superlink.log'}; "
                                            "everything this run started is stopped"), err
    assert "Traceback" not in err and not no_leftover_processes(run_dir)


def test_the_deployed_coordinator_waits_for_every_site_it_starts(tmp_path: Path) -> None:
    """Round 1 of a fresh deployment waits for all ``--sites`` SuperNodes (a slow machine used to
    start it with the first one alone); min_sites stays the config's."""
    import tomllib

    from federation_helpers import tiny_federation

    from fedpose.cli import build_parser

    config = tiny_federation(tmp_path, tmp_path / "data", sites=3)
    args = build_parser().parse_args(["deploy", "local", "--config", str(config), "--sites", "2"])
    written = deploy.write_deployment_configs(args, tmp_path / "run")
    coordinator = tomllib.loads(written.coordinator_toml.read_text())["coordinator"]
    assert coordinator["expected_sites"] == 2 and coordinator["min_sites"] == 1
    assert written.federation.coordinator.expected_sites == 2
