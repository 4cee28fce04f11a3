"""``fedpose export``: the publishable artefact of a run — model weights and the privacy report.

    fedpose export runs/train --out release/                         # central run (checkpoints/last.pt)
    fedpose export runs/train/checkpoints/best.pt --out release/     # one checkpoint file
    fedpose export runs/demo/coordinator --out release/              # federation (global.npz + the ledger)
    fedpose export runs/demo/coordinator --out release/ --dtype float16   # the same, weights in half the bytes

What a run directory holds, and who may see it:

* site-internal (private-data statistics): ``checkpoints/*.pt`` (optimizer state, per-step metrics,
  RNG state and the config's seed), ``metrics.json`` and ``curves.png`` (per-step loss, gradient-norm
  medians, realised batch sizes), ``config.toml``, ``privacy.json`` (may hold the dataset size and
  the accountant's state); a site's ``state_dir`` (budget, LDP copy, released update,
  ``rounds.jsonl``); a coordinator's ``report.json``, ``history.json`` and ``ledger.sqlite`` are
  operator records;
* publishable: what this command writes — ``model.safetensors`` (architecture in its metadata +
  weights only, no pickle: safe to open; read by ``fedpose eval`` / ``predict``), ``MODEL_CARD.md``
  (architecture, training data by site and protection unit, each guarantee, evaluation, intended
  use, limits), ``privacy_report.json`` (allow-listed keys, see
  :data:`fedpose.privacy.report.PUBLISHABLE_KEYS` and :data:`PUBLISHABLE_SECTION_KEYS`; seeds
  withheld) and ``PRIVACY.txt``. Nothing in them names a path, host or user.

``--eval-data`` scores the exported weights on a dataset for the model card. Use a public test set:
a score on private data is itself a release that no guarantee covers (the card says which it was).

``best.pt`` is chosen by PCKh on the run's validation split. If that split is private, the choice
itself is a release that no guarantee covers, so ``--checkpoint last`` is the default and exporting
``best`` says so in the report.

The reported ε must cover the exported weights: an export whose privacy record is older than the
model (a run stopped between writing the two) is refused rather than understating the spend.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from fedpose.cli.common import UserError
from fedpose.federation.global_model import GLOBAL_CHECKPOINT, GlobalModelError, load_global_model

MODEL_FILE = "model.safetensors"
CARD_FILE = "MODEL_CARD.md"
REPORT_FILE = "privacy_report.json"
TEXT_FILE = "PRIVACY.txt"
EXPORTED_FILES = (MODEL_FILE, CARD_FILE, REPORT_FILE, TEXT_FILE)
#: what exports before safetensors wrote (a pickle-based checkpoint): replaced, never kept beside the new model
LEGACY_MODEL_FILE = "model.pt"
COORDINATOR_REPORT = "report.json"  # fedpose.federation.report.REPORT_FILE
DEFAULT_LEDGER = "ledger.sqlite"  # the coordinator's default ledger_db, inside its checkpoint_dir

#: Nested sections of an engine privacy report that may be published, key by key: how the guarantee
#: was computed from declared, public values (the basis comes from public data, the view map and
#: the LDP settings are configuration).
PUBLISHABLE_SECTION_KEYS: dict[str, frozenset[str]] = {
    "basis": frozenset({"k", "public_samples", "refresh_every", "dtype", "source", "refreshes", "current_k", "current_version"}),
    "public_view": frozenset({
        "map", "factor", "bits", "kernel_size", "sigma", "many_to_one", "computed", "protects", "region", "margin", "fill", "covers",
    }),
    # the fixed step shape: public settings (slots, rows), η and N_max — a function of q and the slots
    "fixed_shape": frozenset({"max_batch_units", "rows_per_unit", "augmentations_per_record", "rows_per_step",
                              "overflow_probability_per_step", "max_units", "statement"}),
    "input_privacy": frozenset({
        "mechanism", "guarantee", "guarantee_statement", "guarantee_void", "epsilon_total", "epsilon_realized", "delta",
        "accountant", "unit_protected", "epsilon_per_original_pixel", "block_note", "public", "ll_prune", "ll_offset",
        "allocation", "budgets", "randomness", "cryptographically_secure", "scope",
    }),
}
#: Keys of a federated export's per-site entries.
SITE_KEYS = frozenset({"site_id", "guarantee", "protection_unit", "neighbouring_relation", "epsilon", "delta", "accountant",
                       "epsilon_text", "rounds_joined", "protected_part", "treated_as_public", "spends",
                       "round", "noise_multiplier", "sample_rate", "steps",
                       # a site's LDP-Slicing on its inputs (its declared settings): a guarantee beside its DP one
                       "input_privacy", "mechanism", "epsilon_total", "epsilon_per_original_pixel", "ll_prune"})
#: Keys this command adds around the engine report.
EXPORT_KEYS = frozenset({"source", "model_selection", "run_id", "sites"})

# A seeded (test-only) noise source names its seed in its description; whoever knows it can
# regenerate and subtract the noise, so it is withheld even though such a run claims nothing.
_SEED_VALUE = re.compile(r"\bseed\s*[=:]?\s*-?\d+")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export", help="write the publishable artefact of a run: weights + privacy report, nothing else",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run", type=Path, metavar="RUN_DIR_OR_CHECKPOINT",
                        help="a `fedpose train` run directory or one of its checkpoints/*.pt, "
                             "or a coordinator checkpoint dir or its global.npz")
    parser.add_argument("--out", type=Path, required=True, help="output directory (new, or holding an earlier export only)")
    parser.add_argument("--checkpoint", choices=("last", "best"), default=None,
                        help="central run directories: which checkpoint (default last; best = chosen on the validation "
                             "split, reported as such)")
    parser.add_argument("--eval-data", type=Path, default=None,
                        help="score the exported model (PCKh) on this dataset for the model card; use a public test set "
                             "(a score on private data is a release no guarantee covers)")
    parser.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                        help="how the weights are stored: float16 halves the file; the model card's score (--eval-data) "
                             "is then of the rounded weights, as published")
    parser.add_argument("--eval-name", default="the evaluation set given at export",
                        help="how the model card names --eval-data (never its path), e.g. 'MPII validation (public)'")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    source: Path = args.run
    if source.is_file() and source.name == GLOBAL_CHECKPOINT:
        source = source.parent
    if source.is_dir() and (source / GLOBAL_CHECKPOINT).exists():
        if args.checkpoint == "best":
            raise UserError(f"export: {source} is a federation: its only model is {GLOBAL_CHECKPOINT} (there is no 'best')")
        model, report = _federation(source)
    elif source.is_file() and source.suffix == ".pt":
        if args.checkpoint is not None:
            raise UserError(f"export: --checkpoint chooses a file inside a run directory; {source} already is one")
        if source.parent.name != "checkpoints":
            raise UserError(f"export: {source} is not inside a run's checkpoints/ directory (its privacy.json is beside it)")
        model, report = _central(source.parent.parent, source)
    elif source.is_dir() and (source / "checkpoints").is_dir():
        model, report = _central(source, source / "checkpoints" / f"{args.checkpoint or 'last'}.pt")
    else:
        raise UserError(f"export: {source} is neither a `fedpose train` run directory (checkpoints/) or checkpoint, "
                        f"nor a coordinator dir ({GLOBAL_CHECKPOINT})")
    if args.eval_data is not None and not args.eval_data.exists():
        raise UserError(f"export: --eval-data {args.eval_data} does not exist")
    half = args.dtype == "float16"
    if half:  # round first: the card scores, and eval later reads, exactly the weights published
        from fedpose.model.checkpoint import half_precision_state

        try:
            model.load_state_dict(half_precision_state(model))
        except ValueError as exc:
            raise UserError(f"export --dtype float16: {source}: {exc}") from None
    evaluation = _evaluate(model, args.eval_data, args.eval_name) if args.eval_data is not None else None
    return _write(args.out, model, _withhold_machine_local(_withhold_seeds(report)), evaluation, half)


def _central(run_dir: Path, path: Path) -> tuple[Any, dict[str, Any]]:
    from fedpose.model import CheckpointError, model_from_checkpoint
    from fedpose.privacy.report import publishable_report

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
    step, covered = int(checkpoint.get("step") or 0), privacy.get("steps")
    if not isinstance(covered, int) or covered < step:
        # central.py writes the checkpoint first, then privacy.json: a run stopped in between
        raise UserError(
            f"export: {privacy_path} covers {covered} training steps but {path} was saved at step {step}: the run "
            "stopped between writing them, and exporting would understate ε. Resume the run "
            f"(`fedpose train --resume {run_dir}`) so that privacy.json is rewritten with its next checkpoint."
        )
    report = {"source": "central training", **_publishable_sections(publishable_report(privacy))}
    if path.stem == "best":
        # the split is named by its role, never by its path (hospital paths carry study and patient names)
        report["model_selection"] = ("best validation PCKh on the run's validation split (data.val): the selection used "
                                     "that split and is NOT covered by the guarantee unless the split is public")
    elif path.stem == "last":
        report["model_selection"] = "last checkpoint (no selection on data)"
    else:
        report["model_selection"] = f"checkpoint {path.name} at step {step}, chosen by the operator (not by a score on data)"
    return model, report


def _publishable_sections(report: dict[str, Any]) -> dict[str, Any]:
    """Nested sections reduced to their allow-listed keys (the top level is already allow-listed)."""
    from fedpose.privacy.ldp_slicing import CHANNELS

    out = dict(report)
    for section, allowed in PUBLISHABLE_SECTION_KEYS.items():
        if isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items() if k in allowed}
    budgets = (out.get("input_privacy") or {}).get("budgets")
    if isinstance(budgets, dict):  # per-channel ε of the LDP allocation (configuration), nothing else
        out["input_privacy"]["budgets"] = {c: v for c, v in budgets.items() if c in CHANNELS}
    return out


def _withhold_seeds(value: Any) -> Any:
    if isinstance(value, str):
        return _SEED_VALUE.sub("seed withheld", value)
    if isinstance(value, dict):
        return {key: _withhold_seeds(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_withhold_seeds(item) for item in value]
    return value


#: An absolute path (POSIX, ~/…, or a Windows drive) inside a text: machine-local, never published.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~])(?:~|[A-Za-z]:[\\/]|/)[^\s'\"(),;]*[^\s'\"(),;.:]")
MACHINE_LOCAL = "<machine-local value withheld>"


def _machine_local_words() -> list[str]:
    """This machine's host and user names (paths in hospitals also carry study and patient names)."""
    import getpass
    import socket

    words = []
    for get in (socket.gethostname, getpass.getuser):
        try:
            word = get()
        except Exception:  # no user name in some containers: nothing to withhold
            continue
        # "a" or "ci" would mangle ordinary words; "root" names nobody
        if word and len(word) >= 3 and word != "root":
            words.append(word)
    return words


