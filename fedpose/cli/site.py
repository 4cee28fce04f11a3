"""``fedpose site``: a site's own records and keys.

    fedpose site report --state-dir state/site-1            # one line per reply the site sent
    fedpose site report --state-dir state/site-1 --csv      # the same, for a spreadsheet
    fedpose site report --state-dir state/site-1 --verify   # the hash chain + agreement with the budget
    fedpose site identity --out /etc/fedpose/site-1.identity.pem   # the site's identity (signed keys and replies)
    fedpose site prepare --site-config site-1.toml --input-size 256 192   # decode the images before joining

``report``: the audit log for the site's privacy officer (public values only).
The log (``<state_dir>/audit.jsonl``, :mod:`fedpose.federation.site_audit`) is written by the site
each time it replies: what was asked, what it answered, its ε after the round (guarantee, unit, δ,
accountant), the bytes and SHA-256 of the update it released, when. The site's diagnostics
(``rounds.jsonl``: losses, timings) are never shown here.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path
from typing import Any

from fedpose.cli.common import UserError, examples, print_json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("site", help="a site's own records and preparation: its audit log, identity, decoded images")
    sub = parser.add_subparsers(dest="site_command", metavar="ACTION", required=True)
    report = sub.add_parser(
        "report", help="every round the site took part in: asked, answered, ε, bytes and SHA-256 released (public values only)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_argument("--state-dir", required=True, type=Path, help="the site's state_dir (its audit.jsonl)")
    mode = report.add_mutually_exclusive_group()
    mode.add_argument("--json", action="store_true", help="print one JSON object (every entry, every field)")
    mode.add_argument("--csv", action="store_true", help="print CSV, one row per entry")
    mode.add_argument("--verify", action="store_true",
                      help="check the hash chain and its agreement with the budget and the spend journal: exit 0, or "
                           "exit 2 with one line naming the first bad entry")
    report.epilog = examples(
        "fedpose site report --state-dir state/site-1",
        "fedpose site report --state-dir state/site-1 --verify",
    )
    report.set_defaults(handler=_report)
    identity = sub.add_parser(
        "identity", help="make this site's identity key (signs its secure-aggregation keys and its replies); prints the public key",
        description="Writes an Ed25519 private key (PEM, mode 0600) for the site config's identity.key and prints its "
                    "public key: give that to every other site out of band (not through the coordinator), and list "
                    "theirs under identity.peers; give it to the coordinator's operator too, for "
                    "coordinator.site_identities (the coordinator then uses only replies this key signed). "
                    "The key never leaves the site.")
    identity.add_argument("--out", required=True, type=Path, help="where to write the private key")
    identity.add_argument("--force", action="store_true", help="overwrite an existing key (its peers must then be told)")
    identity.epilog = examples("fedpose site identity --out /etc/fedpose/site-1.identity.pem")
    identity.set_defaults(handler=_identity)
    prepare = sub.add_parser(
        "prepare", help="check and decode the site's training images into its canonical windows before it joins",
        description="Decodes every training image once into the site's canonical windows (fedpose.data.canonical) "
                    "at the federation's input size, in the site's state_dir. A site does this when it first loads "
                    "its data anyway; done here, before the site joins, no round's time includes it. Applies the "
                    "site's input privacy (LDP-Slicing) first, as its first round would.")
    prepare.add_argument("--site-config", required=True, type=Path, help="the site's config (a SiteConfig TOML)")
    prepare.add_argument("--input-size", required=True, type=int, nargs=2, metavar=("H", "W"),
                         help="the federation's model input size (the coordinator's model)")
    prepare.epilog = examples("fedpose site prepare --site-config site-1.toml --input-size 256 192")
    prepare.set_defaults(handler=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    from fedpose.config import load_config
    from fedpose.federation.config import SiteConfig
    from fedpose.federation.local_training import CANONICAL_WINDOWS_DIR, load_site_dataset

    site = load_config(str(args.site_config), model=SiteConfig)
    height, width = args.input_size
    if height <= 0 or width <= 0:
        raise UserError(f"--input-size must be positive, got {height} {width}")
    if not Path(site.data.train).exists():  # before any work, naming the key as the config spells it
        raise UserError(f"{args.site_config}: data.train = {site.data.train}: no such file or directory")
    dataset = load_site_dataset(site, (height, width))
    assert dataset.windows is not None
    print_json({"site_id": site.site_id, "records": len(dataset), "input_size": [height, width],
                "window_size": list(dataset.windows.windows.shape[1:3]),
                "bytes": int(dataset.windows.windows.nbytes), "in": str(Path(site.state_dir) / CANONICAL_WINDOWS_DIR)})
    return 0


def _identity(args: argparse.Namespace) -> int:
    from fedpose.federation.secagg import crypto
    from fedpose.io import atomic_write

    out: Path = args.out
    if out.exists() and not args.force:
        raise UserError(f"--out {out} already exists (use --force to replace the identity; its peers must then be told)")
    pem = crypto.new_identity()
    atomic_write(out, lambda fh: fh.write(pem))  # owner-only (0600) from the start
    print_json({"key": str(out), "public_key": crypto.identity_public_key(crypto.load_identity(out))})
    return 0


#: CSV columns, in order (nested fields flattened)
CSV_COLUMNS = ("seq", "at_utc", "site_id", "run_id", "round", "asked_local_steps", "asked_basis_version", "asked_backbone",
               "asked_input_size", "global_sha256", "ledger_record_rounds", "status", "reason", "error_class", "local_steps",
               "guarantee", "protection_unit", "delta", "accountant", "epsilon", "adjacency", "eps_max", "epsilon_text", "rounds_spent",
               "noise_multiplier", "sample_rate", "steps", "update_bytes", "update_sha256", "blocked_seq", "secagg_request",
               "secagg_answer", "seed_share_nodes", "key_share_nodes", "prev", "hash")


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at))


def _epsilon_text(entry: Any) -> str:
    from fedpose.federation.report import epsilon_text

    if entry.guarantee is None:
        return "not stated (the site could not read its own state)"
    return epsilon_text(entry.epsilon, entry.delta, entry.guarantee, entry.accountant, entry.protection_unit, entry.adjacency)


def _answer(entry: Any) -> str:
    """The table's reason column: the reason code or error class, or the secure-aggregation stage answered."""
    stage = entry.secagg_stage
    if stage is not None and entry.blocked_seq is None:
        return f"secagg {stage.answer}" + (f" ({stage.refusal})" if stage.refusal else "")
    return entry.reason or entry.error_class or "-"


