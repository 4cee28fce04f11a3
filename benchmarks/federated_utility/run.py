"""Why federate: public-only vs site-alone vs federated vs central, private and non-private.

    python benchmarks/federated_utility/run.py                      # every run, resumes finished ones
    python benchmarks/federated_utility/run.py --probe federated --set data_seed=7 --set "seeds=[0]"   # a tuning probe
    python benchmarks/federated_utility/run.py --report-only        # rewrite results.{json,md,png} from the parts
    python benchmarks/federated_utility/run.py --resume-from benchmarks/federated_utility/results.json  # go on in a new session

Protocol (paper 001's public pre-training + private fine-tuning, federated), on fedpose's synthetic
multi-site data (3 non-IID sites; the test split mixes the three sites' distributions and each test
record names its source site, so every site has its own held-out test split, and the mixture is
the union):

* ``public-only``: the public pre-trained base (``init_checkpoint``: by default the shipped
  ``checkpoints/public/public-base-tiny_vit_test-128x96.pt``, trained on 40 000 synthetic public
  images; no site data). Every other arm starts from it. (``init_checkpoint = null``: a short warm
  start on the sweep's own public split instead, the coordinator's
  :func:`fedpose.federation.warm_start.warm_start` — the protocol before issue 26.)
* ``site-alone``: each site trains alone, same mechanism, ε, δ, unit, rounds and local steps as in
  the federation (a federation of one site: the same code path).
* ``federated``: the three sites through the real coordinator round loop
  (:class:`~fedpose.federation.server.rounds.RoundRunner`: basis service, validation, aggregation,
  ledger) and the real site round (:func:`~fedpose.federation.local_training.run_site_round`: budget
  guard, private training). Flower's messaging is bypassed by
  :class:`~fedpose.federation.server.in_process.InProcessTransport` (same process, no serialization).
* ``central``: the three sites' data pooled at one "site", same per-unit ε: the same sampling rate q
  per unit, so the same σ over the same steps, with a 3× larger expected batch (one noise draw per
  step for all the data — what a trusted curator could do).
* non-private ``federated`` and ``central``: the same with mechanism "none".
* ``score_local_models`` (a probe, no run of its own): each private federated run also scores each
  site's own model at the end of its last round — the global model it was sent plus the Δ it
  released, what the site held when it replied — on the site's own test split, and the blends
  (1 − α)·global + α·own of ``LOCAL_BLENDS`` (under FedAvg: w_R + α(Δ_i − Δ̄)). Both are released
  values, so these models are post-processing: no privacy beyond the federated run's ε.

Every run is saved when it finishes (``parts/<key>.json`` in the work dir), so an interrupted
sweep resumes where it stopped (a run in which a site failed a round — out of GPU memory, say — is
no result: it goes to ``parts/failed/`` and runs again); results.json / results.md / results.png are rewritten from the
parts after every run. ``--jobs 2`` runs two runs at a time (one torch thread each).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedpose.config import check_basis_rank
from fedpose.privacy.mechanisms import get_mechanism

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
#: the issue's two (DP with projection, FP-DP) and plain DP-SGD, which the small trainable set makes
#: competitive (noise_or_subspace.json); ε 8 first, pdp first, so a sweep cut short has the headline rows
DEFAULT_MECHANISMS = ("pdp", "dpsgd", "fpdp")


class Settings(BaseModel):
    """Every hyper-parameter of the sweep (written into results.json)."""

    model_config = ConfigDict(extra="forbid")

    size: tuple[int, int] = (128, 96)  # at 64×64 nothing learned, non-private central included (at_64x64/)
    sites: int = 3
    #: 120 synthetic patients × 4 images (issue 26: ≥ 120 patients / 480 records per site)
    per_site: int = 480
    public: int = 64  # the sweep's own public split: the projection basis's S_pub
    test: int = 240
    data_seed: int = 0
    backbone: str = "tiny_vit_test"
    #: the private arms' trainable set. Measured on the tuning data (noise_or_subspace.json, one site,
    #: ε 8 per patient): PDP's public projection of ``finetune`` keeps < 25 % of what clipping alone
    #: gains (k 4–48, σ = 0), so every private ``finetune`` recipe ended within ±1 of the base; the
    #: 6.6 k biases and LayerNorms keep 80 % of it with σ = 0 and gain under real noise
    scenario: str = "biases_norms"
    #: the non-private arms' set: the best reference, not the private arms' restriction
    nonprivate_scenario: str = "full"
    #: the adapters of scenario ``lora`` (and of the probe patches that add adapters): rank r and scale α (adds (α/r)·B·A)
    lora_rank: int = 8
    lora_alpha: float = 8.0
    #: the public base every arm starts from (a path relative to the repository); None: warm start
    init_checkpoint: str | None = "checkpoints/public/public-base-tiny_vit_test-128x96.pt"
    #: a short warm start leaves the sites something to teach: at 128×96, 150 steps reach 38 % and
    #: non-private federated training adds 3 points; 50 steps reach 23 % and it adds 15 (probes.json)
    warm_steps: int = 50
    warm_lr: float = 2e-3
    #: expected units (patients) per step: q = 16/120 per site
    batch_size: int = 16
    rounds: int = 8
    local_steps: int = 10
    #: private arms (federated, central); site-alone private arms carry a single site's noise: ``site_alone_lr``.
    #: 0.2 pays where more sites average the noise (10 sites, four images: +1.7, tuning_probes_sites10.json;
    #: sites10_site_lr/) and little at 3 (ablation lr0.2 +1.0 ± 0.9 one image, none with four;
    #: tuning_probes_site_lr.json; sites3_site_lr/): those tables set it, the default stays 0.1
    site_lr: float = 0.1
    site_alone_lr: float = 0.03
    #: "mechanism@ε" → the federated and central arms' step size where ``site_lr`` is wrong for that
    #: noise: dpsgd at ε 2 (no projection: noise in all 6.6 k directions) lost 5.2 at lr 0.1 and
    #: gained 1.9 at 0.03 (3 sites, tuning data; tuning_probes_biases_norms.json); pdp at ε 2 gained
    #: more at 0.1 (+3.0) than at 0.03 (+1.5), so it keeps ``site_lr``
    site_lr_at: dict[str, float] = Field(default_factory=lambda: {"dpsgd@2": 0.03})
    #: non-private arms (unclipped SGD, all weights): on the shipped base 0.1 wrecks it (14.5), 0.01 dips
    #: to 12.8 in round 1, 0.003 ends highest (tuning_probes.json)
    nonprivate_lr: float = 0.003
    site_momentum: float = 0.9
    #: the sites' optimizer (every arm): "sgd" (momentum ``site_momentum``) or "adamw" (weight decay 0)
    site_optimizer: str = "sgd"
    max_grad_norm: float = 1.0
    #: PDP's k of the ``biases_norms`` set's 6.6 k directions: 64, every direction 64 public images span
    #: (noise_or_subspace.json: one site at ε 8, +4.7 on the mixture, dpsgd without projection +3.8)
    k: int = 64
    public_samples: int = 64
    refresh_every_rounds: int = 2
    #: None: the coordinator's basis service (a basis per ``refresh_every_rounds`` rounds, at the
    #: global weights); N: coordinator basis.source = "sites", each site recomputes V from its own
    #: copy of the public split every N local steps, at its current local weights (PDP-SGD's schedule)
    site_basis_refresh_steps: int | None = 5
    #: the sites' data.rotation_clip: their augmentation's rotation N(0, 30°²) clipped at ± this × 30°
    #: (1: ±30°, the default; 2: HRNet's ±60°, the recipe of the ±60° public base)
    site_rotation_clip: float = 1.0
    #: privacy.basis.public_rotation of a site-computed basis (degrees; 0: upright public images)
    basis_public_rotation: float = 60.0
    #: privacy.basis.public_grey of a site-computed basis (share of the public images seen grey)
    basis_public_grey: float = 0.0
    public_view_factor: int = 8
    public_view_bits: int = 3
    #: privacy.public_gradient_weight: λ on fdp / fpdp's noise-free ψ(x) gradient
    public_gradient_weight: float = 1.0
    #: privacy.augmentation_multiplicity K (De et al. 2022): K augmented copies per record, averaged before clipping
    augmentation_multiplicity: int = 1
    aggregation: str = "fedavg"
    server_lr: float = 1.0
    #: coordinator.aggregation.lr_schedule: "cosine" decays the server step to a tenth over the rounds
    server_lr_schedule: str = "constant"
    server_momentum: float = 0.9
    #: coordinator.ema.decay: 0 off; else every arm is evaluated on the moving average of the global
    #: models over rounds (post-processing of the released models: free in privacy)
    ema_decay: float = 0.0
    delta: float = 1e-5
    #: σ of every private arm instead of the one its ε calibrates (None: calibrated, always in a reported
    #: row). An emulation: the total σ that distributed noise under secure aggregation needs for ε
    #: (benchmarks/distributed_noise), run as the central arm, is the sum that federated SGD with
    #: distributed noise would release each step; the arm's ε then names the emulated mechanism's
    #: guarantee, and the site's own guard still checks this σ's PLD ε against it
    noise_multiplier: float | None = None
    unit: str = "patient"
    #: images of a sampled patient in a step (uniformly chosen); the patient is clipped as one unit
    #: either way, so 1 costs no privacy and makes a step a quarter of the rows
    max_records_per_unit: int = 1
    mechanisms: list[str] = Field(default_factory=lambda: list(DEFAULT_MECHANISMS))
    epsilons: list[float] = Field(default_factory=lambda: [2.0, 8.0])
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2])
    #: False: only the private arms (and public-only) — for probes of a private recipe
    nonprivate: bool = True
    threads: int = 1
    #: samples per chunk of per-sample gradients (site ``train.chunk_size``): memory only, the same
    #: gradients. None sizes it from free GPU memory when the run starts, which counts neither the
    #: activations nor the runs beside it: 15 runs side by side on one H100 ran out of memory
    chunk_size: int | None = None
    #: unit slots U of every DP step (site ``privacy.max_batch_units``, fedpose.privacy.fixed_shape). None: the
    #: product's default (P(Poisson(B) > U) ≤ 1e-15: U 57 at B 16, so with 4 images a patient 228 rows of which
    #: ~64 are real), whose zero-weight padding makes a step's time independent of the data. 1: a step computes
    #: only its sampled units (an overflowing batch keeps every unit either way), so the released update has the
    #: same distribution — padded rows add exact zeros — and only the step's timing differs, which nothing in this
    #: in-process sweep releases: the same results in about a third of the compute (a 10-site federated run with
    #: four images a patient: 17–19 min on one thread instead of 42–59)
    max_batch_units: int | None = None
    #: also score each site's own model at the end of a private federated run (``local_model_scores``:
    #: post-processing, no privacy cost; evaluation only — each federated run scores 2 × sites more models)
    score_local_models: bool = False
    #: evaluate with flip test (fedpose's default since 2026-12-05: each crop's and its mirror's SimCC
    #: distributions averaged). Off here: every committed result of this sweep was scored without it, and a
    #: resumed sweep must not mix the two protocols
    flip_test: bool = False

    @model_validator(mode="after")
    def _basis_samples_exist(self) -> "Settings":
        # a site's basis takes m = min(public_samples, public images): a larger public_samples (and a k
        # above the images) would silently train with fewer directions than the settings record
        if not any(get_mechanism(name).projects for name in self.mechanisms):
            return self
        if self.public_samples > self.public:
            raise ValueError(f"public_samples = {self.public_samples} exceeds the sweep's public split (public = {self.public} "
                             "images): set public as large")
        check_basis_rank(self.k, self.public_samples)
        return self


@dataclasses.dataclass(frozen=True)
class Arm:
    """One training run: which sites train, with which mechanism and ε."""

    seed: int
    mechanism: str  # "none" or a private mechanism
    epsilon: float | None
    kind: str  # "public-only" | "site-alone" | "federated" | "central"
    site: str | None = None  # site-alone: which site

    @property
    def key(self) -> str:
        privacy = "nonprivate" if self.mechanism == "none" else f"{self.mechanism}-eps{self.epsilon:g}"
        if self.kind == "public-only":
            return f"s{self.seed}/public-only"
        return f"s{self.seed}/{privacy}/{self.kind}" + (f"/{self.site}" if self.site else "")


def all_arms(settings: Settings, only: str | None = None) -> list[Arm]:
    """Every run, in the order they are run: the seed-shared public-only and non-private arms first,
    then each (ε, mechanism), ε 8 first (the goals are stated there): its federated arm over all
    seeds, then central, then site-alone — a sweep cut short has every seed of the arms it finished,
    the headline arm first."""
    site_ids = [f"site-{k}" for k in range(1, settings.sites + 1)]
    arms: list[Arm] = [Arm(seed, "none", None, "public-only") for seed in settings.seeds]
    for seed in settings.seeds if settings.nonprivate else ():
        arms += [Arm(seed, "none", None, "federated"), Arm(seed, "none", None, "central")]
    for epsilon in sorted(settings.epsilons, reverse=True):
        for mechanism in settings.mechanisms:
            arms += [Arm(seed, mechanism, epsilon, "federated") for seed in settings.seeds]
            arms += [Arm(seed, mechanism, epsilon, "central") for seed in settings.seeds]
            arms += [Arm(seed, mechanism, epsilon, "site-alone", s) for seed in settings.seeds for s in site_ids]
    return [a for a in arms if only is None or a.kind in (only, "public-only")]


# -- data ----------------------------------------------------------------------------------------------
def ensure_data(settings: Settings, work: Path) -> Path:
    """The synthetic dataset and the pooled site data (central arms)."""
    from fedpose.data.annotations import ANNOTATIONS_FILE, write_annotations
    from fedpose.data.loaders import load_records
    from fedpose.data.synthetic import ensure_dataset

    data = work / "data"
    ensure_dataset(data, sites=settings.sites, per_site=settings.per_site, public=settings.public, test=settings.test,
                   size=tuple(settings.size), seed=settings.data_seed, workers=1, progress=False)
    pooled = work / "pooled"
    if not (pooled / ANNOTATIONS_FILE).exists():
        (pooled / "images").mkdir(parents=True, exist_ok=True)
        records = []
        for k in range(1, settings.sites + 1):
            site_records, root = load_records(data / f"site-{k}")
            for record in site_records:
                name = f"images/site-{k}-{Path(record.image).name}"
                shutil.copyfile(root / record.image, pooled / name)
                records.append(dataclasses.replace(record, image=name))
        write_annotations(pooled / ANNOTATIONS_FILE, records)
    return data


def test_splits(data: Path, settings: Settings) -> dict[str, Any]:
    """split name → (records, root): each site's own test split and the mixture."""
    from fedpose.data.loaders import load_records

    records, root = load_records(data / "test")
    splits = {f"site-{k}": ([r for r in records if r.extra.get("site") == f"site-{k}"], root) for k in range(1, settings.sites + 1)}
    splits["mixture"] = (records, root)
    return splits


