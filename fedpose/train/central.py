"""A central (non-federated) training run: what ``fedpose train`` does.

Run directory (``train.out_dir``)::

    config.toml        the resolved configuration (defaults filled in)
    metrics.json       {"train": [per-step records], "val": [periodic validation PCKh],
                        "divergence": [where the loss began to blow up, see DivergenceMonitor],
                        "privacy": the ε text, "NO PRIVACY GUARANTEE (seeded test noise): …" under
                        privacy.insecure_seeded_noise, "device": where it ran (train.device)}
    curves.png         training loss and validation PCKh
    privacy.json       the engine's privacy report (for "none": no guarantee)
    checkpoints/last.pt, checkpoints/best.pt (best validation PCKh Mean)

Resume (``--resume RUN_DIR`` or a checkpoint file) restores model, optimizer, schedule, step,
metrics, RNG state and the privacy ledger. For mechanism "none" the batch and augmentation
stream is replayed to the checkpointed position, so a resumed run continues exactly as an
uninterrupted one. For DP mechanisms the accountant continues from the checkpoint; noise and
sampling coins come from a CSPRNG keyed from OS entropy whose key is never saved, so a resumed run
draws fresh noise. A private step's augmentations come from the same CSPRNG (a seed per row); under
the test-only ``privacy.insecure_seeded_noise`` noise, coins and those seeds draw from a fresh stream
seeded by (seed, step): replaying a seeded noise stream would reuse noise already spent.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from fedpose.config import ConfigError, RunConfig, validate
from fedpose.io import atomic_write_json, atomic_write_text
from fedpose.model import build_model, load_checkpoint, save_checkpoint
from fedpose.model.checkpoint import restore_rng_state
from fedpose.privacy.csprng import SEEDED_NO_GUARANTEE
from fedpose.privacy.mechanisms import get_mechanism
from fedpose.runtime import configure_device, describe_device, resolve_device
from fedpose.train.evaluate import evaluate
from fedpose.train.loop import DivergenceMonitor, calibrate_batch_norm, describe_divergence, train_steps
from fedpose.train.optim import build_optimizer, build_scheduler

CHECKPOINT_DIR = "checkpoints"
LAST = "last.pt"
BEST = "best.pt"
STREAM_STRIDE = 1_000_003  # fresh (seed, step) streams for resumed DP runs


# ----------------------------------------------------------------------------- config file
def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if not isinstance(value, float) or math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def to_toml(data: dict[str, Any], table: str = "") -> str:
    """Nested dict of scalars/lists → TOML; None values are omitted (they mean 'unset')."""
    lines = [f"[{table}]"] if table else []
    lines += [f"{k} = {_toml_value(v)}" for k, v in data.items() if v is not None and not isinstance(v, dict)]
    for key, value in data.items():
        if isinstance(value, dict):
            lines += ["", to_toml(value, f"{table}.{key}" if table else key).rstrip("\n")]
    return "\n".join(lines).lstrip("\n") + "\n"


# ----------------------------------------------------------------------------- resume
def resolve_resume(path: str | Path) -> Path:
    """RUN_DIR → RUN_DIR/checkpoints/last.pt; a file is used as is."""
    path = Path(path)
    if path.is_dir():
        candidate = path / CHECKPOINT_DIR / LAST
        if not candidate.exists():
            raise FileNotFoundError(f"--resume {path}: no {CHECKPOINT_DIR}/{LAST} in this run directory")
        return candidate
    if not path.exists():
        raise FileNotFoundError(f"--resume {path}: no such run directory or checkpoint")
    return path


def refuse_rewinding_the_spend(run_dir: Path, start_step: int, resume: str | Path) -> None:
    """A DP run resumes only from its latest spend: a checkpoint behind the steps its privacy.json
    holds (``best.pt``, an older copy) would restore that checkpoint's ledger and drop the later
    steps from ε — steps whose outputs chose ``best.pt`` in the first place."""
    try:
        spent = json.loads((run_dir / "privacy.json").read_text())
    except (OSError, ValueError):
        return  # no report yet (a run stopped before its first checkpoint): nothing to rewind
    steps = spent.get("steps") if spent.get("guarantee") not in (None, "none") else None
    if isinstance(steps, int) and steps > start_step:
        raise ConfigError(
            f"--resume {resume}: this checkpoint is at step {start_step}, but {run_dir / 'privacy.json'} holds {steps} DP "
            f"steps already spent: resuming from it would drop steps {start_step + 1}–{steps} from ε. Resume the run's "
            f"latest checkpoint (--resume {run_dir})")


def resume_run_dir(path: str | Path) -> Path:
    """The directory a resumed run continues in: the run directory given, or the one holding the
    checkpoint file given (RUN_DIR/checkpoints/X.pt). Never the ``train.out_dir`` saved in the
    checkpoint: a copied run resumed there would write into the original."""
    path = Path(path)
    if path.is_dir():
        return path
    if path.parent.name == CHECKPOINT_DIR:
        return path.parent.parent
    raise ConfigError(
        f"--resume {path}: this checkpoint is not inside a run's {CHECKPOINT_DIR}/ directory, so there is no run "
        f"directory to continue in (a resumed run writes where its checkpoint is); put it at "
        f"RUN_DIR/{CHECKPOINT_DIR}/{LAST} and resume RUN_DIR"
    )


def config_from_checkpoint(
    checkpoint: dict[str, Any], overrides: list[str] | None = None, run_dir: str | Path | None = None
) -> RunConfig:
    """The checkpoint's configuration plus ``overrides``; ``run_dir`` (see :func:`resume_run_dir`)
    replaces the saved ``train.out_dir``, so the run continues where it was resumed from."""
    from fedpose.config import apply_overrides

    if not isinstance(checkpoint.get("config"), dict):
        raise ConfigError("the checkpoint holds no run configuration (was it written by fedpose train?)")
    raw = dict(checkpoint["config"])
    if run_dir is not None:
        raw["train"] = {**(raw.get("train") or {}), "out_dir": str(run_dir)}
    raw = apply_overrides(raw, overrides or [])
    return validate(RunConfig, raw, "the checkpoint's config", overrides)


class _ReplayableDataset(Dataset):
    """Wraps the training set so the batch stream can be fast-forwarded without decoding images:
    while ``replaying``, an item only draws its augmentation (advancing the same RNG)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.replaying = False

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.replaying:
            draw = getattr(self.dataset, "augmentation", None)
            if draw is not None:
                draw()
            return {"index": int(index)}
        return self.dataset[index]

    def load(self, index: int, rng: Any) -> dict[str, Any]:
        """A private step's row (:func:`fedpose.privacy.engine.load_rows`), its augmentation drawn
        from ``rng``: private runs never replay (fresh coins and noise on resume)."""
        load = getattr(self.dataset, "load", None)
        return self.dataset[index] if load is None else load(index, rng)


