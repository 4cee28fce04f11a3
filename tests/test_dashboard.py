"""The operators' dashboard (docker/grafana, docker/prometheus.yml): every series a panel queries is one
the real exporters export, with the labels the panel uses; compose provisions it; and, where the
``prometheus`` binary is installed, a real Prometheus scrapes a coordinator and a site exporter and
answers every panel's query."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedpose.config import load_config
from fedpose.federation.deployment import load_coordinator_run
from fedpose.federation.metrics import CoordinatorMetrics, SiteMetrics
from fedpose.federation.report import RoundRecord, SiteRoundRecord
from fedpose.federation.site_budget import SiteBudget

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "fedpose.json"
APP_ROOT = "/app"  # WORKDIR of the images: /app/<path> is <repo>/<path>
SCRAPE_LABELS = {"job", "instance"}  # added by Prometheus to every scraped series
#: what a site's exporter may publish: its budget state, all of it public by the site's own accounting
#: (ε, ε_max, δ, steps and rounds spent or refused); nothing about its data. A new series is a privacy review.
SITE_EXPORTER_SERIES = {
    "fedpose_site_round", "fedpose_site_training_steps_total", "fedpose_site_epsilon_spent", "fedpose_site_epsilon_max",
    "fedpose_site_delta", "fedpose_site_dp_steps_total", "fedpose_site_refusals_total", "fedpose_site_rounds_spent_total",
}


def _every_outcome_round() -> RoundRecord:
    """A finished round in which every per-site outcome, a PCKh and the byte counts occur."""
    report = {"epsilon": 1.5, "delta": 1e-5, "guarantee": "DP", "accountant": "pld", "eps_max": 8.0}
    sites = {
        "site-1": SiteRoundRecord(status="ok", update_norm=2.0, bytes_down=1000, bytes_up=900, **report),
        "site-2": SiteRoundRecord(status="refused", bytes_down=1000, **report),
        "site-3": SiteRoundRecord(status="missing", bytes_down=1000),
        "site-4": SiteRoundRecord(status="failed", bytes_down=1000, **report),
        "site-5": SiteRoundRecord(status="rejected", reject_reason="norm", update_norm=1e6, bytes_down=1000, bytes_up=900, **report),
    }
    return RoundRecord(round=1, pckh={"Mean": 41.5, "Mean@0.1": 12.0, "Head": 60.0, "loss": 0.3}, aggregated=True, accepted=1,
                       rejected=1, selected=5, wall_seconds=12.0, sites=sites, exhausted=0, basis_bytes=2000, basis_transport="compact")


def _coordinator_metrics() -> CoordinatorMetrics:
    metrics = CoordinatorMetrics()
    metrics.observe_round(_every_outcome_round())
    return metrics


def _site_metrics(state_dir: Path) -> SiteMetrics:
    budget = SiteBudget(state_dir, "site-1", eps_max=8.0, delta=1e-5, guarantee="DP")
    budget.authorize_round("run", 1, 1.0, 0.25, 4)
    metrics = SiteMetrics("site-1", budget=budget)
    metrics.observe_round(1, 4)
    return metrics


def _series(metrics: CoordinatorMetrics | SiteMetrics) -> dict[str, set[str]]:
    """{series name: its label names} as the exporter serves them (counter ``_total``, histogram ``_bucket`` ...)."""
    out: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            if not sample.name.endswith("_created"):  # prometheus-client's creation timestamps
                out.setdefault(sample.name, set()).update(sample.labels)
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, set[str]]]:
    """The real exporters' series by exporter kind, each series' labels including those Prometheus adds."""
    kinds = {"coordinator": _series(_coordinator_metrics()), "site": _series(_site_metrics(tmp_path_factory.mktemp("site")))}
    return {kind: {name: labels | SCRAPE_LABELS for name, labels in series.items()} for kind, series in kinds.items()}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def scrape() -> dict:
    return yaml.safe_load((DOCKER / "prometheus.yml").read_text())


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _targets() -> list[tuple[str, dict]]:
    return [(panel["title"], target) for panel in _dashboard()["panels"] for target in panel["targets"]]


def _selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric, {label: value}) of every series selector of a PromQL expression."""
    return [(m.group(1), dict(re.findall(r'(\w+)\s*=~?\s*"([^"]*)"', m.group(2) or "")))
            for m in re.finditer(r"\b(fedpose_\w+)\s*(\{[^}]*\})?", expr)]


def _grouping_labels(expr: str) -> set[str]:
    return {label.strip() for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr)
            for label in group.split(",") if label.strip()}


def _job_kinds(scrape: dict, compose: dict) -> dict[str, str]:
    """Scrape job name -> the exporter kind its targets are (the coordinator runs inside the superlink service)."""
    kinds = {}
    for job in scrape["scrape_configs"]:
        hosts = {t.split(":")[0] for config in job["static_configs"] for t in config["targets"]}
        kinds[job["job_name"]] = "coordinator" if hosts == {"superlink"} else "site" if all(h.startswith("metrics-site-") for h in hosts) else "?"
    return kinds