def evaluate_splits(model: Any, splits: dict[str, Any], size: tuple[int, int], flip_test: bool) -> dict[str, dict[str, float]]:
    from fedpose.data.dataset import PoseDataset
    from fedpose.train.evaluate import evaluate

    out = {}
    for name, (records, root) in splits.items():
        scores = evaluate(model, PoseDataset(records, root, input_size=size, train=False), batch_size=32, flip_test=flip_test)
        out[name] = {"pckh50": round(scores["Mean"], 2), "pckh10": round(scores["Mean@0.1"], 2), "samples": scores["samples"]}
    return out


#: α of the sites' own-model scores (``score_local_models``): (1 − α)·w_R + α·(the site's own model)
LOCAL_BLENDS = (0.5, 1.0)


class LastRoundRecorder:
    """A transport that keeps, per site, the global arrays it was sent in its last round and the Δ it
    released: the site's own model at the end of that round is their sum (``run_site_round``'s Δ is
    its trained weights minus the weights it received)."""

    def __init__(self, transport: Any):
        self.transport = transport
        self.last: dict[str, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = {}

    def node_ids(self) -> list[int]:
        return self.transport.node_ids()

    def secagg_exchange(self, messages: Any, timeout: float) -> Any:
        return self.transport.secagg_exchange(messages, timeout)

    def send_and_receive(self, requests: list[Any], timeout: float) -> list[Any]:
        replies = self.transport.send_and_receive(requests, timeout)
        sent = {request.node: request.global_arrays for request in requests}
        for reply in replies:
            if reply.reply is not None and reply.reply.status == "ok" and reply.update is not None:
                delta = reply.update()
                # a copy: a request holds the coordinator's live global state, which the aggregate updates
                received = {name: np.array(sent[reply.node][name], copy=True) for name in delta}
                self.last[reply.reply.site_id] = (received, delta)
        return replies


def site_model_state(final: dict[str, Any], received: dict[str, np.ndarray], delta: dict[str, np.ndarray],
                     alpha: float) -> dict[str, Any]:
    """The state dict (1 − α)·w_R + α·(received + Δ) on the Δ's tensors, w_R (``final``) elsewhere: α 0 is
    the final global model, α 1 the site's own model at the end of its last round."""
    import torch

    state = dict(final)
    for name, step in delta.items():
        own = torch.from_numpy(np.asarray(received[name] + step, dtype=np.float32))
        state[name] = (1 - alpha) * final[name] + alpha * own
    return state


def local_model_scores(model: Any, last: dict[str, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]],
                       splits: dict[str, Any], size: tuple[int, int], flip_test: bool) -> dict[str, dict[str, dict[str, float]]]:
    """α → site → scores of :func:`site_model_state` (each of ``LOCAL_BLENDS``) on the site's own test split.
    Under FedAvg (server step 1, equal weights) with every site in the last round, the blend is w_R + α(Δ_i − Δ̄)."""
    final = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for alpha in LOCAL_BLENDS:
        per_site = {}
        for site_id, (received, delta) in sorted(last.items()):
            model.load_state_dict(site_model_state(final, received, delta, alpha), strict=True)
            per_site[site_id] = evaluate_splits(model, {site_id: splits[site_id]}, size, flip_test)[site_id]
        out[f"{alpha:g}"] = per_site
    model.load_state_dict(final, strict=True)
    return out


