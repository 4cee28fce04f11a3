"""Coordinator and site metrics, scraped over real HTTP from per-process registries."""

from __future__ import annotations

import urllib.request

import pytest

from fedpose.federation.metrics import CoordinatorMetrics, SiteMetrics, scrape_values, start_metrics_server
from fedpose.federation.site_budget import BudgetExhausted, SiteBudget


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return dict(scrape_values(response.read().decode()))


def test_coordinator_metrics_over_http():
    metrics = CoordinatorMetrics()
    metrics.round.set(3)
    metrics.participating_sites.set(2)
    metrics.observe_site_report("site-a", 1.25, 1e-5, "DP", "pld", "patient", "add_remove")
    metrics.observe_site_report("site-b", 0.5, 1e-5, "FDP", "rdp", "record", "replace_one")
    metrics.update_norm.labels(site="site-a").set(4.5)
    metrics.rejected_updates.labels(reason="norm").inc()
    metrics.rejected_updates.labels(reason="norm").inc()
    metrics.basis_bytes_sent.labels(transport="compact").inc(20_800)
    metrics.round_duration.observe(12.0)
    server = start_metrics_server(0, metrics.registry, addr="127.0.0.1")
    try:
        values = _scrape(server.port)
    finally:
        server.close()
    assert values["fedpose_round"] == 3 and values["fedpose_participating_sites"] == 2
    assert values['fedpose_site_epsilon{accountant="pld",adjacency="add_remove",guarantee="DP",site="site-a",unit="patient"}'] == 1.25
    assert values['fedpose_site_epsilon{accountant="rdp",adjacency="replace_one",guarantee="FDP",site="site-b",unit="record"}'] == 0.5
    assert values['fedpose_site_delta{site="site-a"}'] == 1e-5
    assert values['fedpose_update_norm{site="site-a"}'] == 4.5
    assert values['fedpose_rejected_updates_total{reason="norm"}'] == 2
    assert values['fedpose_basis_bytes_sent_total{transport="compact"}'] == 20_800
    assert values["fedpose_round_duration_seconds_count"] == 1


def test_registries_are_per_instance():
    a, b = CoordinatorMetrics(), CoordinatorMetrics()  # would raise "Duplicated timeseries" on a shared registry
    a.round.set(7)
    assert b.registry.get_sample_value("fedpose_round") == 0
    assert a.registry.get_sample_value("fedpose_round") == 7


def test_site_metrics_read_the_persisted_budget(tmp_path):
    budget = SiteBudget(tmp_path / "s", "site-a", eps_max=10.0, delta=1e-5, guarantee="DP")
    metrics = SiteMetrics("site-a", budget=budget)
    server = start_metrics_server(0, metrics.registry, addr="127.0.0.1")
    try:
        assert _scrape(server.port)['fedpose_site_epsilon_spent{accountant="pld",adjacency="add_remove",guarantee="DP",site="site-a",unit="record"}'] == 0.0
        # Another process (a later ClientApp) spends and refuses; the scrape sees it on disk.
        other = SiteBudget(tmp_path / "s", "site-a", eps_max=10.0, delta=1e-5, guarantee="DP")
        other.authorize_round("run", 1, 1.0, 0.01, 100)
        with pytest.raises(BudgetExhausted):
            other.authorize_round("run", 2, 0.0, 0.01, 100)
        metrics.observe_round(2, 100)
        values = _scrape(server.port)
    finally:
        server.close()
    assert values['fedpose_site_epsilon_spent{accountant="pld",adjacency="add_remove",guarantee="DP",site="site-a",unit="record"}'] == pytest.approx(other.epsilon)
    assert values['fedpose_site_epsilon_max{accountant="pld",adjacency="add_remove",guarantee="DP",site="site-a",unit="record"}'] == 10.0
    assert values['fedpose_site_dp_steps_total{site="site-a"}'] == 100
    assert values['fedpose_site_refusals_total{site="site-a"}'] == 1
    assert values['fedpose_site_round{site="site-a"}'] == 2
    assert values['fedpose_site_training_steps_total{site="site-a"}'] == 100


def test_site_exporter_reports_a_bad_config_without_a_traceback(tmp_path, capsys) -> None:
    from sites.metrics import main as site_metrics

    bad = tmp_path / "site.toml"
    bad.write_text('site_id = "site-1"\nstate_dir = "state"\neps_max = -1\n[data]\ntrain = "d"\n')
    assert site_metrics(["--site-config", str(bad), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sites.metrics: error:") and "eps_max" in err and "Traceback" not in err


def test_site_exporter_names_missing_training_data_without_a_traceback(tmp_path, capsys) -> None:
    """A new site's exporter reads its annotations to pin the protection unit: missing data is one line."""
    from sites.metrics import main as site_metrics

    config = tmp_path / "site.toml"
    config.write_text(f'site_id = "site-1"\nstate_dir = "{tmp_path / "state"}"\neps_max = 8\n'
                      f'[data]\ntrain = "{tmp_path / "absent"}"\n[privacy]\nmechanism = "dpsgd"\nsample_rate = 0.1\n'
                      f'target_epsilon = 1.0\n')
    assert site_metrics(["--site-config", str(config), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sites.metrics: error:") and "absent" in err and "Traceback" not in err


def test_a_taken_metrics_port_is_named():
    """A second coordinator on the same port: the error names the port and the setting to change."""
    from prometheus_client import CollectorRegistry

    first = start_metrics_server(0, CollectorRegistry(), addr="127.0.0.1")
    try:
        with pytest.raises(OSError, match=rf"metrics port 127.0.0.1:{first.port} .*coordinator.metrics_port"):
            start_metrics_server(first.port, CollectorRegistry(), addr="127.0.0.1")
    finally:
        first.close()


def test_the_coordinator_exporter_binds_the_loopback_unless_told_otherwise(tmp_path) -> None:
    """The exporter has no authentication (each site's ε, participation, update norms, bytes): it bound
    every interface with no way to change it, even under `deploy local` ("everything on 127.0.0.1").
    A red-team finding. It binds 127.0.0.1 now; `coordinator.metrics_addr` opens it deliberately."""
    from fedpose.federation.deployment import CoordinatorRunConfig
    from fedpose.federation.metrics import CoordinatorMetrics

    metrics = CoordinatorMetrics.serve(0)
    try:
        assert metrics._server._server.server_address[0] == "127.0.0.1"
    finally:
        metrics.close()
    assert CoordinatorRunConfig.model_validate({"run_id": "r", "coordinator": {}}).coordinator.metrics_addr == "127.0.0.1"
