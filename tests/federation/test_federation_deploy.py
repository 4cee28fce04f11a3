"""Real deployments on 127.0.0.1 (`fedpose deploy local`): SuperLink + SuperNodes + coordinator as
separate processes over gRPC with TLS and SuperNode authentication. Tiny model and images.

Few deployments cover everything (each ClientApp is a new process that imports torch + opacus, so
rounds are slow on a loaded 2-core machine): (A) results, wire protocol, metrics, what leaves a
site, and a site that runs out of budget; (B) a site's SuperNode killed while its ClientApp runs
(the disconnect ends the round, which says so), then the coordinator killed and resumed (the killed
site is back and its spend is picked up from its next report); (C) a site with a corrupt image: a
visible, attributed failure and exit code 3, and --resume on the finished run; (D) deploy local
itself SIGKILLed: nothing it started survives. Faults that need a deployment of their own (a lost
SuperLink) are in test_federation_deploy_faults.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest

from fedpose.federation.report import SITE_FAILURE_EXIT
from federation_helpers import (
    assert_budget_ledger_and_true_spend_agree,
    corrupt_image,
    deploy_logs_tail,
    deploy_output,
    epsilon_after_rounds,
    free_base_port,
    history,
    ledger_rows,
    no_leftover_processes,
    process_tree,
    site_budget,
    start_deploy,
    still_running,
    flower_env,
    tiny_federation,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    from fedpose.data.synthetic import ensure_dataset

    out = tmp_path_factory.mktemp("data") / "syn"
    ensure_dataset(out, sites=2, per_site=24, public=8, test=16, size=(64, 64), seed=0, progress=False)
    return out


def _scrape(port: int) -> str:
    # a site's first scrape imports the PLD accountant and computes ε: over 5 s once on a loaded
    # 2-core machine (the suite runs two test files at once)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        return response.read().decode()


def _finish(proc, timeout: float = 1600) -> str:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    return deploy_output(proc)


def test_deployment_grpc_tls_auth_results_ledgers_and_budget_stop(tmp_path: Path, data_dir: Path) -> None:
    # site-2 can afford exactly one round; site-1 has plenty
    eps_small = (epsilon_after_rounds(1) + epsilon_after_rounds(2)) / 2
    config = tiny_federation(tmp_path, data_dir, sites=2, rounds=2, eps_max=[50.0, eps_small], timeout=240.0)
    run_dir, base = tmp_path / "run", free_base_port()
    egress_log = tmp_path / "egress.jsonl"
    proc = start_deploy(config, run_dir, base, 2, env=flower_env(FEDPOSE_EGRESS_LOG=str(egress_log)))
    try:
        wait_for(lambda: (run_dir / "run_id").exists(), 300, "the run to be submitted", proc)
        ca = (run_dir / "certs" / "ca.crt").read_bytes()

        # The Fleet API speaks gRPC over TLS: an HTTP/2 TLS channel becomes READY, and a call on the
        # Fleet service is answered with a gRPC status by the server (an HTTP server cannot do that).
        channel = grpc.secure_channel(f"127.0.0.1:{base}", grpc.ssl_channel_credentials(root_certificates=ca))
        grpc.channel_ready_future(channel).result(timeout=30)
        with pytest.raises(grpc.RpcError) as answered:
            channel.unary_unary("/flwr.proto.Fleet/PullMessages")(b"\x00garbage", timeout=10)
        assert answered.value.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        channel.close()
        # ... and nothing answers in plaintext on that port (TLS is enforced).
        plain = grpc.insecure_channel(f"127.0.0.1:{base}")
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(plain).result(timeout=3)
        plain.close()
        # gRPC health service of the SuperLink
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{base + 3}") as health:
            status = health_pb2_grpc.HealthStub(health).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING

        # SuperNode authentication: a SuperNode with a key the SuperLink never registered, and one
        # with no key at all, are turned away (they exit) and never join a round.
        rogues = _start_rogue_supernodes(tmp_path, base, ca_path=run_dir / "certs" / "ca.crt")
        for name, rogue in rogues.items():
            try:
                rogue.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(rogue.pid, signal.SIGKILL)
                pytest.fail(f"the {name} SuperNode was not refused within 120 s")
            log = (tmp_path / f"rogue-{name}.log").read_text()
            assert rogue.returncode != 0 and "Exit Code: 305" in log, log[-2000:]  # 305: could not connect to the SuperLink

        # Prometheus over HTTP: coordinator (ServerApp) and each site's exporter
        coordinator_text = wait_for(lambda: _try_scrape(base + 5, "fedpose_round 1.0"), 400, "coordinator metrics after round 1", proc)
        site_text = _scrape(base + 20)
    finally:
        output = _finish(proc)
    # checked once the deployment has ended, so that a failure shows its console and logs
    assert proc.returncode == 0, output + deploy_logs_tail(run_dir)
    assert 'fedpose_site_epsilon{accountant="pld",adjacency="add_remove",guarantee="DP",site="site-1",unit="patient"}' in coordinator_text, \
        coordinator_text + output + deploy_logs_tail(run_dir)
    assert 'fedpose_site_epsilon_spent{accountant="pld",adjacency="add_remove",guarantee="DP",site="site-1",unit="patient"}' in site_text
    assert "round   2" in output and "(DP, δ = 1e-05, PLD)" in output
    # round 0 (the initial model's score, which the ServerApp prints to its log) also reaches this console, first
    assert output.index("round   0 | PCKh@0.5 = ") < output.index("round   1 |"), output

    rounds = history(run_dir)
    assert [r["round"] for r in rounds] == [1, 2]
    assert {s: v["status"] for s, v in rounds[0]["sites"].items()} == {"site-1": "ok", "site-2": "ok"}
    # site-2 said after round 1 that another round would not fit: it is asked again and its own guard
    # refuses visibly (nothing spent) — the coordinator never decides a site's exhaustion for it
    assert {s: v["status"] for s, v in rounds[1]["sites"].items()} == {"site-1": "ok", "site-2": "refused"}
    for r in rounds:
        assert r["pckh"] is not None and 0 <= r["pckh"]["Mean"] <= 100
    report = json.loads((run_dir / "coordinator" / "report.json").read_text())
    assert report["rounds_completed"] == 2 and report["stopped_reason"] == "completed 2 rounds"
    assert (run_dir / "coordinator" / "curves.png").exists()

    # each site ran its own installed ClientApp: the run's package was received, never installed or
    # imported (sites/pinned.py) — whoever submits a run cannot choose the code a site runs
    from sites.pinned import NOT_INSTALLED

    for site_id in ("site-1", "site-2"):
        executed = (run_dir / "logs" / f"superexec-{site_id}.log").read_text()
        assert NOT_INSTALLED in executed, executed[-2000:]
    site_logs = [log for kind in ("supernode", "superexec") for log in (run_dir / "logs").glob(f"{kind}-site-*.log")]
    assert len(site_logs) == 4 and not any("Successfully installed" in log.read_text(errors="replace") for log in site_logs)

    # both ledgers: each site's own budget and the coordinator's mirror agree
    rows = ledger_rows(run_dir)
    assert sorted((e.site_id, e.round, e.status) for e in rows) == [
        ("site-1", 1, "ok"), ("site-1", 2, "ok"), ("site-2", 1, "ok"), ("site-2", 2, "refused")]
    for site_id, statuses in (("site-1", ["spent", "spent"]), ("site-2", ["spent", "refused"])):
        budget = site_budget(run_dir, site_id)
        assert [(e["round"], e["status"]) for e in budget["entries"]] == list(zip((1, 2), statuses))
        assert all(e["run_id"] == "itest" for e in budget["entries"])
        reported = max(e.epsilon for e in rows if e.site_id == site_id)
        assert reported == pytest.approx(epsilon_after_rounds(statuses.count("spent")), rel=1e-6)
        # over gRPC too, the digest of each update the coordinator received is the one the site logged sending
        from fedpose.federation.site_audit import read_log

        sent = {e.round: e.update_sha256 for e in read_log(run_dir / "sites" / site_id)}
        assert {e.round: e.update_sha256 for e in rows if e.site_id == site_id} == sent and sent[1] is not None

    # each site's progress file, where deploy local's progress lines read it (site-2 refused round 2: no training)
    from fedpose.federation.site_progress import read_progress

    progress = [read_progress(run_dir / "sites" / site_id) for site_id in ("site-1", "site-2")]
    assert [(p.run_id, p.round, p.steps_done, p.finished) for p in progress if p] == [("itest", 2, 2, True), ("itest", 1, 2, True)]

    # every message that left a site: only parameter-shaped Δ arrays, protocol metrics and strings
    from fedpose.federation import protocol

    outgoing = [json.loads(line) for line in egress_log.read_text().splitlines()]
    assert len(outgoing) == 4
    trainable = _trainable_shapes(run_dir)
    for message in outgoing:
        records = message["records"]
        reply = protocol.decode_reply(records["reply"]["values"])  # exactly the typed schema, nothing else
        assert reply.privacy is not None and reply.privacy.guarantee == "DP"
        assert reply.signature, "deploy local gives each site an identity: every reply is signed"
        if reply.status == "refused":  # site-2, round 2: no update leaves the site
            assert not (records.get("update") or {}).get("arrays"), records.keys()
            continue
        assert reply.status == "ok" and set(records) == {"update", "reply"}
        arrays = records["update"]["arrays"]
        assert arrays and {k: tuple(v["shape"]) for k, v in arrays.items()} == trainable
        assert all(v["dtype"] == "float32" for v in arrays.values())
    assert not no_leftover_processes(run_dir), "deploy local left processes running"

    # A restarted site (fresh process, state from disk) still refuses, whatever it is asked.
    from fedpose.config import ModelSpec, load_config
    from fedpose.federation.aggregation import load_array_checkpoint
    from fedpose.federation.config import SiteConfig
    from fedpose.federation.local_training import train_site_round

    site = load_config(run_dir / "configs" / "site-2.toml", model=SiteConfig)
    before = site_budget(run_dir, "site-2")
    weights, meta = load_array_checkpoint(run_dir / "coordinator" / "global.npz")
    result = train_site_round(site, "itest", 3, weights, ModelSpec.model_validate(meta["state"]["model_spec"]), local_steps=2)
    assert result.reply.status == "refused" and result.reply.reason == "budget-exhausted" and result.update == {}
    assert result.reply.privacy is not None and result.reply.privacy.guarantee == "DP"
    after = site_budget(run_dir, "site-2")
    assert after["accountant"] == before["accountant"]  # nothing spent
    assert [(e["round"], e["status"]) for e in after["entries"]] == [(1, "spent"), (2, "refused"), (3, "refused")]


def _start_rogue_supernodes(tmp_path: Path, base: int, ca_path: Path) -> dict[str, subprocess.Popen]:
    """An 'unregistered' SuperNode (valid key pair, never registered) and a 'keyless' one."""
    import sys

    from fedpose.cli.certs import write_dev_certificates

    write_dev_certificates(tmp_path / "rogue-certs", ["rogue"])
    supernode = str(Path(sys.executable).parent / "flower-supernode")
    common = [supernode, "--superlink", f"127.0.0.1:{base}", "--grpc-rere", "--root-certificates", str(ca_path),
              "--host", "127.0.0.1", "--node-config", 'site-config="/nonexistent.toml"']
    argv = {"unregistered": [*common, "--port", str(base + 28), "--auth-supernode-private-key", str(tmp_path / "rogue-certs" / "sites" / "rogue")],
            "keyless": [*common, "--port", str(base + 29)]}
    # the SuperNode starts flower-superexec from PATH (without it, it hangs instead of exiting)
    env = flower_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return {name: subprocess.Popen(args, env=env, stdout=(tmp_path / f"rogue-{name}.log").open("w"), stderr=subprocess.STDOUT,
                                   start_new_session=True)
            for name, args in argv.items()}


def _try_scrape(port: int, needle: str) -> str | None:
    try:
        text = _scrape(port)
    except OSError:
        return None
    return text if needle in text else None


def _trainable_shapes(run_dir: Path) -> dict[str, tuple[int, ...]]:
    from fedpose.federation.aggregation import load_array_checkpoint
    from fedpose.model import build_model_from_spec

    _, meta = load_array_checkpoint(run_dir / "coordinator" / "global.npz")
    model = build_model_from_spec(meta["state"]["model_spec"])
    return {k: tuple(p.shape) for k, p in model.trainable_parameters().items()}


def test_a_site_killed_while_its_clientapp_runs_goes_missing_then_killed_coordinator_resumes_with_the_same_ledger(
        tmp_path: Path, data_dir: Path) -> None:
    """site-2's machine goes while its round-2 ClientApp runs: the disconnect ends round 2 (not its
    timeout), which says so; Ctrl-C then kills the coordinator, and --resume continues the run with
    the same ledger, site-2 back and every spend counted once."""
    timeout = 150.0
    # Four rounds: Ctrl-C lands in round 3 or just after it, so at least one round is left to resume.
    config = tiny_federation(tmp_path, data_dir, sites=2, rounds=4, timeout=timeout)
    run_dir, base = tmp_path / "run", free_base_port()
    proc = start_deploy(config, run_dir, base, 2)
    try:
        wait_for(lambda: len(history(run_dir)) >= 1, 400, "round 1", proc)
        pids = json.loads((run_dir / "pids.json").read_text())
        supernode, superexec = pids["supernode-site-2"], pids["superexec-site-2"]
        tree = wait_for(lambda: (lambda t: t if any("fedpose-site-clientapp" in c for c in t.values()) else None)(
            process_tree(superexec)), 300, "site-2's round-2 ClientApp", proc, poll=0.2)
        # the machine goes: SuperNode, the site's SuperExec and ClientApp (before the ClientApp has
        # imported torch, so before it could spend round 2)
        os.killpg(supernode, signal.SIGKILL)
        os.killpg(superexec, signal.SIGKILL)
        for pid, _ in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_for(lambda: len(history(run_dir)) >= 2, 400, "round 2", proc)
        proc.send_signal(signal.SIGINT)  # Ctrl-C on the deployment: the coordinator dies with it
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not no_leftover_processes(run_dir), "Ctrl-C left processes running"
    # the operator is told, once, which of the site's processes went (not only through round 2's line)
    first = deploy_output(proc)
    for name in ("supernode-site-2", "superexec-site-2"):
        assert first.count(f"fedpose: warning: {name} exited with code -9") == 1, first
    assert "site-1" not in "".join(line for line in first.splitlines() if "exited with code" in line)

    rounds = history(run_dir)
    assert rounds[1]["sites"]["site-1"]["status"] == "ok" and rounds[1]["aggregated"]
    reason = rounds[1]["sites"]["site-2"]["reason"]
    assert rounds[1]["sites"]["site-2"]["status"] == "missing" and reason.startswith(
        "the site disconnected: Flower declared its node gone"), reason
    # the disconnect ended the round (Flower declares a node gone ≤ 2 × 30 s after its last heartbeat)
    assert rounds[1]["exchange_seconds"] < 0.8 * timeout, rounds[1]["exchange_seconds"]
    before = {(e.site_id, e.round): e for e in ledger_rows(run_dir)}
    assert before[("site-2", 2)].status == "missing" and before[("site-1", 2)].status == "ok"
    done = max(r for _, r in before)
    assert done in (2, 3)  # round 3 may finish before the Ctrl-C lands (the dead node is not selected)

    proc = start_deploy(config, run_dir, base, 2, "--resume", "--allow-site-failures")
    output = _finish(proc)
    assert proc.returncode == 0, output + deploy_logs_tail(run_dir)  # site-2 missed rounds: allowed, and summarised
    # the resumed deployment prints every round of the run, round 2 with why site-2 is missing
    (line,) = [l for l in output.splitlines() if l.startswith("round   2 |")]
    assert "site-2: missing (the site disconnected: Flower declared its node gone" in line, line
    assert "round   2 site-2: missing — the site disconnected" in output, output  # the failure summary
    assert output.strip().splitlines()[-1].startswith("run 'itest': 4 rounds completed in total; report:"), output
    assert f"resuming run 'itest' after round {done}" in (run_dir / "logs" / "coordinator.log").read_text()
    assert not no_leftover_processes(run_dir)
    rounds = history(run_dir)
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]
    after = {(e.site_id, e.round): e for e in ledger_rows(run_dir)}
    for key, entry in before.items():
        assert after[key] == entry, f"ledger row {key} changed on resume"
    assert {("site-1", r) for r in (1, 2, 3, 4)} <= set(after)
    # site-2 is back in the first resumed round: its spend is picked up from that report (it never
    # trained round 2, nor round 3 if that ran before the Ctrl-C)
    back = done + 1
    assert {("site-2", r) for r in (1, 2, back)} <= set(after)
    assert all(after[("site-2", r)].status == "missing" for r in range(2, back) if ("site-2", r) in after)
    assert after[("site-2", 1)].status == "ok" and after[("site-2", back)].status == "ok"
    assert after[("site-2", back)].epsilon == pytest.approx(epsilon_after_rounds(2), rel=1e-6)
    # each site's budget = the ledger = its true spend (the rounds its own log says it trained in)
    assert_budget_ledger_and_true_spend_agree(run_dir, "site-1", [1, 2, 3, 4])
    assert_budget_ledger_and_true_spend_agree(run_dir, "site-2", [1, *range(back, 5)])


def test_a_corrupt_image_fails_its_site_visibly_and_resume_says_the_run_is_finished(tmp_path: Path, data_dir: Path) -> None:
    data = Path(shutil.copytree(data_dir, tmp_path / "data"))
    bad = corrupt_image(data / "site-2")
    config = tiny_federation(tmp_path, data, sites=2, rounds=1)
    run_dir, base = tmp_path / "run", free_base_port()
    proc = start_deploy(config, run_dir, base, 2)
    output = _finish(proc, timeout=400)
    assert proc.returncode == SITE_FAILURE_EXIT, output
    (round_line,) = [line for line in output.splitlines() if line.startswith("round   1 |")]
    assert "site-1: ok, ε" in round_line and "site-2: error (ImageLoadError: the site's ClientApp failed" in round_line
    assert "round   1 site-2: error — ImageLoadError" in output  # the summary: round, site id, error class
    assert output.strip().splitlines()[-1].startswith("run 'itest': 1 round completed in total"), output
    assert bad.name not in output and "Traceback" not in output
    assert not no_leftover_processes(run_dir), "deploy local left processes running"

    # ledger and site budgets agree: site-2 spent nothing and is on record as failed
    rows = {(e.site_id, e.round): e for e in ledger_rows(run_dir)}
    assert rows[("site-2", 1)].status == "missing" and rows[("site-2", 1)].epsilon in (None, 0.0) and rows[("site-2", 1)].steps == 0
    assert not [e for e in site_budget(run_dir, "site-2")["entries"] if e["status"] == "spent"]
    assert rows[("site-1", 1)].status == "ok"
    assert rows[("site-1", 1)].epsilon == pytest.approx(epsilon_after_rounds(1), rel=1e-6)
    assert [e["round"] for e in site_budget(run_dir, "site-1")["entries"] if e["status"] == "spent"] == [1]

    # --resume on the finished run: how to continue, nothing started
    proc = start_deploy(config, run_dir, base, 2, "--resume")
    output = _finish(proc, timeout=120)
    assert proc.returncode == 0, output + deploy_logs_tail(run_dir)
    assert "run 'itest' already finished after 1 rounds (coordinator.rounds = 1); to continue, raise coordinator.rounds: " \
           "--resume --rounds 2" in output, output
    assert "submitted" not in output


def test_sigkill_of_deploy_local_leaves_no_process_behind(tmp_path: Path, data_dir: Path) -> None:
    """SIGKILL cannot be caught: the watchdog stops SuperLink, SuperExecs, SuperNodes, exporters,
    the ServerApp and the ClientApps of the round that was running."""
    config = tiny_federation(tmp_path, data_dir, sites=2, rounds=3)
    run_dir, base = tmp_path / "run", free_base_port()
    proc = start_deploy(config, run_dir, base, 2)
    started: dict[tuple[int, int], str] = {}

    def clientapps_running() -> bool:
        started.update(process_tree(proc.pid))
        return any("fedpose-site-clientapp" in cmdline for cmdline in started.values())

    try:
        wait_for(clientapps_running, 300, "a ClientApp process (a round under way)", proc, poll=0.3)
        for name in ("flower-superlink", "flower-supernode", "flower-superexec", "fedpose-site-superexec", "sites.metrics",
                     "flwr-serverapp"):
            assert any(name in cmdline for cmdline in started.values()), (name, started)
        proc.kill()
        proc.wait(timeout=10)
        wait_for(lambda: not still_running(started) and not no_leftover_processes(run_dir), 15,
                 "every process deploy local started to end")
    finally:
        for pid, _ in still_running(started):  # a failed test must not leave them on a shared machine
            os.kill(pid, signal.SIGKILL)