# -- runs ----------------------------------------------------------------------------------------------
def warm_start_checkpoint(settings: Settings, data: Path, work: Path, seed: int) -> Path:
    """The public-only model of ``seed`` (trained once, shared by every arm of that seed)."""
    import torch

    from fedpose.config import ModelConfig, OptimConfig
    from fedpose.federation.warm_start import warm_start
    from fedpose.model import build_model, save_checkpoint
    from fedpose.runtime import configure_cpu

    if settings.init_checkpoint is not None:
        return REPO / settings.init_checkpoint
    path = work / "public" / f"seed{seed}.pt"
    if path.exists():
        return path
    configure_cpu(settings.threads)
    torch.manual_seed(seed)
    model = build_model(ModelConfig(backbone=settings.backbone, scenario="scratch"), tuple(settings.size))
    warm_start(model, data / "public", settings.warm_steps, OptimConfig(lr=settings.warm_lr, warmup_steps=20),
               settings.batch_size, seed, calibrate=True, echo=lambda _: None)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(path, model)
    return path


def units_per_site(settings: Settings) -> int:
    """N: a site's protection units (the synthetic sites show each patient in IMAGES_PER_PATIENT images)."""
    from fedpose.data.synthetic.generate import IMAGES_PER_PATIENT

    return math.ceil(settings.per_site / IMAGES_PER_PATIENT) if settings.unit == "patient" else settings.per_site


def sample_rate_of(settings: Settings) -> float:
    """The declared q of every private arm: B/N (central: 3B/3N)."""
    return settings.batch_size / units_per_site(settings)


def noise_multiplier(settings: Settings, mechanism: str, epsilon: float, sample_rate: float) -> float:
    """σ that spends exactly ``epsilon`` over all rounds × local steps (the site's accountant: PLD)."""
    from fedpose.config import PrivacyConfig
    from fedpose.privacy.engine import resolve_noise_multiplier

    privacy = PrivacyConfig(mechanism=mechanism, target_epsilon=epsilon, delta=settings.delta, sample_rate=sample_rate)
    return resolve_noise_multiplier(privacy, sample_rate, settings.rounds * settings.local_steps)