def _withhold_machine_local(value: Any, words: list[str] | None = None) -> Any:
    """Every string with absolute paths, this host's name and this user's name replaced. The report
    is built from allow-listed keys already; this is the last line for text that names a place."""
    words = _machine_local_words() if words is None else words
    if isinstance(value, str):
        value = _ABSOLUTE_PATH.sub(MACHINE_LOCAL, value)
        for word in words:
            value = re.sub(rf"(?<![\w-]){re.escape(word)}(?![\w-])", MACHINE_LOCAL, value)
        return value
    if isinstance(value, dict):
        return {key: _withhold_machine_local(item, words) for key, item in value.items()}
    if isinstance(value, list):
        return [_withhold_machine_local(item, words) for item in value]
    return value


def _federation(coordinator_dir: Path) -> tuple[Any, dict[str, Any]]:
    from fedpose.federation.report import epsilon_text
    from fedpose.privacy.report import GUARANTEES

    try:
        federated = load_global_model(coordinator_dir)
    except GlobalModelError as exc:
        raise UserError(f"export: {exc}") from None
    model, model_round, checkpoint = federated.model, federated.round, federated.path
    summaries, recorded_round, record, spends = _site_summaries(coordinator_dir, federated.run_id)
    if recorded_round < model_round:
        # report.json is written when a run finishes: one that stopped early has an older one
        raise UserError(
            f"export: {record} records rounds up to {recorded_round}, but {checkpoint} is the model after round "
            f"{model_round}: the sites' ε would be understated. Resume the run to completion, or keep the ledger "
            f"({DEFAULT_LEDGER}) beside {GLOBAL_CHECKPOINT}."
        )
    sites = [{
        "site_id": s["site_id"], "guarantee": s.get("guarantee"), "epsilon": s.get("epsilon"), "delta": s.get("delta"),
        "accountant": s.get("accountant") or "rdp", "rounds_joined": s.get("rounds_joined"),
        "protection_unit": s.get("unit") or "record",  # summaries from before units: record-level
        # the relation the site reported its ε under (a ledger from before it: the guarantee's own)
        "neighbouring_relation": s.get("adjacency") or (GUARANTEES[s["guarantee"]].relation
                                                        if s.get("guarantee") in set(GUARANTEES) - {"none"} else None),
        "epsilon_text": epsilon_text(s.get("epsilon"), s.get("delta"), s.get("guarantee"), s.get("accountant") or "rdp",
                                     s.get("unit"), s.get("adjacency")),
        **_protected_part(s.get("guarantee"), s.get("unit") or "record"),
        # the accountant's inputs per round (declared σ, q, steps: public values), so ε can be recomputed
        **({"spends": [{"round": r, "noise_multiplier": sigma, "sample_rate": q, "steps": steps}
                       for r, sigma, q, steps in spends[s["site_id"]]]} if s["site_id"] in spends else {}),
        **_input_privacy(s),
    } for s in summaries]
    report = {"source": "federation", "run_id": federated.run_id or None, "sites": sites,
              "guarantee_statement": "each site's guarantee is about its own protection units (protection_unit: record, image or patient), composed over every local step of every round it spent on (its spends: a round that failed after its spend counts, though it released no update)",
              "model_selection": f"{federated.describe()} (no selection on data)"}
    return model, report


