"""Run configuration: pydantic models loaded from TOML, validated once at the edge.

Unknown keys and invalid values are rejected with a message naming the dotted key
(e.g. ``privacy.basis.k``). ``--set key=value`` overrides are applied before validation.
"""

from __future__ import annotations

import os
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

from fedpose.privacy.mechanisms import MECHANISM_NAMES, MECHANISMS, get_mechanism


M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names the key."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


#: the values a device setting takes (``train.device``, ``coordinator.device``)
DEVICE_CHOICES = "'auto' (CUDA when available, else the CPU), 'cpu', 'cuda' or 'cuda:N'"


def _device_setting(value: str) -> str:
    """Syntax only: whether the device exists is decided where it runs (``fedpose.runtime.resolve_device``),
    since a coordinator validates its sites' configs on a machine that may have other devices."""
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", value):
        raise ValueError(f"must be {DEVICE_CHOICES}")
    return value


DeviceSetting = Annotated[str, AfterValidator(_device_setting)]


class AugmentationConfig(Strict):
    """Training-time augmentation: the keys central training's [data] and a site's [data] share."""

    flip: bool = Field(True, description="horizontal-flip augmentation (left/right joints swapped)")
    scale_jitter: float = Field(0.25, ge=0, lt=1, description="random scale factor range ±")
    rotation: float = Field(30.0, ge=0, le=180, description="random rotation: an angle ~ N(0, rotation²) degrees on 60 % of loads")
    rotation_clip: float = Field(
        1.0, ge=1, le=6,
        description="the rotation's hard range, in units of data.rotation: angles are clipped to ± rotation_clip × rotation "
        "(at most 180°). 1 keeps data.rotation the range; HRNet's recipe is 2 (MPII: rotation 30, so up to ±60°)",
    )

    @property
    def rotation_range(self) -> float:
        """The largest |angle| the augmentation draws (degrees)."""
        return min(180.0, self.rotation * self.rotation_clip)

    def augmentation_options(self) -> dict[str, Any]:
        """PoseDataset's augmentation keywords: every training set built from a config passes these."""
        return {"flip": self.flip, "scale_jitter": self.scale_jitter, "rotation": self.rotation,
                "rotation_range": self.rotation_range}

    @property
    def is_random(self) -> bool:
        """Whether two loads of one record can differ (any augmentation on)."""
        return self.flip or self.scale_jitter > 0 or self.rotation > 0


def check_augmentation_multiplicity(privacy: "PrivacyConfig", data: AugmentationConfig, where: str = "") -> None:
    """K > 1 copies of a record are only worth their K× cost when loading it twice can differ."""
    if privacy.augmentation_multiplicity > 1 and not data.is_random:
        raise ValueError(
            f"{where}privacy.augmentation_multiplicity = {privacy.augmentation_multiplicity}: every copy of a record would be "
            "the same image (data.flip is false, data.scale_jitter and data.rotation are 0); turn an augmentation on or "
            "set it to 1"
        )


class DataConfig(AugmentationConfig):
    train: Path | None = Field(None, description="dataset directory with annotations.json (training split)")
    val: Path | None = Field(None, description="dataset directory used for periodic validation")
    val_flip_test: bool = Field(
        True, description="validate with flip test: each crop's and its mirror's SimCC distributions averaged "
        "(post-processing of the model, no privacy cost; twice the forward passes)")
    input_size: tuple[int, int] = Field((256, 192), description="model input (height, width)")

    @model_validator(mode="after")
    def _sizes(self) -> "DataConfig":
        h, w = self.input_size
        if h % 32 or w % 32 or h <= 0 or w <= 0:
            raise ValueError(f"data.input_size must be positive multiples of 32, got {self.input_size}")
        return self


#: Which parameters train (:mod:`fedpose.model.pose_model` defines each set). Under DP-SGD the
#: noise's norm grows with √(trainable parameters), so a smaller set can pay at a given ε.
Scenario = Literal["finetune", "norms_head", "norms", "biases_norms", "grey_biases_norms", "grey_early_biases_norms", "lora",
                   "full", "scratch"]
#: the scenarios that keep most weights at ``model.init_checkpoint`` (random without one)
PARTIAL_SCENARIOS: tuple[str, ...] = ("finetune", "norms_head", "norms", "biases_norms", "grey_biases_norms", "grey_early_biases_norms",
                                      "lora")
