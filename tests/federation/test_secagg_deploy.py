"""Secure aggregation (SecAgg+) on real processes: a Flower SuperLink and one SuperNode per site on
127.0.0.1, started with Flower's own commands (``flower-superlink``, ``flower-supernode``, ``flwr
run``) as an operator starts them, several runs on one SuperLink. Tiny model and images.

(A) five sites that train without noise (mechanism "none": their Δ is a deterministic function of
    the global weights, the data and ``train.seed``), two runs on one deployment:
    - all 5 sites with secure aggregation: the round line says so, and the global model equals
      plain FedAvg of the sites' updates within the stated quantization bound. The
      updates are the real sites' — they never leave a site in the clear, so the test recomputes
      them in-process with the same inputs (same initial global model, data, seed, round, one
      thread) and the comparison is exact up to the bound: a real site whose Δ differed from the
      recomputed one (by more than ~10⁻⁶ per coordinate) fails the test. (DP sites cannot be
      compared this way: their noise comes from the CSPRNG, and a federation site refuses the
      test-only seeded noise.) Nothing but masked vectors and stage messages leaves the sites.
    - a malicious coordinator (a real ServerApp whose unmask request lists one site as both a
      survivor and dropped), sampling 3 of the 5 sites → every site refuses, the round is abandoned,
      nothing is aggregated. (That a sampled subset is masked among itself and sums to its FedAvg
      is test_secagg_rounds', in-process with real cryptography; a third real run here cost
      ~100 s of the suite for it.)
(B) four DP-SGD sites (site-1 requires secure aggregation), two runs on one deployment:
    - a secure round: one site's SuperNode is SIGKILLed right after its masked vector reached the
      SuperLink → its self mask is rebuilt from the others' seed shares, the round completes with
      its vector in the sum, every site's spend in the ledger;
    - a plain run: site-1 (which requires secure aggregation) refuses and spends nothing (its
      budget file is byte-identical), the others train.
    (Too few sites left to unmask — abandoned, the global model unchanged, every spend recorded —
    is the same round runner code: test_secagg_rounds, in-process, without a second 36–60 s wait
    for a dead node.)

How a dead node is waited for: every stage (setup, share keys, masked vectors, unmask) is one
exchange of :class:`coordinator.grid.GridTransport`, which stops waiting for a node when it answers,
when the SuperLink no longer lists it (Flower declares a SuperNode gone when its heartbeats stop:
it sends one every ~24 s and the SuperLink keeps it for 2 × 30 s, so 36–60 s after a SIGKILL), or
at the round timeout (the TTL of the stage's messages). A killed site is therefore dropped 36–60 s
after the kill — not at the round timeout, which is set well above that and above a round's
training. To kill a site *after masking* without a race, the test pauses (SIGSTOP) the other
sites' training ClientApps until the victim's SuperNode has logged its masked reply as sent, kills
the victim's process group, then resumes them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tomli_w

from federation_helpers import (
    BATCH_SIZE,
    DELTA,
    LOCAL_STEPS,
    NOISE,
    PER_SITE,
    REPO,
    SAMPLE_RATE,
    epsilon_after_rounds,
    flower_env,
    free_base_port,
    no_leftover_processes,
    process_tree,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONNECTION = "secagg-test"
INPUT_SIZE = [64, 64]
CLIP_RANGE = 0.05
SECURE = {"enabled": True, "clip_range": CLIP_RANGE, "bits": 16, "modulus_bits": 32, "max_sites": 8}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    from fedpose.data.synthetic import ensure_dataset

    out = tmp_path_factory.mktemp("data") / "syn"
    ensure_dataset(out, sites=5, per_site=PER_SITE, public=8, test=16, size=tuple(INPUT_SIZE), seed=0, progress=False)
    return out


# -- configs -----------------------------------------------------------------------------------------
def site_entry(tmp: Path, data_dir: Path, k: int, private: bool, **extra: Any) -> dict[str, Any]:
    privacy = ({"mechanism": "dpsgd", "noise_multiplier": NOISE, "sample_rate": SAMPLE_RATE, "max_grad_norm": 1.0, "delta": DELTA}
               if private else {"mechanism": "none"})
    return {"site_id": f"site-{k}", "data": {"train": str(data_dir / f"site-{k}")}, "state_dir": str(tmp / "sites" / f"site-{k}"),
            "eps_max": 50.0, "local_steps": LOCAL_STEPS, "train": {"batch_size": BATCH_SIZE, "threads": 1, "seed": k},
            "privacy": privacy, **extra}


def coordinator_toml(tmp: Path, name: str, rounds: int = 1, timeout: float = 150.0, secure: dict | None = None,
                     **extra: Any) -> Path:
    """``expected_sites`` (in ``extra``): round 1 waits for them — SuperNodes connect one by one."""
    coordinator = {"rounds": rounds, "min_sites": 1, "round_timeout_s": timeout, "local_steps": LOCAL_STEPS,
                   "checkpoint_dir": str(tmp / name), "data": {"input_size": INPUT_SIZE},
                   "model": {"backbone": "tiny_vit_test", "scenario": "scratch"}, "update_norm_bound": 1e6,
                   "secure_aggregation": secure or {"enabled": False}, **extra}
    path = tmp / f"{name}.toml"
    path.write_text(tomli_w.dumps({"run_id": name, "coordinator": coordinator}))
    return path


# -- a deployment started with Flower's commands ------------------------------------------------------
def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


class Deployment:
    """SuperLink + one SuperNode per site TOML (insecure transport: TLS and SuperNode authentication
    are covered by test_federation_deploy.py; here the subject is the protocol over real processes)."""

    def __init__(self, root: Path, site_tomls: list[Path], **env: str):
        self.root = root
        self.base = free_base_port()
        flwr_home = root / "flwr-home"  # no_leftover_processes() finds everything by it
        flwr_home.mkdir(parents=True)
        (flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "127.0.0.1:{self.base + 1}"\ninsecure = true\n')
        self.env = flower_env(FLWR_HOME=str(flwr_home), PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO),
                              PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **env)
        (root / "logs").mkdir()
        self.procs: dict[str, subprocess.Popen] = {}
        self.superlink = self._start("superlink", [
            _bin("flower-superlink"), "--insecure", "--disable-runtime-dependency-installation", "--fleet-api-type", "grpc-rere",
            "--fleet-api-address", f"127.0.0.1:{self.base}", "--host", "127.0.0.1", "--port", str(self.base + 1)])
        wait_for(lambda: _listening(self.base) and _listening(self.base + 1), 120, "the SuperLink", self.superlink, poll=0.3)
        self.sites = [tomllib.loads(p.read_text())["site_id"] for p in site_tomls]
        for i, (site_id, path) in enumerate(zip(self.sites, site_tomls)):
            self._start(site_id, [_bin("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{self.base}", "--grpc-rere",
                                  "--node-config", f'site-config="{path}"', "--host", "127.0.0.1", "--port", str(self.base + 10 + i)])

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen:
        with (self.root / "logs" / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True, cwd=REPO)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.root / "logs" / f"{name}.log").read_text(errors="replace")

    def run(self, config: Path, app_dir: Path = REPO, timeout: float = 900) -> tuple[str, float]:
        """Submit one run with ``flwr run``, wait for it to finish; (the coordinator's output, seconds)."""
        from fedpose.cli.deploy import _Coordinator

        started = time.monotonic()
        coordinator = _Coordinator(Path(tomllib.loads(config.read_text())["coordinator"]["checkpoint_dir"]))  # before the run
        out = subprocess.run([_bin("flwr"), "run", str(app_dir), CONNECTION, "--run-config", f'coordinator-config="{config}"',
                              "--format", "json"], env=self.env, capture_output=True, text=True, timeout=180, cwd=app_dir)
        assert out.returncode == 0, out.stdout + out.stderr
        run_id = str(json.loads(out.stdout[out.stdout.index("{"):])["run-id"])
        asked = [started]

        def finished() -> bool:
            # `flwr ls` is a Python process (~1 s of CPU the sites need): asked once the coordinator has
            # ended (as deploy local tells: its report written, or its process gone), else every 30 s
            if not coordinator.ended() and time.monotonic() - asked[0] < 30:
                return False
            asked[0] = time.monotonic()
            return self._status(run_id).startswith("finished")

        wait_for(finished, timeout, f"run {run_id} ({config.stem}) to finish", self.superlink, poll=0.5)
        seconds = time.monotonic() - started
        status = self._status(run_id)
        shown = subprocess.run([_bin("flwr"), "log", run_id, CONNECTION, "--show"], env=self.env, capture_output=True, text=True,
                               timeout=120)
        output = shown.stdout + shown.stderr
        (self.root / "logs" / f"coordinator-{config.stem}.log").write_text(output)
        assert status == "finished:completed", f"{status}\n{output[-4000:]}"
        return output, seconds

    def _status(self, run_id: str) -> str:
        out = subprocess.run([_bin("flwr"), "ls", CONNECTION, "--run-id", run_id, "--format", "json"], env=self.env,
                             capture_output=True, text=True, timeout=120)
        try:
            runs = json.loads(out.stdout[out.stdout.index("{"):]).get("runs") or []
        except ValueError:
            return ""
        return str(runs[0]["status"]) if runs else ""

    def kill(self, site_id: str) -> None:
        """The site's machine goes: SuperNode, SuperExec and any ClientApp, SIGKILL."""
        os.killpg(self.procs[site_id].pid, signal.SIGKILL)
        self.procs[site_id].wait(timeout=30)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        # what Flower started in sessions of its own (the SuperLink's SuperExec and ServerApps) carries our
        # FLWR_HOME; SIGKILL takes effect asynchronously, so close() returns once none of them still runs
        deadline = time.monotonic() + 10
        while (pids := _pids_with(f"FLWR_HOME={self.env['FLWR_HOME']}".encode())) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)