def _input_privacy(summary: dict[str, Any]) -> dict[str, Any]:
    """A site's LDP-Slicing statement on its inputs, as its latest report gave it (empty: none)."""
    from fedpose.federation.protocol import InputPrivacyStatement
    from fedpose.privacy.report import input_privacy_text

    if summary.get("input_ldp_epsilon") is None:
        return {}
    statement = InputPrivacyStatement(mechanism="ldp-slicing", epsilon_total=summary["input_ldp_epsilon"],
                                      ll_prune=bool(summary.get("input_ldp_ll_prune")))
    return {"input_privacy": {**statement.model_dump(), "guarantee": "LDP", "delta": 0.0, "accountant": "pure composition",
                              "epsilon_per_original_pixel": statement.epsilon_per_original_pixel,
                              "epsilon_text": input_privacy_text(statement.epsilon_total, statement.ll_prune)}}


def _protected_part(guarantee: str | None, unit: str) -> dict[str, str]:
    """What a site's guarantee protects of a unit, and what it treats as public: all of the unit and
    nothing under DP; under FDP / MaskDP only part of it, the rest (ψ(x), the keypoints, the crop
    outside the masked heads) unprotected — a reader of the ε must see that beside it."""
    from fedpose.privacy.report import GUARANTEES, protected_unit_text

    if guarantee not in GUARANTEES or guarantee == "none":
        return {}
    known = GUARANTEES[guarantee]
    return {"protected_part": protected_unit_text(known, unit), "treated_as_public": known.public}


