"""One site's part of one federated round, without Flower: guard the budget, train, return Δ.

``sites/client_app.py`` is a thin Flower wrapper around :func:`train_site_round`. Everything a
ClientApp needs between rounds lives on disk in the site's ``state_dir`` (deployment starts a new
ClientApp process per message): the budget (:class:`~fedpose.federation.site_budget.SiteBudget`)
and the cached projection basis.

What leaves the site (and nothing else): Δ = w_local − w_global for the trainable parameters, the
number of local examples, and the cumulative privacy report (ε at δ, RDP per order, guarantee,
accountant). Δ is computed from weights that were only ever updated with privatized gradients
(clipped + noised by the engine), so releasing it is post-processing of the mechanism's output.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fedpose.federation.config import SiteConfig
from fedpose.federation.site_budget import BudgetExhausted, SiteBudget

log = logging.getLogger(__name__)

RoundStatus = Literal["ok", "refused", "replayed", "failed"]


@dataclass
class SiteRoundResult:
    """What a site sends back for one round (``update`` is empty unless ``status`` is "ok").

    "failed": the spend was recorded, then training stopped (it diverged); nothing is released."""

    site_id: str
    status: RoundStatus
    update: dict[str, np.ndarray]
    num_examples: int
    privacy: dict[str, Any]  #: cumulative: SiteBudget.report() + "next_round_affordable"
    reason: str = ""
    train_metrics: dict[str, float] = field(default_factory=dict)
    basis_version: int = -1  #: basis version the update was trained with (-1: none)
    compute_seconds: float = 0.0  #: wall time of the local work (load + train)


def guarantee_for(mechanism: str) -> Any:
    """The :class:`fedpose.privacy.report.Guarantee` a mechanism makes (DESIGN.md table)."""
    from fedpose.privacy import report

    registry = {
        "none": report.NO_PRIVACY,
        "dpsgd": report.RECORD_DP,
        "pdp": report.PROJECTED_DP,
        "fdp": report.FEATURE_DP,
        "fpdp": report.FEATURE_PROJECTED_DP,
        "maskdp": report.MASK_DP,
    }
    if mechanism not in registry:
        raise ValueError(f"unknown privacy mechanism {mechanism!r}; known: {sorted(registry)}")
    return registry[mechanism]


def open_budget(site: SiteConfig) -> SiteBudget | None:
    """The site's persisted budget (None for non-private training, which has nothing to guard)."""
    if site.privacy.mechanism == "none":
        return None
    return SiteBudget(site.state_dir, site.site_id, site.eps_max, site.delta, guarantee_for(site.privacy.mechanism).name)


def privacy_report(site: SiteConfig, budget: SiteBudget | None) -> dict[str, Any]:
    if budget is None:
        return {"site_id": site.site_id, "guarantee": "none", "accountant": "none", "epsilon": math.inf,
                "delta": 0.0, "eps_max": site.eps_max, "steps": 0, "rounds_spent": 0, "orders": [], "rdp": []}
    return budget.report()


# -- basis (cached on disk: a new ClientApp process per message) ----------------------------------------
def basis_cache_dir(site: SiteConfig) -> Path:
    return Path(site.state_dir) / "basis"


def cached_basis_version(site: SiteConfig) -> int:
    """The basis version cached at the site (-1 = none)."""
    from fedpose.federation.basis_transport import BasisCache

    version = BasisCache(basis_cache_dir(site)).version()
    return -1 if version is None else version


def _site_basis(site: SiteConfig, model: Any, version: int, message: tuple[dict, dict] | None) -> np.ndarray | None:
    """V for this round: decode/rebuild the coordinator's message, or load the cached copy."""
    from fedpose.federation.basis_transport import BasisCache, BasisTransportError
    from fedpose.federation.public_basis import receive_basis

    if version < 0:
        return None
    if message is not None:
        return receive_basis(message[0], message[1], model, site.public_data, basis_cache_dir(site))
    cached = BasisCache(basis_cache_dir(site)).load()
    if cached is None or cached[0] != version:
        raise BasisTransportError(f"site '{site.site_id}': basis v{version} was neither sent nor cached")
    return np.asarray(cached[1], dtype=np.float32)