def _pids_with(variable: bytes) -> list[int]:
    """Running processes (zombies excluded) whose environment holds ``variable`` (NAME=value)."""
    pids = []
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            if variable in (proc_dir / "environ").read_bytes().split(b"\0"):
                if (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(proc_dir.name))
        except OSError:
            continue
    return pids


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def clientapps(deployment: Deployment, site_id: str) -> list[int]:
    return [pid for (pid, _), cmd in process_tree(deployment.procs[site_id].pid).items() if "flwr-clientapp" in cmd]


def site_log(site_dir: Path) -> str:
    path = site_dir / "site.log"
    return path.read_text(errors="replace") if path.exists() else ""


def train_reply_sent(supernode_log: str, after: int) -> bool:
    """The SuperNode pushed a train reply to the SuperLink after offset ``after`` of its log."""
    text = supernode_log[after:]
    sending = text.find("Sending: train message")
    return sending >= 0 and "Sent successfully" in text[sending:]


def drop_after_masking(deployment: Deployment, tmp: Path, round_id: int, victims: list[str], others: list[str]) -> float:
    """Kill ``victims`` right after their masked vectors reached the SuperLink, while ``others`` are
    held (SIGSTOP) mid-training, so the victims can answer no later stage. Returns the kill time."""
    offsets = {v: len(deployment.log(v)) for v in victims}
    marker = f"round {round_id}: training on"
    wait_for(lambda: all(marker in site_log(tmp / "sites" / s) for s in others), 400, f"round {round_id} training at {others}",
             deployment.superlink, poll=0.1)
    held = [pid for s in others for pid in clientapps(deployment, s)]
    assert held, "the surviving sites' ClientApps finished before they could be held"
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: all(train_reply_sent(deployment.log(v), offsets[v]) for v in victims), 300,
                 f"the masked vectors of {victims}", deployment.superlink, poll=0.1)
        for victim in victims:
            deployment.kill(victim)
        killed = time.monotonic()
    finally:
        for pid in held:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    return killed


