"""Federation configuration: one site, the coordinator, and a whole simulated federation.

A site's config holds only what the site itself reads: its data and augmentation
(:class:`SiteDataConfig`), how its steps run (:class:`~fedpose.config.StepConfig`), its optimizer,
privacy and input privacy (the sections of :mod:`fedpose.config`, so a site's steps are
``fedpose train``'s steps), plus what only a federation has: a stable site id, a persisted state
directory and a per-site ε budget. The coordinator's instruction carries the global model's spec
every round; what of it changes what the site's guarantee means (the input size under FDP and
MaskDP) the site pins in its state and checks (:mod:`fedpose.federation.site_pins`). The
coordinator adds rounds, aggregation and the basis transport.

Privacy note: ``eps_max`` is a bound on the guarantee named by ``privacy.mechanism`` (record-level
(ε,δ)-DP for dpsgd/pdp, feature-level DP for fdp/fpdp, MaskDP for maskdp), at δ = ``privacy.delta``,
RDP accounting, composed over every local step of every round the site joins.
"""

from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from fedpose.config import (
    DEVICE_CHOICES,
    GREY_SCENARIOS,
    AugmentationConfig,
    DataConfig,
    DeviceSetting,
    InputPrivacyConfig,
    ModelConfig,
    OptimConfig,
    PrivacyConfig,
    StepConfig,
    Strict,
    check_augmentation_multiplicity,
    check_basis_rank,
    grey_copies_refuse_projection,
)
from fedpose.privacy.mechanisms import get_mechanism

# A site id is used as a file name, a Prometheus label and a SQLite key: keep it boring.
SITE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"

AggregationName = Literal["fedavg", "fedadam", "fedavgm"]
BasisTransport = Literal["full", "compact"]
BasisDtype = Literal["float32", "float16", "bfloat16"]


class AggregationConfig(Strict):
    """Server optimizer applied to the weighted mean update Δ (the pseudo-gradient)."""

    strategy: AggregationName = Field("fedavg", description="fedavg | fedadam | fedavgm")
    server_lr: float | None = Field(
        None, gt=0, description="server learning rate η (None: 1.0 for fedavg/fedavgm, 0.01 for fedadam)"
    )
    momentum: float = Field(0.9, ge=0, lt=1, description="fedavgm: server momentum β")
    beta1: float = Field(0.9, ge=0, lt=1, description="fedadam: first-moment decay")
    beta2: float = Field(0.99, ge=0, lt=1, description="fedadam: second-moment decay")
    tau: float = Field(1e-3, gt=0, description="fedadam: adaptivity (ε in the denominator)")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="cosine: η decays from server_lr to final_lr_fraction × server_lr over coordinator.rounds "
        "(DP noise leaves a model wandering at a floor proportional to the step; raising rounds on resume stretches the decay)",
    )
    final_lr_fraction: float = Field(0.1, gt=0, le=1, description="cosine: η in the last round, as a fraction of server_lr")


class BasisTransportConfig(Strict):
    """How the coordinator ships the public-subspace basis V (p×k) to sites (pdp / fpdp)."""

    source: Literal["coordinator", "sites"] = Field(
        "coordinator",
        description="coordinator: one V per refresh at the global weights, shipped to every site; sites: the "
        "coordinator ships none and each projecting site recomputes V from its own copy of S_pub every "
        "privacy.basis.refresh_every local steps at its current weights (PDP-SGD's own schedule; site public_data needed)",
    )
    refresh_every_rounds: int = Field(1, ge=1, description="recompute V every R rounds on the current global model")
    transport: BasisTransport = Field(
        "compact",
        description="full: send V itself; compact: send a recipe (public sample ids + m×k mixing "
        "matrix) and let the site rebuild V from its copy of the public set",
    )
    dtype: BasisDtype = Field("float32", description="wire dtype of V in full mode")
    k: int = Field(50, ge=1, description="projection dimension (top-k eigenvectors of the public second moment; at most public_samples)")
    public_samples: int = Field(100, ge=1, description="m, public samples per basis computation")

    @model_validator(mode="after")
    def _reachable_k(self) -> "BasisTransportConfig":
        check_basis_rank(self.k, self.public_samples)
        return self


