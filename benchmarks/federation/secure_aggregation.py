"""Secure aggregation's cost per round: bytes and wall time with vs without SecAgg, 3 and 10 sites.

In-process (:class:`fedpose.federation.server.rounds.RoundRunner`, no Flower): every site is a
scripted node that answers with a fixed Δ of the global model's trainable shape — no training, so
what differs between the two modes is exactly what secure aggregation adds — while the secure
rounds run each site's real :class:`~fedpose.federation.secagg.site.SiteSecAggSession` (P-384 key
agreement, Shamir shares, Fernet, AES-CTR masks) and the coordinator's real unmasking. Both modes of
one site count run back to back in one process, so their ratio is measured in one run.

Per mode: the coordinator's round wall time (all sites' secure-aggregation work runs in this one
process, one after another: on a real federation the sites' share runs in parallel, each site
paying about 1/n of it), bytes down and up per site (global weights and Δ, or the masked vector
and the stage messages), the stage messages alone, and the sites' share of the time (their
masking, measured separately). The model is the demo's coordinator model by default.

    python benchmarks/federation/secure_aggregation.py [--sites 3 10] [--repeats 2]
    → benchmarks/federation/secure_aggregation_results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from fedpose.federation import protocol
from fedpose.federation.deployment import CoordinatorRunConfig
from fedpose.federation.report import load_history
from fedpose.federation.secagg import site as secagg_site
from fedpose.federation.server import rounds as rounds_module
from fedpose.federation.server.rounds import NodeReply, RoundRunner, TrainRequest

OUT = Path(__file__).with_name("secure_aggregation_results.json")


class FixedUpdateSites:
    """n nodes answering with a fixed Δ (|Δ_i| ≤ r), through real secure-aggregation sessions when asked."""

    def __init__(self, n: int, trainable: list[str]):
        self.n, self.trainable = n, trainable
        self.sessions: dict[int, secagg_site.SiteSecAggSession] = {}
        self.site_seconds = 0.0  #: the sites' own secure-aggregation work (sessions, shares, masking)

    def node_ids(self) -> list[int]:
        return list(range(1, self.n + 1))

    def _reply(self, request: TrainRequest) -> protocol.SiteReply:
        privacy = protocol.PrivacyReport(guarantee="DP", unit="record", adjacency="add_remove", accountant="pld", epsilon=1.0,
                                         delta=1e-5, eps_max=10.0, steps=2, rounds_spent=1, orders=[], rdp=[],
                                         next_round_affordable=True)
        return protocol.SiteReply(site_id=f"site-{request.node}", run_id=request.instruction.run_id,
                                  round=request.instruction.round, status="ok", privacy=privacy, local_steps=2)

    def send_and_receive(self, requests: list[TrainRequest], timeout: float) -> list[NodeReply]:
        replies = []
        for request in requests:
            rng = np.random.default_rng(request.node)
            update = {k: rng.uniform(-0.01, 0.01, request.global_arrays[k].shape).astype(np.float32) for k in self.trainable}
            if request.secagg_inbox is None:
                replies.append(NodeReply(request.node, self._reply(request), update=lambda u=update: u,
                                         bytes_up=sum(a.nbytes for a in update.values())))
                continue
            started = time.perf_counter()
            session = self.sessions[request.node]
            session.receive_shares(request.secagg_inbox)
            masked = session.mask(np.concatenate([update[k].reshape(-1) for k in self.trainable]))
            self.site_seconds += time.perf_counter() - started
            replies.append(NodeReply(request.node, self._reply(request), masked=lambda m=masked: m, bytes_up=int(masked.nbytes)))
        return replies

    def secagg_exchange(self, messages: Mapping[int, protocol.SecAggRequest], timeout: float) -> dict[int, protocol.SecAggSiteMessage]:
        started = time.perf_counter()
        answers: dict[int, protocol.SecAggSiteMessage] = {}
        for node, message in messages.items():
            if isinstance(message, protocol.SecAggSetup):
                session, answers[node] = secagg_site.start(f"site-{node}", message)
                if session is not None:
                    self.sessions[node] = session
            else:
                answers[node] = secagg_site.answer(self.sessions.get(node), f"site-{node}", message)
        self.site_seconds += time.perf_counter() - started
        return answers


def one_round(n: int, secure: bool, model: dict, input_size: list[int]) -> dict:
    with tempfile.TemporaryDirectory(prefix="fedpose-secagg-bench-") as tmp:
        run = CoordinatorRunConfig.model_validate({"run_id": "bench", "coordinator": {
            "checkpoint_dir": str(Path(tmp) / "coordinator"), "data": {"input_size": input_size}, "rounds": 1, "min_sites": 1,
            "model": model, "secure_aggregation": {"enabled": secure, "clip_range": 0.05, "bits": 16, "modulus_bits": 32,
                                                   "max_sites": 64}}})
        runner = RoundRunner(run, echo=lambda _: None)
        sites = FixedUpdateSites(n, list(runner.global_model().trainable_parameters()))
        runner.run_rounds(sites)
        (entry,) = load_history(Path(tmp) / "coordinator")
        stage = entry.secure_aggregation.stage_bytes if entry.secure_aggregation else 0
        return {
            "wall_seconds": entry.wall_seconds,
            "site_seconds": sites.site_seconds,
            "bytes_down_per_site": float(np.mean([s.bytes_down for s in entry.sites.values()])),
            "bytes_up_per_site": float(np.mean([s.bytes_up for s in entry.sites.values()])),
            "stage_bytes_per_site": stage / n,
            "trainable_parameters": int(sum(runner.global_state[k].size for k in sites.trainable)),
            "aggregated": entry.aggregated,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[3, 10])
    parser.add_argument("--repeats", type=int, default=2, help="rounds per mode; the median is reported")
    parser.add_argument("--backbone", default="tiny_vit_test")
    parser.add_argument("--scenario", default="scratch")
    parser.add_argument("--input-size", type=int, nargs=2, default=[128, 96])
    args = parser.parse_args()
    rounds_module.NODE_SETTLE_S = 0.0
    model = {"backbone": args.backbone, "scenario": args.scenario}
    results = []
    for n in args.sites:
        runs = {mode: [one_round(n, mode == "secure", model, args.input_size) for _ in range(args.repeats)] for mode in ("plain", "secure")}
        median = {mode: {k: float(np.median([r[k] for r in rs])) for k in rs[0] if k != "aggregated"} for mode, rs in runs.items()}
        plain, secure = median["plain"], median["secure"]
        row = {"sites": n, "plain": plain, "secure": secure,
               "wall_time_ratio": secure["wall_seconds"] / plain["wall_seconds"],
               "bytes_per_site_ratio": (secure["bytes_down_per_site"] + secure["bytes_up_per_site"] + secure["stage_bytes_per_site"])
               / (plain["bytes_down_per_site"] + plain["bytes_up_per_site"]),
               "site_seconds_per_site": secure["site_seconds"] / n}
        results.append(row)
        print(json.dumps(row, indent=1), flush=True)
    OUT.write_text(json.dumps({"model": {**model, "input_size": args.input_size}, "repeats": args.repeats,
                               "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_average": os.getloadavg()},
                               "note": "in-process, fixed updates (no training); the secure rounds run the real cryptography "
                                       "of every site in this one process, one after another",
                               "results": results}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
