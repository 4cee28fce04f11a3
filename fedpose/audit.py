"""``fedpose audit``: an empirical lower bound on ε from one training run.

The audit trains with the configured mechanism through the real gradient engine — central
training (:func:`audit_central`) or one federated site round through the real site code
(:func:`audit_site_round`) — with m canaries, each included with probability ½, scores every
canary after training, and turns the best "included"/"excluded" guesses into a lower bound on ε
(:mod:`fedpose.privacy.audit_bound`: the one-run bound of Steinke, Nasr & Jagielski 2023 and its
f-DP variant of Mahloujifar, Melis & Chaudhuri 2024, the larger of the two), next to the
accountant's ε for the same run.

* **white-box** (:mod:`fedpose.privacy.canaries`): gradient-space canaries, a fixed direction added
  as a canary's clipped gradient; scored by the projection on it of what was released — each
  step's noisy gradient in central training (the release DP-SGD protects; the optimizer is
  post-processing) minus what the dataset alone would have released (the auditor knows every record
  but the canaries: the DP threat model), the round's update Δ at a site (all a site sends). For
  projecting mechanisms the directions lie in the public subspace, else projection removes them.
* **black-box** (central training, add/remove guarantees): canaries are records — out-of-distribution
  images with keypoints at random places, so only memorising a canary lowers its loss; grey where
  the model trains only grey copies, which colour images never move — in the
  training set with probability ½; scored by how much training lowered each canary's loss (the
  initial weights follow from the config's seed, so they are public). Weak by nature: it sees only
  the final model.

A correct mechanism gives ε_lower ≤ ε (with probability ≥ the confidence); ε_lower > ε means the
implementation leaks more than it claims. At small ε the bound is far below ε (one run and m
canaries cannot see small ε): the audit is there to catch gross bugs — missing or reproducible
noise, unaccounted releases — which give ε_lower well above ε.

``reference_run`` (white-box, central) also trains a canary-free twin with the same config and seeds
and scores the difference of the two releases: noise reused across runs (e.g.
``privacy.insecure_seeded_noise``) cancels there, so the audit fires; with fresh noise the
difference is only noisier.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from fedpose.config import GREY_SCENARIOS, RunConfig
from fedpose.privacy.accountants.base import ADD_REMOVE
from fedpose.privacy.audit_bound import GuessResult, best_lower_bound
from fedpose.privacy.canaries import CanarySet, canary_capacity
from fedpose.privacy.mechanisms import NOISY_MECHANISM_NAMES, get_mechanism

if TYPE_CHECKING:
    from fedpose.federation.config import CoordinatorConfig, SiteConfig

#: canaries by default: enough for a bound ≥ 2 when nothing is hidden; a projecting mechanism's
#: white-box audit takes at most k per release (:func:`~fedpose.privacy.canaries.canary_capacity`)
DEFAULT_CANARIES = 1000
DEFAULT_CONFIDENCE = 0.95
WHITE_BOX, BLACK_BOX = "white-box", "black-box"
MODES = (WHITE_BOX, BLACK_BOX)


@dataclass
class AuditResult:
    """Scores and the bound; :meth:`to_dict` is what ``--json`` prints."""

    scores: np.ndarray
    included: np.ndarray
    guess: GuessResult
    confidence: float
    mode: str
    setting: str  #: "central" or "site-round"
    privacy: dict[str, Any]  #: the audited run's privacy report (engine or site budget)
    reference_run: bool
    seconds: float

    def _per_unit_and_adjacency(self) -> str:
        """", per patient, add/remove-one-patient adjacency" for the audited run ('' where unknown)."""
        from fedpose.privacy.report import adjacency_words

        unit, relation = self.privacy.get("protection_unit"), self.privacy.get("neighbouring_relation")
        return (f", per {unit}" if unit else "") + (f", {adjacency_words(relation, unit)}" if relation else "")

    def to_dict(self) -> dict[str, Any]:
        from fedpose.privacy.report import format_epsilon

        epsilon = self.privacy.get("epsilon")
        claimed = math.inf if epsilon is None else float(epsilon)
        delta = float(self.privacy.get("delta") or 0.0)
        guarantee = str(self.privacy.get("guarantee"))
        accountant = str(self.privacy.get("accountant"))
        lower = self.guess.epsilon_lower
        return {
            "epsilon_lower": _finite_or_none(lower),
            "epsilon_lower_steinke": _finite_or_none(self.guess.epsilon_lower_steinke),
            "epsilon_lower_fdp": _finite_or_none(self.guess.epsilon_lower_fdp),
            "epsilon": epsilon,
            "delta": delta,
            "confidence": self.confidence,
            "canaries": int(self.scores.size),
            "mechanism": self.privacy.get("mechanism"),
            "guarantee": guarantee,
            "accountant": accountant,
            "neighbouring_relation": self.privacy.get("neighbouring_relation"),
            "unit_protected": self.privacy.get("unit_protected"),
            "protection_unit": self.privacy.get("protection_unit"),
            "protection_unit_choice": self.privacy.get("protection_unit_choice"),
            "mode": self.mode,
            "setting": self.setting,
            "reference_run": self.reference_run,
            "violation": bool(lower > claimed),
            "guarantee_void": bool(self.privacy.get("guarantee_void", False)),
            "epsilon_text": format_epsilon(claimed, delta, guarantee, accountant, self.privacy.get("protection_unit"),
                                           self.privacy.get("neighbouring_relation")),
            "epsilon_lower_text": (f"ε_lower = {lower:.4g} ({guarantee}, δ = {delta:.3g}{self._per_unit_and_adjacency()}, "
                                   f"one-run audit: max of Steinke et al. "
                                   f"2023 ({self.guess.epsilon_lower_steinke:.4g}) and f-DP ({self.guess.epsilon_lower_fdp:.4g}), "
                                   f"{self.confidence:.0%} confidence, {self.scores.size} canaries, {self.mode})"),
            "guesses": self.guess.guesses, "correct": self.guess.correct, "guesses_in": self.guess.guesses_in,
            "tests_tried": self.guess.tried,
            "included_canaries": int(self.included.sum()),
            "noise_multiplier": self.privacy.get("noise_multiplier"), "sample_rate": self.privacy.get("sample_rate"),
            "steps": self.privacy.get("steps"), "seconds": round(self.seconds, 2),
        }


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _log_step(log: Callable[[str], None], steps_done: int, steps: int) -> None:
    """An audit's progress: a line after every tenth of its steps (about ten lines)."""
    if steps_done % max(1, steps // 10) == 0:
        log(f"audit step {steps_done}/{steps}")


def _released_gradient(model: Any) -> torch.Tensor:
    """What the engine released this step: the gradient it set on the trainable parameters."""
    grads = [p.grad for p in model.trainable_parameters().values()]
    if any(g is None for g in grads):
        raise RuntimeError("the engine released no gradient for some trainable parameter")
    return torch.cat([g.reshape(-1) for g in grads])


def _load(path: Path, cfg: RunConfig, train: bool) -> Any:
    from fedpose.data.dataset import load_records

    records, root = load_records(path)
    return _dataset(records, root, cfg, train)


def _dataset(records: list[Any], root: Path, cfg: RunConfig, train: bool) -> Any:
    """A training set (``train``) is built for the mechanism's public view as `fedpose train`'s is (ψ(x) for
    fdp / fpdp, full-size decodes for maskdp)."""
    from fedpose.data.dataset import PoseDataset
    from fedpose.privacy.public_views import dataset_view_options

    data = cfg.data
    return PoseDataset(records, root, input_size=data.input_size, train=train, seed=cfg.train.seed, **data.augmentation_options(),
                       **(dataset_view_options(cfg.privacy) if train else {}))


def _check_auditable(cfg: RunConfig) -> None:
    if cfg.data.train is None:
        raise ValueError("data.train: required (the training set the audit trains on)")
    if not get_mechanism(cfg.privacy.mechanism).noisy:
        raise ValueError(f"privacy.mechanism: '{cfg.privacy.mechanism}' makes no claim to audit "
                         f"(choose {', '.join(NOISY_MECHANISM_NAMES)})")


def _training_dir(cfg: RunConfig) -> tuple[Path, dict[str, Any] | None]:
    """What `fedpose train` trains on: data.train, or its input-privatized copy (the same copy train
    makes or reuses: auditing on it releases nothing new) — and that input guarantee."""
    from fedpose.privacy.input_privacy import prepare_site_dataset

    return prepare_site_dataset(cfg.data.train, cfg.input_privacy)


class _CentralRun:
    """One central training run (model, engine, optimizer) that can be stepped in lockstep with a twin."""

    def __init__(self, cfg: RunConfig, train_set: Any = None) -> None:
        from fedpose.model import build_model
        from fedpose.train.central import build_training_engine
        from fedpose.train.optim import build_optimizer, build_scheduler

        _check_auditable(cfg)
        torch.manual_seed(cfg.train.seed)  # the twin of a reference run starts from the same weights
        train_dir, self.input_guarantee = _training_dir(cfg)
        self.train_set = _load(train_dir, cfg, train=True) if train_set is None else train_set
        public = None
        if get_mechanism(cfg.privacy.mechanism).projects:
            if cfg.privacy.basis.public_data is None:
                raise ValueError(f"privacy.basis.public_data: required for mechanism '{cfg.privacy.mechanism}'")
            public = _load(Path(cfg.privacy.basis.public_data), cfg, train=False)
        self.model = build_model(cfg.model, cfg.data.input_size)
        self.model.train_mode()
        # unit, q, σ and accountant exactly as `fedpose train` decides them on this config
        self.engine, self.unit_choice = build_training_engine(cfg, self.model, self.train_set, train_dir, public,
                                                              cfg.train.seed)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.batches = self.engine.batches(self.train_set)

    def privacy_report(self) -> dict[str, Any]:
        """The engine's report, with why the unit is what it is (as `fedpose train` writes it)."""
        report = self.engine.privacy_report()
        report["input_privacy"] = self.input_guarantee
        if self.unit_choice is not None:
            report["protection_unit_choice"] = self.unit_choice.reason
        return report

    def step(self) -> torch.Tensor:
        """One step; returns what it released, less the dataset-only release when canaries are attached."""
        batch = next(self.batches)
        self.optimizer.zero_grad(set_to_none=True)
        self.engine.step(self.model, batch)
        released = _released_gradient(self.model)
        if self.engine.canary_gradients is not None:
            released = released - self.engine.audit_data_release
        self.optimizer.step()
        self.scheduler.step()
        return released


def audit_central(
    cfg: RunConfig,
    canaries: int | None = None,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
    reference_run: bool = False,
    mode: str = WHITE_BOX,
    log: Callable[[str], None] = lambda _: None,
) -> AuditResult:
    """Audit central training with ``cfg`` (``cfg.train.steps`` steps). ``canaries``: None for the
    default (:data:`DEFAULT_CANARIES`, or what a projecting mechanism's releases hold)."""
    from fedpose.runtime import configure_cpu

    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    configure_cpu(cfg.train.threads)
    if mode == BLACK_BOX:
        if reference_run:
            raise ValueError("a reference run pairs white-box releases; the black-box audit scores the final model only")
        return _black_box_central(cfg, canaries, confidence, seed, log)
    return _white_box_central(cfg, canaries, confidence, seed, reference_run, log)


def _white_box_canaries(count: int | None, engine: Any, model: Any, privacy: Any, releases: int,
                        steps_per_release: int, seed: int) -> CanarySet:
    """The canary set for ``engine``'s mechanism: in the basis for projecting ones (module docstring)."""
    num_params = sum(p.numel() for p in model.trainable_parameters().values())
    basis_size = privacy.basis.k if engine.mechanism.projects else None
    capacity = canary_capacity(basis_size, releases)
    if count is None:
        count = DEFAULT_CANARIES if capacity is None else min(DEFAULT_CANARIES, capacity)
    return CanarySet.create(count, num_params, engine.accountant.relation, privacy.max_grad_norm, engine.sample_rate,
                            seed, releases, steps_per_release,
                            basis=(lambda: engine.basis) if basis_size is not None else None, basis_size=basis_size)


def _white_box_central(cfg: RunConfig, canaries: int | None, confidence: float, seed: int, reference_run: bool,
                       log: Callable[[str], None]) -> AuditResult:
    started = time.perf_counter()
    run = _CentralRun(cfg)
    twin = _CentralRun(cfg) if reference_run else None
    engine = run.engine
    canary_set = _white_box_canaries(canaries, engine, run.model, cfg.privacy, cfg.train.steps, 1, seed)
    engine.canary_gradients = canary_set.step_gradient
    if twin is not None:  # no canaries, but the same bookkeeping: its release less its dataset-only part
        twin.engine.canary_gradients = lambda _step: torch.zeros(())  # adds nothing
    scores = np.zeros(canary_set.count)
    for step in range(cfg.train.steps):
        released = run.step()
        if twin is not None:
            released = released - twin.step()
        scores += canary_set.scores(released, step)
        _log_step(log, step + 1, cfg.train.steps)
    # in units of one canary contribution per sampled step (release = sum / B)
    scores *= cfg.train.batch_size / cfg.privacy.max_grad_norm
    guess = best_lower_bound(scores, canary_set.included, cfg.privacy.delta, confidence)
    return AuditResult(scores, canary_set.included, guess, confidence, WHITE_BOX, "central", run.privacy_report(),
                       reference_run, time.perf_counter() - started)


def _ood_canary_records(count: int, input_size: tuple[int, int], directory: Path, rng: np.random.Generator,
                        grey: bool = False) -> list[Any]:
    """``count`` black-box canaries: images of blocky noise (nothing like a person) with all joints
    visible at random places. Each is its own mislabelled outlier, so training on one lowers mostly
    its own loss; the crop (centre, scale) covers the whole image. (Joints at random corners, equally
    far from the centre for every canary, measured weaker: 0.6–1.2 against 1.2–2.6 for the σ = 0 CI
    case over 4 seeds.) The noise is colour, or ``grey`` (R = G = B) for a model that trains only grey
    copies: a colour image's gradient is exactly zero there, so colour canaries would measure nothing."""
    from PIL import Image

    from fedpose.data.annotations import PoseRecord
    from fedpose.data.coco import PIXEL_STD
    from fedpose.data.dataset import DEFAULT_PADDING
    from fedpose.joints import NUM_JOINTS

    height, width = input_size
    directory.mkdir(parents=True, exist_ok=True)
    records = []
    for index in range(count):
        cells = rng.integers(0, 256, size=(height // 8, width // 8, 1 if grey else 3), dtype=np.uint8)
        pixels = np.kron(cells, np.ones((8, 8, 1), dtype=np.uint8))
        path = directory / f"canary-{index:05d}.png"
        Image.fromarray(np.repeat(pixels, 3, axis=2) if grey else pixels).save(path)
        joints = rng.uniform([0.15 * width, 0.15 * height], [0.85 * width, 0.85 * height], size=(NUM_JOINTS, 2))
        records.append(PoseRecord(
            image=str(path), joints=joints.astype(np.float32), joints_vis=np.ones(NUM_JOINTS, np.float32),
            center=np.array([width / 2, height / 2], np.float32), scale=height / (PIXEL_STD * DEFAULT_PADDING),
            # each canary is one unit of its own whatever the unit (own image, own patient), and never
            # narrows the unit the real records support
            patient_id=f"audit-canary-{index:05d}",
        ))
    return records


def _canary_losses(model: Any, canaries: Any) -> np.ndarray:
    """Each canary's training loss under ``model`` (no augmentation, no gradient)."""
    from fedpose.privacy.engine import collate

    was_training = model.training
    model.train(False)
    try:
        with torch.no_grad():
            batch = collate([canaries[i] for i in range(len(canaries))])
            logits_x, logits_y = model(batch["image"])
            return model.loss(logits_x, logits_y, batch["joints"], batch["weight"]).double().numpy()
    finally:
        model.train(was_training)


def _black_box_central(cfg: RunConfig, canaries: int | None, confidence: float, seed: int,
                       log: Callable[[str], None]) -> AuditResult:
    from fedpose.data.dataset import load_records

    started = time.perf_counter()
    _check_auditable(cfg)
    relation = get_mechanism(cfg.privacy.mechanism).guarantee.relation
    if relation != ADD_REMOVE:
        raise ValueError(f"black-box canaries are whole records added or removed; '{cfg.privacy.mechanism}' protects "
                         f"only a record's private part ({relation}): audit it white-box")
    count = DEFAULT_CANARIES if canaries is None else canaries
    rng = np.random.default_rng(seed)
    records, root = load_records(_training_dir(cfg)[0])
    with tempfile.TemporaryDirectory(prefix="fedpose-audit-canaries-") as directory:
        canary_records = _ood_canary_records(count, cfg.data.input_size, Path(directory), rng,
                                             grey=cfg.model.scenario in GREY_SCENARIOS)
        included = rng.random(count) < 0.5
        train_set = _dataset(records + [r for r, keep in zip(canary_records, included) if keep], root, cfg, train=True)
        if cfg.privacy.sample_rate is None:
            # q = B/N would reveal how many canaries are in; the expected size keeps q independent of the coins.
            # N counts protection units, decided on the real records as `fedpose train` would.
            from fedpose.train.central import resolve_protection_unit

            units = resolve_protection_unit(cfg, records, root, None)[1]
            rate = min(1.0, cfg.train.batch_size / (units.num_units + count / 2))
            cfg = cfg.model_copy(update={"privacy": cfg.privacy.model_copy(update={"sample_rate": rate})})
        run = _CentralRun(cfg, train_set)
        canary_set = _dataset(canary_records, root, cfg, train=False)
        initial = _canary_losses(run.model, canary_set)
        for step in range(cfg.train.steps):
            run.step()
            _log_step(log, step + 1, cfg.train.steps)
        scores = initial - _canary_losses(run.model, canary_set)  # how much training lowered each canary's loss
    guess = best_lower_bound(scores, included, cfg.privacy.delta, confidence)
    return AuditResult(scores, included, guess, confidence, BLACK_BOX, "central", run.privacy_report(),
                       False, time.perf_counter() - started)


def audit_site_round(
    site: SiteConfig,
    coordinator: CoordinatorConfig,
    canaries: int | None = None,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
    work_dir: Path | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> AuditResult:
    """White-box audit of one round of ``site`` (a :class:`~fedpose.federation.config.SiteConfig`)
    through the real site code (budget guard, engine, local training), scored on the released Δ.

    The round trains the model a real site is sent: the initial global model of ``coordinator`` (a
    :class:`~fedpose.federation.config.CoordinatorConfig`: its model, input size and seed; no warm
    start), handed over as weights + model spec like the coordinator's instruction.

    The round spends a fresh budget in ``work_dir`` (a temporary directory by default), never the
    site's own state.
    """
    from fedpose.federation.local_training import train_site_round
    from fedpose.model import build_model
    from fedpose.model.checkpoint import model_spec

    started = time.perf_counter()
    temporary = tempfile.TemporaryDirectory(prefix="fedpose-audit-") if work_dir is None else None
    state_dir = Path(temporary.name if temporary is not None else work_dir) / "audit-site-state"
    try:
        audited = site.model_copy(update={"state_dir": state_dir})
        torch.manual_seed(coordinator.seed)
        model = build_model(coordinator.model, tuple(coordinator.data.input_size))
        global_state = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
        holder: dict[str, Any] = {}

        def attach(engine: Any) -> None:
            # the round releases one Δ: every canary is active in all its steps (≤ k of them when projecting)
            holder["canaries"] = _white_box_canaries(canaries, engine, model, site.privacy, 1, site.local_steps, seed)
            engine.canary_gradients = holder["canaries"].step_gradient
            holder["engine"] = engine

        log(f"audit: one round of site '{site.site_id}' ({site.local_steps} local steps)")
        result = train_site_round(audited, "audit", 1, global_state, model_spec(model), site.local_steps, engine_hook=attach,
                                  on_step=lambda step: _log_step(log, step, site.local_steps))
        if result.reply.status != "ok":
            raise RuntimeError(f"the audited site round ended with status {result.reply.status!r} ({result.reply.reason})")
        canary_set: CanarySet = holder["canaries"]
        names = list(model.trainable_parameters())
        delta_flat = torch.cat([torch.from_numpy(np.asarray(result.update[n])).reshape(-1) for n in names])
        scores = -canary_set.scores(delta_flat, release=0)  # descent: an included canary pulls the weights against d_i
        guess = best_lower_bound(scores, canary_set.included, site.privacy.delta, confidence)
        report = holder["engine"].privacy_report()
        wire = result.reply.privacy
        if wire is not None:  # the site's own cumulative statement for this round (budget accountant)
            report.update(epsilon=wire.epsilon, accountant=wire.accountant)
        return AuditResult(scores, canary_set.included, guess, confidence, WHITE_BOX, "site-round", report,
                           False, time.perf_counter() - started)
    finally:
        if temporary is not None:
            temporary.cleanup()


def save_score_plot(result: AuditResult, path: Path) -> Path:
    """Histogram of canary scores, included vs excluded, titled with ε_lower and the claimed ε."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result.to_dict()
    fig, ax = plt.subplots(figsize=(7, 4))
    bins = np.histogram_bin_edges(result.scores, bins=40)
    ax.hist(result.scores[result.included], bins=bins, alpha=0.6, label=f"included ({int(result.included.sum())})")
    ax.hist(result.scores[~result.included], bins=bins, alpha=0.6, label=f"excluded ({int((~result.included).sum())})")
    ax.set_xlabel("canary score: " + ("projection of the release on the canary direction" if result.mode == WHITE_BOX
                                      else "decrease of the canary's loss over training"))
    ax.set_ylabel("canaries")
    ax.set_title(f"{summary['mechanism']}: {summary['epsilon_lower_text'].split(' (')[0]} vs claimed {summary['epsilon_text']}",
                 fontsize=9)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
