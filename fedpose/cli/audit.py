"""``fedpose audit``: empirical lower bound on ε from one training run (white-box canaries).

    fedpose audit --config configs/train-dpsgd.toml [--canaries 1000] [--confidence 0.95] [--json] [--out DIR]
    fedpose audit --config configs/demo.toml --site site-1      # one round through the real site code

A central config (``fedpose train``'s) audits ``train.steps`` steps of central training; a
federation config (with ``[[sites]]``) audits one round of ``--site`` (default: the first site) on a
scratch budget, never the site's own. Exit status 3 when the lower bound exceeds the claimed ε.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedpose.cli.common import UserError, open_unit_interval, positive_int, print_json

#: exit status of an audit whose lower bound exceeds the claimed ε (the implementation leaks more than it says)
VIOLATION_EXIT = 3


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "audit",
        help="one-run privacy audit: canaries, empirical ε lower bound vs the accountant's ε",
        description=(
            "Train with the configured mechanism through the real DP engine with N canaries, each included with "
            "probability 1/2, score them by the projection of the release on their gradient direction, and report "
            "the one-run lower bound on ε (Steinke, Nasr & Jagielski 2023) next to the accountant's ε for the same run."
        ),
    )
    parser.add_argument("--config", type=Path, required=True, help="central (fedpose train) or federation (fedpose simulate) TOML")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set train.steps=20 (repeatable)")
    parser.add_argument("--site", help="federation config: the site whose round is audited (default: the first)")
    parser.add_argument("--canaries", type=positive_int, default=1000, help="number of canaries m (default 1000)")
    parser.add_argument("--confidence", type=open_unit_interval, default=0.95, help="confidence of the bound (default 0.95)")
    parser.add_argument("--mode", choices=("white-box",), default="white-box",
                        help="white-box: gradient-space canaries scored on the released update (black-box is not implemented)")
    parser.add_argument("--reference-run", action="store_true",
                        help="central: also train a canary-free twin with the same config and score the difference of "
                        "the releases (catches noise reused across runs)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the audit's own coins (canary directions and inclusion)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", type=Path, help="directory for audit.json and scores.png (score distributions)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import json

    from fedpose.config import ConfigError, RunConfig, apply_overrides, load_toml, validate

    raw = apply_overrides(load_toml(args.config), args.overrides)
    try:
        if "sites" in raw:
            from fedpose.federation.config import FederationConfig

            raw.pop("synthetic", None)  # read by `fedpose simulate` only
            federation = validate(FederationConfig, raw, str(args.config))
            sites = {s.site_id: s for s in federation.sites}
            site = sites.get(args.site) if args.site else federation.sites[0]
            if site is None:
                raise UserError(f"--site {args.site}: no such site in {args.config} (sites: {', '.join(sites)})")
            if args.reference_run:
                raise UserError("--reference-run audits central training; a site round takes no twin")
            cfg = None
        else:
            if args.site:
                raise UserError(f"--site needs a federation config ([[sites]]); {args.config} is a central one")
            cfg = validate(RunConfig, raw, str(args.config))
    except ConfigError as exc:
        raise UserError(str(exc)) from None

    from fedpose.audit import audit_central, audit_site_round, save_score_plot

    log = (lambda _: None) if args.json else print
    try:
        if cfg is not None:
            result = audit_central(cfg, args.canaries, args.confidence, args.seed, args.reference_run, log=log)
        else:
            result = audit_site_round(site, args.canaries, args.confidence, args.seed, log=log)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    summary = result.to_dict()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        summary["plot"] = str(save_score_plot(result, args.out / "scores.png"))
        (args.out / "audit.json").write_text(json.dumps(summary, indent=1) + "\n")
    if args.json:
        print_json(summary)
    else:
        print(f"{summary['mechanism']} ({summary['setting']}, {summary['mode']}, {summary['canaries']} canaries):")
        print(f"  claimed:   {summary['epsilon_text']}, {summary['neighbouring_relation']}")
        print(f"  empirical: {summary['epsilon_lower_text']}")
        print(f"  best guesses: {summary['correct']}/{summary['guesses']} correct")
        if summary["guarantee_void"]:
            print("  NOTE: seeded test noise — the claimed guarantee is void for this run")
        print("  VIOLATION: the release leaks more than the claimed ε" if summary["violation"]
              else "  consistent: the lower bound does not exceed the claimed ε")
    return VIOLATION_EXIT if summary["violation"] else 0