def _site_summaries(coordinator_dir: Path, run_id: str | None) -> tuple[list[dict[str, Any]], int, Path, dict[str, list]]:
    """(per-site summaries, last round they cover, the file they come from, each site's spends in
    ``run_id`` by round): the ledger when it is in the coordinator dir (written before every global
    checkpoint), else the final report.json (which holds no spends)."""
    from dataclasses import asdict

    from fedpose.federation.ledger import BudgetLedger, LedgerError

    ledger_path = coordinator_dir / DEFAULT_LEDGER
    if ledger_path.exists():
        try:
            with BudgetLedger(ledger_path, read_only=True) as ledger:
                return ([asdict(s) for s in ledger.site_summaries()], ledger.last_round(), ledger_path,
                        ledger.spend_events(run_id) if run_id else {})
        except LedgerError as exc:
            raise UserError(f"export: {exc}") from None
    report_path = coordinator_dir / COORDINATOR_REPORT
    try:
        summary = json.loads(report_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"export: cannot read {report_path} ({exc}) and there is no {ledger_path}; a model is never "
                        "exported without its privacy report") from None
    rounds = [int(r["round"]) for r in summary.get("rounds", []) if isinstance(r, dict) and "round" in r]
    return list(summary.get("sites", [])), max(rounds, default=int(summary.get("rounds_completed") or 0)), report_path, {}


