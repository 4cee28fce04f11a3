"""The round protocol between coordinator and sites: record names and keys (Flower-free).

Coordinator → site, message type ``train``:
  ``global``  ArrayRecord: every tensor of the global model's state dict (name → array)
  ``basis``   ArrayRecord + ``basis-config`` ConfigRecord, only when the site lacks the current
              basis version (pdp / fpdp): V itself, or a compact recipe the site rebuilds
  ``config``  ConfigRecord: run-id, round, local-steps, model-spec (JSON), basis-version

Site → coordinator (the reply; nothing else ever leaves a site):
  ``update``  ArrayRecord: Δ = w_local − w_global of the trainable parameters (only with status ok)
  ``metrics`` MetricRecord (numbers only): num-examples, cumulative epsilon / delta / rdp / orders,
              steps, rounds-spent, basis-version, next-round-affordable, train-loss, compute-seconds
  ``site``    ConfigRecord (strings): site-id, status (ok | refused | replayed | failed), guarantee,
              accountant, reason
"""

from __future__ import annotations

import json
import math
from typing import Any

from fedpose.federation.local_training import SiteRoundResult

MESSAGE_TYPE_TRAIN = "train"

GLOBAL_RECORD = "global"
BASIS_RECORD = "basis"
BASIS_CONFIG_RECORD = "basis-config"
CONFIG_RECORD = "config"
UPDATE_RECORD = "update"
METRICS_RECORD = "metrics"
SITE_RECORD = "site"

#: every record name a site may send (the egress guard rejects anything else)
SITE_REPLY_RECORDS = frozenset({UPDATE_RECORD, METRICS_RECORD, SITE_RECORD})
#: the string fields a site may send, and nothing else
SITE_STRING_KEYS = frozenset({"site-id", "status", "guarantee", "accountant", "reason"})
#: the numeric fields a site may send (scalars; rdp/orders are per-order lists of the accountant)
SITE_METRIC_KEYS = frozenset({
    "num-examples", "epsilon", "delta", "eps-max", "steps", "rounds-spent", "rdp", "orders", "basis-version",
    "next-round-affordable", "train-loss", "compute-seconds", "local-steps",
})


def train_config(run_id: str, round_id: int, local_steps: int, model_spec: dict[str, Any], basis_version: int) -> dict[str, Any]:
    return {
        "run-id": run_id, "round": int(round_id), "local-steps": int(local_steps),
        "model-spec": json.dumps(model_spec), "basis-version": int(basis_version),
    }


def parse_train_config(config: dict[str, Any]) -> tuple[str, int, int, dict[str, Any], int]:
    """(run id, round, local steps, model spec, basis version) from a train message's config."""
    return (str(config["run-id"]), int(config["round"]), int(config["local-steps"]),
            json.loads(str(config["model-spec"])), int(config["basis-version"]))


def reply_fields(result: SiteRoundResult) -> tuple[dict[str, float | int | list[float]], dict[str, str]]:
    """(metrics, strings) of a site's reply — the only scalars that leave the site."""
    privacy = result.privacy
    metrics: dict[str, float | int | list[float]] = {
        "num-examples": int(result.num_examples),
        "epsilon": float(privacy["epsilon"]),
        "delta": float(privacy["delta"]),
        "eps-max": float(privacy["eps_max"]),
        "steps": int(privacy["steps"]),
        "rounds-spent": int(privacy["rounds_spent"]),
        "rdp": [float(x) for x in privacy["rdp"]],
        "orders": [float(x) for x in privacy["orders"]],
        "basis-version": int(result.basis_version),
        "next-round-affordable": int(bool(privacy.get("next_round_affordable", True))),
        "compute-seconds": float(result.compute_seconds),
    }
    for key, value in result.train_metrics.items():
        name = key.replace("_", "-")
        if name in SITE_METRIC_KEYS and math.isfinite(value):
            metrics[name] = float(value)
    strings = {
        "site-id": result.site_id, "status": result.status, "guarantee": str(privacy["guarantee"]),
        "accountant": str(privacy["accountant"]), "reason": result.reason,
    }
    return metrics, strings


def site_report_from_reply(metrics: dict[str, Any], strings: dict[str, Any]) -> dict[str, Any]:
    """The reply's privacy fields as a :meth:`SiteBudget.report`-shaped dict (for the ledger)."""
    epsilon = float(metrics["epsilon"]) if "epsilon" in metrics else None
    guarantee = str(strings.get("guarantee", ""))
    return {
        "site_id": str(strings["site-id"]),
        "epsilon": epsilon if epsilon is not None and math.isfinite(epsilon) else None,
        "delta": float(metrics["delta"]) if "delta" in metrics else None,
        "guarantee": guarantee or None,
        "accountant": str(strings.get("accountant", "rdp")),
        "rdp": list(metrics["rdp"]) if metrics.get("rdp") else None,
        "orders": list(metrics["orders"]) if metrics.get("orders") else None,
    }
