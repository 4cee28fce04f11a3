"""``fedpose audit``: an empirical lower bound on ε from one training run (white-box canaries).

The audit trains with the configured mechanism through the real gradient engine — central
training (:func:`audit_central`) or one federated site round through the real site code
(:func:`audit_site_round`) — with m canaries (:mod:`fedpose.privacy.canaries`), each included with
probability ½. It scores every canary by the projection of what was released on its direction —
each step's noisy gradient in central training (the release DP-SGD protects; the optimizer is
post-processing), the round's update Δ at a site (all a site sends) — and turns the best
"included"/"excluded" guesses into the one-run lower bound of Steinke, Nasr & Jagielski 2023
(:mod:`fedpose.privacy.audit_bound`), next to the accountant's ε for the same run.

A correct mechanism gives ε_lower ≤ ε (with probability ≥ the confidence); ε_lower > ε means the
implementation leaks more than it claims. At small ε the bound is far below ε (one run and m
canaries cannot see small ε): the audit is there to catch gross bugs — missing or reproducible
noise, unaccounted releases — which give ε_lower well above ε.

``reference_run`` also trains a canary-free twin with the same config and seeds and scores the
difference of the two releases: noise reused across runs (e.g. ``privacy.insecure_seeded_noise``)
cancels there, so the audit fires; with fresh noise the difference is only noisier.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from fedpose.config import RunConfig
from fedpose.privacy.audit_bound import GuessResult, best_lower_bound
from fedpose.privacy.canaries import CanarySet

#: canaries by default: enough for a bound ≥ 2 when nothing is hidden (ε_lower ≤ ~5.5 at 1000)
DEFAULT_CANARIES = 1000
DEFAULT_CONFIDENCE = 0.95
MODES = ("white-box",)


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

    def to_dict(self) -> dict[str, Any]:
        from fedpose.privacy.report import format_epsilon

        epsilon = self.privacy.get("epsilon")
        claimed = math.inf if epsilon is None else float(epsilon)
        delta = float(self.privacy.get("delta") or 0.0)
        guarantee = str(self.privacy.get("guarantee"))
        accountant = str(self.privacy.get("accountant"))
        lower = self.guess.epsilon_lower
        return {
            "epsilon_lower": lower if math.isfinite(lower) else None,
            "epsilon": epsilon,
            "delta": delta,
            "confidence": self.confidence,
            "canaries": int(self.scores.size),
            "mechanism": self.privacy.get("mechanism"),
            "guarantee": guarantee,
            "accountant": accountant,
            "neighbouring_relation": self.privacy.get("neighbouring_relation"),
            "unit_protected": self.privacy.get("unit_protected"),
            "mode": self.mode,
            "setting": self.setting,
            "reference_run": self.reference_run,
            "violation": bool(lower > claimed),
            "guarantee_void": bool(self.privacy.get("guarantee_void", False)),
            "epsilon_text": format_epsilon(claimed, delta, guarantee, accountant),
            "epsilon_lower_text": (f"ε_lower = {lower:.4g} ({guarantee}, δ = {delta:.3g}, one-run audit of Steinke et al. "
                                   f"2023, {self.confidence:.0%} confidence, {self.scores.size} canaries, {self.mode})"),
            "guesses": self.guess.guesses, "correct": self.guess.correct, "guess_counts_tried": self.guess.tried,
            "included_canaries": int(self.included.sum()),
            "noise_multiplier": self.privacy.get("noise_multiplier"), "sample_rate": self.privacy.get("sample_rate"),
            "steps": self.privacy.get("steps"), "seconds": round(self.seconds, 2),
        }


def _released_gradient(model: Any) -> torch.Tensor:
    """What the engine released this step: the gradient it set on the trainable parameters."""
    grads = [p.grad for p in model.trainable_parameters().values()]
    if any(g is None for g in grads):
        raise RuntimeError("the engine released no gradient for some trainable parameter")
    return torch.cat([g.reshape(-1) for g in grads])


def _load(path: Path, cfg: RunConfig, train: bool) -> Any:
    from fedpose.data.dataset import PoseDataset, load_records

    records, root = load_records(path)
    data = cfg.data
    return PoseDataset(records, root, input_size=data.input_size, train=train, flip=data.flip,
                       scale_jitter=data.scale_jitter, rotation=data.rotation, seed=cfg.train.seed)


class _CentralRun:
    """One central training run (model, engine, optimizer) that can be stepped in lockstep with a twin."""

    def __init__(self, cfg: RunConfig) -> None:
        from fedpose.model import build_model
        from fedpose.privacy.engine import build_engine
        from fedpose.train.optim import build_optimizer, build_scheduler

        if cfg.data.train is None:
            raise ValueError("data.train: required (the training set the audit trains on)")
        if cfg.privacy.mechanism == "none":
            raise ValueError("privacy.mechanism: 'none' makes no claim to audit (choose dpsgd, pdp, fdp, fpdp or maskdp)")
        torch.manual_seed(cfg.train.seed)  # the twin of a reference run starts from the same weights
        self.train_set = _load(Path(cfg.data.train), cfg, train=True)
        public = None
        if cfg.privacy.mechanism in ("pdp", "fpdp"):
            if cfg.privacy.basis.public_data is None:
                raise ValueError(f"privacy.basis.public_data: required for mechanism '{cfg.privacy.mechanism}'")
            public = _load(Path(cfg.privacy.basis.public_data), cfg, train=False)
        self.model = build_model(cfg.model, cfg.data.input_size)
        self.model.train_mode()
        self.engine = build_engine(cfg.privacy, self.model, len(self.train_set), cfg.train.batch_size, cfg.train.steps,
                                   public, cfg.train.seed)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.batches = self.engine.batches(self.train_set)

    def step(self) -> torch.Tensor:
        batch = next(self.batches)
        self.optimizer.zero_grad(set_to_none=True)
        self.engine.step(self.model, batch)
        released = _released_gradient(self.model)
        self.optimizer.step()
        self.scheduler.step()
        return released


def audit_central(
    cfg: RunConfig,
    canaries: int = DEFAULT_CANARIES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
    reference_run: bool = False,
    log: Callable[[str], None] = lambda _: None,
) -> AuditResult:
    """White-box audit of central training with ``cfg`` (``cfg.train.steps`` steps)."""
    from fedpose.runtime import configure_cpu

    started = time.perf_counter()
    configure_cpu(cfg.train.threads)
    run = _CentralRun(cfg)
    twin = _CentralRun(cfg) if reference_run else None
    engine = run.engine
    num_params = sum(p.numel() for p in run.model.trainable_parameters().values())
    canary_set = CanarySet.create(canaries, num_params, engine.accountant.relation, cfg.privacy.max_grad_norm,
                                  engine.sample_rate, seed)
    engine.canary_gradients = canary_set.step_gradient
    scores = np.zeros(canary_set.count)
    for step in range(cfg.train.steps):
        released = run.step()
        if twin is not None:
            released = released - twin.step()
        scores += canary_set.scores(released)
        if (step + 1) % max(1, cfg.train.steps // 10) == 0:
            log(f"audit step {step + 1}/{cfg.train.steps}")
    # in units of one canary contribution per sampled step (release = sum / B)
    scores *= cfg.train.batch_size / cfg.privacy.max_grad_norm
    guess = best_lower_bound(scores, canary_set.included, cfg.privacy.delta, confidence)
    return AuditResult(scores, canary_set.included, guess, confidence, "white-box", "central", engine.privacy_report(),
                       reference_run, time.perf_counter() - started)


def audit_site_round(
    site: Any,
    canaries: int = DEFAULT_CANARIES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
    work_dir: Path | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> AuditResult:
    """White-box audit of one round of ``site`` (a :class:`~fedpose.federation.config.SiteConfig`)
    through the real site code (budget guard, engine, local training), scored on the released Δ.

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
        torch.manual_seed(site.train.seed)
        model = build_model(site.model, site.data.input_size)
        global_state = {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}
        holder: dict[str, Any] = {}

        def attach(engine: Any) -> None:
            num_params = sum(p.numel() for p in model.trainable_parameters().values())
            holder["canaries"] = CanarySet.create(canaries, num_params, engine.accountant.relation,
                                                  site.privacy.max_grad_norm, engine.sample_rate, seed)
            engine.canary_gradients = holder["canaries"].step_gradient
            holder["engine"] = engine

        log(f"audit: one round of site '{site.site_id}' ({site.local_steps} local steps)")
        result = train_site_round(audited, "audit", 1, global_state, model_spec(model), site.local_steps, engine_hook=attach)
        if result.reply.status != "ok":
            raise RuntimeError(f"the audited site round ended with status {result.reply.status!r} ({result.reply.reason})")
        canary_set: CanarySet = holder["canaries"]
        names = list(model.trainable_parameters())
        delta_flat = torch.cat([torch.from_numpy(np.asarray(result.update[n])).reshape(-1) for n in names])
        scores = -canary_set.scores(delta_flat)  # descent: an included canary pulls the weights against d_i
        guess = best_lower_bound(scores, canary_set.included, site.privacy.delta, confidence)
        report = holder["engine"].privacy_report()
        wire = result.reply.privacy
        if wire is not None:  # the site's own cumulative statement for this round (budget accountant)
            report.update(epsilon=wire.epsilon, accountant=wire.accountant)
        return AuditResult(scores, canary_set.included, guess, confidence, "white-box", "site-round", report,
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
    ax.set_xlabel("canary score: projection of the release on the canary direction")
    ax.set_ylabel("canaries")
    ax.set_title(f"{summary['mechanism']}: {summary['epsilon_lower_text'].split(' (')[0]} vs claimed {summary['epsilon_text']}",
                 fontsize=9)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