def history(checkpoint_dir: Path) -> list[dict[str, Any]]:
    return json.loads((checkpoint_dir / "history.json").read_text())["rounds"]


def _rounds(checkpoint_dir: Path) -> list[dict[str, Any]]:
    try:
        return history(checkpoint_dir)
    except (OSError, ValueError):
        return []


def round_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if re.match(r"round +\d+ \|", line)]


# -- (A) the aggregate of 5 sites, and a malicious coordinator -----------------------------------------
def expected_updates(tmp: Path, site_tomls: list[Path], config: Path) -> tuple[dict[str, np.ndarray], list[str], dict[str, dict[str, np.ndarray]]]:
    """The initial global model as the coordinator builds it, its trainable names, and each site's
    round-1 Δ recomputed in this process (a fresh state_dir: the same inputs as the real site's)."""
    import torch

    from fedpose.config import load_config
    from fedpose.federation.config import SiteConfig
    from fedpose.federation.deployment import load_coordinator_run
    from fedpose.federation.local_training import run_site_round
    from fedpose.model import build_model
    from fedpose.model.checkpoint import model_spec

    cfg = load_coordinator_run(str(config)).coordinator
    torch.manual_seed(cfg.seed)  # RoundRunner._initial_model: no public data, so no warm start
    model = build_model(cfg.model, tuple(cfg.data.input_size))
    spec = model_spec(model)
    initial = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
    trainable = list(model.trainable_parameters())
    updates = {}
    for path in site_tomls:
        site = load_config(str(path), model=SiteConfig)
        site = site.model_copy(update={"state_dir": tmp / "recompute" / site.site_id})
        result = run_site_round(site, "recompute", 1, initial, spec, cfg.local_steps, threads=1)
        assert result.reply.status == "ok", result.reply
        updates[site.site_id] = result.update
    return initial, trainable, updates


