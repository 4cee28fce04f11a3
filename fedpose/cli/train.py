"""``fedpose train``: central training run (non-private or with a DP mechanism)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedpose.cli.common import UserError, examples, print_json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train the pose model on one dataset (central run; checkpoints, metrics, privacy report)",
        description=(
            "Train TinyViT + SimCC on data.train with the configured privacy mechanism, validating "
            "PCKh on data.val every train.eval_every steps. Writes config.toml, metrics.json, "
            "curves.png, privacy.json and checkpoints/{last,best}.pt to train.out_dir. "
            "--resume continues a run from its last checkpoint (its saved config, plus --set), writing into the "
            "run directory it is resumed from."
        ),
    )
    parser.add_argument("--config", type=Path, help="TOML config file (see configs/); not needed with --resume")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.steps=100 (repeatable)",
    )
    parser.add_argument("--resume", type=Path, metavar="RUN_DIR_OR_CHECKPOINT",
                        help="continue a run (run directory or checkpoint file)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the final summary as one JSON object on stdout (the log goes to stderr)")
    parser.epilog = examples(
        'fedpose train --config configs/central.toml',
        'fedpose train --config configs/central.toml --set train.steps=200 --set privacy.target_epsilon=4',
        'fedpose train --resume runs/train --set train.steps=400   # continue in runs/train',
        'fedpose train --config C --json > summary.json   # log on stderr',
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from fedpose.config import load_config

    if args.config is None and args.resume is None:
        raise UserError("train: give --config FILE (or --resume RUN_DIR to continue a run)")
    if args.config is not None and args.resume is not None:
        raise UserError("train: --resume uses the run's saved config; change it with --set, not --config")
    if args.config is not None:
        load_config(args.config, args.overrides)  # fail fast on config errors, before importing torch

    from fedpose.model import CheckpointError, load_checkpoint
    from fedpose.privacy.input_privacy import InputPrivacyError
    from fedpose.train.central import config_from_checkpoint, resolve_resume, resume_run_dir, run_training

    try:
        if args.resume is not None:
            # the run continues where it is resumed from, never in the out_dir saved in the checkpoint
            cfg = config_from_checkpoint(load_checkpoint(resolve_resume(args.resume)), args.overrides,
                                         run_dir=resume_run_dir(args.resume))
        else:
            cfg = load_config(args.config, args.overrides)
        # with --json, stdout is the one JSON document: the run's log goes to stderr with the progress bar
        log = (lambda line: print(line, file=sys.stderr)) if args.json else print
        summary = run_training(cfg, resume=args.resume, progress=not args.quiet, log=log)
    except (CheckpointError, InputPrivacyError) as exc:
        raise UserError(str(exc)) from None
    except ValueError as exc:
        # configuration problems detected while building the model / engine (they name the key)
        raise UserError(str(exc)) from None
    if args.json:
        print_json(summary)
    return 0
