"""Shared helpers of the federation integration tests (tiny federations, real processes)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import tomli_w

REPO = Path(__file__).resolve().parents[1]
FEDPOSE = [sys.executable, "-m", "fedpose.cli"]
INPUT_SIZE = [64, 64]
BATCH_SIZE = 8
PER_SITE = 24
NOISE = 1.0
SAMPLE_RATE = BATCH_SIZE / PER_SITE  # declared by each site (N stays secret)
LOCAL_STEPS = 2
UNIT_SLOTS = PER_SITE // 4  #: a synthetic site split shows up to 4 images per patient
DELTA = 1e-5


def tiny_federation(tmp: Path, data_dir: Path, *, sites: int = 2, rounds: int = 2, timeout: float = 120.0,
                    eps_max: list[float] | None = None, run_id: str = "itest") -> Path:
    """A federation TOML: tiny TinyViT, 64×64 images, DP-SGD, 2 local steps."""
    def site(k: int) -> dict[str, Any]:
        return {
            "site_id": f"site-{k}", "data": {"train": str(data_dir / f"site-{k}")},
            "state_dir": str(tmp / "sites" / f"site-{k}"), "eps_max": (eps_max or [50.0] * sites)[k - 1],
            "local_steps": LOCAL_STEPS,
            "train": {"batch_size": BATCH_SIZE, "threads": 1, "seed": k},
            # 6 unit slots: the site's 6 patients (N_max at q = 1/3 is 6), the most any batch can hold;
            # the default slot count for B = 8 (39) would make every step 6.5× the work
            "privacy": {"mechanism": "dpsgd", "noise_multiplier": NOISE, "sample_rate": SAMPLE_RATE, "max_grad_norm": 1.0, "delta": DELTA,
                        "max_batch_units": UNIT_SLOTS},
        }

    raw = {
        "run_id": run_id,
        "synthetic": {"dir": str(data_dir), "per_site": PER_SITE, "public": 8, "test": 16, "size": INPUT_SIZE, "seed": 0},
        "coordinator": {
            "rounds": rounds, "min_sites": 1, "round_timeout_s": timeout, "local_steps": LOCAL_STEPS,
            "checkpoint_dir": str(tmp / "coordinator"),
            "data": {"val": str(data_dir / "test"), "input_size": INPUT_SIZE},
            "model": {"backbone": "tiny_vit_test", "scenario": "scratch"},
            "update_norm_bound": 1e6,
        },
        "sites": [site(k) for k in range(1, sites + 1)],
    }
    path = tmp / "federation.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


def epsilon_after_rounds(rounds: int) -> float:
    """ε a site of :func:`tiny_federation` has spent after ``rounds`` rounds, by the accountant its
    (new) budget enforces: the default for DP's relation (PLD)."""
    from fedpose.privacy.accountant import PrivacyLedger, default_accountant

    acc = PrivacyLedger(accountant=default_accountant("add_remove"))
    acc.step(NOISE, BATCH_SIZE / PER_SITE, LOCAL_STEPS * rounds)
    return acc.get_epsilon(DELTA)[0]


def free_base_port() -> int:
    """A base port with base..base+30 free on 127.0.0.1, below the range Linux draws outgoing
    connections' ports from (the suite's many gRPC connections once took a SuperNode's port between
    this check and its bind). Under pytest-xdist each worker draws from bases of its own (base / 50 ≡
    worker index, modulo the worker count), so two workers' federations never pick one range."""
    from fedpose.cli.deploy import port_free

    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    for _ in range(200):
        base = random.randrange(20000 + 50 * worker, _ephemeral_ports_start() - 31, 50 * workers)
        if all(port_free(base + i) for i in range(31)):
            return base
    raise RuntimeError("no free port range")


def _ephemeral_ports_start() -> int:
    try:
        start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        start = 32768  # Linux's default
    return start if start > 25000 else 60000  # a range that leaves too few ports below it: draw anywhere


def flower_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, FLWR_TELEMETRY_ENABLED="0", **extra)


def start_deploy(config: Path, run_dir: Path, base_port: int, sites: int, *extra: str, env: dict | None = None) -> subprocess.Popen:
    log_path = run_dir.parent / f"deploy-{run_dir.name}-{int(time.time() * 1000)}.log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        [*FEDPOSE, "deploy", "local", "--sites", str(sites), "--config", str(config), "--run-dir", str(run_dir),
         "--base-port", str(base_port), "--timeout", "1500", *extra],
        cwd=REPO, env=env or flower_env(), stdout=log, stderr=subprocess.STDOUT, text=True,
        # Ctrl-C must reach it even when pytest itself runs as a background job, whose shell
        # leaves SIGINT ignored (an ignored signal stays ignored across exec)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    log.close()
    proc.log_path = log_path  # type: ignore[attr-defined]
    return proc


