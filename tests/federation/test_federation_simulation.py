"""The federation under Flower's simulation runtime (Ray), as `fedpose simulate` runs it; a site
whose update is corrupted on the way out is rejected and logged, a site whose training fails is
recorded with the site's own error, and the round goes on; the command line ends a run with a
site failure with a summary and exit code 3, and says how to continue a finished run."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import tomllib
from pathlib import Path

import numpy as np
import pytest
import tomli_w
from flwr.app import Array, ArrayRecord

from fedpose.federation import protocol
from fedpose.federation.report import SITE_FAILURE_EXIT
from fedpose.federation.site_progress import read_progress
from federation_helpers import corrupt_image, epsilon_after_rounds, history, ledger_rows, site_budget, tiny_federation

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _site_id(reply) -> str:
    return protocol.decode_reply(dict(reply.content[protocol.REPLY_RECORD])).site_id


def corrupt_site_2(msg, context, call_next):
    """Outside the egress guard: turn site-2's (valid) update into NaNs, as a broken site would."""
    reply = call_next(msg, context)
    if reply.has_content() and _site_id(reply) == "site-2" and "update" in reply.content:
        update = reply.content["update"]
        reply.content["update"] = ArrayRecord({k: Array(np.full(a.shape, np.nan, dtype=np.float32)) for k, a in update.items()})
    return reply


