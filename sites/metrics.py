"""A site's long-lived Prometheus exporter (the ClientApp itself lives for one message only).

    python -m sites.metrics --site-config /etc/fedpose/site-1.toml --port 9480

serves ``/metrics`` with the site's persisted budget (ε spent with guarantee label, δ, ε_max,
steps, refusals), read from its ``state_dir`` at every scrape.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from fedpose.config import ConfigError, load_config
from fedpose.data.annotations import AnnotationError
from fedpose.federation.config import SiteConfig
from fedpose.federation.local_training import open_budget
from fedpose.federation.metrics import SiteMetrics, start_metrics_server
from fedpose.federation.site_budget import BudgetError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sites.metrics", description=__doc__)
    parser.add_argument("--site-config", required=True, help="the site's TOML (SiteConfig)")
    parser.add_argument("--port", type=int, default=None, help="HTTP port (default: the site's metrics_port)")
    parser.add_argument("--addr", default="127.0.0.1")
    args = parser.parse_args(argv)
    try:
        site = load_config(args.site_config, model=SiteConfig)
        port = args.port if args.port is not None else site.metrics_port
        if port is None:
            parser.error("no --port and no metrics_port in the site config")
        budget = open_budget(site)
    # the operator needs the problem, not a traceback: a bad config, budget state, or the data a new
    # site's protection unit is read from (missing or unreadable annotations)
    except (ConfigError, BudgetError, AnnotationError, OSError) as exc:
        print(f"sites.metrics: error: {exc}", file=sys.stderr)
        return 2
    server = start_metrics_server(port, SiteMetrics(site.site_id, budget=budget).registry, addr=args.addr)
    print(f"site '{site.site_id}' metrics on http://{args.addr}:{server.port}/metrics", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