def deploy_output(proc: subprocess.Popen) -> str:
    return proc.log_path.read_text()  # type: ignore[attr-defined]


def deploy_logs_tail(run_dir: Path, chars: int = 2500) -> str:
    """The end of each log deploy local wrote: a failure in CI, where the run dir is gone afterwards,
    then shows the coordinator's and Flower's own account, not only the CLI's one line."""
    tails = [f"\n--- {log.name} (end) ---\n{log.read_text(errors='replace')[-chars:]}"
             for log in sorted((run_dir / "logs").glob("*.log"))]
    return "".join(tails)


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, poll: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) while waiting for {what}")
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def history(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "coordinator" / "history.json"
    try:
        return json.loads(path.read_text())["rounds"]
    except (OSError, ValueError, KeyError):
        return []


def site_budget(run_dir: Path, site_id: str) -> dict[str, Any]:
    return json.loads((run_dir / "sites" / site_id / "budget.json").read_text())["payload"]


def ledger_rows(run_dir: Path) -> list[Any]:
    from fedpose.federation.ledger import BudgetLedger

    with BudgetLedger(run_dir / "coordinator" / "ledger.sqlite", read_only=True) as ledger:
        return ledger.entries()


def trained_rounds(run_dir: Path, site_id: str) -> list[int]:
    """Rounds the site trained in (spent on), from its own log: 'ok', or 'failed' after training."""
    lines = (run_dir / "sites" / site_id / "rounds.jsonl").read_text().splitlines()
    return sorted({e["round"] for e in map(json.loads, lines) if e["outcome"] in ("ok", "failed")})


def assert_budget_ledger_and_true_spend_agree(run_dir: Path, site_id: str, trained: list[int]) -> None:
    """The site's own log says it trained in exactly ``trained``; its budget spent each of those
    rounds once; the coordinator's ledger holds the ε those rounds cost."""
    assert trained_rounds(run_dir, site_id) == trained, site_id
    spent = [e["round"] for e in site_budget(run_dir, site_id)["entries"] if e["status"] == "spent"]
    assert spent == trained, (site_id, spent)  # each round spent once
    recorded = max(e.epsilon or 0.0 for e in ledger_rows(run_dir) if e.site_id == site_id)
    assert recorded == pytest.approx(epsilon_after_rounds(len(trained)), rel=1e-6), site_id


def no_leftover_processes(run_dir: Path) -> list[str]:
    """Command lines of live processes that mention ``run_dir`` or run with its Flower home
    (``FLWR_HOME=<run_dir>/flwr-home``, set for everything deploy local starts and inherited by
    Flower's SuperExec, ServerApp and ClientApp processes, whose command lines name no path)."""
    flwr_home = f"FLWR_HOME={run_dir / 'flwr-home'}".encode()
    leftovers = []
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            text = (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[0]
            environ = (proc_dir / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (str(run_dir) in text or flwr_home in environ) and state != "Z":
            leftovers.append(text)
    return leftovers


def process_tree(pid: int) -> dict[tuple[int, int], str]:
    """(PID, start time) → command line of every live descendant of ``pid`` (from /proc; the start
    time tells a process from a later one that reuses its PID)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append((int(stat.parent.name), int(fields[19])))
        except (OSError, IndexError, ValueError):
            continue
    found: dict[tuple[int, int], str] = {}
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            try:
                found[child] = (Path(f"/proc/{child[0]}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
            stack.append(child[0])
    return found


def still_running(processes: dict[tuple[int, int], str]) -> dict[tuple[int, int], str]:
    """Those processes of :func:`process_tree` that are still alive (not zombies)."""
    alive = {}
    for (pid, start), cmdline in processes.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[19]) == start and fields[0] != "Z":
            alive[(pid, start)] = cmdline
    return alive


def corrupt_image(split_dir: Path, index: int = 5) -> Path:
    """Truncate one image of a dataset split (its header still parses); return its path."""
    from fedpose.data.loaders import load_records

    records, root = load_records(split_dir)
    path = root / records[index].image
    path.write_bytes(path.read_bytes()[:200])
    return path