def crash_site_4(msg, context, call_next):
    """site-4's ClientApp raises after training, as a site with a full disk would."""
    reply = call_next(msg, context)
    if reply.has_content() and _site_id(reply) == "site-4":
        raise OSError("No space left on device (site-4)")
    return reply


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_simulation_rejects_a_corrupted_update_and_keeps_going(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    import tomllib

    from fedpose.cli.federation_run import ensure_synthetic
    import torch

    from coordinator.simulation import run_federation_simulation
    from fedpose.cli.simulate import gpus_per_site, resolve_federation

    data_dir = tmp_path / "data"
    # every site replies (or its app's error does), so the round never waits for its timeout; a long
    # one keeps a loaded machine's slow site from being reported missing (it was, at 120 s, under load 5)
    config = tiny_federation(tmp_path, data_dir, sites=5, rounds=1, timeout=600.0)
    raw = tomllib.loads(config.read_text())
    raw["sites"][2]["optim"] = {"name": "sgd", "lr": 3e38}  # site-3: near float32 max, the noisy step overflows
    config.write_text(tomli_w.dumps(raw))
    federation, synthetic, resolved = resolve_federation(config, [])
    ensure_synthetic({**synthetic, "dir": str(data_dir)}, len(federation.sites))
    corrupt = corrupt_image(data_dir / "site-5")  # site-5: one truncated image among its files
    records = _Records()
    logging.getLogger("fedpose.coordinator").addHandler(records)
    try:
        run_federation_simulation(federation, resolved, gpus_per_site=gpus_per_site(federation, torch.cuda.device_count()),
                                  client_mods=(corrupt_site_2, crash_site_4))
    finally:
        logging.getLogger("fedpose.coordinator").removeHandler(records)

    (entry,) = history(tmp_path)
    assert entry["sites"]["site-1"]["status"] == "ok"
    assert entry["sites"]["site-2"]["status"] == "rejected"
    assert entry["sites"]["site-2"]["reject_reason"] == "non_finite"
    assert entry["aggregated"] and entry["accepted"] == 1
    rows = {e.site_id: e for e in ledger_rows(tmp_path)}
    assert rows["site-2"].status == "rejected" and "non_finite" in rows["site-2"].reason
    assert rows["site-2"].epsilon is not None  # it trained: its spend is on record
    assert any("site-2" in m and "rejected" in m and "non_finite" in m for m in records.messages), records.messages
    # site-3's training diverged: it says so, with its spend, instead of timing out
    assert entry["sites"]["site-3"]["status"] == "failed"
    assert entry["sites"]["site-3"]["reason"].startswith("local training diverged")  # a fixed text: no loss leaves the site
    assert rows["site-3"].status == "missing" and "diverged" in rows["site-3"].reason
    assert rows["site-3"].epsilon is not None and rows["site-3"].epsilon > 0  # spent before training
    assert any("site-3" in m and "diverged" in m for m in records.messages), records.messages
    assert not any("site-3" in m and "timeout" in m for m in records.messages), records.messages
    # site-4's ClientApp crashed in round 1, before the coordinator learnt which node it is: the
    # node is reported (not charged to a site) with the site's own error, not as a timeout
    assert len(entry["unidentified_missing_nodes"]) == 1
    assert any("ClientApp failed" in m and "No space left on device (site-4)" in m for m in records.messages), records.messages

    # site-5's corrupt image: found before training, attributed, nothing spent, no traceback on the console
    assert entry["sites"]["site-5"]["status"] == "error"
    assert entry["sites"]["site-5"]["reason"].startswith("ImageLoadError: the site's ClientApp failed")
    assert rows["site-5"].status == "missing" and rows["site-5"].epsilon in (None, 0.0) and rows["site-5"].steps == 0
    assert not [e for e in site_budget(tmp_path, "site-5")["entries"] if e["status"] == "spent"]
    console = capfd.readouterr()
    assert corrupt.name not in console.out + console.err  # the details went to the site's own log ...
    assert corrupt.name in (tmp_path / "sites" / "site-5" / "site.log").read_text()  # ... here

    from fedpose.federation.aggregation import load_array_checkpoint

    weights, _ = load_array_checkpoint(tmp_path / "coordinator" / "global.npz")
    assert all(np.isfinite(w).all() for w in weights.values() if w.dtype.kind == "f")
    report = json.loads((tmp_path / "coordinator" / "report.json").read_text())
    assert report["rounds_completed"] == 1


def test_cli_site_failure_exit_code_finished_resume_and_a_prompt_resumed_round(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """`fedpose simulate` with a corrupt image at site-2: the run ends with a failure summary and
    exit code 3, no traceback on the console; --resume on the finished run says how to continue;
    resumed with more rounds (and --allow-site-failures) it exits 0 — and its first round starts
    at once: simulation hands out new node ids on every start, and waiting for the checkpoint's
    old ids sat out the whole round timeout."""
    from fedpose.cli import main
    from fedpose.cli.federation_run import ensure_synthetic
    from fedpose.cli.simulate import resolve_federation

    data_dir = tmp_path / "data"
    config = tiny_federation(tmp_path, data_dir, sites=2, rounds=1, timeout=300.0)
    _, synthetic, _ = resolve_federation(config, [])
    ensure_synthetic(synthetic, 2)
    bad = corrupt_image(data_dir / "site-2")

    assert main(["simulate", "--config", str(config)]) == SITE_FAILURE_EXIT
    console = capfd.readouterr()
    assert "round   1 site-2: error — ImageLoadError" in console.err, console  # the summary: round, site id, error class
    assert console.out.strip().splitlines()[-1].startswith("run 'itest': 1 round completed in total"), console.out
    assert "Traceback" not in console.out + console.err and bad.name not in console.out + console.err
    rows = {(e.site_id, e.round): e for e in ledger_rows(tmp_path)}
    assert rows[("site-2", 1)].status == "missing" and rows[("site-2", 1)].steps == 0
    assert not [e for e in site_budget(tmp_path, "site-2")["entries"] if e["status"] == "spent"]
    assert rows[("site-1", 1)].epsilon == pytest.approx(epsilon_after_rounds(1), rel=1e-6)

    assert main(["simulate", "--config", str(config), "--resume"]) == 0
    assert ("run 'itest' already finished after 1 rounds (coordinator.rounds = 1); to continue, raise coordinator.rounds: "
            "--resume --set coordinator.rounds=2") in capfd.readouterr().out

    assert main(["simulate", "--config", str(config), "--resume", "--set", "coordinator.rounds=2", "--allow-site-failures"]) == 0
    console = capfd.readouterr()
    assert "round   2 site-2: error — ImageLoadError" in console.out and "Traceback" not in console.out + console.err
    assert console.out.strip().splitlines()[-1].startswith("run 'itest': 2 rounds completed in total; report:")
    rounds = history(tmp_path)
    # the resumed round starts as soon as both sites are back (measured by the coordinator, so a
    # loaded machine's slow training does not count); waiting for stale ids took the 300 s timeout
    assert rounds[1]["node_wait_seconds"] < 30, rounds[1]
    assert [r["round"] for r in rounds] == [1, 2]
    assert {s: v["status"] for s, v in rounds[1]["sites"].items()} == {"site-1": "ok", "site-2": "error"}
    assert [e["round"] for e in site_budget(tmp_path, "site-1")["entries"] if e["status"] == "spent"] == [1, 2]


def test_rolled_back_and_deleted_site_state_refuse_until_adopted(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """`fedpose simulate` on real processes: after round 2, site-1's state dir is put back from a
    backup taken after round 1 and site-2's is deleted. In round 3 both refuse before any data work
    (the coordinator's ledger witnesses their spends), release nothing, and the run ends with the
    failure summary and exit code 3. After `fedpose privacy adopt`, round 4 trains; each site's
    budget = the ledger = the true spend (the rounds it trained, from its own rounds.jsonl)."""
    import shutil

    from fedpose.cli import main
    from fedpose.cli.federation_run import ensure_synthetic
    from fedpose.cli.simulate import resolve_federation

    data_dir = tmp_path / "data"
    config = tiny_federation(tmp_path, data_dir, sites=2, rounds=1, timeout=300.0)
    _, synthetic, _ = resolve_federation(config, [])
    ensure_synthetic(synthetic, 2)
    states = {s: tmp_path / "sites" / s for s in ("site-1", "site-2")}
    trained: dict[str, list[int]] = {s: [] for s in states}  # the truth, from each site's own log

    def set_aside_logs() -> None:
        for s, state in states.items():
            log = state / "rounds.jsonl"
            if log.exists():
                trained[s] += [e["round"] for e in map(json.loads, log.read_text().splitlines()) if e["outcome"] == "ok"]
                log.unlink()

    def books(s: str) -> tuple[float, float]:
        """(ε of the site's budget, the largest ε the ledger holds for it)."""
        from fedpose.federation.site_budget import SiteBudget

        rows = [e for e in ledger_rows(tmp_path) if e.site_id == s and e.epsilon is not None]
        return SiteBudget(states[s], s, eps_max=50.0, delta=1e-5).epsilon, max(e.epsilon for e in rows)

    assert main(["simulate", "--config", str(config)]) == 0
    shutil.copytree(states["site-1"], tmp_path / "backup-site-1")
    assert main(["simulate", "--config", str(config), "--resume", "--set", "coordinator.rounds=2"]) == 0
    capfd.readouterr()
    set_aside_logs()
    assert trained == {"site-1": [1, 2], "site-2": [1, 2]}
    shutil.rmtree(states["site-1"])
    shutil.copytree(tmp_path / "backup-site-1", states["site-1"])
    (states["site-1"] / "rounds.jsonl").unlink()  # round 1's line is already counted
    shutil.rmtree(states["site-2"])

    assert main(["simulate", "--config", str(config), "--resume", "--set", "coordinator.rounds=3"]) == SITE_FAILURE_EXIT
    console = capfd.readouterr()
    behind = protocol.REASON_TEXT["behind-federation-record"]
    assert f"site-1: refused ({behind})" in console.out and f"site-2: refused ({behind})" in console.out, console.out
    assert f"round   3 site-1: refused — {behind}" in console.err and "Traceback" not in console.out + console.err
    round3 = history(tmp_path)[-1]
    assert round3["round"] == 3 and not round3["aggregated"]
    rows = {(e.site_id, e.round): e for e in ledger_rows(tmp_path)}
    assert all(rows[(s, 3)].status == "missing" and rows[(s, 3)].steps == 0 for s in states)
    for s, state in states.items():
        log = [json.loads(line) for line in (state / "rounds.jsonl").read_text().splitlines()]
        assert [e["outcome"] for e in log] == ["refused"] and "behind the federation's record" in log[0]["note"]
    from fedpose.federation.aggregation import load_checkpoint_meta

    assert load_checkpoint_meta(states["site-1"] / "released_update.npz")["round"] == 1  # nothing released in round 3
    assert not (states["site-2"] / "released_update.npz").exists()
    assert books("site-1") == pytest.approx((epsilon_after_rounds(1), epsilon_after_rounds(2)), rel=1e-6)
    assert books("site-2")[0] == 0.0 and books("site-2")[1] == pytest.approx(epsilon_after_rounds(2), rel=1e-6)

    for state in states.values():
        assert main(["privacy", "adopt", str(state)]) == 0
    # round 3's refusals stay in the run's failure summary: accepted here, round 4 must train
    assert main(["simulate", "--config", str(config), "--resume", "--set", "coordinator.rounds=4", "--allow-site-failures"]) == 0
    set_aside_logs()
    assert trained == {"site-1": [1, 2, 4], "site-2": [1, 2, 4]}
    for s in states:
        site_eps, ledger_eps = books(s)
        assert site_eps == pytest.approx(epsilon_after_rounds(3), rel=1e-6) and ledger_eps == pytest.approx(site_eps, rel=1e-9)


def _holder_of(path: Path, processes: dict[tuple[int, int], str]) -> int | None:
    """The PID among ``processes`` that has ``path`` open (what ``lsof``/``fuser`` tell a user)."""
    for pid, _ in processes:
        try:
            if any(os.readlink(fd) == str(path) for fd in Path(f"/proc/{pid}/fd").iterdir()):
                return pid
        except OSError:
            continue
    return None


def test_a_killed_site_worker_is_blamed_on_its_site_only_and_the_next_round_runs_every_site(tmp_path: Path) -> None:
    """`fedpose simulate` with Flower's Ray runtime: SIGKILL the worker process running site-2's
    round 2 (found as a user would: the `ray::ClientAppActor` process holding site-2's site.log
    open). Flower's actors are shared by all nodes and a dead one went back into the pool: the next
    message it got — site-1's or site-2's in round 3 — failed with its error. Now only site-2 is
    missing in round 2, in fedpose's words (Ray's text is in the simulation log), and round 3
    trains both sites; budget = ledger = the rounds each site spent on; no process left."""
    from federation_helpers import FEDPOSE, REPO, flower_env, no_leftover_processes, process_tree, still_running, wait_for

    config = tiny_federation(tmp_path, tmp_path / "data", sites=2, rounds=3, timeout=300.0)
    # The kill must land while site-2's round 2 runs: with the federation's 6 unit slots a tiny round
    # can end (site.log closed) between two polls on a quiet machine. The default slot count makes
    # each step the work it was when this test was written, a round of a few seconds.
    raw = tomllib.loads(config.read_text())
    for site in raw["sites"]:
        del site["privacy"]["max_batch_units"]
    config.write_text(tomli_w.dumps(raw))
    console = tmp_path / "console.txt"
    with console.open("w") as out:
        proc = subprocess.Popen([*FEDPOSE, "simulate", "--config", str(config)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env=flower_env(FLWR_HOME=str(tmp_path / "flwr-home")))
    started: dict[tuple[int, int], str] = {}
    site_2_log = tmp_path / "sites" / "site-2" / "site.log"

    def site_2_worker() -> int | None:
        started.update(process_tree(proc.pid))
        return _holder_of(site_2_log, {k: v for k, v in started.items() if "ClientAppActor" in v})

    try:
        wait_for(lambda: len(history(tmp_path)) >= 1, 400, "round 1", proc)
        killed = wait_for(site_2_worker, 200, "site-2's worker in round 2", proc, poll=0.02)
        assert len(history(tmp_path)) == 1, "round 2 ended before site-2's worker was found"
        os.kill(killed, signal.SIGKILL)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            wait_for(lambda: not still_running(started) and not no_leftover_processes(tmp_path), 30,
                     "every process of the simulation to end", poll=0.5)
        finally:
            for pid, _ in still_running(started):  # a failed test must not leave them on a shared machine
                os.kill(pid, signal.SIGKILL)
    output = console.read_text()
    assert proc.returncode == SITE_FAILURE_EXIT, output

    lines = {int(line.split("|")[0].split()[1]): line for line in output.splitlines() if line.startswith("round ") and "|" in line}
    died = "site-2: missing (the site's simulation worker died before replying — killed or crashed"
    assert "site-1: ok, ε" in lines[2] and died in lines[2], lines[2]
    assert "site-1: ok, ε" in lines[3] and "site-2: ok, ε" in lines[3], lines[3]  # the restarted worker serves both
    assert "round   2 site-2: missing — the site's simulation worker died" in output  # the failure summary
    for raw in ("(raylet)", "ray.exceptions", "Worker ID", "actor_id", "Traceback"):
        assert raw not in output, (raw, output)
    log = (tmp_path / "coordinator" / "simulation.log").read_text()
    assert "ray.exceptions." in log and f"{killed}" in log  # Ray's report, with the dead worker's pid

    rounds = history(tmp_path)
    assert [r["sites"]["site-2"]["status"] for r in rounds] == ["ok", "missing", "ok"]
    for site_id in ("site-1", "site-2"):  # the Ray workers wrote each site's progress where the CLI reads it
        progress = read_progress(tmp_path / "sites" / site_id)
        assert progress is not None and (progress.round, progress.finished) == (3, True), (site_id, progress)
    assert all(r["sites"]["site-1"]["status"] == "ok" and r["aggregated"] for r in rounds)
    rows = {(e.site_id, e.round): e for e in ledger_rows(tmp_path)}
    assert rows[("site-2", 2)].status == "missing" and "worker died" in rows[("site-2", 2)].reason
    for site_id in ("site-1", "site-2"):
        spent = [e for e in site_budget(tmp_path, site_id)["entries"] if e["status"] == "spent"]
        site_log = (tmp_path / "sites" / site_id / "site.log").read_text()
        trained = {r for r in (1, 2, 3) if f"site {site_id} round {r}: training on" in site_log}
        # the true spend: every round the site trained in, by its own log; the killed round counts
        # when the kill came after the spend was recorded (and before training started, or not)
        assert trained <= {e["round"] for e in spent} <= trained | ({2} if site_id == "site-2" else set()), (site_id, spent, trained)
        true_epsilon = epsilon_after_rounds(len(spent))
        assert spent[-1]["epsilon_after"] == pytest.approx(true_epsilon, rel=1e-6)
        assert max(e.epsilon for (s, _), e in rows.items() if s == site_id and e.epsilon is not None) == \
            pytest.approx(true_epsilon, rel=1e-6)


def test_ctrl_c_stops_the_simulation_at_once_and_resume_finishes_it(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C in the terminal (SIGINT to the whole process group, Ray's workers included) during
    round 1: Flower stopped its Ray backend but left the ServerApp's thread waiting for replies, and
    the process sat there until the round timeout (Ray restarted the workers the signal killed). It
    now exits 130 within seconds, says how to continue, leaves no process behind, and `--resume`
    finishes the run from what was saved."""
    import threading
    import time

    from fedpose.cli import main
    from federation_helpers import FEDPOSE, REPO, flower_env, no_leftover_processes, process_tree, still_running, wait_for

    config = tiny_federation(tmp_path, tmp_path / "data", sites=2, rounds=2, timeout=300.0)
    def as_a_terminal_leaves_sigint() -> None:
        # this test process may ignore or block SIGINT (a test runner's worker; Ray, run in-process by
        # the tests before this one), and both survive exec: Python would install no handler for it
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    proc = subprocess.Popen([*FEDPOSE, "simulate", "--config", str(config)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=as_a_terminal_leaves_sigint,
                            env=flower_env(FLWR_HOME=str(tmp_path / "flwr-home")))
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    started: dict[tuple[int, int], str] = {}
    try:
        wait_for(lambda: any(line.startswith("round   0") for line in lines), 300, "round 0", proc, poll=0.2)
        started.update(process_tree(proc.pid))
        interrupted = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
        assert code == 130, "".join(lines)
        assert time.monotonic() - interrupted < 30  # not the 300 s round timeout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            wait_for(lambda: not still_running(started) and not no_leftover_processes(tmp_path), 30,
                     "every process of the simulation to end", poll=0.5)
        finally:
            for pid, _ in still_running(started):
                os.kill(pid, signal.SIGKILL)
    output = "".join(lines)
    assert f"fedpose: interrupted: the simulation stopped; `fedpose simulate --config {config} --resume` continues" in output
    assert "Traceback" not in output
    assert len(history(tmp_path)) < 2
    capfd.readouterr()
    assert main(["simulate", "--config", str(config), "--resume"]) == 0
    assert [r["round"] for r in history(tmp_path)][-1] == 2
