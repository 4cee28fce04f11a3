"""``fedpose audit``: empirical lower bound on ε from one training run (white-box or black-box canaries).

    fedpose audit --config configs/central.toml [--canaries 1000] [--confidence 0.95] [--json] [--out DIR]
    fedpose audit --config configs/central.toml --mode black-box   # canary images, scored by loss
    fedpose audit --config configs/demo.toml --site site-1             # one round through the real site code

A central config (``fedpose train``'s) audits ``train.steps`` steps of central training; a
federation config (with ``[[sites]]``) audits one round of ``--site`` (default: the first site) on a
scratch budget, never the site's own (white-box only). Exit status 3 when the lower bound exceeds
the claimed ε.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedpose.cli.common import UserError, examples, open_unit_interval, positive_int, print_json

#: exit status of an audit whose lower bound exceeds the claimed ε (the implementation leaks more than it says)
VIOLATION_EXIT = 3
#: fedpose.audit.MODES, spelled out so that building the CLI imports no torch/scipy (a test keeps them equal)
MODES = ("white-box", "black-box")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "audit",
        help="one-run privacy audit: canaries, empirical ε lower bound vs the accountant's ε",
        description=(
            "Train with the configured mechanism through the real DP engine with N canaries, each included with "
            "probability 1/2, score them after training, and report the one-run lower bound on ε next to the "
            "accountant's ε for the same run: the larger of Steinke, Nasr & Jagielski (2023) and its f-DP variant "
            "(Mahloujifar, Melis & Chaudhuri 2024, Gaussian tradeoff curves), both in the JSON. "
            "Modes: white-box (default) adds gradient-space canaries (a fixed direction as a canary's clipped "
            "gradient; for pdp/fpdp a direction of the public basis, which projection keeps) and scores each by the "
            "projection of the released gradient on it, less what the dataset alone released; black-box (central "
            "training, add/remove mechanisms: dpsgd, pdp) adds out-of-distribution images with keypoints at random "
            "places as training records and scores each by how much training lowered its loss — weak by nature."
        ),
    )
    parser.add_argument("--config", type=Path, required=True, help="central (fedpose train) or federation (fedpose simulate) TOML")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set train.steps=20 (repeatable)")
    parser.add_argument("--site", help="federation config: the site whose round is audited (default: the first)")
    parser.add_argument("--canaries", type=positive_int, default=None,
                        help="number of canaries m (default 1000; white-box pdp/fpdp: at most basis.k per release, so "
                        "min(1000, k × steps) centrally and k for a site round)")
    parser.add_argument("--confidence", type=open_unit_interval, default=0.95, help="confidence of the bound (default 0.95)")
    parser.add_argument("--mode", choices=MODES, default=MODES[0],
                        help="white-box: gradient-space canaries scored on the released update (central or site round); "
                        "black-box: canary images in the training set scored by their loss under the final model "
                        "(central training, dpsgd or pdp)")
    parser.add_argument("--reference-run", action="store_true",
                        help="central: also train a canary-free twin with the same config and score the difference of "
                        "the releases (catches noise reused across runs)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the audit's own coins (canary directions and inclusion)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", type=Path, help="directory for audit.json and scores.png (score distributions)")
    parser.epilog = examples(
        'fedpose audit --config configs/central.toml',
        'fedpose audit --config configs/central.toml --mode black-box --canaries 500',
        'fedpose audit --config configs/demo.toml --site site-1 --json',
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import json

    from fedpose.config import ConfigError, RunConfig, apply_overrides, load_toml, validate

    raw = apply_overrides(load_toml(args.config), args.overrides)
    try:
        if "sites" in raw:
            from fedpose.federation.config import FederationConfig

            raw.pop("synthetic", None)  # read by `fedpose simulate` only
            federation = validate(FederationConfig, raw, str(args.config), args.overrides)
            sites = {s.site_id: s for s in federation.sites}
            site = sites.get(args.site) if args.site else federation.sites[0]
            if site is None:
                raise UserError(f"--site {args.site}: no such site in {args.config} (sites: {', '.join(sites)})")
            if args.reference_run:
                raise UserError("--reference-run audits central training; a site round takes no twin")
            if args.mode == "black-box":
                raise UserError("--mode black-box audits central training (a central config); a site round is audited white-box")
            cfg = None
        else:
            if args.site:
                raise UserError(f"--site needs a federation config ([[sites]]); {args.config} is a central one")
            cfg = validate(RunConfig, raw, str(args.config), args.overrides)
    except ConfigError as exc:
        raise UserError(str(exc)) from None

    from fedpose.audit import audit_central, audit_site_round, save_score_plot

    log = (lambda _: None) if args.json else print
    try:
        if cfg is not None:
            result = audit_central(cfg, args.canaries, args.confidence, args.seed, args.reference_run, args.mode, log=log)
        else:
            result = audit_site_round(site, federation.coordinator, args.canaries, args.confidence, args.seed, log=log)
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
        unit, why = summary["protection_unit"], summary["protection_unit_choice"]
        print(f"  audited:   per {unit}{f' ({why})' if why else ''}, q = {summary['sample_rate']:.4g}, "
              f"σ = {summary['noise_multiplier']:.4g}, {summary['steps']} steps, {summary['accountant'].upper()} accountant")
        print(f"  empirical: {summary['epsilon_lower_text']}")
        print(f"  {guess_line(summary)} (Steinke et al.: {summary['epsilon_lower_steinke']:.4g}, "
              f"f-DP: {summary['epsilon_lower_fdp']:.4g})")
        if summary["guarantee_void"]:
            print("  NOTE: seeded test noise — the claimed guarantee is void for this run")
        print("  VIOLATION: the release leaks more than the claimed ε" if summary["violation"]
              else "  consistent: the lower bound does not exceed the claimed ε")
    return VIOLATION_EXIT if summary["violation"] else 0


def guess_line(summary: dict) -> str:
    """What the auditor's best guess split was; with none that bounds ε above 0, say so, not "0/0"."""
    if summary["guesses"] == 0:
        return (f"best guesses: none of the {summary['tests_tried']} guess tests bounds ε above 0 "
                "(the canaries' scores give no evidence of inclusion at this confidence)")
    return (f"best guesses: {summary['correct']} of {summary['guesses']} correct "
            f"({summary['guesses_in']} guessed included, the rest excluded)")

