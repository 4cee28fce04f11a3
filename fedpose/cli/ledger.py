"""``fedpose ledger show|export``: read the coordinator's per-site privacy-budget ledger."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from fedpose.cli.common import UserError, examples


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ledger", help="inspect the coordinator's per-site budget ledger (SQLite)")
    sub = parser.add_subparsers(dest="ledger_command", metavar="ACTION", required=True)

    show = sub.add_parser("show", help="one line per site: reported ε (guarantee, δ), rounds joined/refused/missing")
    show.add_argument("--db", required=True, type=Path, help="ledger database (coordinator checkpoint_dir/ledger.sqlite)")
    show.add_argument("--eps-max", type=float, default=None, help="also mark sites whose reported ε reached this")
    show.epilog = examples(
        'fedpose ledger show --db runs/demo/coordinator/ledger.sqlite --eps-max 8',
    )
    show.set_defaults(handler=_show)

    export = sub.add_parser("export", help="dump every (site, round) entry (JSON: also each site's summary, as `show` "
                                           "gives it, and each site's spends per round — σ, q, steps — to recompute ε "
                                           "from; CSV: the entries only, one a row)")
    export.add_argument("--db", required=True, type=Path, help="ledger database")
    export.add_argument("--format", choices=("json", "csv"), default="json", help="json (default) or csv")
    export.add_argument("--out", type=Path, default=None, help="write here (atomically) instead of stdout")
    export.epilog = examples(
        'fedpose ledger export --db runs/demo/coordinator/ledger.sqlite --format csv --out ledger.csv',
    )
    export.set_defaults(handler=_export)


def _open(path: Path):
    from fedpose.federation.ledger import BudgetLedger, LedgerError

    if path.is_dir():  # SQLite would answer "disk I/O error"
        raise UserError(f"{path}: a directory, not a ledger database file")
    try:
        return BudgetLedger(path, read_only=True)
    except LedgerError as exc:
        raise UserError(str(exc)) from None


def _show(args: argparse.Namespace) -> int:
    from fedpose.privacy.report import format_epsilon, input_privacy_text

    with _open(args.db) as ledger:
        summaries = ledger.site_summaries()
        exhausted = ledger.exhausted_sites(args.eps_max)
    if not summaries:
        print(f"{args.db}: no entries yet")
        return 0
    for s in summaries:
        if s.guarantee == "none":  # a non-private site: ε = ∞, said so
            eps = format_epsilon(math.inf, 0.0, "none")
        else:
            eps = "ε not reported" if s.epsilon is None else format_epsilon(s.epsilon, s.delta or 0.0, s.guarantee or "?",
                                                                             s.accountant or "rdp", s.unit, s.adjacency)
        if s.unconfirmed_rounds:  # sent, never answered, after its last report: it may have spent (ledger docstring)
            eps += f"; {s.unconfirmed_rounds} round(s) sent since without a reply"
            if s.epsilon_possible is not None:
                possible = format_epsilon(s.epsilon_possible, s.delta or 0.0, s.guarantee or "?", s.accountant or "rdp", s.unit,
                                          s.adjacency)
                eps += (f" — possibly {possible}"
                        " if each was spent at its last per-round cost (its next reply reconciles)")
        flag = "  EXHAUSTED" if s.site_id in exhausted else ""
        if s.eps_max is not None:  # the site's own budget, as it reported it
            eps += f" of its ε_max {s.eps_max:g}" + ("" if s.next_round_affordable is not False else " (next round would not fit)")
        print(
            f"{s.site_id}: {eps}; rounds joined {s.rounds_joined}, refused {s.rounds_refused}, "
            f"missing {s.rounds_missing}"
            + (f" ({s.rounds_spent_unreleased} of them spent, then failed: no update)" if s.rounds_spent_unreleased else "")
            + f"; last round {s.last_round} ({s.last_status}){flag}"
        )
        if s.input_ldp_epsilon is not None:
            print(f"  {s.site_id}'s inputs: {input_privacy_text(s.input_ldp_epsilon, bool(s.input_ldp_ll_prune))}")
    return 0


def _export(args: argparse.Namespace) -> int:
    with _open(args.db) as ledger:
        text = ledger.export(args.format)
    if args.out is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    else:
        from fedpose.io import atomic_write_text

        atomic_write_text(args.out, text)
    return 0