def assert_secure_fedavg(checkpoint_dir: Path, initial: dict[str, np.ndarray], trainable: list[str],
                         updates: dict[str, dict[str, np.ndarray]]) -> tuple[float, float]:
    """The run's global model after round 1 = plain FedAvg of the clipped updates of the sites in the
    round, within the round's stated bound (+ float32 rounding of the stored weights). → (largest
    error, bound)."""
    from fedpose.federation.aggregation import load_array_checkpoint
    from fedpose.federation.global_model import GLOBAL_CHECKPOINT

    (entry,) = history(checkpoint_dir)
    sites = sorted(entry["sites"])
    assert all(entry["sites"][s]["status"] == "ok" for s in sites), entry["sites"]
    bound = entry["secure_aggregation"]["error_bound"]
    assert 0 < bound < 1e-5, bound  # 2r / (2^16 − 1) for weights 1: small against Δ (checked below)
    arrays, _ = load_array_checkpoint(checkpoint_dir / GLOBAL_CHECKPOINT)
    worst, moved = 0.0, 0.0
    for name in initial:
        got = np.asarray(arrays[name], np.float64)
        if name not in trainable:
            assert np.array_equal(arrays[name], initial[name]), name
            continue
        mean = sum(np.clip(np.asarray(updates[s][name], np.float64), -CLIP_RANGE, CLIP_RANGE) for s in sites) / len(sites)
        expected = initial[name].astype(np.float64) + mean
        slack = np.abs(expected) * 2.0**-23 + 1e-12  # the global model is stored in float32
        error = np.abs(got - expected)
        assert (error <= bound + slack).all(), (name, float((error - slack).max()), bound)
        worst = max(worst, float((error - slack).max()))
        moved = max(moved, float(np.abs(mean).max()))
    assert moved > 100 * bound, (moved, bound)  # the sites' updates are far larger than the bound: the check has teeth
    return worst, bound


EVIL_APP = '''\
"""A coordinator that asks each site for both shares of one peer (its seed share and its key share)."""
import fedpose.federation.server.rounds as rounds
from coordinator.server_app import build_server_app
from fedpose.federation.secagg.coordinator import CoordinatorSecAggRound


class AsksForBothShares(CoordinatorSecAggRound):
    def view_request(self):  # the view the sites sign, and the unmask request built from it
        honest = super().view_request()
        victim = honest.survivors[0]  # its masked vector arrived; now ask for its mask key too
        return honest.model_copy(update={"dropped": sorted({*honest.dropped, victim})})


rounds.CoordinatorSecAggRound = AsksForBothShares
app = build_server_app()
'''