def arm_noise_multiplier(settings: Settings, arm: Arm) -> float:
    """σ of an arm's sites: 0 without privacy, else ``settings.noise_multiplier`` where it is set (an
    emulation), else the σ that spends the arm's ε."""
    if arm.mechanism == "none":
        return 0.0
    if settings.noise_multiplier is not None:
        return settings.noise_multiplier
    return noise_multiplier(settings, arm.mechanism, float(arm.epsilon), sample_rate_of(settings))


def arm_lr(settings: Settings, arm: Arm) -> float:
    """The sites' step size: tuned per noise level on the tuning data (data_seed 7), never on a reported split."""
    if arm.mechanism == "none":
        return settings.nonprivate_lr
    if arm.kind == "site-alone":
        return settings.site_alone_lr
    return settings.site_lr_at.get(f"{arm.mechanism}@{arm.epsilon:g}", settings.site_lr)


def site_config(settings: Settings, arm: Arm, site_id: str, train: Path, public: Path, state: Path, batch_size: int,
                sample_rate: float, sigma: float) -> Any:
    from fedpose.federation.config import SiteConfig

    privacy: dict[str, Any] = {"mechanism": arm.mechanism}
    if arm.mechanism != "none":
        privacy.update(noise_multiplier=sigma, sample_rate=sample_rate, max_grad_norm=settings.max_grad_norm,
                       delta=settings.delta, unit=settings.unit, max_records_per_unit=settings.max_records_per_unit,
                       public_view={"kind": "downsample_quantize", "factor": settings.public_view_factor, "bits": settings.public_view_bits},
                       public_gradient_weight=settings.public_gradient_weight,
                       augmentation_multiplicity=settings.augmentation_multiplicity,
                       max_batch_units=settings.max_batch_units)
        if settings.site_basis_refresh_steps is not None:
            privacy["basis"] = {"k": settings.k, "public_samples": settings.public_samples,
                                "refresh_every": settings.site_basis_refresh_steps, "public_rotation": settings.basis_public_rotation,
                                "public_grey": settings.basis_public_grey}
    return SiteConfig.model_validate({
        "site_id": site_id, "data": {"train": str(train), "rotation_clip": settings.site_rotation_clip}, "public_data": str(public),
        "state_dir": str(state), "eps_max": (arm.epsilon or 1.0) * (1 + 1e-6), "local_steps": settings.local_steps,
        "optim": {"name": settings.site_optimizer, "lr": arm_lr(settings, arm),
                  "momentum": settings.site_momentum, "weight_decay": 0.0},
        "train": {"batch_size": batch_size, "seed": arm.seed * 100 + int(site_id.rsplit("-", 1)[-1] if site_id[-1].isdigit() else 0),
                  "threads": settings.threads, "chunk_size": settings.chunk_size},
        "privacy": privacy,
    })


CPU_HOST = "CPU (x86_64), 2 cores shared with other engineers' jobs; no GPU"


def this_device() -> str:
    """Where a run trains here: every site and the coordinator use device "auto" (CUDA when visible)."""
    from fedpose.runtime import describe_device, resolve_device

    device = resolve_device("auto")
    if device.type == "cuda":
        return f"{describe_device(device)}, {os.cpu_count()} CPU cores"
    return f"CPU ({platform.processor() or platform.machine()}), {os.cpu_count()} cores shared with other engineers' jobs; no GPU"


def run_arm(settings: Settings, arm: Arm, data: Path, work: Path) -> dict[str, Any]:
    """Train one arm through the coordinator's round loop; evaluate it on every test split."""
    import torch

    from fedpose.federation.deployment import CoordinatorRunConfig
    from fedpose.federation.global_model import load_global_model
    from fedpose.federation.report import load_history
    from fedpose.federation.server.in_process import InProcessTransport
    from fedpose.federation.server.rounds import RoundRunner
    from fedpose.model import model_from_checkpoint
    from fedpose.privacy.mechanisms import get_mechanism
    from fedpose.runtime import configure_cpu

    configure_cpu(settings.threads)
    splits = test_splits(data, settings)
    load_before = os.getloadavg()
    started, cpu_started = time.time(), time.process_time()
    init = warm_start_checkpoint(settings, data, work, arm.seed)
    result: dict[str, Any] = {"key": arm.key, **dataclasses.asdict(arm), "lr": arm_lr(settings, arm), "device": this_device(),
                              "torch": torch.__version__, "python": platform.python_version()}
    if arm.kind == "public-only":
        model, _ = model_from_checkpoint(init)
        result["scores"] = evaluate_splits(model, splits, tuple(settings.size), settings.flip_test)
    else:
        arm_dir = work / "arms" / arm.key
        shutil.rmtree(arm_dir, ignore_errors=True)  # an interrupted run starts over (its budgets were spent)
        if arm.kind == "central":
            trains = [("pooled", work / "pooled")]
            batch = settings.batch_size * settings.sites  # same q per unit over 3× the units
        elif arm.kind == "federated":
            trains = [(f"site-{k}", data / f"site-{k}") for k in range(1, settings.sites + 1)]
            batch = settings.batch_size
        else:
            trains = [(str(arm.site), data / str(arm.site))]
            batch = settings.batch_size
        sample_rate = sample_rate_of(settings)
        sigma = arm_noise_multiplier(settings, arm)
        sites = [site_config(settings, arm, site_id, train, data / "public", arm_dir / "sites" / site_id, batch, sample_rate, sigma)
                 for site_id, train in trains]
        projects = get_mechanism(arm.mechanism).projects
        run = CoordinatorRunConfig.model_validate({"run_id": "fedutil", "coordinator": {
            "rounds": settings.rounds, "min_sites": len(sites), "local_steps": settings.local_steps, "round_timeout_s": 3600,
            "checkpoint_dir": str(arm_dir / "coordinator"),
            "data": {"val": str(data / "test"), "input_size": list(settings.size)},
            "public_data": str(data / "public") if projects else None,
            "basis": {"source": "coordinator" if settings.site_basis_refresh_steps is None else "sites",
                      "transport": "compact", "k": settings.k, "public_samples": settings.public_samples,
                      "refresh_every_rounds": settings.refresh_every_rounds},
            "model": {"backbone": settings.backbone, "init_checkpoint": str(init),
                      "scenario": settings.nonprivate_scenario if arm.mechanism == "none" else settings.scenario,
                      "lora_rank": settings.lora_rank, "lora_alpha": settings.lora_alpha},
            "aggregation": {"strategy": settings.aggregation, "server_lr": settings.server_lr, "momentum": settings.server_momentum,
                            "lr_schedule": settings.server_lr_schedule},
            "ema": {"decay": settings.ema_decay},
            "seed": arm.seed,
        }})
        lines: list[str] = []
        # the blends start from w_R: with ema_decay > 0 the saved model is the moving average instead
        score_local = settings.score_local_models and arm.kind == "federated" and arm.mechanism != "none" and settings.ema_decay == 0
        transport = InProcessTransport(sites)
        recorder = LastRoundRecorder(transport) if score_local else None
        RoundRunner(run, echo=lines.append).run_rounds(recorder or transport)
        model = load_global_model(arm_dir / "coordinator").model  # its moving average when ema_decay > 0
        if recorder is not None:
            result["local_scores"] = local_model_scores(model, recorder.last, splits, tuple(settings.size), settings.flip_test)
        history = load_history(arm_dir / "coordinator")
        initial = json.loads((arm_dir / "coordinator" / "report.json").read_text()).get("initial_pckh")
        last_sites = history[-1].sites if history else {}
        result.update(
            scores=evaluate_splits(model, splits, tuple(settings.size), settings.flip_test),
            curve_mixture_pckh50=[initial] + [(r.pckh or {}).get("Mean") for r in history],
            curve_mixture_pckh10=[None] + [(r.pckh or {}).get("Mean@0.1") for r in history],
            rounds_completed=len(history),
            site_rounds={s: [r.sites[s].status if s in r.sites else None for r in history] for s, _ in trains},
            epsilon_spent={s: last_sites[s].epsilon if s in last_sites else None for s, _ in trains},
            noise_multiplier=sigma, sample_rate=sample_rate if arm.mechanism != "none" else None, batch_size=batch,
            round_lines=lines,
        )
    result.update(wall_seconds=round(time.time() - started, 1), cpu_seconds=round(time.process_time() - cpu_started, 1),
                  load_before=[round(x, 2) for x in load_before], load_after=[round(x, 2) for x in os.getloadavg()])
    return result


