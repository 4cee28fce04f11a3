"""``fedpose export``: the publishable artefact of a run — model weights and the privacy report.

    fedpose export runs/train --out release/            # central run (checkpoints/last.pt)
    fedpose export runs/demo/coordinator --out release/ # federation (global.npz + the ledger)

What a run directory holds, and who may see it:

* site-internal (private-data statistics): ``checkpoints/*.pt`` (optimizer state, per-step metrics,
  RNG state and the config's seed), ``metrics.json`` and ``curves.png`` (per-step loss, gradient-norm
  medians, realised batch sizes), ``config.toml``, ``privacy.json`` (may hold the dataset size);
  a site's ``state_dir`` (budget, LDP copy, released update, ``rounds.jsonl``);
* publishable: what this command writes — ``model.pt`` (architecture + weights only; readable by
  ``fedpose eval`` / ``predict``), ``privacy_report.json`` (allow-listed keys, see
  :data:`fedpose.privacy.report.PUBLISHABLE_KEYS`) and ``PRIVACY.txt``.

``best.pt`` is chosen by PCKh on the run's validation split. If that split is private, the choice
itself is a release that no guarantee covers, so ``--checkpoint last`` is the default and exporting
``best`` says so in the report.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fedpose.cli.common import UserError

MODEL_FILE = "model.pt"
REPORT_FILE = "privacy_report.json"
TEXT_FILE = "PRIVACY.txt"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export", help="write the publishable artefact of a run: weights + privacy report, nothing else",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run", type=Path, metavar="RUN_DIR", help="a `fedpose train` run directory, or a coordinator checkpoint dir")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--checkpoint", choices=("last", "best"), default="last",
                        help="central runs: which checkpoint (best = chosen on the validation split; reported as such)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from fedpose.federation.aggregation import load_array_checkpoint

    run_dir: Path = args.run
    if (run_dir / "global.npz").exists():
        model, report = _federation(run_dir, load_array_checkpoint)
    elif (run_dir / "checkpoints").is_dir():
        model, report = _central(run_dir, args.checkpoint)
    else:
        raise UserError(f"export: {run_dir} is neither a `fedpose train` run directory (checkpoints/) nor a coordinator dir (global.npz)")
    return _write(args.out, model, report)


def _central(run_dir: Path, which: str) -> tuple[Any, dict[str, Any]]:
    from fedpose.model import CheckpointError, model_from_checkpoint
    from fedpose.privacy.report import publishable_report

    path = run_dir / "checkpoints" / f"{which}.pt"
    if not path.exists():
        raise UserError(f"export: {path} does not exist")
    privacy_path = run_dir / "privacy.json"
    try:
        privacy = json.loads(privacy_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"export: cannot read {privacy_path} ({exc}); a model is never exported without its privacy report") from None
    try:
        model, checkpoint = model_from_checkpoint(path)
    except CheckpointError as exc:
        raise UserError(f"export: {exc}") from None
    report = {"source": "central training", **publishable_report(privacy)}
    config = checkpoint.get("config") or {}
    if which == "best":
        val = (config.get("data") or {}).get("val")
        report["model_selection"] = (f"best validation PCKh on {val}: the selection used that split and is NOT covered "
                                     "by the guarantee unless the split is public")
    else:
        report["model_selection"] = "last checkpoint (no selection on data)"
    return model, report


def _federation(run_dir: Path, load_array_checkpoint: Any) -> tuple[Any, dict[str, Any]]:
    import numpy as np
    import torch

    from fedpose.model import build_model_from_spec
    from fedpose.privacy.report import format_epsilon

    arrays, meta = load_array_checkpoint(run_dir / "global.npz")
    spec = (meta.get("state") or {}).get("model_spec")
    if not spec:
        raise UserError(f"export: {run_dir / 'global.npz'} holds no model spec")
    model = build_model_from_spec(spec)
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in arrays.items()})
    report_path = run_dir / "report.json"
    try:
        summary = json.loads(report_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"export: cannot read {report_path} ({exc}); a model is never exported without its privacy report") from None
    sites = []
    for site in summary.get("sites", []):
        epsilon, delta, guarantee = site.get("epsilon"), site.get("delta"), site.get("guarantee")
        sites.append({"site_id": site["site_id"], "guarantee": guarantee, "epsilon": epsilon, "delta": delta, "accountant": "rdp",
                      "epsilon_text": format_epsilon(float("inf") if epsilon is None else epsilon, delta or 0.0, guarantee or "none"),
                      "rounds_joined": site.get("rounds_joined")})
    report = {"source": "federation", "run_id": summary.get("run_id"), "sites": sites,
              "guarantee_statement": "each site's guarantee is about its own records, composed over every local step of every round it joined",
              "model_selection": "global model after the last round (no selection on data)"}
    return model, report


def _write(out: Path, model: Any, report: dict[str, Any]) -> int:
    from fedpose.io import atomic_write_json, atomic_write_text
    from fedpose.model.checkpoint import save_weights_only
    from fedpose.privacy.report import describe

    out.mkdir(parents=True, exist_ok=True)
    save_weights_only(out / MODEL_FILE, model, extra={"privacy": report})
    atomic_write_json(out / REPORT_FILE, report)
    if report.get("source") == "federation":
        lines = [f"federated run {report.get('run_id')}: {report['guarantee_statement']}"]
        lines += [f"  {s['site_id']}: {s['epsilon_text']}" for s in report["sites"]]
    else:
        lines = [describe(report)]
    lines.append(f"model selection: {report['model_selection']}")
    atomic_write_text(out / TEXT_FILE, "\n".join(lines) + "\n")
    print(f"exported {out / MODEL_FILE}, {out / REPORT_FILE}, {out / TEXT_FILE}")
    return 0
