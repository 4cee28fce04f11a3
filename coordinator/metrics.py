"""Coordinator Prometheus glue: serve :class:`fedpose.federation.metrics.CoordinatorMetrics` over
HTTP for the life of the ServerApp and feed it one finished round at a time."""

from __future__ import annotations

from typing import Any

from fedpose.federation.metrics import CoordinatorMetrics as _Metrics
from fedpose.federation.metrics import start_metrics_server


class CoordinatorMetrics:
    def __init__(self, port: int, addr: str = "0.0.0.0"):
        self.metrics = _Metrics()
        self.server = start_metrics_server(port, self.metrics.registry, addr=addr)

    def observe_round(self, entry: dict[str, Any]) -> None:
        m = self.metrics
        m.round.set(entry["round"])
        m.participating_sites.set(entry["accepted"])
        m.round_duration.observe(entry["wall_seconds"])
        for site_id, site in entry["sites"].items():
            status = site["status"]
            if site.get("epsilon") is not None and site.get("guarantee"):
                m.observe_site_report(site_id, float(site["epsilon"]), float(site["delta"]), str(site["guarantee"]),
                                      str(site.get("accountant") or "rdp"))
            if site.get("update_norm") is not None:
                m.update_norm.labels(site=site_id).set(site["update_norm"])
            if status == "rejected":
                m.rejected_updates.labels(reason=site.get("reject_reason", "invalid")).inc()
            elif status == "refused":
                m.refused_rounds.labels(site=site_id).inc()
            elif status == "missing":
                m.missing_replies.labels(site=site_id).inc()
            elif status in ("failed", "error"):
                m.failed_rounds.labels(site=site_id).inc()
        if entry.get("basis_bytes"):
            m.basis_bytes_sent.labels(transport=entry.get("basis_transport", "full")).inc(entry["basis_bytes"])
        m.exhausted_sites.set(entry.get("exhausted", 0))

    def close(self) -> None:
        self.server.close()