def test_every_panel_queries_exported_series_with_their_labels(exported: dict, scrape: dict, compose: dict) -> None:
    jobs = _job_kinds(scrape, compose)
    assert _targets()
    for title, target in _targets():
        expr = target["expr"]
        selectors = _selectors(expr)
        assert selectors, f"panel {title!r}: {expr!r} queries no fedpose series"
        used = _grouping_labels(expr) | set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        for name, matchers in selectors:
            if "job" in matchers:
                assert matchers["job"] in jobs, f"panel {title!r}: no scrape job {matchers['job']!r} in docker/prometheus.yml"
            kinds = [jobs[matchers["job"]]] if "job" in matchers else ["coordinator", "site"]
            owners = [exported[kind][name] for kind in kinds if name in exported[kind]]
            assert owners, f"panel {title!r}: {name} is exported by no {' or '.join(kinds)} exporter"
            for label in set(matchers) | (used - {"le"} if not name.endswith("_bucket") else used):
                assert any(label in labels for labels in owners), f"panel {title!r}: {name} has no label {label!r}"


def test_the_dashboard_shows_what_operators_need_and_never_a_bare_epsilon() -> None:
    panels = {panel["title"]: " ".join(t["expr"] for t in panel["targets"]) for panel in _dashboard()["panels"]}
    queried = " ".join(panels.values())
    assert any("fedpose_site_epsilon_spent" in q and "fedpose_site_epsilon_max" in q for q in panels.values()), "ε against ε_max"
    for outcome in ("fedpose_participating_sites", "fedpose_refused_rounds_total", "fedpose_missing_replies_total",
                    "fedpose_failed_rounds_total", "fedpose_rejected_updates_total"):
        assert outcome in queried, f"round outcomes: {outcome}"
    for needed in ("fedpose_round_duration_seconds", "fedpose_site_bytes_total", "fedpose_global_pckh"):
        assert needed in queried, needed
    for panel in _dashboard()["panels"]:
        for target in panel["targets"]:
            if re.search(r"fedpose_site_epsilon(_spent)?\b", target["expr"]):
                assert "{{guarantee}}" in target["legendFormat"], f"{panel['title']}: ε without its guarantee"
                assert "{{unit}}" in target["legendFormat"], f"{panel['title']}: ε without its protection unit"
                assert "δ" in panel["description"], f"{panel['title']}: ε without its δ"
                if "epsilon_max" not in target["expr"]:
                    assert "{{accountant}}" in target["legendFormat"], f"{panel['title']}: ε without its accountant"
                if "/" not in target["expr"] and "epsilon_max" not in target["expr"]:
                    assert "{{adjacency}}" in target["legendFormat"], f"{panel['title']}: ε without its adjacency"
    datasources = {t["datasource"]["uid"] for _, t in _targets()} | {p["datasource"]["uid"] for p in _dashboard()["panels"]}
    provisioned = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yaml").read_text())["datasources"]
    assert datasources == {d["uid"] for d in provisioned}, "panels must name the provisioned datasource"


def test_the_site_exporter_publishes_only_its_budget_state(tmp_path: Path) -> None:
    """Nothing a site exporter serves depends on the site's data beyond what its guarantee accounts for."""
    assert set(_series(_site_metrics(tmp_path))) == SITE_EXPORTER_SERIES


def test_prometheus_scrapes_the_compose_exporters(scrape: dict, compose: dict) -> None:
    jobs = _job_kinds(scrape, compose)
    assert sorted(jobs.values()) == ["coordinator", "site"], jobs
    services = compose["services"]
    run = load_coordinator_run(REPO / Path(services["coordinator"]["environment"]["COORDINATOR_CONFIG"]).relative_to(APP_ROOT))
    for job in scrape["scrape_configs"]:
        targets = {t for config in job["static_configs"] for t in config["targets"]}
        if jobs[job["job_name"]] == "coordinator":
            assert targets == {f"superlink:{run.coordinator.metrics_port}"}
            assert any(str(p).endswith(f":{run.coordinator.metrics_port}") for p in services["superlink"]["ports"])
        else:
            exporters = {name: service for name, service in services.items() if name.startswith("metrics-site-")}
            assert len(exporters) == len([s for s in services if s.startswith("site-")])
            ports = {name: next(a.split("=", 1)[1] for a in service["command"] if a.startswith("--port=")) for name, service in exporters.items()}
            assert targets == {f"{name}:{port}" for name, port in ports.items()}


def _mounts(service: dict) -> dict[str, str]:
    """container path -> host path (relative to docker/) of a service's bind mounts."""
    return {v.split(":")[1]: v.split(":")[0] for v in service["volumes"] if v.startswith(".")}