# -- the round ---------------------------------------------------------------------------------------
def load_site_dataset(site: SiteConfig, input_size: tuple[int, int]) -> Any:
    """The site's training set (after input privacy, if configured) at the global model's input size."""
    from fedpose.data.dataset import PoseDataset, load_records
    from fedpose.privacy.input_privacy import prepare_site_dataset

    assert site.data.train is not None  # SiteConfig validates it
    data_dir, _ = prepare_site_dataset(site.data.train, site.input_privacy)
    records, root = load_records(data_dir)
    if not records:
        raise ValueError(f"site '{site.site_id}': no training records in {data_dir}")
    return PoseDataset(
        records, root, input_size=tuple(input_size), train=True, flip=site.data.flip,
        scale_jitter=site.data.scale_jitter, rotation=site.data.rotation, seed=site.train.seed,
    )


def _engine_basis(engine: Any, basis: np.ndarray | None, version: int) -> None:
    """Hand the coordinator's basis to a projecting engine (pdp / fpdp)."""
    if basis is None:
        return
    if not hasattr(engine, "set_basis"):
        raise RuntimeError("this privacy engine cannot take a basis from the coordinator (no set_basis)")
    engine.set_basis(basis, version=version)


def train_site_round(
    site: SiteConfig,
    run_id: str,
    round_id: int,
    global_state: dict[str, np.ndarray],
    model_spec: dict[str, Any],
    local_steps: int,
    basis_version: int = -1,
    basis_message: tuple[dict[str, np.ndarray], dict[str, Any]] | None = None,
    threads: int | None = None,
) -> SiteRoundResult:
    """Guard the budget, run ``local_steps`` private steps from the global weights, return Δ.

    Refuses (status "refused", nothing spent, no update) when the planned steps would take the
    site past ``eps_max``. The spend is recorded durably before training starts.
    """
    import torch

    from fedpose.model import build_model_from_spec
    from fedpose.privacy.engine import build_engine
    from fedpose.runtime import configure_cpu
    from fedpose.train.loop import TrainingDiverged, train_steps

    started = time.perf_counter()
    # The site caps the work it accepts per round at its own configured local_steps.
    local_steps = min(int(local_steps), site.local_steps)
    configure_cpu(threads)
    torch.manual_seed(site.train.seed * 100_003 + int(round_id))
    budget = open_budget(site)

    model = build_model_from_spec(model_spec)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(global_state))
    if missing:
        raise ValueError(f"global model lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict({k: torch.from_numpy(np.asarray(global_state[k])).to(expected[k].dtype) for k in expected})
    model.train_mode()
    trainable = model.trainable_parameters()
    start_weights = {name: p.detach().clone() for name, p in trainable.items()}

    basis = _site_basis(site, model, basis_version, basis_message)
    dataset = load_site_dataset(site, tuple(model_spec["input_size"]))
    public_dataset = None
    if basis is None and site.public_data is not None and site.privacy.mechanism in ("pdp", "fpdp"):
        # no coordinator basis: the engine computes its own from the site's copy of S_pub
        from fedpose.data.dataset import PoseDataset, load_records

        public_records, public_root = load_records(site.public_data)
        public_dataset = PoseDataset(public_records, public_root, input_size=tuple(model_spec["input_size"]), train=False)
    engine = build_engine(
        site.privacy, model, dataset_size=len(dataset), batch_size=site.train.batch_size,
        planned_steps=local_steps, public_dataset=public_dataset, seed=site.train.seed * 1_000_003 + int(round_id),
    )
    _engine_basis(engine, basis, basis_version)

    if budget is not None:
        sigma, rate = float(engine.noise_multiplier), float(engine.sample_rate)
        try:
            auth = budget.authorize_round(run_id, round_id, sigma, rate, local_steps)
        except BudgetExhausted as refusal:
            log.warning(refusal.reason)
            return SiteRoundResult(
                site.site_id, "refused", {}, 0, _with_outlook(privacy_report(site, budget), budget, sigma, rate, local_steps),
                reason=refusal.reason, basis_version=basis_version, compute_seconds=time.perf_counter() - started,
            )
        if auth.replayed:
            # The round was already spent (a duplicated message, or a coordinator that resumed after
            # the site had trained). A fresh noisy update would be a second release of the round:
            # re-send the update released then (no new privacy cost), or nothing if there is none.
            report = _with_outlook(privacy_report(site, budget), budget, sigma, rate, local_steps)
            released = _load_released(site, run_id, round_id)
            if released is not None:
                update, num_examples = released
                return SiteRoundResult(site.site_id, "ok", update, num_examples, report, reason="re-sent the update released for this round",
                                       train_metrics={"local_steps": float(local_steps)}, basis_version=basis_version,
                                       compute_seconds=time.perf_counter() - started)
            reason = f"site '{site.site_id}' already spent round {round_id} of run '{run_id}' but has no released update; no second release"
            return SiteRoundResult(site.site_id, "replayed", {}, 0, report, reason=reason, basis_version=basis_version,
                                   compute_seconds=time.perf_counter() - started)

    optimizer = _build_optimizer(site, list(trainable.values()))
    try:
        history = train_steps(model, engine, dataset, optimizer, local_steps, progress=False)
    except TrainingDiverged as failure:
        # Spent (recorded above) but nothing released: say so, with the spend, instead of vanishing.
        log.warning("site %s round %d: %s", site.site_id, round_id, failure)
        return SiteRoundResult(site.site_id, "failed", {}, 0, _report_after_training(site, budget, engine, local_steps),
                               reason=f"training failed: {failure}",
                               basis_version=basis_version, compute_seconds=time.perf_counter() - started)
    update = {name: (p.detach() - start_weights[name]).cpu().numpy() for name, p in model.trainable_parameters().items()}
    if budget is not None:
        _save_released(site, run_id, round_id, update, len(dataset))
    losses = [float(h["loss"]) for h in history if "loss" in h and math.isfinite(float(h["loss"]))]
    return SiteRoundResult(
        site.site_id, "ok", update, len(dataset), _report_after_training(site, budget, engine, local_steps),
        train_metrics={"train_loss": float(np.mean(losses)) if losses else float("nan"), "local_steps": float(local_steps)},
        basis_version=basis_version, compute_seconds=time.perf_counter() - started,
    )


def _released_path(site: SiteConfig) -> Path:
    return Path(site.state_dir) / "released_update.npz"


def _save_released(site: SiteConfig, run_id: str, round_id: int, update: dict[str, np.ndarray], num_examples: int) -> None:
    """Keep the last released update (already privatized), so a replayed round re-sends it."""
    from fedpose.federation.aggregation import save_array_checkpoint

    save_array_checkpoint(_released_path(site), update, {"run_id": run_id, "round": int(round_id), "num_examples": int(num_examples)})


def _load_released(site: SiteConfig, run_id: str, round_id: int) -> tuple[dict[str, np.ndarray], int] | None:
    from fedpose.federation.aggregation import load_array_checkpoint

    if not _released_path(site).exists():
        return None
    arrays, meta = load_array_checkpoint(_released_path(site))
    if meta.get("run_id") != run_id or meta.get("round") != int(round_id):
        return None
    return arrays, int(meta["num_examples"])


def _report_after_training(site: SiteConfig, budget: SiteBudget | None, engine: Any, local_steps: int) -> dict[str, Any]:
    report = privacy_report(site, budget)
    if budget is None:
        return {**report, "next_round_affordable": True}
    return _with_outlook(report, budget, float(engine.noise_multiplier), float(engine.sample_rate), local_steps)


def _with_outlook(report: dict[str, Any], budget: SiteBudget, sigma: float, rate: float, steps: int) -> dict[str, Any]:
    """Add whether one more identical round would still fit ε_max (so the coordinator can stop asking)."""
    report = dict(report)
    report["next_round_affordable"] = bool(budget.planned_epsilon(sigma, rate, steps) <= budget.eps_max)
    return report


def _build_optimizer(site: SiteConfig, params: list[Any]) -> Any:
    import torch

    if site.optim.name == "sgd":
        return torch.optim.SGD(params, lr=site.optim.lr, momentum=site.optim.momentum, weight_decay=site.optim.weight_decay)
    return torch.optim.AdamW(params, lr=site.optim.lr, weight_decay=site.optim.weight_decay)
