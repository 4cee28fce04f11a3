"""``fedpose privacy``: budget arithmetic for the Poisson-subsampled Gaussian mechanism.

    fedpose privacy epsilon --sample-rate 0.01 --noise-multiplier 1.0 --steps 1000 --delta 1e-5 [--accountant pld]
    fedpose privacy noise --target-epsilon 0.8 --sample-rate 0.01 --steps 1000 --delta 4e-5 [--accountant rdp]
    fedpose privacy report runs/x/privacy.json
    fedpose privacy budget STATE_DIR [--accountant pld [--apply]]
    fedpose privacy adopt STATE_DIR [--dry-run]

``--accountant`` defaults to the tightest accountant exact for the guarantee's neighbouring
relation (``pld``). Every ε is printed with its guarantee type, δ, relation, accountant and
protection unit (``--unit``; never a bare ε).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from fedpose.cli.common import (
    UserError,
    examples,
    nonnegative_float,
    open_unit_interval,
    positive_float,
    positive_int,
    print_json,
)

#: the registry's names (fedpose.privacy.accountants.ACCOUNTANTS), listed here so `--help` needs no numerics import
ACCOUNTANT_NAMES = ("rdp", "pld", "prv")


def _rate(text: str) -> float:
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"a sample rate is in (0, 1], got {text}")
    return value


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sample-rate", type=_rate, required=True, help="Poisson sampling rate q = B/N")
    parser.add_argument("--steps", type=positive_int, required=True, help="number of noisy steps T")
    parser.add_argument("--delta", type=open_unit_interval, required=True, help="target δ (e.g. below 1/N)")
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument(
        "--guarantee", choices=("DP", "FDP", "MaskDP"), default="DP",
        help="DP: add/remove-one unit (dpsgd, pdp); FDP / MaskDP: replace-one unit's private part, membership "
        "hidden (fdp, fpdp, maskdp) — a different, larger privacy loss (default: DP)",
    )
    parser.add_argument(
        "--accountant", choices=ACCOUNTANT_NAMES, default=None,
        help="rdp | pld | prv (default: the tightest exact for the guarantee's relation: pld; prv handles DP only)",
    )
    parser.add_argument(
        "--unit", choices=("record", "image", "patient"), default="record",
        help="protection unit the guarantee is about; q is then the rate at which units are sampled "
        "(expected units per batch / units at the site) (default: record)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "privacy", help="privacy budget: ε for a noise level, noise for a target ε, privacy.json summary"
    )
    sub = parser.add_subparsers(dest="privacy_command", metavar="ACTION", required=True)

    eps = sub.add_parser("epsilon", help="ε of T Poisson-subsampled Gaussian steps (RDP, PLD or PRV accountant)")
    eps.add_argument("--noise-multiplier", type=nonnegative_float, required=True, help="σ (noise std / clip C)")
    _add_common(eps)
    eps.epilog = examples(
        'fedpose privacy epsilon --noise-multiplier 1.0 --sample-rate 0.01 --steps 1000 --delta 1e-5',
        'fedpose privacy epsilon --noise-multiplier 1.0 --sample-rate 0.5 --steps 100 --delta 1e-5 --unit patient --accountant rdp',
    )
    eps.set_defaults(handler=_epsilon)

    noise = sub.add_parser("noise", help="smallest noise multiplier σ (to 0.5%%) reaching a target ε")
    noise.add_argument("--target-epsilon", type=positive_float, required=True, help="the ε to reach (at --delta)")
    _add_common(noise)
    noise.epilog = examples(
        'fedpose privacy noise --target-epsilon 4 --sample-rate 0.01 --steps 1000 --delta 1e-5',
        'fedpose privacy noise --target-epsilon 8 --sample-rate 0.05 --steps 500 --delta 1e-5 --guarantee FDP',
    )
    noise.set_defaults(handler=_noise)

    rep = sub.add_parser("report", help="summarise a privacy.json written by training (or a run / export directory)")
    rep.add_argument("path", type=Path, metavar="PATH",
                     help="a privacy.json, a `fedpose train` run directory (its privacy.json) or a `fedpose export` "
                          "directory (its privacy_report.json)")
    rep.add_argument("--json", action="store_true", help="print the report as one JSON object")
    rep.epilog = examples(
        "fedpose privacy report runs/train   # the run's privacy.json",
        "fedpose privacy report release/ --json   # an export's privacy_report.json (central or federated)",
    )
    rep.set_defaults(handler=_report)

    budget = sub.add_parser(
        "budget", help="a site's spend recomputed from its persisted events, by every accountant; --apply switches its accountant"
    )
    budget.add_argument("state_dir", type=Path, help="the site's state_dir (holds budget.json)")
    budget.add_argument("--accountant", choices=ACCOUNTANT_NAMES, default=None, help="the accountant to compare with or switch to")
    budget.add_argument("--apply", action="store_true",
                        help="switch the budget to --accountant (recorded in the budget with ε before and after)")
    budget.add_argument("--json", action="store_true", help="print one JSON object only")
    budget.epilog = examples(
        'fedpose privacy budget runs/demo/sites/site-1',
        'fedpose privacy budget runs/demo/sites/site-1 --accountant pld --apply',
    )
    budget.set_defaults(handler=_budget)

    adopt = sub.add_parser(
        "adopt", help="after a restore from backup: add the spends a site's budget lacks (its journal, the coordinator's "
                      "record it last refused on) to its budget — recorded, never lowering anything")
    adopt.add_argument("state_dir", type=Path, help="the site's state_dir (holds budget.json)")
    adopt.add_argument("--dry-run", action="store_true", help="show what would be adopted, change nothing")
    adopt.add_argument("--json", action="store_true", help="print one JSON object only")
    adopt.epilog = examples(
        "fedpose privacy adopt runs/demo/sites/site-1 --dry-run",
        "fedpose privacy adopt runs/demo/sites/site-1",
    )
    adopt.set_defaults(handler=_adopt)


def _accounting(args: argparse.Namespace) -> tuple[str, str]:
    """(relation, accountant) of the requested guarantee; a relation the accountant cannot handle is a user error."""
    from fedpose.privacy.accountants import default_accountant, get_accountant
    from fedpose.privacy.report import relation_of

    relation = relation_of(args.guarantee)
    accountant = args.accountant or default_accountant(relation)
    if not get_accountant(accountant).supports(relation):
        raise UserError(f"--accountant {accountant} does not handle the {args.guarantee} guarantee's relation ({relation}); "
                        f"use {default_accountant(relation)}")
    return relation, accountant


def _epsilon(args: argparse.Namespace) -> int:
    from fedpose.privacy.accountant import epsilon_for
    from fedpose.privacy.report import format_epsilon, guarantee_sentence

    relation, accountant = _accounting(args)
    epsilon, order = epsilon_for(args.noise_multiplier, args.sample_rate, args.steps, args.delta, relation=relation,
                                 accountant=accountant)
    result = {
        "epsilon": epsilon if math.isfinite(epsilon) else None,
        "delta": args.delta,
        "order": order if math.isfinite(order) else None,  # the optimal RDP order (rdp only)
        "accountant": accountant,
        "guarantee": args.guarantee,
        "protection_unit": args.unit,
        "neighbouring_relation": relation,
        "guarantee_sentence": guarantee_sentence(epsilon if math.isfinite(epsilon) else None, args.delta,
                                                 args.guarantee, args.unit, relation, accountant),
    }
    if args.json:
        print_json(result)
    else:
        print(format_epsilon(epsilon, args.delta, args.guarantee, accountant, unit=args.unit, relation=relation))
        print(f"  {result['guarantee_sentence']}")
        order_text = f", optimal RDP order α = {order:g}" if math.isfinite(order) else ""
        print(f"  σ = {args.noise_multiplier:g}, q = {args.sample_rate:g}, T = {args.steps}{order_text}, relation: {relation}")
    return 0


def _noise(args: argparse.Namespace) -> int:
    from fedpose.privacy.accountant import epsilon_for, noise_multiplier_for
    from fedpose.privacy.report import format_epsilon

    relation, accountant = _accounting(args)
    try:
        sigma = noise_multiplier_for(args.target_epsilon, args.sample_rate, args.steps, args.delta, relation=relation,
                                     accountant=accountant)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    epsilon, order = epsilon_for(sigma, args.sample_rate, args.steps, args.delta, relation=relation, accountant=accountant)
    result = {"noise_multiplier": sigma, "epsilon": epsilon, "delta": args.delta,
              "order": order if math.isfinite(order) else None, "accountant": accountant,
              "guarantee": args.guarantee, "protection_unit": args.unit, "neighbouring_relation": relation}
    if args.json:
        print_json(result)
    else:
        print(f"noise multiplier σ = {sigma:.4f} → {format_epsilon(epsilon, args.delta, args.guarantee, accountant, unit=args.unit, relation=relation)}")
        print(f"  target ε = {args.target_epsilon:g}, q = {args.sample_rate:g}, T = {args.steps}, relation: {relation}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from fedpose.privacy.report import describe, describe_federation

    path = _report_file(args.path)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not valid JSON ({' '.join(str(exc).split())})") from None
    federated = isinstance(report, dict) and report.get("source") == "federation"  # a federated export's
    if not isinstance(report, dict) or "mechanism" not in report and not federated:
        raise UserError(f"{path}: not a fedpose privacy.json (no 'mechanism' key) nor a federated export's report")
    if args.json:
        print_json(report)
    else:
        try:
            print(describe_federation(report) if federated else describe(report))
        except KeyError as exc:
            raise UserError(f"{path}: the privacy report lacks key {exc}") from None
    return 0


#: what a directory given to `privacy report` holds: a run's report, or an export's
REPORT_FILES = ("privacy.json", "privacy_report.json")


def _report_file(path: Path) -> Path:
    """A report file as given, or the report inside a run or export directory."""
    if not path.is_dir():
        return path
    for name in REPORT_FILES:
        if (path / name).is_file():
            return path / name
    if (path / "ledger.sqlite").is_file():
        raise UserError(f"{path}: a federation's coordinator directory: its sites' ε are in its ledger (`fedpose ledger show "
                        f"--db {path / 'ledger.sqlite'}`); `fedpose export {path} --out DIR` writes the privacy_report.json "
                        "this command reads")
    raise UserError(f"{path}: a directory without {' or '.join(REPORT_FILES)} (give a run or export directory, or the file)")


def _budget(args: argparse.Namespace) -> int:
    from fedpose.federation.site_budget import BudgetError, recompute_budget
    from fedpose.privacy.report import format_epsilon

    if args.apply and args.accountant is None:
        raise UserError("--apply needs --accountant (the accountant to switch the budget to)")
    try:
        result = recompute_budget(args.state_dir, args.accountant, apply=args.apply)
        behind = _spends_the_budget_lacks(args.state_dir)
    except BudgetError as exc:
        raise UserError(str(exc)) from None
    if args.json:
        print_json({**result, "spends_not_in_budget": behind["adopted"] if behind else [],
                    "epsilon_with_them": behind["epsilon_after"] if behind else None})
        return 0
    guarantee, delta, unit, relation = result["guarantee"], result["delta"], result["unit"], result["neighbouring_relation"]
    print(f"site '{result['site_id']}': {result['steps']} steps under the {relation} relation")
    print(f"  enforced: {format_epsilon(result['epsilon'], delta, guarantee, result['accountant'], unit, relation)}")
    if behind:  # a restored or replaced state: the budget understates what was spent
        rounds = ", ".join(f"run '{s['run_id']}' round {s['round']} ({s['from']})" for s in behind["adopted"])
        print(f"  WARNING: this budget lacks {len(behind['adopted'])} spend(s) held elsewhere — {rounds}; counting them, "
              f"{format_epsilon(behind['epsilon_after'], delta, guarantee, behind['accountant'], unit, relation)} was spent; "
              f"`fedpose privacy adopt {args.state_dir}` adds them to the budget")
    for name, epsilon in result["epsilon_by_accountant"].items():
        print(f"  by {name}: {format_epsilon(epsilon, delta, guarantee, name, unit, relation)}")
    if result["applied"]:
        print(f"  switched to {result['accountant'].upper()} (recorded in {args.state_dir / 'budget.json'})")
    elif args.accountant is not None and args.accountant != result["accountant"]:
        print(f"  not switched: add --apply to enforce {args.accountant.upper()} from now on")
    return 0


def _adoption(state_dir: Path, dry_run: bool) -> dict[str, Any]:
    """``privacy adopt``: add to the budget the spends its journal or the coordinator's record (the one
    the site last refused on) hold and it lacks; with ``dry_run`` nothing is written."""
    from fedpose.federation.site_budget import adopt_spends
    from fedpose.federation.witness import load_saved_record

    saved = load_saved_record(state_dir)
    spends, source = saved if saved is not None else ([], "")
    return adopt_spends(state_dir, spends, source, dry_run=dry_run)


def _spends_the_budget_lacks(state_dir: Path) -> dict[str, Any] | None:
    """What ``privacy adopt`` would add (None when there is nothing): a dry run, nothing written."""
    found = _adoption(state_dir, dry_run=True)
    return found if found["adopted"] else None


def _adopt(args: argparse.Namespace) -> int:
    from fedpose.federation.site_budget import BudgetError
    from fedpose.privacy.report import format_epsilon

    try:
        result = _adoption(args.state_dir, args.dry_run)
    except BudgetError as exc:
        raise UserError(str(exc)) from None
    if args.json:
        print_json(result)
        return 0
    guarantee, delta, accountant = result["guarantee"], result["delta"], result["accountant"]
    print(f"site '{result['site_id']}': spent {format_epsilon(result['epsilon_before'], delta, guarantee, accountant, result['unit'], result['neighbouring_relation'])}")
    if not result["adopted"]:
        print("  its budget already holds every journaled spend and every spend on the coordinator's record: nothing to adopt")
        return 0
    for spend in result["adopted"]:
        print(f"  {'would adopt' if args.dry_run else 'adopted'} run '{spend['run_id']}' round {spend['round']} "
              f"(σ = {spend['noise_multiplier']:g}, q = {spend['sample_rate']:g}, {spend['steps']} steps) from the {spend['from']}")
    verb = "would be" if args.dry_run else "is now"
    print(f"  the budget {verb} {format_epsilon(result['epsilon_after'], delta, guarantee, accountant, result['unit'], result['neighbouring_relation'])}"
          + ("" if args.dry_run else f" (recorded in {args.state_dir / 'budget.json'} under 'adoptions')"))
    return 0