#: the trainable sets of grey copies (fedpose.model.grey_copies): of every bias and LayerNorm affine,
#: or of those of the patch embedding and the first two stages only
GREY_SCENARIOS: tuple[str, ...] = ("grey_biases_norms", "grey_early_biases_norms")
#: low-rank adapters wider than this are refused (a spec from the coordinator must stay buildable)
MAX_LORA_RANK = 128


def grey_copies_refuse_projection(where: str) -> str:
    """Why ``where`` (the setting that chose pdp or fpdp) cannot train grey copies: the one message of
    the federation config's check (before a run) and the engine's (when a site's round starts)."""
    return (f"{where}: pdp and fpdp project onto public gradients, which are zero for grey copies "
            f"(model.scenario {' / '.join(repr(s) for s in GREY_SCENARIOS)}: public images are colour); use dpsgd, fdp or maskdp")


class ModelConfig(Strict):
    backbone: str = Field("tiny_vit_5m_224", description="timm TinyViT name, or 'tiny_vit_test' (small, for tests)")
    scenario: Scenario = Field(
        "finetune",
        description="which parameters train (trainable of all, tiny_vit_5m_224 at 256×192 | 128×96, measured): "
        "finetune: stage 3 + every LayerNorm + the SimCC head (4.74 M of 7.17 M | 4.33 M of 6.76 M); "
        "norms_head: every LayerNorm + the head (2.11 M | 1.70 M); "
        "norms: every LayerNorm + the head without its 3×3 joint conv (0.63 M | 0.22 M); "
        "biases_norms: every bias + every LayerNorm (BitFit; 31 k | 31 k); "
        "grey_biases_norms: a copy of biases_norms that grey (infrared) images use and train, colour images keep the "
        "base's (31 k | 31 k; fedpose.model.grey_copies); "
        "grey_early_biases_norms: those grey copies in the patch embedding and the first two stages only, where grey "
        "images differ from colour ones (5 k | 5 k); "
        "lora: rank-r adapters on stage 3's attention qkv/proj and MLP fc1/fc2 (base weights frozen) + every "
        "LayerNorm + the head (2.19 M | 1.78 M at r = 8, 82 k of them adapters); full: all; scratch: all, random init",
    )
    lora_rank: int = Field(8, ge=1, le=MAX_LORA_RANK, description="rank r of the low-rank adapters (scenario 'lora' only)")
    lora_alpha: float = Field(
        8.0, gt=0, description="adapter scale α: an adapter adds (α/r)·B·A to its frozen weight (scenario 'lora' only)"
    )
    init_checkpoint: Path | None = Field(None, description="timm state dict or fedpose checkpoint to start from")
    split_factor: int = Field(2, ge=1, le=8, description="SimCC bins per pixel")
    label_sigma: float = Field(6.0, gt=0, description="SimCC Gaussian label-smoothing σ, in bins")
    head_hidden: int = Field(256, ge=0, description="SimCC head hidden width (0 = flatten straight to the bins)")


class ModelSpec(Strict):
    """A built model's architecture: what rebuilding it needs (never its weights). Recorded in
    checkpoints, and sent with every round's instruction: a site trains the model it is sent."""

    backbone: str
    scenario: Scenario
    input_size: tuple[int, int]  #: (height, width)
    split_factor: int = Field(ge=1, le=8)  #: ModelConfig's bounds: a coordinator cannot send what no config could build
    label_sigma: float = Field(gt=0)
    head_hidden: int = Field(ge=0)
    #: the adapters of scenario "lora" (None otherwise; specs written before adapters existed lack them)
    lora_rank: int | None = Field(None, ge=1, le=MAX_LORA_RANK)
    lora_alpha: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _adapters(self) -> "ModelSpec":
        has_lora = self.scenario == "lora"
        if (self.lora_rank is not None, self.lora_alpha is not None) != (has_lora, has_lora):
            raise ValueError(f"model spec: scenario {self.scenario!r} with lora_rank {self.lora_rank} and lora_alpha "
                             f"{self.lora_alpha}: both are required for 'lora' and absent otherwise")
        return self

    @model_serializer(mode="wrap")
    def _without_absent_adapters(self, handler: Any) -> Any:
        # A spec without adapters serializes exactly as before they existed, so instructions,
        # checkpoints and audit logs of the other scenarios stay readable by earlier versions.
        data = handler(self)
        if isinstance(data, dict) and self.scenario != "lora":
            data.pop("lora_rank", None)
            data.pop("lora_alpha", None)
        return data