# ----------------------------------------------------------------------------- the run
@dataclass
class RunState:
    step: int = 0
    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)
    best: float = -math.inf
    #: DivergenceMonitor events (each the step a divergence began), recorded in metrics.json
    divergence: list[dict[str, Any]] = field(default_factory=list)

    def metrics(self) -> dict[str, Any]:
        return {"train": self.train, "val": self.val, "best_val_mean": None if self.best == -math.inf else self.best,
                "divergence": self.divergence}


def _load_dataset(path: Path, cfg: RunConfig, train: bool, seed: int, with_public_view: bool = False) -> Any:
    """``with_public_view``: the training set of FDP / FP-DP also computes ψ(x) (before augmentation),
    MaskDP's decodes every image at full size (see :func:`~fedpose.privacy.public_views.dataset_view_options`)."""
    from fedpose.data.dataset import PoseDataset, load_records
    from fedpose.privacy.public_views import dataset_view_options

    records, root = load_records(path)
    if not records:
        raise ConfigError(f"{path}: the dataset has no records")
    if train and get_mechanism(cfg.privacy.mechanism).noisy:
        # units and MaskDP's head boxes count images by name: one file must have one name
        from fedpose.data.annotations import refuse_image_aliases
        from fedpose.data.loaders import resolve_image_or_raise

        refuse_image_aliases(root, {name: resolve_image_or_raise(root, name) for name in sorted({r.image for r in records})})
    data = cfg.data
    return PoseDataset(records, root, input_size=data.input_size, train=train, seed=seed, **data.augmentation_options(),
                       **(dataset_view_options(cfg.privacy) if with_public_view else {}))