# -- driver --------------------------------------------------------------------------------------------
def part_path(work: Path, key: str) -> Path:
    """Where the run of arm ``key`` is saved."""
    return work / "parts" / (key.replace("/", "__") + ".json")


def failed_rounds(result: dict[str, Any], rounds: int) -> str:
    """What went wrong in a run's rounds: "" when every site finished every one of ``rounds``
    (public-only runs train nothing)."""
    if "site_rounds" not in result:
        return ""
    failures = [f"{site} round {number}: {status or 'no reply'}" for site, statuses in result["site_rounds"].items()
                for number, status in enumerate(statuses, start=1) if status != "ok"]
    if result["rounds_completed"] < rounds:
        failures.insert(0, f"{result['rounds_completed']} of {rounds} rounds")
    return "; ".join(failures[:3]) + (f" and {len(failures) - 3} more" if len(failures) > 3 else "")


def run_pending(settings: Settings, arms: list[Arm], work: Path, data: Path) -> None:
    from fedpose.io import atomic_write_json

    for arm in arms:
        path = part_path(work, arm.key)
        if path.exists():
            continue
        print(f"[{time.strftime('%H:%M:%S')}] {arm.key} ...", flush=True)
        result = run_arm(settings, arm, data, work)
        failed = failed_rounds(result, settings.rounds)
        if failed:
            # a round a site did not finish (out of device memory, say) leaves the model partly or wholly
            # untrained: never a result; kept aside for reading, and run again by the next resume
            failed_path = work / "parts" / "failed" / path.name
            failed_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(failed_path, result)
            print(f"[{time.strftime('%H:%M:%S')}] {arm.key}: FAILED, not a result ({failed}); kept in {failed_path}", flush=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, result)
        mixture = result["scores"]["mixture"]["pckh50"]
        own = result["scores"][arm.site]["pckh50"] if arm.site else None
        print(f"[{time.strftime('%H:%M:%S')}] {arm.key}: mixture PCKh@0.5 {mixture}" + (f", own split {own}" if own is not None else "")
              + f" ({result['wall_seconds']} s)", flush=True)


T = TypeVar("T")


def worker_share(runs: list[T], worker: str) -> list[T]:
    """The runs of worker ``"i/n"`` (``--worker``): every n-th from the i-th, so n worker processes
    split a sweep without talking to each other (each run is saved as its own part)."""
    index, count = (int(x) for x in worker.split("/"))
    return runs[index::count]


def run_workers(command: list[str], jobs: int) -> list[int]:
    """Run ``command --worker i/jobs`` for i < jobs as separate processes; their exit codes."""
    workers = [subprocess.Popen([*command, "--worker", f"{i}/{jobs}"]) for i in range(jobs)]
    return [w.wait() for w in workers]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/fedpose_federated_utility"), help="data, checkpoints, per-run parts")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=JSON",
                        help="override a setting, e.g. --set rounds=12 --set 'epsilons=[8]'")
    parser.add_argument("--probe", choices=("federated", "site-alone", "central"), default=None,
                        help="tuning: only this arm kind (plus public-only), results kept apart in <work>/probe-<hash>")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (separate processes)")
    parser.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)  # "i/n": run every n-th pending arm
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--resume-from", type=Path, default=None, metavar="RESULTS_JSON",
                        help="first copy the runs of a committed results.json into the work dir (every setting that "
                             "shapes a run must match; mechanisms, ε and seeds may differ)")
    parser.add_argument("--collect-probes", type=Path, default=None, metavar="JSON",
                        help="write every probe under --work (settings that differ from the defaults, each run's "
                             "scores and curve) to JSON, then exit")
    parser.add_argument("--out", type=Path, default=HERE, help="where results.{json,md,png} go")
    args = parser.parse_args()

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    def value(text: str) -> Any:  # JSON where it parses (numbers, lists, true/false/null), else the text itself
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    if args.collect_probes:
        collect_probes(args.work, args.collect_probes)
        return 0
    raw = {k: value(v) for k, v in (o.split("=", 1) for o in args.overrides)}
    settings = Settings.model_validate(raw)
    work = args.work
    if args.probe:
        import hashlib

        work = work / f"probe-{hashlib.sha1(settings.model_dump_json().encode()).hexdigest()[:8]}"
    work.mkdir(parents=True, exist_ok=True)
    (work / "settings.json").write_text(settings.model_dump_json(indent=1))
    arms = all_arms(settings, args.probe)
    if args.resume_from is not None:
        print(f"{seed_parts_from(args.resume_from, settings, work)} runs taken from {args.resume_from}", flush=True)
    if args.report_only:
        write_results(settings, arms, work, args.out)
        return 0
    data = ensure_data(settings, work)
    if args.worker:
        run_pending(settings, worker_share([a for a in arms if a.kind != "public-only"], args.worker), work, data)
        return 0
    started = time.time()
    run_pending(settings, [a for a in arms if a.kind == "public-only"], work, data)  # shared by every arm of a seed
    if args.jobs > 1:
        base = [sys.executable, str(Path(__file__).resolve()), "--work", str(args.work), *sum((["--set", o] for o in args.overrides), [])]
        base += ["--probe", args.probe] if args.probe else []
        codes = run_workers(base, args.jobs)
        if any(codes):
            print(f"workers exited with {codes}", flush=True)
    else:
        run_pending(settings, arms, work, data)
    if not args.probe:
        write_results(settings, arms, work, args.out)
    else:
        summarize_probe(arms, work)
    print(f"done in {time.time() - started:.0f} s", flush=True)
    return 0


