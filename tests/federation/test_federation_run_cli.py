"""What `fedpose deploy local` and `fedpose simulate` decide before and after a run, without
starting one: whose data each site uses (never deleted or regenerated), the failure summary and
exit code, and the coordinator's error lines when a deployment fails."""

from __future__ import annotations

import json
import shutil
import socket
import tomllib
from pathlib import Path

import pytest
import tomli_w

from fedpose.cli import main
from fedpose.federation.report import COORDINATOR_ERROR_PREFIX, SITE_FAILURE_EXIT
from federation_helpers import free_base_port, tiny_federation


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()}


def _deploy_until_ports(config: Path, run_dir: Path, sites: int) -> int:
    """`deploy local` up to its port check: a listener on the base port stops it there (after the
    configs are written and the data is checked), before any process starts."""
    base = free_base_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", base))
        busy.listen()
        return main(["deploy", "local", "--sites", str(sites), "--config", str(config), "--run-dir", str(run_dir),
                     "--base-port", str(base)])


@pytest.fixture(scope="module")
def three_sites(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-site dataset made with other parameters than tiny_federation's [synthetic] table."""
    from fedpose.data.synthetic import ensure_dataset

    out = tmp_path_factory.mktemp("data") / "syn"
    ensure_dataset(out, sites=3, per_site=4, public=2, test=2, size=(64, 64), seed=0, progress=False)
    return out


def test_deploy_with_fewer_sites_uses_each_sites_own_data_and_touches_nothing(tmp_path: Path, three_sites: Path,
                                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`--sites 2` on a 3-site config once deleted site-3's data (the [synthetic] directory was
    regenerated for the other site count) under a running federation."""
    config = tiny_federation(tmp_path, three_sites, sites=3)
    before = _snapshot(three_sites)
    assert _deploy_until_ports(config, tmp_path / "run", 2) == 2
    err = capsys.readouterr().err
    assert "ports already in use" in err
    assert _snapshot(three_sites) == before  # nothing regenerated, nothing deleted
    # used as it is, but not silently: the [synthetic] table describes other data than the directory holds
    assert "holds another synthetic dataset than [synthetic] describes (per_site: 4 → " in err
    for k in (1, 2):
        site = tomllib.loads((tmp_path / "run" / "configs" / f"site-{k}.toml").read_text())
        assert site["data"]["train"] == str(three_sites / f"site-{k}")  # the site's own config
        assert site["state_dir"] == str(tmp_path / "run" / "sites" / f"site-{k}")
    assert not (tmp_path / "run" / "configs" / "site-3.toml").exists()
    coordinator = tomllib.loads((tmp_path / "run" / "configs" / "coordinator.toml").read_text())["coordinator"]
    assert coordinator["data"]["val"] == str(three_sites / "test")


def test_synthetic_data_is_made_only_where_nothing_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    config = tiny_federation(tmp_path, data, sites=2)
    assert _deploy_until_ports(config, tmp_path / "run", 2) == 2  # absent: generated
    assert (data / "site-2" / "annotations.json").exists()
    assert "another synthetic dataset" not in capsys.readouterr().err  # the very dataset [synthetic] describes

    # another seed asked for data that exists: used as it is, with a warning naming the difference
    reseeded = tmp_path / "reseeded.toml"
    raw = tomllib.loads(config.read_text())
    raw["synthetic"]["seed"] = 7
    reseeded.write_text(tomli_w.dumps(raw))
    before = _snapshot(data)
    assert _deploy_until_ports(reseeded, tmp_path / "run-reseeded", 2) == 2
    assert "seed: 0 → 7)" in capsys.readouterr().err
    assert _snapshot(data) == before

    # a first run stopped during generation (Ctrl-C): every directory exists, some annotations do not —
    # the next run completes it instead of failing later on a half-written split
    manifest = json.loads((data / "manifest.json").read_text())
    (data / ".synth-params.json").write_text(json.dumps(manifest["params"]))
    (data / "manifest.json").unlink()
    (data / "test" / "annotations.json").unlink()
    assert _deploy_until_ports(config, tmp_path / "run", 2) == 2
    assert (data / "test" / "annotations.json").exists() and (data / "manifest.json").exists()
    capsys.readouterr()

    # a split of that dataset goes missing: an error naming it, and nothing else is touched
    shutil.rmtree(data / "site-2")
    before = _snapshot(data)
    assert _deploy_until_ports(config, tmp_path / "run", 2) == 2
    err = capsys.readouterr().err
    assert "site-2" in err and "never deletes existing data" in err and "ports" not in err
    assert _snapshot(data) == before


def _report(directory: Path, failures: list[dict]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.json").write_text(json.dumps({"run_id": "r", "stopped_reason": "completed 2 rounds",
                                                      "rounds_completed": 2, "site_failures": failures}))
    return directory


@pytest.mark.parametrize("allowed", [False, True])
def test_a_site_failure_ends_the_run_with_a_summary_and_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   allowed: bool) -> None:
    from fedpose.cli.federation_run import conclude_run

    failure = {"round": 2, "site": "site-2", "status": "error", "reason": "ImageLoadError: the site's ClientApp failed"}
    assert conclude_run(_report(tmp_path / "failed", [failure]), allowed) == (0 if allowed else SITE_FAILURE_EXIT)
    out, err = capsys.readouterr()
    summary = out if allowed else err
    assert "round   2 site-2: error — ImageLoadError" in summary
    assert out.strip().splitlines()[-1] == f"run 'r': 2 rounds completed in total; report: {tmp_path / 'failed' / 'report.json'}"
    assert ("--allow-site-failures" in err) is not allowed
    assert conclude_run(_report(tmp_path / "clean", []), allowed) == 0
    assert "failure" not in capsys.readouterr().err


def test_a_failed_deployment_shows_the_coordinators_error_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedpose.cli.deploy import report_failed_run

    log = (f"resuming run 'r' after round 4\n{COORDINATOR_ERROR_PREFIX}LedgerError: the budget ledger /x/ledger.sqlite is "
           "missing or empty; restore it from a backup\nTraceback (most recent call last):\n  ...\n")
    report_failed_run("finished:failed", log, tmp_path / "logs")
    err = capsys.readouterr().err.splitlines()
    assert err == [f"{COORDINATOR_ERROR_PREFIX}LedgerError: the budget ledger /x/ledger.sqlite is missing or empty; "
                   "restore it from a backup",
                   f"fedpose: error: the run did not complete (finished:failed); see {tmp_path / 'logs'}"]


def test_a_run_flower_ended_says_flowers_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The coordinator said nothing (its ServerApp's heartbeats stopped reaching the SuperLink): Flower's
    status details are the reason; where the coordinator did say why, its line is enough."""
    from fedpose.cli.deploy import report_failed_run

    assert report_failed_run("finished:failed", "round 1 ...\n", tmp_path / "logs", "No heartbeat received from the task") == 1
    assert capsys.readouterr().err.splitlines() == [
        f"fedpose: error: the run did not complete (finished:failed: No heartbeat received from the task); see {tmp_path / 'logs'}"]
    report_failed_run("finished:failed", f"{COORDINATOR_ERROR_PREFIX}LedgerError: x\n", tmp_path / "logs",
                      "ServerApp failed with exception: x")
    assert capsys.readouterr().err.splitlines()[-1] == f"fedpose: error: the run did not complete (finished:failed); see {tmp_path / 'logs'}"


def test_deploy_gives_each_site_an_identity_whose_signature_the_coordinator_requires(tmp_path: Path, three_sites: Path) -> None:
    """Without identities any node the SuperLink admits could answer in a site's name (docs/deployment.md,
    *Signed replies*): deploy local makes one per site, once, and lists them for the coordinator."""
    from fedpose.federation.secagg import crypto

    config = tiny_federation(tmp_path, three_sites, sites=3)
    run_dir = tmp_path / "run"
    assert _deploy_until_ports(config, run_dir, 3) == 2  # configs written, nothing started
    coordinator = tomllib.loads((run_dir / "configs" / "coordinator.toml").read_text())["coordinator"]
    keys = {}
    for k in (1, 2, 3):
        identity = tomllib.loads((run_dir / "configs" / f"site-{k}.toml").read_text())["identity"]
        key_path = Path(identity["key"])
        assert key_path.parent == run_dir / "certs" / "identities" and key_path.stat().st_mode & 0o077 == 0  # owner-only
        assert identity["peers"] == coordinator["site_identities"]
        keys[f"site-{k}"] = key_path.read_bytes()
        assert coordinator["site_identities"][f"site-{k}"] == crypto.identity_public_key(crypto.load_identity(key_path))
    assert len(set(keys.values())) == 3

    # a resumed run's sites keep theirs (made once)
    assert _deploy_until_ports(config, run_dir, 3) == 2
    assert {f"site-{k}": (run_dir / "certs" / "identities" / f"site-{k}.pem").read_bytes() for k in (1, 2, 3)} == keys

    # one site: no secure sum, whose peer list an identity carries, so none is made
    single = tmp_path / "single"
    assert _deploy_until_ports(config, single, 1) == 2
    assert "identity" not in tomllib.loads((single / "configs" / "site-1.toml").read_text())
    assert "site_identities" not in tomllib.loads((single / "configs" / "coordinator.toml").read_text())["coordinator"]


def test_no_identity_file_is_named_after_a_site_id_validation_refuses(tmp_path: Path, three_sites: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """An id such as ../x would have put a key file outside the run dir before validation refused it."""
    config = tiny_federation(tmp_path, three_sites, sites=2)
    raw = tomllib.loads(config.read_text())
    raw["sites"][1]["site_id"] = "../../escaped"
    config.write_text(tomli_w.dumps(raw))
    run_dir = tmp_path / "deep" / "run"
    assert _deploy_until_ports(config, run_dir, 2) == 2
    assert "site_id" in capsys.readouterr().err  # validation names the bad id
    assert not list(tmp_path.rglob("*.pem"))  # no key anywhere, inside or outside the run dir