def _evaluate(model: Any, data: Path, name: str) -> dict[str, Any]:
    """PCKh of the exported weights on ``data``, for the model card (named by ``name``, never by path)."""
    from fedpose.data.dataset import PoseDataset, load_records
    from fedpose.train.evaluate import evaluate

    records, root = load_records(data)
    if not records:
        raise UserError(f"export: --eval-data {data} has no records")
    try:
        scores = evaluate(model.cpu(), PoseDataset(records, root, input_size=model.input_size, train=False), batch_size=16)
    except ValueError as exc:
        raise UserError(f"export: --eval-data {data}: {exc}") from None
    return {"name": name, **scores}


def model_card(model: Any, report: dict[str, Any], evaluation: dict[str, Any] | None, half: bool = False) -> str:
    """``MODEL_CARD.md``: what a hospital receiving the model needs to judge it. Built from the
    model spec, the publishable report and the operator's evaluation only; every ε with its
    guarantee, δ, unit and accountant (``epsilon_text``)."""
    import math

    from fedpose.joints import JOINT_NAMES
    from fedpose.model.checkpoint import model_spec

    spec = model_spec(model)
    parameters = sum(p.numel() for p in model.parameters())
    lines = ["# Model card", "",
             "A 2D human-pose estimator (16 MPII joints) trained with differential privacy by fedpose.", "",
             "## Architecture", "",
             f"- backbone `{spec.backbone}` ({spec.scenario}"
             f"{f': rank-{spec.lora_rank} adapters, α {spec.lora_alpha:g}, kept apart from the weights they adapt' if spec.lora_rank else ''}), SimCC head (split factor {spec.split_factor}, label σ "
             f"{spec.label_sigma:g}{f', hidden {spec.head_hidden}' if spec.head_hidden else ''}), {parameters:,} parameters",
             f"- input: one person crop of {spec.input_size[1]}×{spec.input_size[0]} pixels (width × height); output: "
             f"{len(JOINT_NAMES)} joints ({', '.join(JOINT_NAMES)}) with a confidence each",
             f"- file: `{MODEL_FILE}` (safetensors: tensors and a metadata map, no pickle; the model spec is in its metadata"
             f"{'; weights stored as float16' if half else ''}). "
             "Read by `fedpose eval --checkpoint DIR` and `fedpose predict --checkpoint DIR`.", "",
             "## Training data and privacy guarantees", ""]
    federated = report.get("source") == "federation"
    # FDP / MaskDP: part of each unit is public
    partial_sites = [s for s in report.get("sites", []) if s.get("guarantee") not in ("DP", "none", None)]
    partial = bool(partial_sites) if federated else report.get("guarantee") not in ("DP", "none", None)
    if federated:
        lines += [f"Federated run `{report.get('run_id')}`; {report['guarantee_statement']}.", "",
                  "| site | protection unit | rounds joined (update used) | rounds spent | guarantee |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {s['site_id']} | {s.get('protection_unit') or 'record'} | {s.get('rounds_joined')} | "
                  f"{len(s['spends']) if 'spends' in s else 'not recorded'} | {s['epsilon_text']} |" for s in report.get("sites", [])]
        ldp_sites = [s for s in report.get("sites", []) if s.get("input_privacy")]
        if ldp_sites:
            lines += ["", "Sites whose training images were locally privatized before training (a guarantee of its own):", ""]
            lines += [f"- {s['site_id']}: {s['input_privacy']['epsilon_text']}" for s in ldp_sites]
        if partial_sites:
            lines += ["", "Sites whose guarantee protects only part of each unit:", ""]
            lines += [f"- {s['site_id']} ({s['guarantee']}): protects {s.get('protected_part')}; treated as public, "
                      f"not protected: {s.get('treated_as_public')}" for s in partial_sites]
    else:
        lines += [f"Central training by one data holder, mechanism `{report.get('mechanism')}`.", "",
                  f"- guarantee: {report.get('epsilon_text')}",
                  f"- protection unit: {report.get('protection_unit', 'record')}; unit protected: {report.get('unit_protected')}",
                  f"- adjacency: {report.get('adjacency', report.get('neighbouring_relation'))}; "
                  f"treated as public: {report.get('public')}"]
        if report.get("guarantee_void"):
            lines.append("- **the guarantee is void**: the noise was seeded (a test run) and can be regenerated")
    lines += ["", f"Model selection: {report['model_selection']}.", "",
              f"`{REPORT_FILE}` and `{TEXT_FILE}` beside this card hold "
              + ("each site's guarantee, what it protects and treats as public, and its spends per round (σ, q, steps) "
                 "where the coordinator's ledger holds them." if federated else "the full privacy report."),
              "", "## Evaluation", ""]
    if evaluation is None:
        lines.append("Not evaluated at export. Score it on a public test set: `fedpose eval --checkpoint DIR --data TEST_SET`.")
    else:
        def score(key: str) -> str:
            return "n/a" if math.isnan(evaluation[key]) else f"{evaluation[key]:.2f}"

        keys = ("Head", "Shoulder", "Elbow", "Wrist", "Hip", "Knee", "Ankle", "Mean", "Mean@0.1")
        lines += [f"PCKh@0.5 on {evaluation['name']} ({evaluation['samples']} people, MPII protocol, head boxes, flip test: "
                  "each crop's and its mirror's predictions averaged; Mean@0.1 is PCKh@0.1):", "",
                  "| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys), "| " + " | ".join(score(k) for k in keys) + " |", "",
                  "A score on a private set is itself a release no guarantee above covers; publish scores on public data."]
    lines += ["", "## Intended use", "",
              "Research and development of 2D pose estimation on single-person crops similar to the training data "
              "(MPII-style images, the person roughly centred). Not a medical device: not for diagnosis or for "
              "decisions about an individual patient.", "",
              "## Limits", "",
              "- Differential privacy bounds what the weights reveal about one protection unit (record, image or "
              "patient, per site above) to the stated (ε, δ) under the stated accountant; it says nothing about "
              "units a site did not protect, about a site's participation in the run, or about its dataset size "
              "beyond DP resolution." + (" Under FDP or MaskDP the bound covers only the protected part of a unit: "
                                         "what such a guarantee treats as public (above) is not protected, and the "
                                         "weights may reveal it." if partial else ""),
              "- DP noise costs accuracy: expect lower PCKh than a non-private model of the same size, and worse on "
              "poses, people and image sources rare in the training data.",
              "- The model takes the whole input as the person box; multi-person images need a person detector first."]
    return "\n".join(lines) + "\n"