def test_a_finished_round_exports_global_pckh_and_bytes_per_site() -> None:
    registry = _coordinator_metrics().registry
    assert registry.get_sample_value("fedpose_global_pckh", {"score": "Mean"}) == 41.5
    assert registry.get_sample_value("fedpose_global_pckh", {"score": "Head"}) == 60.0
    assert registry.get_sample_value("fedpose_global_pckh", {"score": "loss"}) is None  # a loss, not a PCKh
    assert registry.get_sample_value("fedpose_site_bytes_total", {"site": "site-1", "direction": "up"}) == 900
    assert registry.get_sample_value("fedpose_site_bytes_total", {"site": "site-3", "direction": "down"}) == 1000
    assert registry.get_sample_value("fedpose_site_bytes_total", {"site": "site-3", "direction": "up"}) == 0  # no reply
    no_eval = CoordinatorMetrics()
    no_eval.observe_round(RoundRecord(round=1, pckh=None))  # no held-out split: no PCKh series at all
    assert not [s for f in no_eval.registry.collect() if f.name == "fedpose_global_pckh" for s in f.samples]


def test_compose_provisions_prometheus_and_grafana(compose: dict) -> None:
    services = compose["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    config = next(a.split("=", 1)[1] for a in prometheus["command"] if a.startswith("--config.file="))
    assert (DOCKER / _mounts(prometheus)[config]).resolve() == DOCKER / "prometheus.yml"
    grafana_mounts = _mounts(grafana)
    for host in grafana_mounts.values():
        assert (DOCKER / host).is_dir(), f"grafana mounts missing {host}"
    provisioning = DOCKER / grafana_mounts["/etc/grafana/provisioning"]
    provider = yaml.safe_load((provisioning / "dashboards/fedpose.yaml").read_text())["providers"][0]
    assert (DOCKER / grafana_mounts[provider["options"]["path"]] / DASHBOARD.name).resolve() == DASHBOARD
    (source,) = yaml.safe_load((provisioning / "datasources/prometheus.yaml").read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090" and "9090" in str(prometheus["ports"])
    for name in ("prometheus", "grafana"):  # unauthenticated by default: published on the host's loopback only
        assert all(str(p).startswith("127.0.0.1:") for p in services[name]["ports"]), name
    for volume in (v.split(":")[0] for s in (prometheus, grafana) for v in s["volumes"] if not v.startswith(".")):
        assert volume in compose["volumes"], f"{volume} is not a named volume"
    binary = shutil.which("prometheus")
    if binary:  # the flags compose passes exist in the real binary; promtool accepts the scrape config
        usage = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
        for flag in (a.split("=", 1)[0] for a in prometheus["command"]):
            assert flag in usage.stdout + usage.stderr, f"prometheus has no flag {flag}"
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "config", str(DOCKER / "prometheus.yml")], capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr


# -- the real Prometheus ----------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _query(port: int, expr: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _wait(what: str, predicate: Any, timeout: float, proc: subprocess.Popen) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"prometheus exited: {proc.stdout.read() if proc.stdout else ''}"
        try:
            value = predicate()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="the prometheus binary is not installed (Debian package prometheus)")
def test_a_real_prometheus_scrapes_a_coordinator_and_a_site_exporter_and_answers_every_panel(tmp_path: Path, scrape: dict, compose: dict) -> None:
    from site_round_helpers import make_site_data, site_config

    coordinator = CoordinatorMetrics.serve(0, addr="127.0.0.1")
    coordinator.observe_round(_every_outcome_round())
    data = make_site_data(tmp_path / "data")
    site = site_config(data, tmp_path / "state")
    site_toml = tmp_path / "site-1.toml"
    import tomli_w

    site_toml.write_text(tomli_w.dumps(site.model_dump(mode="json", exclude_none=True)))
    assert load_config(site_toml, model=type(site)) == site
    site_port = _free_port()
    exporter = subprocess.Popen([sys.executable, "-m", "sites.metrics", "--site-config", str(site_toml), "--port", str(site_port)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # the compose scrape config, pointed at these two exporters and scraping every second
    jobs = _job_kinds(scrape, compose)
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": []}
    for job in scrape["scrape_configs"]:
        port = coordinator._server.port if jobs[job["job_name"]] == "coordinator" else site_port
        config["scrape_configs"].append({**job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]})
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    web_port = _free_port()
    prometheus = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{web_port}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert exporter.stdout is not None and "metrics on" in exporter.stdout.readline()
        _wait("both targets up", lambda: len([r for r in _query(web_port, "up == 1")]) == 2, 60, prometheus)
        site_eps = _query(web_port, 'fedpose_site_epsilon_spent{job="fedpose-sites"}')
        assert site_eps and site_eps[0]["metric"]["site"] == "site-1" and float(site_eps[0]["value"][1]) == 0.0
        for title, target in _targets():
            expr = target["expr"].replace("$__rate_interval", "1m")
            result = _wait(f"panel {title!r}: {expr}", lambda: _query(web_port, expr), 30, prometheus)
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target["legendFormat"]):
                assert all(label in series["metric"] for series in result), f"panel {title!r}: no {label} in {result}"
        pckh = _query(web_port, 'fedpose_global_pckh{score="Mean"}')
        assert float(pckh[0]["value"][1]) == pytest.approx(41.5)
        assert not _query(web_port, 'fedpose_global_pckh{score="loss"}'), "the evaluation loss is not a PCKh"
    finally:
        prometheus.terminate()
        exporter.terminate()
        prometheus.wait(timeout=30)
        exporter.wait(timeout=30)
        coordinator.close()
