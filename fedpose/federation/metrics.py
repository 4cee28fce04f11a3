"""Prometheus metrics for the coordinator and for a site, each on its own registry.

Every :class:`CoordinatorMetrics` / :class:`SiteMetrics` owns a fresh ``CollectorRegistry`` (never
prometheus-client's global default), so two in one process (tests, simulation) do not collide.
Serve one with :func:`start_metrics_server`.

ε is never exported bare: the per-site ε gauge carries the ``guarantee`` label (DP, FDP, MaskDP;
not comparable across guarantees) and the ``accountant`` label (rdp, pld, prv: which one computed it),
and a δ gauge sits beside it.

Sites under Flower deployment run a new ClientApp process per message, so a site's long-lived
metrics server should read the persisted budget rather than in-process counters:
``SiteMetrics(..., budget=SiteBudget(...))`` re-reads the budget state on every scrape.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fedpose.eval.pckh import PCKH_KEYS
from fedpose.privacy.report import relation_of

if TYPE_CHECKING:
    from fedpose.federation.report import RoundRecord
    from fedpose.federation.site_budget import SiteBudget

ROUND_SECONDS_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 3600, float("inf"))


class CoordinatorMetrics:
    """round, participating sites, ε per site, update norms, site outcomes, bytes, round time, global PCKh."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.round = Gauge("fedpose_round", "Current federated round", registry=r)
        self.participating_sites = Gauge("fedpose_participating_sites", "Sites whose update was aggregated in the last round", registry=r)
        self.site_epsilon = Gauge(
            "fedpose_site_epsilon", "Cumulative ε reported by each site (never bare: see the guarantee, accountant, unit "
            "(protected) and adjacency labels, and fedpose_site_delta)",
            ["site", "guarantee", "accountant", "unit", "adjacency"], registry=r,
        )
        self.site_delta = Gauge("fedpose_site_delta", "δ of each site's reported ε", ["site"], registry=r)
        self.update_norm = Gauge("fedpose_update_norm", "L2 norm of each site's last update", ["site"], registry=r)
        self.rejected_updates = Counter("fedpose_rejected_updates", "Site updates rejected by validation", ["reason"], registry=r)
        self.refused_rounds = Counter("fedpose_refused_rounds", "Rounds a site refused (its budget guard)", ["site"], registry=r)
        self.missing_replies = Counter("fedpose_missing_replies", "Sites that sent no reply before the round timeout, or an error", ["site"], registry=r)
        self.failed_rounds = Counter("fedpose_failed_rounds", "Rounds whose local training failed at the site (spent, nothing released)", ["site"], registry=r)
        self.exhausted_sites = Gauge("fedpose_exhausted_sites", "Sites no longer selected (budget exhausted)", registry=r)
        self.basis_bytes_sent = Counter("fedpose_basis_bytes_sent", "Basis payload bytes sent to sites", ["transport"], registry=r)
        self.round_duration = Histogram("fedpose_round_duration_seconds", "Wall time of a round", buckets=ROUND_SECONDS_BUCKETS, registry=r)
        # the coordinator's own view: PCKh on its held-out split, message sizes it sent and received
        self.global_pckh = Gauge("fedpose_global_pckh", "PCKh of the global model on the coordinator's held-out split after "
                                 "the last evaluated round (score: Mean = PCKh@0.5 Mean, Mean@0.1, or a joint group)",
                                 ["score"], registry=r)
        self.site_bytes = Counter("fedpose_site_bytes", "Bytes of round messages sent to (direction=down) and received "
                                  "from (direction=up) each site", ["site", "direction"], registry=r)

        self._server: MetricsServer | None = None

    @classmethod
    def serve(cls, port: int, addr: str = "127.0.0.1") -> "CoordinatorMetrics":
        """Metrics served over HTTP at ``addr:port`` until :meth:`close`."""
        metrics = cls()
        metrics._server = start_metrics_server(port, metrics.registry, addr=addr)
        return metrics

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def observe_site_report(self, site_id: str, epsilon: float, delta: float, guarantee: str, accountant: str, unit: str,
                            adjacency: str) -> None:
        self.site_epsilon.labels(site=site_id, guarantee=guarantee, accountant=accountant, unit=unit,
                                 adjacency=adjacency).set(epsilon)
        self.site_delta.labels(site=site_id).set(delta)

    def observe_round(self, entry: RoundRecord) -> None:
        """One finished round's history entry (see ``fedpose.federation.server.rounds``)."""
        self.round.set(entry.round)
        self.participating_sites.set(entry.accepted)
        self.round_duration.observe(entry.wall_seconds)
        for score, value in (entry.pckh or {}).items():
            if score in PCKH_KEYS and value is not None:  # the evaluation's "loss" is not a PCKh
                self.global_pckh.labels(score=score).set(value)
        for site_id, site in entry.sites.items():
            self.site_bytes.labels(site=site_id, direction="down").inc(site.bytes_down)
            self.site_bytes.labels(site=site_id, direction="up").inc(site.bytes_up)
            if site.epsilon is not None and site.guarantee:
                self.observe_site_report(site_id, float(site.epsilon), float(site.delta or 0.0), site.guarantee,
                                         site.accountant or "rdp", site.unit or "record",
                                         site.adjacency or relation_of(site.guarantee))
            if site.update_norm is not None:
                self.update_norm.labels(site=site_id).set(site.update_norm)
            if site.status == "rejected":
                self.rejected_updates.labels(reason=site.reject_reason or "invalid").inc()
            elif site.status == "refused":
                self.refused_rounds.labels(site=site_id).inc()
            elif site.status == "missing":
                self.missing_replies.labels(site=site_id).inc()
            elif site.status in ("failed", "error"):
                self.failed_rounds.labels(site=site_id).inc()
        if entry.basis_bytes:
            self.basis_bytes_sent.labels(transport=entry.basis_transport).inc(entry.basis_bytes)
        self.exhausted_sites.set(entry.exhausted)