def evil_app_dir(tmp: Path) -> Path:
    """A Flower app (FAB) whose ServerApp is the malicious coordinator; its ClientApp is the real one."""
    app = tmp / "evil-app"
    app.mkdir()
    (app / "evil_coordinator.py").write_text(EVIL_APP)
    (app / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "evil-coordinator"\nversion = "1.0.0"\ndependencies = []\n\n'
        '[tool.flwr.app]\npublisher = "tests"\nfab-include = ["evil_coordinator.py"]\n\n'
        '[tool.flwr.app.components]\nserverapp = "evil_coordinator:app"\nclientapp = "sites.client_app:app"\n\n'
        '[tool.flwr.app.config]\ncoordinator-config = ""\nresume = false\nfederation-config = ""\n')
    return app


def test_five_sites_equal_plain_fedavg_and_a_coordinator_asking_for_both_shares_is_refused(
        tmp_path: Path, data_dir: Path) -> None:
    site_tomls = []
    for k in range(1, 6):
        path = tmp_path / f"site-{k}.toml"
        path.write_text(tomli_w.dumps(site_entry(tmp_path, data_dir, k, private=False)))
        site_tomls.append(path)
    five = coordinator_toml(tmp_path, "five", secure=SECURE, expected_sites=5)
    evil = coordinator_toml(tmp_path, "evil", secure=SECURE, fraction_train=0.6, expected_sites=5)  # 3 of the 5 connected sites
    initial, trainable, updates = expected_updates(tmp_path, site_tomls, five)
    egress_log = tmp_path / "egress.jsonl"
    deployment = Deployment(tmp_path / "deploy", site_tomls, FEDPOSE_EGRESS_LOG=str(egress_log))
    try:
        timings = {}
        output, timings["five"] = deployment.run(five)
        (line,) = round_lines(output)
        assert "secure aggregation: sum of 5 of 5 sites (t = 3, quantization error ≤" in line, line
        (entry,) = history(tmp_path / "five")
        assert entry["aggregated"] and entry["accepted"] == 5 and len(entry["sites"]) == 5
        worst, bound = assert_secure_fedavg(tmp_path / "five", initial, trainable, updates)
        print(f"five: 5 sites, {timings['five']:.0f} s, |global − FedAvg| ≤ {worst:.3g} (bound {bound:.3g})")

        # what left the sites: stage answers and masked vectors; never an update
        sent = [json.loads(line) for line in egress_log.read_text().splitlines()]
        trains = [m for m in sent if m["message_type"] == "train"]
        assert len(trains) == 5 and all(set(m["records"]) == {"reply", "masked"} for m in trains), trains
        assert all(m["records"]["masked"]["arrays"]["vector"]["dtype"] == "uint32" for m in trains), trains[0]

        output, timings["evil"] = deployment.run(evil, app_dir=evil_app_dir(tmp_path))
        (entry,) = history(tmp_path / "evil")
        assert not entry["aggregated"] and entry["secure_aggregation"]["abandoned"].startswith("0 of 3 sites after the view check")
        assert all(site["status"] == "rejected" and site["reject_reason"] == "secure_aggregation_abandoned"
                   for site in entry["sites"].values()), entry["sites"]
        (line,) = round_lines(output)
        refused = f"refused by {', '.join(sorted(entry['sites']))} (both-shares-of-one-peer)"
        assert f"secure aggregation: abandoned (0 of 3 sites after the view check < threshold t = 2; {refused})" in line, line
        for site_id in entry["sites"]:  # each site refused (its own log says why); no share left it
            assert "both-shares-of-one-peer" in site_log(tmp_path / "sites" / site_id), site_id
        answers = [json.loads(m["records"]["secagg"]["values"]["secagg"])["message"]
                   for m in map(json.loads, egress_log.read_text().splitlines()) if m["message_type"] == "query.secagg"]
        assert [(a["kind"], a["reason"]) for a in answers[-3:]] == [("refusal", "both-shares-of-one-peer")] * 3, answers[-3:]
        from fedpose.federation.aggregation import load_array_checkpoint
        from fedpose.federation.global_model import GLOBAL_CHECKPOINT

        arrays, _ = load_array_checkpoint(tmp_path / "evil" / GLOBAL_CHECKPOINT)
        assert all(np.array_equal(arrays[k], initial[k]) for k in initial)  # nothing aggregated
        print("run seconds:", {k: round(v) for k, v in timings.items()})
    finally:
        deployment.close()
    assert not no_leftover_processes(tmp_path / "deploy")