class OptimConfig(Strict):
    name: Literal["adamw", "sgd"] = Field("adamw", description="optimizer")
    lr: float = Field(1e-3, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.01, ge=0, description="decoupled weight decay (adamw) / L2 (sgd)")
    momentum: float = Field(0.9, ge=0, lt=1, description="sgd momentum")
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up steps")
    cosine: bool = Field(True, description="cosine decay to 0 after warm-up (else constant)")


class StepConfig(Strict):
    """How each training step runs: the keys central training's [train] and a site's [train] share."""

    batch_size: int = Field(16, ge=1, description="(expected) batch size")
    seed: int = Field(0, description="seed for non-private runs' shuffling and augmentation and for test-only seeded noise; private steps draw coins, noise and augmentations from the CSPRNG")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (None = torch default; CPU only)")
    device: DeviceSetting = Field("auto", description=f"where training and evaluation run: {DEVICE_CHOICES}")
    chunk_size: int | None = Field(
        None, ge=1,
        description="samples per chunk of per-sample gradients (memory ≈ chunk × trainable parameters × 4 bytes, a few "
        "times over, plus the chunk's activations); None: 16 on the CPU, on CUDA measured on the model when training "
        "starts against the device memory free then — set it when several sites or runs share a GPU (docs/deployment.md)",
    )


class TrainConfig(StepConfig):
    steps: int = Field(1000, ge=1, description="optimizer steps")
    eval_every: int = Field(200, ge=1, description="steps between validation PCKh evaluations")
    checkpoint_every: int = Field(200, ge=1, description="steps between checkpoints")
    eval_samples: int | None = Field(None, ge=1, description="cap on validation samples (None = all)")
    out_dir: Path = Field(Path("runs/train"), description="run directory (metrics.json, curves.png, checkpoints/, privacy.json)")


def check_basis_rank(k: int, public_samples: int) -> None:
    """A basis from m public per-sample gradients spans at most m directions: k > m could never be
    reached, and the projection would silently keep fewer directions than configured."""
    if k > public_samples:
        raise ValueError(f"basis k = {k} exceeds public_samples = {public_samples}: m public gradients span at most m "
                         "directions, so the basis could never have k; raise public_samples (and the public set) or lower k")


class BasisConfig(Strict):
    k: int = Field(50, ge=1, description="projection dimension (at most public_samples: m public gradients span at most m directions)")
    public_samples: int = Field(100, ge=1, description="m, public samples per basis computation")
    refresh_every: int = Field(50, ge=1, description="steps between basis refreshes")
    public_data: Path | None = Field(None, description="public dataset directory (S_pub)")
    dtype: Literal["float32", "float16", "bfloat16"] = Field("float32", description="storage dtype of V")
    public_rotation: float = Field(
        0.0, ge=0, le=180,
        description="degrees: the basis sees each public image turned by a fixed angle drawn uniformly in ± this "
        "(0: upright). For sites whose patients lie tilted beyond public photos (in bed); public data only, no privacy cost",
    )
    public_grey: float = Field(
        0.0, ge=0, le=1,
        description="share of the public images the basis sees in grey (one luminance channel, as a night-time infrared "
        "camera records), a fixed public draw. For sites with infrared cameras; public data only, no privacy cost",
    )

    @model_validator(mode="after")
    def _reachable_k(self) -> "BasisConfig":
        check_basis_rank(self.k, self.public_samples)
        return self


class BlurConfig(Strict):
    kernel_size: int = Field(21, ge=3, description="odd Gaussian kernel size in pixels")
    sigma: float = Field(6.0, gt=0, description="Gaussian blur σ in pixels")

    @model_validator(mode="after")
    def _odd(self) -> "BlurConfig":
        if self.kernel_size % 2 == 0:
            raise ValueError(f"privacy.public_view.blur.kernel_size must be odd, got {self.kernel_size}")
        return self


class PublicViewConfig(Strict):
    """ψ of FDP / FP-DP: what of each record is public. Computed once per record from the
    un-augmented crop (before augmentation); see fedpose.privacy.public_views."""

    kind: Literal["downsample_quantize", "gaussian_blur"] = Field(
        "downsample_quantize",
        description="downsample_quantize: f×f area average then b-bit quantization (many-to-one: everything finer than an "
        "f-pixel block at b bits is private); gaussian_blur: invertible, its FDP neighbour relation is degenerate (protects "
        "almost nothing), kept only for comparison",
    )
    # Defaults chosen by benchmarks/public_view: the coarsest view measured that keeps most (94 %) of
    # the public path's fine-tuning gain; 2 bits lost half of it.
    factor: int = Field(16, ge=2, le=64, description="downsample_quantize: block size f in model-input pixels (16 at 256×192 = 8 at 128×96)")
    bits: int = Field(3, ge=1, le=8, description="downsample_quantize: bits per colour channel kept of each block mean")
    blur: BlurConfig = BlurConfig()