# -- results -------------------------------------------------------------------------------------------
#: settings that say how fast and in how much memory a run goes, or what else it scores — not what it trains
HOW_RUN = frozenset({"threads", "chunk_size", "max_batch_units", "score_local_models"})


def settings_differ(theirs: dict[str, Any], ours: Settings, ignore: frozenset[str] = frozenset()) -> list[str]:
    """The settings, beyond ``HOW_RUN`` and ``ignore``, in which a dump another session saved (perhaps
    from before a setting existed: its default) differs from ``ours``."""
    saved = Settings.model_validate(theirs).model_dump()
    return sorted(k for k, v in ours.model_dump().items() if k not in HOW_RUN | ignore and saved[k] != v)


def devices_of(parts: Iterable[dict[str, Any]]) -> list[str]:
    """The devices that ran ``parts``: runs saved before they recorded their device ran on the CPU."""
    return sorted({p.get("device", CPU_HOST) for p in parts})


#: settings that shape only the private arms (site_config's ``privacy`` block and the trainable set; the
#: step sizes are compared run by run): a sweep that changes these reuses another's public-only and non-private runs
PRIVATE_RECIPE = frozenset({
    "scenario", "lora_rank", "lora_alpha", "max_grad_norm", "k", "public_samples", "refresh_every_rounds",
    "site_basis_refresh_steps", "basis_public_rotation", "basis_public_grey", "public_view_factor", "public_view_bits",
    "public_gradient_weight", "augmentation_multiplicity", "delta", "unit", "max_records_per_unit", "noise_multiplier",
})


def seed_parts_from(results_path: Path, settings: Settings, work: Path) -> int:
    """Continue a sweep another machine or session began: write the runs a committed results.json
    holds as this work dir's parts (only where every setting that shapes a run is the same)."""
    results = json.loads(results_path.read_text())
    # which mechanisms, ε and seeds only choose the arms (each part's key names its own), and the step sizes are
    # checked run by run (below: a new site_lr reruns the federated and central arms, not the site-alone ones);
    # the rest is what a run means
    per_run = frozenset({"mechanisms", "epsilons", "seeds", "nonprivate", "site_lr", "site_alone_lr", "site_lr_at"})
    differ = settings_differ(results["settings"], settings, ignore=per_run)
    if differ and not set(differ) <= PRIVATE_RECIPE:
        raise SystemExit(f"{results_path}: its settings differ from this sweep's in {', '.join(differ)}; not resuming from it")
    if differ:
        print(f"{results_path}: another private recipe ({', '.join(differ)}): taking its public-only and non-private runs only", flush=True)
    # runs saved before step sizes were recorded used their sweep's rule, without per-arm step sizes
    before_site_lr_at = Settings.model_validate(results["settings"]).model_copy(update={"site_lr_at": {}})
    written, rerun = 0, []
    for key, part in results["runs"].items():
        arm = Arm(**{field.name: part[field.name] for field in dataclasses.fields(Arm)})
        if differ and arm.mechanism != "none":
            continue
        if part.get("lr", arm_lr(before_site_lr_at, arm)) != arm_lr(settings, arm):
            rerun.append(key)  # another step size: a different run, done again
            continue
        if arm.mechanism != "none" and not math.isclose(part["noise_multiplier"], arm_noise_multiplier(settings, arm), rel_tol=1e-6):
            rerun.append(key)  # the same ε accounted otherwise today (FDP's relation, 2026-11-27): another σ
            continue
        path = part_path(work, key)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(part))
            written += 1
    if rerun:
        print(f"not taken (another step size or σ than this sweep's): {', '.join(rerun)}", flush=True)
    return written


def load_parts(arms: list[Arm], work: Path) -> dict[str, dict[str, Any]]:
    parts = {}
    for arm in arms:
        path = part_path(work, arm.key)
        if path.exists():
            parts[arm.key] = json.loads(path.read_text())
    return parts


def summarize_probe(arms: list[Arm], work: Path) -> None:
    for key, part in load_parts(arms, work).items():
        scores = part["scores"]
        own = [scores[s]["pckh50"] for s in scores if s.startswith("site-")]
        print(f"{key}: own splits {np.mean(own):.2f} mixture {scores['mixture']['pckh50']:.2f} curve {part.get('curve_mixture_pckh50')}")
        for alpha, per_site in (part.get("local_scores") or {}).items():
            print(f"  each site's last local model, α {alpha}: own splits "
                  f"{np.mean([v['pckh50'] for v in per_site.values()]):.2f}")


def collect_probes(work: Path, out: Path) -> None:
    """Every ``probe-*`` run under ``work`` as one tuning record: what each probe changed (settings
    that differ from the defaults) and what each of its runs scored."""
    from fedpose.io import atomic_write_json

    defaults = Settings().model_dump()
    probes = []
    for directory in sorted(work.glob("probe-*")):
        settings = Settings.model_validate_json((directory / "settings.json").read_text())
        changed = {k: v for k, v in settings.model_dump().items() if v != defaults[k]}
        runs = []
        for path in sorted((directory / "parts").glob("*.json")):
            part = json.loads(path.read_text())
            scores = part["scores"]
            runs.append({"arm": part["key"], "mixture_pckh50": scores["mixture"]["pckh50"],
                         "own_splits_pckh50": {k: v["pckh50"] for k, v in scores.items() if k != "mixture"},
                         "curve_mixture_pckh50": [None if x is None else round(x, 2) for x in part.get("curve_mixture_pckh50") or []],
                         "local_own_splits_pckh50": {alpha: {s: v["pckh50"] for s, v in per_site.items()}
                                                     for alpha, per_site in (part.get("local_scores") or {}).items()} or None,
                         "noise_multiplier": part.get("noise_multiplier"), "epsilon_spent": part.get("epsilon_spent"),
                         "wall_seconds": part["wall_seconds"], "load_before": part.get("load_before")})
        probes.append({"probe": directory.name, "changed_settings": changed, "runs": runs})
    atomic_write_json(out, {
        "what": "tuning probes of benchmarks/federated_utility (--probe): each probe's settings that differ from "
                "the defaults, and every run's scores; tuning data (its data_seed), never a reported split",
        "conditions": {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                       "note": "one torch thread per run, two runs at a time beside other work: see each run's "
                               "load_before; wall_seconds are not timings"},
        "defaults": defaults, "probes": probes})
    print(f"{len(probes)} probes → {out}")