def resolve_protection_unit(
    cfg: RunConfig, records: list[Any], train_dir: Path, checkpoint: dict[str, Any] | None
) -> tuple[Any, Any]:
    """(UnitResolution, UnitIndex) of a DP run's training set — decided once, here, when the data is
    loaded; (None, None) for non-private training. A resumed run must keep the unit its ledger was
    accounted in: a different unit is a different guarantee, so continuing would mix two."""
    from fedpose.data.units import UnitError, UnitIndex, resolve_unit

    if not get_mechanism(cfg.privacy.mechanism).noisy:
        return None, None
    where = f"data.train ({train_dir})"
    try:
        choice = resolve_unit(cfg.privacy.unit, records, where)
    except UnitError as exc:
        raise ConfigError(f"privacy.unit: {exc}") from None
    if checkpoint is not None:
        before = (checkpoint.get("extra") or {}).get("protection_unit") or "record"  # older checkpoints: per record
        if before != choice.unit:
            raise ConfigError(
                f"privacy.unit: the checkpoint's privacy ledger is per {before}, but this run resolves to {choice.unit} "
                f"({choice.reason}); set privacy.unit = \"{before}\" to continue it, or start a new run"
            )
    return choice, UnitIndex.from_records(records, choice.unit, where)


def build_training_engine(
    cfg: RunConfig, model: Any, train_set: Any, train_dir: Path, public_set: Any, seed: int,
    checkpoint: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """(GradientEngine, UnitResolution or None) of a central run on ``train_set``: the one place that
    decides the protection unit, q, σ and the accountant — `fedpose train` and `fedpose audit` both
    build their engine here, so an audit audits exactly the guarantee training would run.

    A resumed run (``checkpoint``) continues its ledger: the accountant, unit and neighbouring relation
    it started with (a checkpoint from before accountants were selectable: RDP; an FDP run from before
    ``replace_one``: visible membership, σ calibrated under it), so neither σ nor ε changes silently."""
    from fedpose.model.grey_copies import records_with_gradient
    from fedpose.privacy.accountant import PrivacyLedger
    from fedpose.privacy.engine import build_engine

    privacy_cfg = cfg.privacy
    saved_ledger = (checkpoint.get("extra") or {}).get("accountant") if checkpoint is not None else None
    if saved_ledger is not None and privacy_cfg.accountant is None:
        privacy_cfg = privacy_cfg.model_copy(update={"accountant": saved_ledger.get("accountant", "rdp")})
    unit_choice, units = resolve_protection_unit(cfg, train_set.records, train_dir, checkpoint)
    ledger = None
    if saved_ledger is not None and get_mechanism(privacy_cfg.mechanism).noisy:
        try:
            ledger = PrivacyLedger.from_dict(saved_ledger)
        except ValueError as exc:
            raise ConfigError(f"the checkpoint's privacy ledger: {exc}") from None
    engine = build_engine(privacy_cfg, model, len(train_set), cfg.train.batch_size, cfg.train.steps, public_set, seed,
                          chunk_size=cfg.train.chunk_size, units=units, ledger=ledger,
                          trainable_records=records_with_gradient(model.trainable_parameters(), train_set))
    return engine, unit_choice


def _curve_rows(state: RunState) -> list[dict[str, Any]]:
    rows = [{"step": r["step"], "loss": r["loss"]} for r in state.train if "loss" in r]
    rows += [{"step": v["step"], "val PCKh@0.5 Mean": v["Mean"]} for v in state.val]
    return rows


def run_training(
    cfg: RunConfig,
    resume: str | Path | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train per ``cfg`` (or continue the checkpoint ``resume``); returns a summary dict.

    ``stop_after`` ends this invocation after that many steps (checkpointing there) without
    changing the schedule, e.g. to time-slice a long run on a shared machine; resume continues it.
    """
    from fedpose.privacy.input_privacy import prepare_site_dataset

    checkpoint = None
    if resume is not None:
        checkpoint = load_checkpoint(resolve_resume(resume))
    if cfg.data.train is None:
        raise ConfigError("data.train: required (a dataset directory with annotations.json, or a COCO keypoints json)")
    device = resolve_device(cfg.train.device, "train.device")
    configure_device(device, cfg.train.threads)
    run_dir = Path(cfg.train.out_dir)
    if resume is not None and run_dir.resolve() != resume_run_dir(resume).resolve():
        raise ConfigError(
            f"train.out_dir: a resumed run continues in the run directory it is resumed from "
            f"({resume_run_dir(resume)}), not in {run_dir}; to continue into another directory, copy the run there "
            "and resume the copy"
        )
    if checkpoint is None and (run_dir / CHECKPOINT_DIR / LAST).exists():
        raise ConfigError(
            f"train.out_dir: {run_dir} already holds a run; continue it with --resume {run_dir} or choose another train.out_dir"
        )
    start_step = int(checkpoint["step"]) if checkpoint else 0
    if checkpoint is not None:
        refuse_rewinding_the_spend(run_dir, start_step, resume)
    total_steps = cfg.train.steps
    if start_step >= total_steps:
        raise ConfigError(f"train.steps: the checkpoint is at step {start_step}; raise train.steps (--set train.steps=N) to continue")

    seed = cfg.train.seed
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
    mechanism = get_mechanism(cfg.privacy.mechanism)
    noisy = mechanism.noisy
    # Resumed DP runs draw fresh streams (never replay spent noise); see the module docstring.
    stream_seed = seed + STREAM_STRIDE * start_step if (noisy and start_step) else seed

    train_dir, input_guarantee = prepare_site_dataset(cfg.data.train, cfg.input_privacy)
    train_set = _load_dataset(Path(train_dir), cfg, train=True, seed=stream_seed, with_public_view=True)
    # The site's validation images are privatized too: input privacy covers every image the site
    # trains or evaluates on (evaluate a checkpoint on clean data with `fedpose eval`).
    val_dir = prepare_site_dataset(cfg.data.val, cfg.input_privacy)[0] if cfg.data.val else None
    val_set = _load_dataset(Path(val_dir), cfg, train=False, seed=seed) if val_dir is not None else None
    public_set = None
    if mechanism.projects:
        if cfg.privacy.basis.public_data is None:
            raise ConfigError(f"privacy.basis.public_data: required for mechanism '{cfg.privacy.mechanism}' in fedpose train")
        from fedpose.data.dataset import public_basis_dataset

        public_set = public_basis_dataset(cfg.privacy.basis.public_data, cfg.data.input_size, cfg.privacy.basis.public_rotation,
                                          cfg.privacy.basis.public_grey)
        if not public_set.records:
            raise ConfigError(f"{cfg.privacy.basis.public_data}: the dataset has no records")

    model = build_model(cfg.model if checkpoint is None else cfg.model.model_copy(update={"init_checkpoint": None}),
                        cfg.data.input_size)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
    elif cfg.model.scenario == "scratch" and cfg.model.init_checkpoint is None:
        # Non-augmented view: calibration must not consume the training stream's augmentation draws.
        calibration_set = _load_dataset(Path(train_dir), cfg, train=False, seed=seed) if not noisy else public_set
        calibrate_batch_norm(model, calibration_set)
    model.to(device)  # before the optimizer exists, so its state is created (or loaded) on the device
    model.train_mode()
    stream = _ReplayableDataset(train_set)
    engine, unit_choice = build_training_engine(cfg, model, train_set, Path(train_dir), public_set, stream_seed, checkpoint)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps)
    state = RunState()
    batches = engine.batches(stream)
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        saved = checkpoint.get("metrics") or {}
        state = RunState(start_step, list(saved.get("train", [])), list(saved.get("val", [])),
                         saved.get("best_val_mean") if saved.get("best_val_mean") is not None else -math.inf,
                         list(saved.get("divergence", [])))
        engine.steps_done = start_step
        if not noisy:  # exact replay of the shuffled order and augmentation draws
            stream.replaying = True
            for _ in range(start_step):
                next(batches)
            stream.replaying = False
        restore_rng_state(checkpoint["rng"])
        log(f"resumed {run_dir} at step {start_step}/{total_steps}")

    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.toml", to_toml(cfg.model_dump(mode="json")))
    device_text = describe_device(device)
    summary_info = {"model": model.describe(), "train_records": len(train_set), "train_dir": str(train_dir),
                    "val_records": len(val_set) if val_set is not None else 0,
                    "val_dir": str(val_dir) if val_dir is not None else None, "device": device_text}
    log(f"training {summary_info['model']['trainable_parameters']:,} parameters "
        f"({cfg.model.backbone}, scenario {cfg.model.scenario}) on {len(train_set)} records, "
        f"privacy mechanism '{cfg.privacy.mechanism}', device {device_text} → {run_dir}")
    if engine.noise is not None and not engine.noise.secure:
        log(f"{SEEDED_NO_GUARANTEE}: privacy.insecure_seeded_noise draws the noise from train.seed = {seed}; "
            "anyone who knows the seed can remove it (tests only)")
    if unit_choice is not None:
        log(f"protection unit: {unit_choice.unit} ({unit_choice.reason}); {engine.dataset_size} {unit_choice.unit}{'' if engine.dataset_size == 1 else 's'}, "
            f"Poisson-sampled at q = {engine.sample_rate:.4g}, each {unit_choice.unit}'s gradient clipped to C as one")
    if engine.augmentation_cost is not None:
        log(engine.augmentation_cost)

    def privacy_report() -> dict[str, Any]:
        report = engine.privacy_report()
        report["input_privacy"] = input_guarantee
        report["device"] = device_text  # where the clipping and noise ran (not part of the guarantee)
        if unit_choice is not None:
            report["protection_unit_choice"] = unit_choice.reason
        return report

    def save(step: int) -> None:
        extra = {"accountant": engine.accountant.to_dict() if engine.accountant is not None else None,
                 "protection_unit": unit_choice.unit if unit_choice is not None else None}
        path = save_checkpoint(run_dir / CHECKPOINT_DIR / LAST, model, optimizer, cfg, state.metrics(), step, scheduler, extra)
        if state.val and state.val[-1]["step"] == step and state.val[-1]["Mean"] >= state.best:
            state.best = state.val[-1]["Mean"]
            save_checkpoint(run_dir / CHECKPOINT_DIR / BEST, model, optimizer, cfg, state.metrics(), step, scheduler, extra)
        report = privacy_report()
        atomic_write_json(run_dir / "metrics.json", {**state.metrics(), "privacy": report["epsilon_text"], "device": device_text})
        atomic_write_json(run_dir / "privacy.json", report)
        rows = _curve_rows(state)
        if rows:
            from fedpose.viz import save_curves

            keys = ["loss"] + (["val PCKh@0.5 Mean"] if state.val else [])
            save_curves(rows, run_dir / "curves.png", keys=keys)
        del path

    end_step = total_steps if stop_after is None else min(total_steps, start_step + max(1, stop_after))

    monitor = DivergenceMonitor()

    def watch(record: dict[str, Any]) -> dict[str, Any] | None:
        # an empty Poisson batch has no loss (NaN): nothing to judge
        if "loss" not in record or record.get("batch_units", 1) == 0:
            return None
        return monitor.update(record["step"], record["loss"])

    for earlier in state.train:  # a resumed run judges its loss against the whole run's history
        watch(earlier)

    def on_step(step: int, record: dict[str, Any]) -> None:
        state.step = step
        state.train.append(record)
        event = watch(record)
        if event is not None:
            state.divergence.append(event)
            log(describe_divergence(event))
        last = step == end_step
        if val_set is not None and (step % cfg.train.eval_every == 0 or last):
            scores = evaluate(model, val_set, batch_size=max(1, cfg.train.batch_size), max_samples=cfg.train.eval_samples,
                              flip_test=cfg.data.val_flip_test)
            state.val.append({"step": step, **scores})
            log(f"step {step}: val PCKh@0.5 Mean {scores['Mean']:.2f} (Mean@0.1 {scores['Mean@0.1']:.2f}), loss {scores['loss']:.4f}")
        if step % cfg.train.checkpoint_every == 0 or last:
            save(step)

    train_steps(model, engine, stream, optimizer, end_step - start_step, scheduler, on_step=on_step,
                progress=progress, batches=batches, first_step=start_step)
    report = privacy_report()
    summary = {
        "run_dir": str(run_dir), "steps": state.step, **summary_info,
        "final_loss": state.train[-1].get("loss") if state.train else None,
        "val": state.val[-1] if state.val else None,
        "epsilon_text": report.get("epsilon_text"),
        "privacy": report,  # the privacy.json written beside it
        "divergence": state.divergence,
    }
    log(f"{'done' if state.step == total_steps else 'stopped'}: {state.step}/{total_steps} steps; {report.get('epsilon_text')}")
    if state.divergence:
        log(f"WARNING: the training loss diverged (from step {state.divergence[0]['step']}; see 'divergence' in "
            f"{run_dir / 'metrics.json'}): check the model before using it")
    return summary