# -- (B) dropouts and a site that requires secure aggregation ------------------------------------------------
def test_a_dropout_after_masking_is_recovered_and_a_site_requiring_secagg_refuses_a_plain_round(
        tmp_path: Path, data_dir: Path) -> None:
    site_tomls = []
    for k in range(1, 5):
        path = tmp_path / f"site-{k}.toml"
        path.write_text(tomli_w.dumps(site_entry(tmp_path, data_dir, k, private=True, require_secure_aggregation=k == 1)))
        site_tomls.append(path)
    secure = coordinator_toml(tmp_path, "secure", secure=SECURE, expected_sites=4)
    plain = coordinator_toml(tmp_path, "plain", expected_sites=3)  # site-4 is dead by then
    deployment = Deployment(tmp_path / "deploy", site_tomls)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:  # the run goes on while this thread kills a site
            run = pool.submit(deployment.run, secure)
            killed = drop_after_masking(deployment, tmp_path, 1, ["site-4"], ["site-1", "site-2", "site-3"])
            wait_for(lambda: len(_rounds(tmp_path / "secure")) >= 1, 400, "round 1", deployment.superlink, poll=0.5)
            after_kill = time.monotonic() - killed
            output, seconds = run.result(timeout=900)
        (first,) = history(tmp_path / "secure")
        (line,) = round_lines(output)

        # site-4's masked vector is in the sum; it answered no unmask request (it was dead)
        assert first["aggregated"] and first["secure_aggregation"]["survivors"] == 4, first
        assert all(first["sites"][s]["status"] == "ok" for s in ("site-1", "site-2", "site-3", "site-4")), first["sites"]
        assert "secure aggregation: sum of 4 of 4 sites (t = 3" in line, line
        victim_log = deployment.log("site-4")
        assert "Receiving: query.secagg" not in victim_log[victim_log.rindex("Sending: train message"):]
        from fedpose.federation.ledger import BudgetLedger

        with BudgetLedger(tmp_path / "secure" / "ledger.sqlite", read_only=True) as ledger:
            rows = {(e.site_id, e.round): e for e in ledger.entries()}
        for site_id in ("site-1", "site-2", "site-3", "site-4"):  # every site trained and spent, the dead one too
            assert rows[(site_id, 1)].status == "ok", rows[(site_id, 1)]
            assert rows[(site_id, 1)].epsilon == pytest.approx(epsilon_after_rounds(1), rel=1e-6), rows[(site_id, 1)]
        # the unmask stage ended when Flower declared the killed node gone (≤ 60 s), not at the 150 s round timeout
        assert after_kill < 130, after_kill
        print(f"dropout run: {seconds:.0f} s; round {first['wall_seconds']:.0f} s; kill → round end {after_kill:.0f} s")

        # a plain round: site-1 requires secure aggregation → refuses, spends nothing; sites 2 and 3 train
        state = tmp_path / "sites" / "site-1"
        before = {p.name: p.read_bytes() for p in state.glob("budget*")}
        assert "budget.json" in before
        output, seconds = deployment.run(plain)
        (entry,) = history(tmp_path / "plain")
        assert entry["sites"]["site-1"]["status"] == "refused", entry
        assert entry["sites"]["site-2"]["status"] == entry["sites"]["site-3"]["status"] == "ok", entry
        assert {p.name: p.read_bytes() for p in state.glob("budget*")} == before  # byte-identical: nothing spent
        (line,) = round_lines(output)
        assert "site-1: refused" in line, line
        print(f"plain run: {seconds:.0f} s")
    finally:
        deployment.close()
    assert not no_leftover_processes(tmp_path / "deploy")