class SiteOptimConfig(OptimConfig):
    """A site's optimizer: built fresh for every round (each round is a new ClientApp process), so
    its schedule runs over that round's local steps; constant by default."""

    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up over each round's first local steps")
    cosine: bool = Field(False, description="cosine decay to 0 over each round's local steps (else constant)")


class SiteDataConfig(AugmentationConfig):
    """A site's training data and its augmentation. No input size: the site trains at the global
    model's (``input_size`` of the coordinator's model spec, pinned in the site's state at its first
    round: :mod:`fedpose.federation.site_pins`); no validation split: the coordinator
    evaluates."""

    train: Path = Field(..., description="the site's training data (dataset directory or COCO json)")


class SiteIdentityConfig(Strict):
    """A site's long-term identity (`fedpose site identity` makes a key): it signs its secure-aggregation
    round keys, checking every peer's against the list it was given out of band, and its train replies
    (checked by a coordinator that lists the key in ``coordinator.site_identities``)."""

    key: Path = Field(..., description="this site's Ed25519 private key (PEM; never leaves the site)")
    peers: dict[str, str] = Field(
        ..., min_length=2,
        description="site id → Ed25519 public key (base64, as `fedpose site identity` prints it) of every site this site "
        "may share a secure sum with, its own included — exchanged between the sites out of band, never through the "
        "coordinator: a directory key that is not signed by the listed identity of its site id is refused",
    )
    max_colluding_sites: int = Field(
        0, ge=0,
        description="c: how many other sites of a round may collude with the coordinator while this site's update "
        "stays hidden in the sum. The site refuses a setup whose threshold t ≤ (n + c)/2 (two views of who survived "
        "could then both gather t signatures, the colluders signing both) and, for c > 0, masks only with every key "
        "holder of the round. The coordinator's secure_aggregation.max_colluding_sites must be at least this. 0: "
        "protection holds against a coordinator that colludes with no site",
    )

    @model_validator(mode="after")
    def _peer_ids(self) -> "SiteIdentityConfig":
        # a garbled key would otherwise surface only mid-round, as that peer's keys "unsigned"
        _check_public_keys("identity.peers", self.peers)
        return self


def _check_public_keys(where: str, keys: dict[str, str]) -> None:
    """Site ids mapped to Ed25519 public keys (base64 of 32 bytes), or ValueError naming the bad ones."""
    bad = [site_id for site_id in keys if not re.fullmatch(SITE_ID_PATTERN, site_id)]
    if bad:
        raise ValueError(f"{where}: {bad} are not site ids")
    garbled = [site_id for site_id, key in keys.items() if not _is_ed25519_public_key(key)]
    if garbled:
        raise ValueError(f"{where}: the keys of {garbled} are not Ed25519 public keys "
                         "(base64 of 32 bytes, as `fedpose site identity` prints them)")


def _is_ed25519_public_key(text: str) -> bool:
    try:
        return len(base64.b64decode(text, validate=True)) == 32
    except (binascii.Error, ValueError):
        return False