class SiteMetrics:
    """round, ε spent, steps, refusals of one site (label ``site``)."""

    def __init__(self, site_id: str, budget: "SiteBudget | None" = None) -> None:
        self.site_id = site_id
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.round = Gauge("fedpose_site_round", "Last round this site trained or refused", ["site"], registry=r).labels(site=site_id)
        self.training_steps = Counter("fedpose_site_training_steps", "Local training steps run in this process", ["site"], registry=r).labels(site=site_id)
        self.budget = budget
        if budget is not None:
            r.register(_BudgetCollector(budget))

    def observe_round(self, round_id: int, steps: int) -> None:
        self.round.set(round_id)
        self.training_steps.inc(steps)


class _BudgetCollector(Collector):
    """Reads the site's persisted budget at scrape time: correct across ClientApp processes."""

    def __init__(self, budget: "SiteBudget") -> None:
        self.budget = budget

    def collect(self) -> Iterator[Any]:
        from fedpose.federation.site_budget import SiteBudget

        fresh = SiteBudget(self.budget.state_dir, self.budget.site_id, self.budget.eps_max, self.budget.delta, self.budget.guarantee,
                           unit=self.budget.unit)
        report = fresh.report()
        labels = {"site": fresh.site_id, "guarantee": fresh.guarantee, "accountant": fresh.accountant_name,
                  "unit": report["unit"], "adjacency": report["relation"]}
        eps = GaugeMetricFamily("fedpose_site_epsilon_spent", "ε this site has spent (never bare: see the guarantee, accountant, "
                                "unit (protected) and adjacency labels, and fedpose_site_delta)", labels=list(labels))
        eps.add_metric(list(labels.values()), report["epsilon"])
        eps_max = GaugeMetricFamily("fedpose_site_epsilon_max", "ε budget of this site", labels=list(labels))
        eps_max.add_metric(list(labels.values()), fresh.eps_max)
        delta = GaugeMetricFamily("fedpose_site_delta", "δ of this site's ε", labels=["site"])
        delta.add_metric([fresh.site_id], fresh.delta)
        steps = CounterMetricFamily("fedpose_site_dp_steps", "Private steps accounted (all rounds, persisted)", labels=["site"])
        steps.add_metric([fresh.site_id], report["steps"])
        refusals = CounterMetricFamily("fedpose_site_refusals", "Rounds refused by the budget guard (persisted)", labels=["site"])
        refusals.add_metric([fresh.site_id], sum(e.status == "refused" for e in fresh.entries))
        spent = CounterMetricFamily("fedpose_site_rounds_spent", "Rounds that spent budget (persisted)", labels=["site"])
        spent.add_metric([fresh.site_id], report["rounds_spent"])
        yield from (eps, eps_max, delta, steps, refusals, spent)

    def describe(self) -> Iterator[Any]:
        return iter(())  # dynamic: read from disk at scrape time only


@dataclass
class MetricsServer:
    port: int
    _server: Any
    _thread: Any

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(port: int, registry: CollectorRegistry, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``registry`` at http://addr:port/metrics in a daemon thread; port 0 picks a free port."""
    try:
        server, thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as error:  # e.g. a second coordinator on the same machine
        raise OSError(error.errno, f"the metrics port {addr}:{port} is not available ({error.strerror}): "
                      "another coordinator may be using it; set coordinator.metrics_port (0 picks a free port)") from error
    return MetricsServer(server.server_port, server, thread)


def scrape_values(text: str) -> Mapping[str, float]:
    """Parse an exposition text into {'name{label="v",...}': value} (for tests and tools)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values