class MaskConfig(Strict):
    region: Literal["head", "face"] = Field("head", description="MaskDP private region taken from the annotation")
    margin: float = Field(
        0.15, ge=0,
        description="box enlargement in the source image, fraction of its size; the crop pixels resampling spreads the box's "
        "pixels into (1.5 source px × the crop's zoom) are masked on top",
    )
    fill: Literal["mean", "zero"] = Field("mean", description="value written into the masked region")


class PrivacyConfig(Strict):
    mechanism: Literal[MECHANISM_NAMES] = Field(  # type: ignore[valid-type]
        "none", description="gradient mechanism; guarantee: "
        + ", ".join(f"{name} → {m.guarantee.name}" for name, m in MECHANISMS.items() if m.noisy)
    )
    target_epsilon: float | None = Field(None, gt=0, description="calibrate σ so the planned steps reach this ε (at privacy.delta, privacy.accountant): in central training train.steps; at a federation site one round's local_steps — per round, not a total: the site's eps_max caps the total")
    accountant: Literal["rdp", "pld", "prv"] | None = Field(
        None,
        description="privacy accountant for ε, σ calibration and site budgets; None: the tightest one exact for the "
        "mechanism's neighbouring relation (pld for every mechanism). An existing site budget keeps the accountant it "
        "was written with (recompute it deliberately with `fedpose privacy budget --apply`)",
    )
    noise_multiplier: float | None = Field(None, ge=0, description="σ: noise std = σ·C (alternative to target_epsilon)")
    max_grad_norm: float = Field(1.0, gt=0, description="per-sample clipping bound C")
    sample_rate: float | None = Field(
        None, gt=0, le=1,
        description="declared Poisson sampling rate q; the accountant, the noise normalisation (÷ train.batch_size) and "
        "everything sent use it, so N enters nothing sent except Δ, where the ε protects it like any statistic of the data "
        "(required at federation sites; None: q = B/N and N is public)",
    )
    delta: float = Field(1e-5, gt=0, lt=1, description="δ at which ε is reported and budgets are enforced")
    insecure_seeded_noise: bool = Field(
        False,
        description="TESTS ONLY: draw DP noise and Poisson sampling from train.seed (reproducible). NOT PRIVATE: "
        "anyone who knows the seed removes the noise; sites refuse to federate with it",
    )
    unit: Literal["auto", "record", "image", "patient"] = Field(
        "auto",
        description="protection unit: what one neighbouring dataset adds or removes — 'record' (one person-crop), "
        "'image' (every person in one image) or 'patient' (every record with one patient_id). Sampling is Poisson over "
        "units and each unit's summed gradient is clipped to C as one. 'auto': the coarsest unit the training "
        "annotations support (patient if every record has patient_id, else image), decided when the data is loaded",
    )
    max_records_per_unit: int = Field(
        4, ge=1,
        description="record rows of each unit slot in every DP step (unit 'record': 1): a sampled unit with more records "
        "is represented by this many chosen uniformly with the CSPRNG (its sum still clipped to C as one), a smaller one "
        "is padded with zero-weight rows. A fixed number, never derived from the data: with max_batch_units it fixes "
        "every step's work, so timing does not depend on the data (fedpose.privacy.fixed_shape). Under grey copies "
        "(model.scenario grey_biases_norms, grey_early_biases_norms) only a unit's grey records fill its rows (a "
        "colour record's gradient is exactly zero there), so this caps grey records per unit and a smaller value saves "
        "work",
    )
    max_batch_units: int | None = Field(
        None, ge=1,
        description="unit slots in every DP step: each Poisson batch is padded to this many units with zero-weight rows "
        "(same forward/backward, so a step's cost is constant). A batch over it keeps every unit, in a whole multiple of "
        "the slots (the (ε, δ) stays exact): a step of a multiple of the usual work, with probability ≤ 1e-15 per step "
        "for up to N_max units, the timing protection's domain (a site with more units trains, warned in its local log). "
        "None: the smallest u with P(Poisson(train.batch_size) > u) ≤ 1e-15 (N_max ≥ batch_size / sample_rate). "
        "At a federation site it sets the domain N_max and the per-sample chunk, while the work is fixed per round: "
        "whole chunks a step and the round's spare on its last step, about 60 % of the per-step padding "
        "(fedpose.privacy.fixed_shape)",
    )
    augmentation_multiplicity: int = Field(
        1, ge=1,
        description="K: every record of a step's batch is loaded K times, each copy an independent random augmentation "
        "(De et al. 2022). Under DP each unit's gradient is the sum over its records of the mean over their K copies, "
        "clipped to C once, so the sensitivity, σ, q and ε are those of K = 1 while the clipped signal is less noisy; "
        "mechanism 'none' averages the copies in its plain mean. Costs K× the compute and activation memory of a step "
        "(U·R·K rows, fedpose.privacy.fixed_shape). Needs random augmentation (data.flip, data.scale_jitter or "
        "data.rotation); the site's own setting, never sent by the coordinator",
    )
    public_gradient_weight: float = Field(
        1.0, ge=0,
        description="λ in g = λ·∇l(public view) + (projected) noisy clipped mean: the weight of the noise-free gradient on "
        "the public view (ψ(x) for fdp / fpdp, the masked image for maskdp). Changes no guarantee (the view is public by "
        "the mechanism's definition) and no ε; 1 is the papers' sum. The public-view gradient is not clipped, so with a "
        "small trainable set it can dwarf the private mean (≤ C) and pull the model toward the coarse view; the site's "
        "own setting, never sent by the coordinator",
    )
    basis: BasisConfig = BasisConfig()
    public_view: PublicViewConfig = PublicViewConfig()
    mask: MaskConfig = MaskConfig()

    @model_validator(mode="after")
    def _noise(self) -> "PrivacyConfig":
        if get_mechanism(self.mechanism).noisy:
            if (self.target_epsilon is None) == (self.noise_multiplier is None):
                raise ValueError(
                    f"privacy: mechanism '{self.mechanism}' needs exactly one of "
                    "privacy.target_epsilon or privacy.noise_multiplier"
                )
        return self