class SiteConfig(Strict):
    """One clinical site (`sites/` ClientApp). The site is the authority on its own budget."""

    site_id: str = Field(..., pattern=SITE_ID_PATTERN, description="stable site id (budgets are keyed by it, not by Flower's node id)")
    data: SiteDataConfig = Field(..., description="the site's training data and augmentation")
    public_data: Path | None = Field(None, description="site copy of S_pub (needed for compact basis transport)")
    state_dir: Path = Field(..., description="persisted site state: budget ledger, basis cache")
    eps_max: float = Field(..., gt=0, description="ε budget of this site (guarantee of privacy.mechanism, δ = privacy.delta)")
    local_steps: int = Field(50, ge=1, description="local optimizer steps per round")
    optim: SiteOptimConfig = SiteOptimConfig()
    train: StepConfig = StepConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    input_privacy: InputPrivacyConfig = InputPrivacyConfig()
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Prometheus port (None = no server)")
    aggregation_weight: float = Field(
        1.0, gt=0, description="declared FedAvg weight of this site's update (a public setting, never the dataset size)"
    )
    require_secure_aggregation: bool = Field(
        False,
        description="refuse every round whose update would leave in the clear (a plain round is refused before any "
        "data work or spend); the site then only trains in secure-aggregation rounds. Against a coordinator that "
        "may lie, set `identity` too: without it the round keys are unsigned, and a coordinator that substitutes "
        "its own can unmask this site's update (its DP guarantee holds either way; docs/privacy.md)",
    )
    identity: SiteIdentityConfig | None = Field(
        None,
        description="sign this site's secure-aggregation keys and check its peers', and sign its train replies (None: "
        "keys unsigned — the coordinator is trusted to relay them faithfully, docs/privacy.md — and replies unsigned)",
    )
    reply_after_s: float | None = Field(
        None, gt=0,
        description="hold every train reply until this many seconds after its instruction arrived: whoever sees when "
        "replies arrive then sees the same round time whatever the data, as long as the round's work fits in it (the "
        "work before the DP steps — reading annotations, checking the files, loading the decoded windows — grows with "
        "the dataset size, and the first round decodes every image unless `fedpose site prepare` did). "
        "A longer round replies at the next whole multiple of it (noted in site.log only), so its arrival tells how many "
        "holds the work took, never its time. The coordinator's round_timeout_s must exceed it. "
        "None: reply when done",
    )
    max_basis_k: int = Field(
        128, ge=1,
        description="largest projection dimension k the site accepts in a coordinator's basis V (p × k floats in memory: "
        "k = 128 at p = 4.7 M is 2.4 GB); a larger V is refused before any spend",
    )

    @model_validator(mode="after")
    def _private_at_the_boundary(self) -> "SiteConfig":
        """What a site must declare so that nothing it sends depends on its data beyond the guarantee."""
        # Before the mechanism's early return: LDP-Slicing at the input is a guarantee of its own, also
        # at a site whose gradient mechanism is "none".
        if getattr(self.input_privacy, "insecure_seed", None) is not None:
            raise ValueError(f"site '{self.site_id}': input_privacy.insecure_seed is for tests only; a site refuses to federate with it")
        check_augmentation_multiplicity(self.privacy, self.data, f"site '{self.site_id}': ")
        if self.identity is not None and self.site_id not in self.identity.peers:
            raise ValueError(f"site '{self.site_id}': identity.peers must list this site's own public key too")
        if not get_mechanism(self.privacy.mechanism).noisy:
            return self
        if self.privacy.sample_rate is None:
            raise ValueError(
                f"site '{self.site_id}': privacy.sample_rate (q) must be declared at a federation site: with q = B/N "
                "the reported ε and RDP curve would reveal the dataset size N, which add/remove DP protects. "
                "Set it to about train.batch_size / <number of training records>"
            )
        if getattr(self.privacy, "insecure_seeded_noise", False):
            raise ValueError(
                f"site '{self.site_id}': privacy.insecure_seeded_noise is for tests only (anyone who knows train.seed "
                "can remove the noise); a site refuses to federate with it"
            )
        return self

    @property
    def delta(self) -> float:
        return self.privacy.delta


class WarmStartConfig(Strict):
    """Non-private training of the initial global model on the coordinator's public data."""

    steps: int = Field(0, ge=0, description="optimizer steps on coordinator.public_data before round 1 (0 = none; no privacy cost)")
    batch_size: int = Field(16, ge=1, description="warm-start batch size")
    optim: OptimConfig = Field(OptimConfig(warmup_steps=20), description="warm-start optimizer and schedule")


class WeightEmaConfig(Strict):
    """An exponential moving average of the global model over rounds (fedpose.federation.weight_ema):
    post-processing of the aggregated privatized updates, free in privacy; evaluated and published
    instead of the iterate, never sent to the sites."""

    decay: float = Field(
        0.0, ge=0, lt=1,
        description="0: off; else ema ← decay·ema + (1−decay)·w_r after each round (a running mean of the rounds "
        "so far while that weighs the newest round more); evaluation and global_ema.npz use the average",
    )

    @property
    def on(self) -> bool:
        return self.decay > 0


