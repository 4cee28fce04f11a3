"""``fedpose privacy``: budget arithmetic for the Poisson-subsampled Gaussian mechanism.

    fedpose privacy epsilon --sample-rate 0.01 --noise-multiplier 1.0 --steps 1000 --delta 1e-5
    fedpose privacy noise --target-epsilon 0.8 --sample-rate 0.01 --steps 1000 --delta 4e-5
    fedpose privacy report runs/x/privacy.json

Every ε is printed with its guarantee type, δ and accountant (never a bare ε).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from fedpose.cli.common import UserError, nonnegative_float, open_unit_interval, positive_float, positive_int, print_json


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
        help="DP: add/remove-one record (dpsgd, pdp); FDP / MaskDP: replace-one with public membership "
        "(fdp, fpdp, maskdp) — a different, larger RDP curve (default: DP)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "privacy", help="privacy budget: ε for a noise level, noise for a target ε, privacy.json summary"
    )
    sub = parser.add_subparsers(dest="privacy_command", metavar="ACTION", required=True)

    eps = sub.add_parser("epsilon", help="ε of T Poisson-subsampled Gaussian steps (RDP accountant)")
    eps.add_argument("--noise-multiplier", type=nonnegative_float, required=True, help="σ (noise std / clip C)")
    _add_common(eps)
    eps.set_defaults(handler=_epsilon)

    noise = sub.add_parser("noise", help="smallest noise multiplier σ (to 0.5%%) reaching a target ε")
    noise.add_argument("--target-epsilon", type=positive_float, required=True)
    _add_common(noise)
    noise.set_defaults(handler=_noise)

    rep = sub.add_parser("report", help="summarise a privacy.json written by training")
    rep.add_argument("path", type=Path)
    rep.add_argument("--json", action="store_true")
    rep.set_defaults(handler=_report)


def _epsilon(args: argparse.Namespace) -> int:
    from fedpose.privacy.accountant import epsilon_for
    from fedpose.privacy.report import format_epsilon, relation_of

    relation = relation_of(args.guarantee)
    epsilon, order = epsilon_for(args.noise_multiplier, args.sample_rate, args.steps, args.delta, relation=relation)
    result = {
        "epsilon": epsilon if math.isfinite(epsilon) else None,
        "delta": args.delta,
        "order": order if math.isfinite(order) else None,
        "accountant": "rdp",
        "guarantee": args.guarantee,
        "neighbouring_relation": relation,
    }
    if args.json:
        print_json(result)
    else:
        print(format_epsilon(epsilon, args.delta, args.guarantee))
        print(f"  σ = {args.noise_multiplier:g}, q = {args.sample_rate:g}, T = {args.steps}, optimal RDP order α = {order:g}, "
              f"relation: {relation}")
    return 0


def _noise(args: argparse.Namespace) -> int:
    from fedpose.privacy.accountant import epsilon_for, noise_multiplier_for
    from fedpose.privacy.report import format_epsilon, relation_of

    relation = relation_of(args.guarantee)
    try:
        sigma = noise_multiplier_for(args.target_epsilon, args.sample_rate, args.steps, args.delta, relation=relation)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    epsilon, order = epsilon_for(sigma, args.sample_rate, args.steps, args.delta, relation=relation)
    result = {"noise_multiplier": sigma, "epsilon": epsilon, "delta": args.delta, "order": order, "accountant": "rdp",
              "guarantee": args.guarantee}
    if args.json:
        print_json(result)
    else:
        print(f"noise multiplier σ = {sigma:.4f} → {format_epsilon(epsilon, args.delta, args.guarantee)}")
        print(f"  target ε = {args.target_epsilon:g}, q = {args.sample_rate:g}, T = {args.steps}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from fedpose.privacy.report import describe

    try:
        report = json.loads(args.path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{args.path}: not valid JSON ({exc})") from None
    if not isinstance(report, dict) or "mechanism" not in report:
        raise UserError(f"{args.path}: not a fedpose privacy.json (no 'mechanism' key)")
    if args.json:
        print_json(report)
    else:
        try:
            print(describe(report))
        except KeyError as exc:
            raise UserError(f"{args.path}: privacy.json lacks key {exc}") from None
    return 0