class InputPrivacyConfig(Strict):
    mechanism: Literal["none", "ldp-slicing"] = Field("none", description="privatize every site image once, at load")
    epsilon: float | None = Field(None, gt=0, description="ε_total per (masked) pixel")
    ll_prune: bool = Field(True, description="zero the Haar LL band before randomization (guarantee then per 2×2 block)")
    ll_offset: float = Field(0.0, ge=0, le=255, description="added after LL pruning, before the clamp (128 keeps negative details)")
    allocation: Literal["sqrt", "uniform"] = Field("sqrt", description="per-bit budget split (uniform = ablation)")
    insecure_seed: int | None = Field(
        None,
        description="TESTS ONLY: seeded PCG64 for the randomized response (reproducible). NOT PRIVATE: anyone who "
        "knows the seed can undo the flips; None = cryptographically secure randomness (AES-256-CTR)",
    )

    @model_validator(mode="after")
    def _eps(self) -> "InputPrivacyConfig":
        if self.mechanism == "ldp-slicing" and self.epsilon is None:
            raise ValueError("input_privacy.epsilon is required for mechanism 'ldp-slicing'")
        return self


class RunConfig(Strict):
    """A central (non-federated) training run: `fedpose train --config ...`."""

    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    input_privacy: InputPrivacyConfig = InputPrivacyConfig()

    @model_validator(mode="after")
    def _copies_differ(self) -> "RunConfig":
        check_augmentation_multiplicity(self.privacy, self.data)
        return self

    @model_validator(mode="after")
    def _public_view_fits_the_input(self) -> "RunConfig":
        view = self.privacy.public_view
        if get_mechanism(self.privacy.mechanism).uses_dataset_public_view and view.kind == "downsample_quantize":
            if any(side % view.factor for side in self.data.input_size):
                raise ValueError(
                    f"privacy.public_view.factor {view.factor} must divide data.input_size {self.data.input_size} "
                    "(ψ's blocks tile the model input)"
                )
        return self


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` → (["a","b","c"], value); value parsed as TOML when possible, else a string."""
    if "=" not in item:
        raise ConfigError(f"--set '{item}': expected key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set '{item}': empty key")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.split("."), value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each ``a.b.c=value`` in ``raw``. A list of tables (e.g. ``[[sites]]``) is entered by a
    0-based index, as validation errors count (``sites.1.eps_max=4``: the second site), or by the
    ``site_id`` of an entry (``sites.site-2.eps_max=4``)."""
    for item in overrides:
        path, value = parse_override(item)
        node: Any = raw
        for depth, part in enumerate(path[:-1]):
            where = ".".join(path[: depth + 1])
            if isinstance(node, list):
                node = _list_entry(node, part, item, where)
                continue
            child = node.setdefault(part, {})
            if not isinstance(child, (dict, list)):
                raise ConfigError(f"--set '{item}': '{where}' is not a section")
            node = child
        if isinstance(node, list):
            raise ConfigError(f"--set '{item}': '{'.'.join(path[:-1])}' is a list of tables; name a key inside one entry")
        node[path[-1]] = value
    return raw


def _list_entry(entries: list[Any], part: str, item: str, where: str) -> dict[str, Any]:
    """The table of ``entries`` named by ``part``: a 0-based index, or an entry's ``site_id``."""
    if part.isdigit():
        index = int(part)
        if index >= len(entries):
            raise ConfigError(f"--set '{item}': '{where}': index {index} out of range ({len(entries)} entries, counted from 0)")
        entry = entries[index]
    else:
        matches = [e for e in entries if isinstance(e, dict) and e.get("site_id") == part]
        if not matches:
            ids = [e.get("site_id") for e in entries if isinstance(e, dict)]
            raise ConfigError(f"--set '{item}': '{where}': no entry with site_id {part!r} (have {ids}; or use an index from 0)")
        entry = matches[0]
    if not isinstance(entry, dict):
        raise ConfigError(f"--set '{item}': '{where}' is not a section")
    return entry


def validation_problems(exc: ValidationError) -> str:
    """Each of pydantic's problems as ``field.path: message``, on one line (for values read from a
    file or a message rather than a config: no ``got`` value, which may be private or long)."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in exc.errors())


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid configuration in {source}:"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(root)"
        if err["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        else:
            lines.append(f"  {key}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if path.is_dir():
        raise ConfigError(f"{path}: a directory, not a config file")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a TOML config file (not UTF-8 text: {exc.reason} at byte {exc.start})") from None


def validate(model: type[M], raw: dict[str, Any], source: str, overrides: list[str] | None = None) -> M:
    """``raw`` as ``model``; a bad value is blamed on where it came from: the ``--set`` that set it
    (``overrides``, already applied to ``raw``), else ``source``."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, _blame(exc, source, overrides or []))) from None


def _blame(exc: ValidationError, source: str, overrides: list[str]) -> str:
    set_keys = {item: ".".join(parse_override(item)[0]) for item in overrides}

    def set_by(loc: tuple[Any, ...]) -> list[str]:
        key = ".".join(str(p) for p in loc)
        return [item for item, k in set_keys.items() if key == k or key.startswith(k + ".") or k.startswith(key + ".")]

    culprits = [set_by(err["loc"]) for err in exc.errors()]
    if culprits and all(culprits):
        return " ".join(dict.fromkeys(f"--set {item}" for items in culprits for item in items))
    return f"{source} (with --set)" if any(culprits) else source


def absolute_paths(raw: dict[str, Any], model: type[BaseModel], base: Path | None = None) -> dict[str, Any]:
    """A copy of ``raw`` (a config for ``model``) with every value of a Path-typed field, nested
    sections included, made absolute against ``base`` (default: the working directory): for config
    files read by processes that run in another directory (a deployment's SuperNodes, ServerApp)."""
    base = Path.cwd() if base is None else base
    out = dict(raw)
    for name, field in model.model_fields.items():
        key = field.alias or name
        value = out.get(key)
        if value is None:
            continue
        kinds = _annotation_types(field.annotation)
        section = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
        if Path in kinds and isinstance(value, (str, Path)):
            out[key] = os.path.normpath(base / Path(value).expanduser())
        elif section is not None and isinstance(value, dict):
            out[key] = absolute_paths(value, section, base)
    return out


def _annotation_types(annotation: Any) -> tuple[Any, ...]:
    """The members of ``X | Y`` / ``Optional[X]``; ``(annotation,)`` for anything else."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def load_config(
    path: str | Path | None, overrides: list[str] | None = None, model: type[M] = RunConfig  # type: ignore[assignment]
) -> M:
    """Load ``model`` from a TOML file (or defaults when ``path`` is None) plus ``--set`` overrides."""
    raw = load_toml(path) if path is not None else {}
    raw = apply_overrides(raw, overrides or [])
    return validate(model, raw, str(path) if path else "defaults", overrides)