def _write(out: Path, model: Any, report: dict[str, Any], evaluation: dict[str, Any] | None = None, half: bool = False) -> int:
    from fedpose.io import atomic_write_json, atomic_write_text
    from fedpose.model.checkpoint import save_safetensors
    from fedpose.privacy.report import describe, describe_federation

    # Only ever the export's files: never mixed into a run directory or beside other artefacts.
    known = (*EXPORTED_FILES, LEGACY_MODEL_FILE)
    if out.exists() and (not out.is_dir() or any(p.name not in known for p in out.iterdir())):
        raise UserError(f"export: {out} exists and holds other files; the export goes to a new directory (or replaces an earlier export)")
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(out / MODEL_FILE, model, half=half)
    (out / LEGACY_MODEL_FILE).unlink(missing_ok=True)  # an earlier export's pickle checkpoint: not beside the new model
    atomic_write_text(out / CARD_FILE, _withhold_machine_local(model_card(model, report, evaluation, half)))
    atomic_write_json(out / REPORT_FILE, report)
    if report.get("source") == "federation":
        text = describe_federation(report)
    else:
        text = f"{describe(report)}\nmodel selection: {report['model_selection']}"
    atomic_write_text(out / TEXT_FILE, text + "\n")
    print(f"exported {out / MODEL_FILE}, {out / CARD_FILE}, {out / REPORT_FILE}, {out / TEXT_FILE}")
    return 0