def _row(entry: Any) -> dict[str, Any]:
    asked, spend, stage = entry.asked, entry.spend, entry.secagg_stage
    return {
        "seq": entry.seq, "at_utc": _utc(entry.at), "site_id": entry.site_id, "run_id": entry.run_id, "round": entry.round,
        "asked_local_steps": asked.local_steps if asked else "", "asked_basis_version": asked.basis_version if asked else "",
        "asked_backbone": asked.model.backbone if asked else "",
        "asked_input_size": "x".join(map(str, asked.model.input_size)) if asked else "",
        "global_sha256": asked.global_sha256 if asked else "",
        "ledger_record_rounds": " ".join(map(str, asked.ledger_record_rounds)) if asked else "",
        "status": entry.status, "reason": entry.reason or "", "error_class": entry.error_class or "",
        "local_steps": entry.local_steps, "guarantee": entry.guarantee or "", "protection_unit": entry.protection_unit or "",
        "delta": "" if entry.delta is None else entry.delta, "accountant": entry.accountant or "",
        "epsilon": "" if entry.epsilon is None else entry.epsilon, "adjacency": entry.adjacency or "",
        "eps_max": "" if entry.eps_max is None else entry.eps_max,
        "epsilon_text": _epsilon_text(entry), "rounds_spent": "" if entry.rounds_spent is None else entry.rounds_spent,
        "noise_multiplier": spend.noise_multiplier if spend else "", "sample_rate": spend.sample_rate if spend else "",
        "steps": spend.steps if spend else "", "update_bytes": entry.update_bytes, "update_sha256": entry.update_sha256 or "",
        "blocked_seq": "" if entry.blocked_seq is None else entry.blocked_seq,
        "secagg_request": stage.request if stage else "", "secagg_answer": stage.answer if stage else "",
        "seed_share_nodes": " ".join(map(str, stage.seed_share_nodes)) if stage else "",
        "key_share_nodes": " ".join(map(str, stage.key_share_nodes)) if stage else "",
        "prev": entry.prev, "hash": entry.hash,
    }


def _report(args: argparse.Namespace) -> int:
    from fedpose.federation.site_audit import AUDIT_FILE, AuditLogError, log_record, read_log, verify

    state_dir: Path = args.state_dir
    path = state_dir / AUDIT_FILE
    if not state_dir.is_dir():
        raise UserError(f"--state-dir {state_dir}: not a directory")
    if not path.exists() and log_record(state_dir) is None:
        raise UserError(f"--state-dir {state_dir}: no audit log ({AUDIT_FILE}); the site has not replied since it started "
                        "keeping one")
    try:
        if args.verify or not path.exists():  # a log the state says it keeps, missing: verify names the loss
            result = verify(state_dir)
            print(f"{path}: {result.entries} entries, hash chain intact; its {result.spends_checked} spends agree with the "
                  "budget and the spend journal")
            if result.restarted_after_loss:
                print("note: this log was begun again after the site's earlier log was lost (its first entry says so); the "
                      "replies before it are not on record here — restore the old log from its outside copy, and compare "
                      "with the coordinator's ledger")
            if result.unlogged_spends:
                rounds = ", ".join(f"run '{r}' round {n}" for r, n in result.unlogged_spends)
                print(f"note: spent in the budget with no logged reply: {rounds} (a site stopped between its spend and its "
                      "reply leaves this; so does a log cut short at its end — compare with the coordinator's ledger)")
            return 0
        entries = read_log(state_dir)
    except AuditLogError as exc:
        raise UserError(str(exc)) from None
    if args.json:
        print_json({"log": str(path), "entries": [{**e.model_dump(mode="json"), "epsilon_text": _epsilon_text(e)}
                                                  for e in entries]})
    elif args.csv:
        writer = csv.DictWriter(sys.stdout, fieldnames=CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(_row(e) for e in entries)
    else:
        sites = sorted({e.site_id for e in entries})
        print(f"audit log of site {', '.join(sites) or '(none)'}: {path}, {len(entries)} replies "
              "(`--verify` checks it; times in UTC)")
        print(f"{'seq':>4}  {'when (UTC)':<19}  {'run':<12} {'round':>5}  {'asked':>5}  {'status':<8} {'reason':<24} "
              f"{'released':>12}  {'update SHA-256':<16}  ε after the round")
        for e in entries:
            print(f"{e.seq:>4}  {_utc(e.at):<19}  {e.run_id:<12} {e.round:>5}  "
                  f"{e.asked.local_steps if e.asked else '-':>5}  {e.status:<8} {_answer(e):<24} "
                  f"{e.update_bytes:>10} B  {(e.update_sha256 or '-')[:16]:<16}  {_epsilon_text(e)}")
    return 0