class SecureAggregationConfig(Strict):
    """SecAgg+ (Bell et al. 2020) over the full graph: the coordinator learns only the sum of the
    sites' quantized updates (:mod:`fedpose.federation.secagg`). Every value here is public: it is
    sent to every site in the setup stage, and the site checks it before anything else.

    Quantization: a site clips its privatized Δ (flattened in the global model's parameter order)
    per coordinate to [−r, r] (r = ``clip_range``), multiplies it by its declared aggregation weight
    w, clips w·Δ to [−R, R] (R = r·``max_weight``: a no-op unless w > W) and rounds it
    stochastically to ``bits``-bit integers; the
    coordinator adds n ≤ ``max_sites`` of them modulo M = 2^``modulus_bits``. The sum never wraps
    because n_max · (2^bits − 1) < M (checked here). Error of the dequantized sum, per coordinate:
    < n · 2R / (2^bits − 1) (each site's stochastic rounding errs by less than one step)."""

    enabled: bool = Field(False, description="mask every site's update: the coordinator sees only the sum over the round's sites")
    clip_range: float = Field(
        0.05, gt=0,
        description="r: each coordinate of a site's privatized Δ is clipped to [−r, r] before quantizing (public; "
        "the site says so in its privacy report)",
    )
    max_weight: float = Field(1.0, gt=0, description="W: largest aggregation weight; w·Δ is clipped to [−W·r, W·r]")
    bits: int = Field(16, ge=2, le=30, description="quantization levels per coordinate: 2^bits (stochastic rounding)")
    modulus_bits: int = Field(32, ge=8, le=62, description="m: the masked sum is computed modulo M = 2^m")
    max_sites: int = Field(64, ge=2, description="n_max: most sites in one secure sum (the no-overflow proof's n)")
    max_colluding_sites: int = Field(
        0, ge=0,
        description="c: the threshold is t = ⌊(n + c)/2⌋ + 1, so that no two views of who survived can both be "
        "certified by t sites when up to c of them collude with the coordinator; a site refuses a lower t than its own "
        "identity.max_colluding_sites asks for. Larger c tolerates fewer dropouts (n − t)",
    )

    @model_validator(mode="after")
    def _no_overflow(self) -> "SecureAggregationConfig":
        if self.max_sites * (2**self.bits - 1) >= 2**self.modulus_bits:
            raise ValueError(
                f"secure_aggregation: max_sites · (2^bits − 1) = {self.max_sites} · {2**self.bits - 1} = "
                f"{self.max_sites * (2**self.bits - 1)} must be < 2^modulus_bits = {2**self.modulus_bits} "
                "(else the masked sum could wrap): raise modulus_bits or lower bits / max_sites")
        return self