def arm_table(settings: Settings, parts: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (privacy setting, arm): mean ± std over seeds of the own-split and mixture PCKh."""
    site_ids = [f"site-{k}" for k in range(1, settings.sites + 1)]
    privacy_settings = [("none", None)] + [(m, e) for m in settings.mechanisms for e in sorted(settings.epsilons)]
    rows = []
    for mechanism, epsilon in privacy_settings:
        kinds = ["site-alone", "federated", "central"] if mechanism != "none" else ["public-only", "federated", "central"]
        for kind in kinds:
            per_seed: dict[str, list[float]] = {}
            for seed in settings.seeds:
                def get(site: str | None) -> dict[str, Any] | None:
                    arm = Arm(seed, mechanism if kind != "public-only" else "none", epsilon if kind != "public-only" else None, kind, site)
                    return parts.get(arm.key)

                if kind == "site-alone":
                    got = {s: get(s) for s in site_ids}
                    if any(v is None for v in got.values()):
                        continue
                    own = {s: got[s]["scores"][s] for s in site_ids}  # each site's model on its own split
                    mixture50 = float(np.mean([got[s]["scores"]["mixture"]["pckh50"] for s in site_ids]))
                    mixture10 = float(np.mean([got[s]["scores"]["mixture"]["pckh10"] for s in site_ids]))
                else:
                    part = get(None)
                    if part is None:
                        continue
                    own = {s: part["scores"][s] for s in site_ids}
                    mixture50, mixture10 = part["scores"]["mixture"]["pckh50"], part["scores"]["mixture"]["pckh10"]
                values = {"own50": float(np.mean([own[s]["pckh50"] for s in site_ids])),
                          "own10": float(np.mean([own[s]["pckh10"] for s in site_ids])),
                          "mixture50": mixture50, "mixture10": mixture10,
                          **{f"{s}_50": own[s]["pckh50"] for s in site_ids}, **{f"{s}_10": own[s]["pckh10"] for s in site_ids}}
                for name, value in values.items():
                    per_seed.setdefault(name, []).append(value)
            if not per_seed:
                continue
            n = len(per_seed["own50"])
            rows.append({"mechanism": mechanism, "epsilon": epsilon, "arm": kind, "seeds": n,
                         **{f"{k}_mean": round(float(np.mean(v)), 2) for k, v in per_seed.items()},
                         **{f"{k}_std": round(float(np.std(v, ddof=1)) if len(v) > 1 else 0.0, 2) for k, v in per_seed.items()},
                         "per_seed_own50": [round(x, 2) for x in per_seed["own50"]]})
    return rows


#: ε per patient → the fraction of the public-only → central non-private gap federated private training must recover (issue 26)
RECOVERY_GOALS = {8.0: 0.7, 2.0: 0.4}


def goals(settings: Settings, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's three goals per private setting, with the measured numbers."""
    def row(mechanism: str, epsilon: float | None, arm: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["mechanism"] == mechanism and r["epsilon"] == epsilon and r["arm"] == arm), None)

    out = []
    central_np = row("none", None, "central")
    fed_np = row("none", None, "federated")
    public = row("none", None, "public-only")
    for mechanism in settings.mechanisms:
        for epsilon in sorted(settings.epsilons):
            fed, alone, central = row(mechanism, epsilon, "federated"), row(mechanism, epsilon, "site-alone"), row(mechanism, epsilon, "central")
            if not (fed and alone and central) or any(r["seeds"] < len(settings.seeds) for r in (fed, alone, central)):
                continue  # a goal is judged on every seed, never on the runs a cut-short sweep has so far
            entry: dict[str, Any] = {"mechanism": mechanism, "epsilon": epsilon,
                                     "fed_minus_alone": round(fed["own50_mean"] - alone["own50_mean"], 2),
                                     "central_minus_fed": round(central["own50_mean"] - fed["own50_mean"], 2)}
            entry["fed_beats_alone_by_5"] = entry["fed_minus_alone"] >= 5
            entry["fed_within_3_of_central"] = entry["central_minus_fed"] <= 3
            if fed_np:
                entry["privacy_cost_federated"] = round(fed_np["own50_mean"] - fed["own50_mean"], 2)
            if central_np and public:
                gap = central_np["own50_mean"] - public["own50_mean"]
                entry["gap_public_to_central_nonprivate"] = round(gap, 2)
                entry["fed_recovers_fraction"] = round((fed["own50_mean"] - public["own50_mean"]) / gap, 3) if gap > 0 else None
                if epsilon in RECOVERY_GOALS:
                    entry["fed_recovers_goal"] = RECOVERY_GOALS[epsilon]
                    entry["fed_recovers_goal_met"] = (entry["fed_recovers_fraction"] is not None
                                                      and entry["fed_recovers_fraction"] >= RECOVERY_GOALS[epsilon])
            out.append(entry)
    return out


#: under every results.md's goals: the per-folder tables are not the reported goal states
GOALS_NOTE = (
    "The percentages here use this table's own non-private runs, trained as long as the private arms. "
    "The goal states reported for issue 26 are in `benchmarks/federated_utility/summary.md`, against "
    "non-private training for 160 steps where that reference exists (10 sites: "
    "`sites10_nonprivate_rounds16/`), which recovers less."
)


def write_results(settings: Settings, arms: list[Arm], work: Path, out: Path) -> None:
    from fedpose.io import atomic_write_json, atomic_write_text

    parts = load_parts(arms, work)
    rows = arm_table(settings, parts)
    goal_rows = goals(settings, rows)
    devices = devices_of(p for p in parts.values() if p["kind"] != "public-only") or [this_device()]

    def versions(name: str) -> str:  # of the machines that ran the parts (a report may be written elsewhere)
        return "; ".join(sorted({p.get(name, "not recorded") for p in parts.values()})) or "none"

    conditions = {
        "device": "; ".join(devices),
        "torch": versions("torch"), "torch_threads_per_run": settings.threads,
        "python": versions("python"),
        "load_average_per_run": {k: {"before": p["load_before"], "after": p["load_after"]} for k, p in parts.items()},
        "wall_seconds_total_of_runs": round(sum(p["wall_seconds"] for p in parts.values()), 1),
        "transport": "in-process (fedpose.federation.server.in_process.InProcessTransport): the real RoundRunner "
                     "(coordinator round loop, basis service, update validation, aggregation, ledger) and the real "
                     "run_site_round (budget guard, private training); Flower's messaging bypassed",
        "data": f"synthetic, generator seed {settings.data_seed} for every seed (seeds vary warm start, sampling, augmentation; "
                "DP noise is always fresh CSPRNG)",
        "privacy": f"pdp, dpsgd: (ε,δ)-DP per {settings.unit} (add/remove one {settings.unit}), PLD accounting; fpdp: "
                   f"feature-level DP (FDP; replace-one {settings.unit}, ψ(x) public), PLD — FDP ε is not comparable with DP ε",
        "tuning": "every hyper-parameter chosen on the tuning data (generator seed 7: tuning_probes.json, "
                  "noise_or_subspace.json), never on the reported data (generator seed "
                  f"{settings.data_seed}{' — this IS the tuning data' if settings.data_seed == 7 else ''})",
    }
    results = {"settings": settings.model_dump(), "conditions": conditions, "table": rows, "goals": goal_rows,
               "runs": parts, "complete": len(parts) == len(arms), "runs_done": len(parts), "runs_planned": len(arms)}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "results.json", results)
    atomic_write_text(out / "results.md", markdown(settings, rows, goal_rows, results))
    plot(settings, rows, parts, out / "results.png")