class CoordinatorConfig(Strict):
    """The coordinator (`coordinator/` ServerApp)."""

    rounds: int = Field(10, ge=1, description="federated rounds")
    min_sites: int = Field(1, ge=1, description="minimum sites that must reply for a round to count")
    expected_sites: int | None = Field(
        None, ge=1,
        description="sites a fresh run waits for before its first round (at most round_timeout_s); None: until the "
        "number of connected sites has been stable for 5 s (a resumed run waits for the sites it knows)")
    fraction_train: float = Field(1.0, gt=0, le=1, description="fraction of non-exhausted sites asked per round")
    round_timeout_s: float = Field(600.0, gt=0, description="round timeout; also the message TTL")
    local_steps: int = Field(50, ge=1, description="local steps each site is asked to run per round")
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    public_data: Path | None = Field(None, description="S_pub for the basis (pdp / fpdp)")
    aggregation: AggregationConfig = AggregationConfig()
    update_norm_bound: float | None = Field(None, gt=0, description="reject updates with ‖Δ‖₂ above this (None = no bound)")
    site_identities: dict[str, str] = Field(
        default_factory=dict,
        description="site id → the public key of the site's identity (base64, as `fedpose site identity` prints it). "
        "When set, a train reply counts for the site it names only if that site's identity signed it (its update's "
        "digest included), and a site not listed is not used: no other node can answer in a site's name. Empty: "
        "replies are taken at their word (any admitted node could send one naming any site)",
    )
    basis: BasisTransportConfig = BasisTransportConfig()
    secure_aggregation: SecureAggregationConfig = Field(
        SecureAggregationConfig(), description="SecAgg+: the coordinator sees only the sum of the sites' updates (off by default)")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Prometheus port (None = no server)")
    metrics_addr: str = Field("127.0.0.1", description="address the Prometheus exporter binds (it has no authentication: "
                              "0.0.0.0 only inside a container whose port is published to the host's loopback)")
    checkpoint_dir: Path = Field(Path("runs/federation/coordinator"), description="global model, server-optimizer state, ledger")
    ledger_db: Path | None = Field(None, description="SQLite budget ledger (default: <checkpoint_dir>/ledger.sqlite)")
    seed: int = Field(0, description="seed for site selection and the public-sample choice")
    device: DeviceSetting = Field("auto", description=f"where the warm start, basis computation and evaluation run: {DEVICE_CHOICES}")
    ema: WeightEmaConfig = Field(WeightEmaConfig(), description="moving average of the global model over rounds (off by default)")
    warm_start: WarmStartConfig = Field(
        WarmStartConfig(),
        description="train the initial global model on public_data first (a from-scratch model's BatchNorm "
        "statistics always come from public_data when it is set)",
    )

    @model_validator(mode="after")
    def _site_identity_keys(self) -> "CoordinatorConfig":
        _check_public_keys("site_identities", self.site_identities)
        return self

    @model_validator(mode="after")
    def _warm_start_needs_public_data(self) -> "CoordinatorConfig":
        if self.warm_start.steps > 0 and self.public_data is None:
            raise ValueError("warm_start.steps > 0 needs coordinator.public_data (the warm start trains on public data only)")
        return self

    @property
    def ledger_path(self) -> Path:
        return self.ledger_db if self.ledger_db is not None else self.checkpoint_dir / "ledger.sqlite"


class SimulationConfig(Strict):
    cpus_per_site: float = Field(1.0, gt=0, description="Ray resources per ClientApp (2-core machines: 1)")
    gpus_per_site: float | None = Field(
        None, ge=0, le=1,
        description="GPU fraction per ClientApp (Ray num_gpus); None: the visible CUDA GPUs shared evenly among the "
        "sites (at most 1 each), 0 when there are none or every site sets train.device = 'cpu'",
    )


class FederationConfig(Strict):
    """`fedpose simulate`: one coordinator and its sites in one config file."""

    run_id: str = Field("fedpose", pattern=SITE_ID_PATTERN, description="stable run id (site budget entries are keyed by (run id, round))")
    coordinator: CoordinatorConfig = CoordinatorConfig()
    sites: list[SiteConfig] = Field(..., min_length=1)
    simulation: SimulationConfig = SimulationConfig()

    @model_validator(mode="after")
    def _unique_sites(self) -> "FederationConfig":
        ids = [s.site_id for s in self.sites]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"sites: duplicate site_id {duplicates}")
        states = [s.state_dir.resolve() for s in self.sites]
        if len(set(states)) != len(states):
            raise ValueError("sites: every site needs its own state_dir (budgets must not be shared)")
        return self

    @model_validator(mode="after")
    def _grey_copies_are_not_projected(self) -> "FederationConfig":
        # A site's engine refuses it too, but only when its first round starts: say it before the run.
        if self.coordinator.model.scenario in GREY_SCENARIOS:
            projecting = [s.site_id for s in self.sites if get_mechanism(s.privacy.mechanism).projects]
            if projecting:
                raise ValueError(grey_copies_refuse_projection(f"sites {projecting}"))
        return self