def _pm(row: dict[str, Any], name: str) -> str:
    return f"{row[f'{name}_mean']:.1f} ± {row[f'{name}_std']:.1f}"


def markdown(settings: Settings, rows: list[dict[str, Any]], goal_rows: list[dict[str, Any]], results: dict[str, Any]) -> str:
    from fedpose.privacy.mechanisms import get_mechanism

    site_ids = [f"site-{k}" for k in range(1, settings.sites + 1)]
    where = " and ".join(sorted({"GPU" if device.startswith("cuda") else "CPU" for device in results["conditions"]["device"].split("; ")}))
    lines = [f"# Federated utility: why federate (synthetic {settings.sites}-site data, {where})", "",
             f"Runs done: {results['runs_done']} / {results['runs_planned']}. PCKh in %, mean ± std over seeds "
             f"{settings.seeds}; *own* = mean over the sites of each model on the site's own test split "
             "(site-alone: each site's own model), *mixture* = the union of the sites' test splits.", "",
             "| mechanism | ε per site (δ = 1e-5) | arm | own PCKh@0.5 | own PCKh@0.1 | mixture @0.5 | mixture @0.1 | "
             + " | ".join(f"{s} @0.5" for s in site_ids) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * len(site_ids)]
    for r in rows:
        guarantee = f"{get_mechanism(r['mechanism']).guarantee.name}, per {settings.unit}"
        eps = "∞" if r["epsilon"] is None else f"{r['epsilon']:g} ({guarantee}, PLD)"
        arm = r["arm"] + (f" ({r['seeds']} of {len(settings.seeds)} seeds so far)" if r["seeds"] < len(settings.seeds) else "")
        lines.append(f"| {r['mechanism']} | {eps} | {arm} | {_pm(r, 'own50')} | {_pm(r, 'own10')} | {_pm(r, 'mixture50')} | "
                     f"{_pm(r, 'mixture10')} | " + " | ".join(_pm(r, f"{s}_50") for s in site_ids) + " |")
    lines += ["", "## Goals (own test splits, mean over sites)", "", GOALS_NOTE, ""]
    for g in goal_rows:
        mark = lambda ok: "**met**" if ok else "**missed**"  # noqa: E731
        text = (f"- {g['mechanism']} ε = {g['epsilon']:g}: federated − site-alone = {g['fed_minus_alone']:+.1f} "
                f"(≥ 5: {mark(g['fed_beats_alone_by_5'])}); central − federated = {g['central_minus_fed']:+.1f} "
                f"(≤ 3: {mark(g['fed_within_3_of_central'])})")
        if g.get("fed_recovers_fraction") is not None:
            text += f"; federated recovers {100 * g['fed_recovers_fraction']:.0f} % of public-only → central non-private"
            if "fed_recovers_goal" in g:
                text += f" (≥ {g['fed_recovers_goal']:.0%} at ε {g['epsilon']:g}: {mark(g['fed_recovers_goal_met'])})"
        if "privacy_cost_federated" in g:
            text += f"; federated non-private − federated private = {g['privacy_cost_federated']:+.1f}"
        lines.append(text)
    lines += ["", "## Settings", "", "```json", json.dumps(results["settings"], indent=1), "```", "",
              "Conditions: " + json.dumps({k: v for k, v in results["conditions"].items() if k != "load_average_per_run"}), ""]
    return "\n".join(lines)


def plot(settings: Settings, rows: list[dict[str, Any]], parts: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # a table of the non-private arms alone (mechanisms = []) gets one column: public-only and non-private
    configs = [(m, e) for m in settings.mechanisms for e in sorted(settings.epsilons)] or [("none", None)]
    fig, axes = plt.subplots(2, len(configs), figsize=(4.2 * len(configs), 7.5), squeeze=False)
    colours = {"public-only": "gray", "site-alone": "tab:orange", "federated": "tab:blue", "central": "tab:green",
               "federated (non-private)": "tab:cyan", "central (non-private)": "tab:olive"}
    for col, (mechanism, epsilon) in enumerate(configs):
        private = mechanism != "none"
        ax = axes[0][col]
        chosen = [r for r in rows if private and r["mechanism"] == mechanism and r["epsilon"] == epsilon]
        chosen += [dict(r, arm=f"{r['arm']} (non-private)") for r in rows if r["mechanism"] == "none" and r["arm"] != "public-only"]
        chosen = [r for r in rows if r["mechanism"] == "none" and r["arm"] == "public-only"] + chosen
        names = [r["arm"] for r in chosen]
        ax.bar(range(len(chosen)), [r["own50_mean"] for r in chosen], yerr=[r["own50_std"] for r in chosen], capsize=3,
               color=[colours.get(n, "k") for n in names])
        ax.set_xticks(range(len(chosen)), [n.replace(" (", "\n(") for n in names], rotation=45, ha="right", fontsize=7)
        guarantee, adjacency = ("FDP", "replace") if mechanism == "fpdp" else ("DP", "add/remove")
        title = (f"{mechanism}: each site ({guarantee}) ε = {epsilon:g} per {settings.unit},\nδ = {settings.delta:g}, "
                 f"{adjacency} one {settings.unit}, PLD" if private else
                 f"non-private arms, {settings.rounds} rounds × {settings.local_steps} steps")
        ax.set(title=title, ylabel="PCKh@0.5, own test splits (%)")
        ax.title.set_fontsize(9)
        ax = axes[1][col]
        private_arms = (("site-alone", "site-alone (site-1)"), ("federated", "federated"), ("central", "central"))
        for kind, label in private_arms if private else ():
            curves = [parts[k]["curve_mixture_pckh50"] for k in parts
                      if k.endswith(f"{mechanism}-eps{epsilon:g}/{kind}" + ("/site-1" if kind == "site-alone" else ""))]
            _curve(ax, curves, label, colours[kind])
        for kind in ("federated", "central"):
            curves = [parts[k]["curve_mixture_pckh50"] for k in parts if k.endswith(f"nonprivate/{kind}")]
            _curve(ax, curves, f"{kind} (non-private)", colours[f"{kind} (non-private)"])
        ax.set(xlabel="round (0 = public-only)", ylabel="PCKh@0.5, mixture (%)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _curve(ax: Any, curves: list[list[float]], label: str, colour: str) -> None:
    if not curves:
        return
    length = min(len(c) for c in curves)
    values = np.array([[math.nan if v is None else v for v in c[:length]] for c in curves], dtype=float)
    mean, std = values.mean(axis=0), values.std(axis=0)
    xs = np.arange(length)
    ax.plot(xs, mean, label=label, color=colour)
    ax.fill_between(xs, mean - std, mean + std, color=colour, alpha=0.15)


if __name__ == "__main__":
    sys.exit(main())
