"""TinyViT + SimCC pose model with DP-friendly training scenarios.

Scenarios — which parameters train (paper 001, §4.1, and issue 26's smaller sets). Under DP-SGD
the noise's norm grows with √p for p trainable parameters while the clipped signal does not, so a
smaller set can pay at a fixed ε (counts for tiny_vit_5m_224: ``model.scenario``'s description).

- ``finetune``: stages 0–2 frozen; stage 3, every LayerNorm and the SimCC head trainable.
- ``norms_head``: every LayerNorm's affine and the SimCC head; no attention, MLP or conv weight of
  the backbone.
- ``norms``: ``norms_head`` without the head's 3×3 joint conv (1.47 M of the head's 1.7 M
  parameters in tiny_vit_5m_224): the LayerNorms and the head's linear layers. The joint conv
  is the head's feature extractor, kept at its public pre-trained value.
- ``biases_norms``: every bias and every LayerNorm affine, nothing else (BitFit, Zaken et al. 2022;
  under DP, Bu et al. 2022): a few thousand parameters across the whole network, so DP-SGD's
  noise (norm ∝ √p) stays small without a projection. Measured on the sweep's tuning data
  (benchmarks/federated_utility/noise_or_subspace.json): with σ = 0 it keeps 80 % of what
  ``finetune`` gains; PDP's public projection of ``finetune`` (k 4–48) keeps under 25 %.
- ``grey_biases_norms``: a grey copy of every tensor of ``biases_norms``, used by grey (infrared)
  images and the only tensors that train; colour images keep the base's
  (:mod:`fedpose.model.grey_copies`). As many parameters as ``biases_norms``.
- ``grey_early_biases_norms``: the grey copies of ``grey_biases_norms`` in the patch embedding and
  the first two stages (:data:`GREY_EARLY_UNITS`) only, a sixth of them. Grey images differ from
  colour ones in low-level statistics (one channel, flat contrast, sensor noise): on the main job's
  tuning data, 32 noise-free steps of the early copies alone gained nearly what all the copies
  gained (grey test images from 53.2 to 72.8 / 70.8 / 69.5 in three draws, against 71.9 / 71.7 /
  71.7), the later stages' and the head's alone 2–3 points, and every weight of the model 73.3
  (benchmarks/federated_utility/grey_copies_by_stage.py); the noise's norm is √6 smaller
  (benchmarks/federated_utility/grey_early_main_job.json).
- ``lora``: low-rank adapters (:class:`LoRALinear`) on the last stage's attention qkv/proj and MLP
  fc1/fc2, every LayerNorm and the head; every base weight frozen. The last stage only: it is
  the stage ``finetune`` trains, and adapters in stages 1–2 would end their affine-tuned fast path
  (below). Adapters start at B = 0, so a fresh ``lora`` model computes exactly its base model.
- ``full``: everything trainable, starting from ``model.init_checkpoint``.
- ``scratch``: everything trainable, random initialisation.

Cost per DP-SGD step (tiny_vit_5m_224, 128×96, 16 rows, 1 thread, process-CPU s, non-private ≈
0.7 for every set): finetune 1.06, norms_head 0.95, lora 0.98, norms 0.75
(benchmarks/base_sizing/trainable_sets.json): the smaller sets save little time, their point is
the noise. ``biases_norms`` takes its per-sample gradients entirely from the batched path below:
1.04 times a non-private forward and backward of the same 16 rows, against 1.18 with the whole
network under ``vmap`` (1.04 against 1.48 at 256×192; benchmarks/step_cost/affine_probe.py).
These were measured with timm's attention blocks; fedpose's skip the window padding's work
(:mod:`fedpose.model.window_attention`): a ``biases_norms`` DP step at 128×96 now costs about half
(1.03 times non-private; benchmarks/step_cost/window_attention.json).

BatchNorm is frozen in every scenario: its modules always run in eval mode (running statistics,
never batch statistics — batch statistics would mix samples and break per-sample DP). Its
affine parameters stay trainable where the scenario trains that part of the network.
Never call ``model.eval()`` to get this: TinyViT's attention then caches its indexed biases,
which breaks the second backward pass and silently zeroes ``attention_biases`` gradients under
``torch.func`` (see shared/FACTS.md). :meth:`PoseModel.train` keeps BatchNorm in eval mode.

The network is a chain of units (patch embedding, stage 0, then each later stage's downsample
and its blocks). The longest prefix of units without trainable parameters is the *frozen
prefix*: :meth:`forward_frozen` runs it (callers wrap it in ``torch.no_grad``), and
:meth:`forward_trainable` runs the rest — a pure function of parameters and buffers, used with
``torch.func.functional_call`` + ``vmap`` for per-sample gradients.

The trainable rest splits once more. Its leading units whose trainable parameters are all
*affines* — LayerNorm affines and the biases of linear, convolution and BatchNorm layers, each a
per-channel scale or shift of a module's output — are the *affine-tuned* part
(:meth:`forward_affine_tuned`: stages 1–2 under ``finetune``; through stage 3 under ``norms_head``
and ``norms``, through stage 3's downsample under ``lora``, the whole backbone under
``biases_norms``); from the first unit with any other trainable parameter on, and always the
head, is the *suffix* (:meth:`forward_suffix`). The DP engine takes per-sample gradients of the
suffix with ``vmap`` and of the affine-tuned part from one batched backward
(:mod:`fedpose.privacy.per_sample` explains why).
"""

from __future__ import annotations

from typing import Literal

import math
import typing

import torch
import torch.nn.functional as F
from timm.models.tiny_vit import TinyVit
from torch import Tensor, nn

from fedpose.config import GREY_SCENARIOS, Scenario
from fedpose.joints import NUM_JOINTS
from fedpose.model.grey_copies import add_grey_copies, grey_pass, is_grey_copy_key
from fedpose.model.simcc import SimCCCodec, SimCCHead
from fedpose.privacy.per_sample import affine_of

SCENARIOS: tuple[str, ...] = typing.get_args(Scenario)
#: the units whose biases and LayerNorm affines get grey copies under "grey_early_biases_norms"
GREY_EARLY_UNITS: tuple[str, ...] = ("backbone.patch_embed.", "backbone.stages.0.", "backbone.stages.1.")
#: the linears of each last-stage block that get adapters under scenario "lora"
LORA_TARGETS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
#: parameter-name suffixes of the adapters (their state-dict keys end in these)
LORA_PARAMETERS = (".lora_a", ".lora_b")
Start = Literal["images", "features", "hidden"]
FEATURE_STRIDE = 32


def _is_layer_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm)  # includes timm LayerNorm2d


def _affine_tuned(unit: nn.Module) -> bool:
    """True if every trainable parameter of ``unit`` is an affine the batched per-sample path
    attributes to samples (:data:`fedpose.privacy.per_sample.AFFINE_MODULES`)."""
    trainable = {id(p) for p in unit.parameters() if p.requires_grad}
    affines = {
        id(getattr(m, name)) for m in unit.modules() if (affine := affine_of(m)) is not None
        for name in affine.parameters if getattr(m, name, None) is not None
    }
    return trainable <= affines


def _is_batch_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def is_adapter_key(name: str) -> bool:
    """Whether a parameter / state-dict key belongs to a low-rank adapter."""
    return name.endswith(LORA_PARAMETERS)


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus a low-rank update (Hu et al., 2021): y = x Wᵀ + b + (α/r) · x Aᵀ Bᵀ.

    A subclass that keeps the wrapped layer's ``weight`` and ``bias`` as its own, so their state-dict
    keys stay those of the plain layer (a non-adapter checkpoint loads unchanged) and the adapter
    adds ``lora_a`` (r × in) and ``lora_b`` (out × r). A is initialised like ``nn.Linear`` (Kaiming
    uniform, a = √5), B to zero: the layer starts as exactly the wrapped one. Pure in its
    parameters (``torch.func.functional_call`` substitutes any of them), no per-call state.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        if not 1 <= rank <= min(base.in_features, base.out_features):
            raise ValueError(f"LoRA rank {rank} must be in 1..{min(base.in_features, base.out_features)} "
                             f"for a {base.in_features} → {base.out_features} linear")
        # nn.Linear's own __init__ would draw (and discard) a fresh weight from the global RNG
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.rank, self.alpha = int(rank), float(alpha)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device, dtype=base.weight.dtype))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device, dtype=base.weight.dtype))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha:g}"


def merged_adapter_weights(state: dict[str, Tensor], alpha: float) -> dict[str, Tensor]:
    """``state`` with every adapter folded into its base weight (W + (α/r)·B·A) and removed: the
    same function as a model without adapters. For loading a ``lora`` model's weights into a model
    whose adapters differ or are absent, so what the adapters learned is kept, not dropped."""
    merged = {k: v for k, v in state.items() if not is_adapter_key(k)}
    for key in state:
        if key.endswith(".lora_a"):
            prefix = key.removesuffix(".lora_a")
            lora_a, lora_b = state[key], state[f"{prefix}.lora_b"]
            weight = merged[f"{prefix}.weight"]
            merged[f"{prefix}.weight"] = (weight.double() + (alpha / lora_a.shape[0]) * (lora_b.double() @ lora_a.double())).to(weight.dtype)
    return merged


class _StageBlocks(nn.Module):
    """A TinyViT stage's blocks as one unit (they work channels-last; the chain is channels-first)."""

    def __init__(self, blocks: nn.Module) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, x: Tensor) -> Tensor:
        # .contiguous() is load-bearing: with a permuted (non-contiguous) input, torch 2.15's
        # vmap(grad(...)) returned per-sample gradients off by ~100 % relative error once the
        # SimCC head followed (plain autograd was right). tests/test_model.py checks vmap == loop.
        return self.blocks(x.permute(0, 2, 3, 1).contiguous()).permute(0, 3, 1, 2)


class PoseModel(nn.Module):
    def __init__(
        self,
        backbone: TinyVit,
        input_size: tuple[int, int],
        scenario: Scenario = "finetune",
        split_factor: int = 2,
        label_sigma: float = 6.0,
        head_hidden: int = 256,
        backbone_name: str = "",
        lora_rank: int = 8,
        lora_alpha: float = 8.0,
    ) -> None:
        super().__init__()
        height, width = input_size
        if height % FEATURE_STRIDE or width % FEATURE_STRIDE:
            raise ValueError(f"input size must be multiples of {FEATURE_STRIDE}, got {input_size}")
        self.input_size = (int(height), int(width))
        self.scenario: Scenario = scenario
        self.split_factor = split_factor
        self.backbone_name = backbone_name
        self.codec = SimCCCodec(self.input_size, split_factor, label_sigma)
        self.backbone = backbone
        self.head = SimCCHead(
            backbone.num_features,
            (height // FEATURE_STRIDE, width // FEATURE_STRIDE),
            NUM_JOINTS,
            self.codec.bins,
            hidden=head_hidden,
        )
        self.lora_rank: int | None = None
        self.lora_alpha: float | None = None
        if scenario == "lora":
            self._add_adapters(lora_rank, lora_alpha)
        #: the modules with grey copies and the grey scenario that made them (part of the architecture)
        self._grey_modules: list[nn.Module] = []
        self._grey_scenario: str | None = None
        if scenario in GREY_SCENARIOS:
            targets = self._trainable_in("biases_norms")
            if scenario == "grey_early_biases_norms":
                targets = {name for name in targets if name.startswith(GREY_EARLY_UNITS)}
            self._grey_modules = add_grey_copies(self, targets)
            self._grey_scenario = scenario
        self._units = self._build_units()
        self.set_scenario(scenario)
        # Random-init BatchNorm statistics that match the network (loaded weights overwrite them);
        # calibrate_batch_norm on real images is better still — see its docstring.
        self.calibrate_batch_norm(_calibration_noise(self.input_size))

    # ----------------------------------------------------------------- structure
    def _build_units(self) -> list[tuple[str, nn.Module]]:
        """(name prefix, module) in execution order; every backbone parameter lives in one unit."""
        stages = self.backbone.stages
        units: list[tuple[str, nn.Module]] = [("backbone.patch_embed", self.backbone.patch_embed), ("backbone.stages.0", stages[0])]
        for index in range(1, len(stages)):
            units.append((f"backbone.stages.{index}.downsample", stages[index].downsample))
            units.append((f"backbone.stages.{index}.blocks", _StageBlocks(stages[index].blocks)))
        return units

    def _add_adapters(self, rank: int, alpha: float) -> None:
        """Wrap the last stage's :data:`LORA_TARGETS` linears in :class:`LoRALinear` (rank, α)."""
        for block in self.backbone.stages[-1].blocks:
            for target in LORA_TARGETS:
                owner_name, attribute = target.rsplit(".", 1)
                owner = block.get_submodule(owner_name)
                setattr(owner, attribute, LoRALinear(getattr(owner, attribute), rank, alpha))
        self.lora_rank, self.lora_alpha = int(rank), float(alpha)

    def _trainable_in(self, scenario: Scenario) -> set[str]:
        """The names of the parameters ``scenario`` trains (module docstring)."""
        names = [name for name, _ in self.named_parameters()]
        if scenario in ("full", "scratch"):
            return set(names)
        layer_norms = {
            f"{name}.{pname}" if name else pname
            for name, module in self.named_modules() if _is_layer_norm(module)
            for pname, _ in module.named_parameters(recurse=False)
        }
        head = {name for name in names if name.startswith("head.")}
        if scenario == "finetune":
            last_stage = f"backbone.stages.{len(self.backbone.stages) - 1}."
            return layer_norms | head | {name for name in names if name.startswith(last_stage)}
        if scenario == "norms_head":
            return layer_norms | head
        if scenario == "norms":
            return layer_norms | {name for name in head if not name.startswith("head.joint_conv.")}
        if scenario == "biases_norms":
            return layer_norms | {name for name in names if name.endswith(".bias")}
        if scenario in GREY_SCENARIOS:
            return {name for name in names if is_grey_copy_key(name)}
        if scenario == "lora":
            return layer_norms | head | {name for name in names if is_adapter_key(name)}
        raise ValueError(f"model.scenario must be one of {', '.join(SCENARIOS)}, got {scenario!r}")

    def set_scenario(self, scenario: Scenario) -> None:
        """Set ``requires_grad`` for the scenario and recompute the frozen prefix. Adapters are part
        of the architecture: only a model built with scenario "lora" has them, and it keeps it."""
        has_adapters = self.lora_rank is not None
        if (scenario == "lora") != has_adapters:
            raise ValueError(f"model.scenario {scenario!r}: this model was built "
                             f"{'with' if has_adapters else 'without'} low-rank adapters; build it for the scenario")
        if (scenario in GREY_SCENARIOS or self._grey_scenario) and scenario != self._grey_scenario:
            built = f"with the grey copies of {self._grey_scenario!r}" if self._grey_scenario else "without grey copies"
            raise ValueError(f"model.scenario {scenario!r}: this model was built {built}; build it for the scenario")
        trainable = self._trainable_in(scenario)
        self.scenario = scenario
        for name, param in self.named_parameters():
            param.requires_grad_(name in trainable)
        self._frozen_units = 0
        for _, unit in self._units:
            if any(p.requires_grad for p in unit.parameters()):
                break
            self._frozen_units += 1
        self._affine_tuned_units = 0
        for _, unit in self._units[self._frozen_units:]:
            if not _affine_tuned(unit):
                break
            self._affine_tuned_units += 1

    @property
    def frozen_prefix(self) -> list[str]:
        """Names of the units :meth:`forward_frozen` runs."""
        return [name for name, _ in self._units[: self._frozen_units]]

    @property
    def affine_tuned_part(self) -> list[str]:
        """Names of the units :meth:`forward_affine_tuned` runs (see the module docstring)."""
        start = self._frozen_units
        return [name for name, _ in self._units[start: start + self._affine_tuned_units]]

    def affine_tuned_modules(self) -> dict[str, nn.Module]:
        """The modules with trainable parameters in the affine-tuned part, by module name: every
        one of them a type in :data:`~fedpose.privacy.per_sample.AFFINE_MODULES`."""
        start = self._frozen_units
        inside = {id(m) for _, unit in self._units[start: start + self._affine_tuned_units] for m in unit.modules()}
        return {
            name: module
            for name, module in self.named_modules()
            if id(module) in inside and any(p.requires_grad for p in module.parameters(recurse=False))
        }

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        return {name: p for name, p in self.named_parameters() if p.requires_grad}

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.trainable_parameters().values())

    # ------------------------------------------------------------------ modes
    def train(self, mode: bool = True) -> "PoseModel":
        """Like ``nn.Module.train`` but BatchNorm always stays in eval mode (frozen statistics)."""
        super().train(mode)
        for module in self.modules():
            if _is_batch_norm(module):
                module.eval()
        return self

    def train_mode(self) -> "PoseModel":
        """Training mode for every module except BatchNorm (see the module docstring)."""
        return self.train(True)

    @torch.no_grad()
    def calibrate_batch_norm(self, images: Tensor) -> None:
        """Set every BatchNorm's running statistics to those of ``images`` (one forward pass).

        For random initialisation only: BatchNorm always runs on running statistics here (see the
        module docstring), and timm's initial statistics (mean 0, var 1) do not match a randomly
        initialised TinyViT's activations — each patch-merging downsample then shrinks the signal
        ~20× and a from-scratch model stalls near the mean pose. Calibrating once on a batch of
        (public) images, or on unit-variance noise when none is at hand, gives the stem and the
        downsamples unit-scale activations. Trained weights are never re-calibrated.
        """
        images = images.to(next(self.parameters()).device)
        batch_norms = [m for m in self.modules() if _is_batch_norm(m)]
        saved = [(m.momentum, m.training) for m in batch_norms]
        for module in batch_norms:
            module.reset_running_stats()
            module.momentum = None  # cumulative average over this one pass = the batch statistics
            module.train()
        self.backbone.forward_features(images)
        for module, (momentum, _) in zip(batch_norms, saved):
            module.momentum = momentum
            module.eval()

    # --------------------------------------------------------------- forward
    def _run(self, units: list[tuple[str, nn.Module]], x: Tensor) -> Tensor:
        for _, unit in units:
            x = unit(x)
        return x

    def forward_frozen(self, images: Tensor) -> Tensor:
        """The parameter-free-to-train prefix (identity when nothing is frozen). Run it under no_grad."""
        return self._run(self._units[: self._frozen_units], images)

    def forward_affine_tuned(self, features: Tensor) -> Tensor:
        """The affine-tuned part after the frozen prefix (identity when there is none)."""
        start = self._frozen_units
        return self._run(self._units[start: start + self._affine_tuned_units], features)

    def forward_suffix(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """The rest after the affine-tuned part, head included → (logits_x, logits_y)."""
        # Grey copies start at the stem, so nothing is frozen or affine-tuned in front: ``hidden`` is the images.
        if self._grey_modules and (self._frozen_units or self._affine_tuned_units):
            raise RuntimeError("grey copies need the images: this model has a frozen or affine-tuned part in front")
        with grey_pass(self._grey_modules, hidden):
            return self.head(self._run(self._units[self._frozen_units + self._affine_tuned_units:], hidden))

    def forward_trainable(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """Everything after the frozen prefix → (logits_x (B, J, W·k), logits_y (B, J, H·k))."""
        return self.forward_suffix(self.forward_affine_tuned(features))

    def forward(self, inputs: Tensor, start: Start = "images") -> tuple[Tensor, Tensor]:
        """Forward from ``start``: "images", "features" (``forward_frozen``'s output) or "hidden"
        (``forward_affine_tuned``'s output). ``torch.func.functional_call(model, params, (x,),
        {"start": "features"})`` is the functional form of :meth:`forward_trainable`."""
        if start == "images":
            return self.forward_trainable(self.forward_frozen(inputs))
        if start == "features":
            return self.forward_trainable(inputs)
        if start == "hidden":
            return self.forward_suffix(inputs)
        raise ValueError(f"start must be 'images', 'features' or 'hidden', got {start!r}")

    # --------------------------------------------------------- loss / decode
    def loss(self, logits_x: Tensor, logits_y: Tensor, joints: Tensor, weight: Tensor) -> Tensor:
        """Per-sample SimCC KL loss (B,), see :meth:`SimCCCodec.loss`."""
        return self.codec.loss(logits_x, logits_y, joints, weight)

    def decode(
        self, logits_x: Tensor, logits_y: Tensor, refine: bool = True, mirrored: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """→ (coords (B, J, 2) in input pixels, confidence (B, J)); ``mirrored``: the logits of the
        horizontally mirrored crops, for flip test (:meth:`SimCCCodec.decode`)."""
        return self.codec.decode(logits_x, logits_y, refine=refine, mirrored=mirrored)

    def predict_crops(self, images: Tensor, flip_test: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Crops (B, 3, H, W) → (coords (B, J, 2) in input pixels, confidence (B, J), logits_x,
        logits_y). ``flip_test``: also run the mirrored crops and decode the mean of the two
        distributions (post-processing of the released model: no privacy cost; twice the forward
        passes). The logits are the unmirrored crops' (the loss is the training objective's)."""
        logits_x, logits_y = self(images)
        mirrored = self(images.flip(-1)) if flip_test else None
        coords, confidence = self.decode(logits_x, logits_y, mirrored=mirrored)
        return coords, confidence, logits_x, logits_y

    def describe(self) -> dict[str, object]:
        return {
            "backbone": self.backbone_name,
            "scenario": self.scenario,
            "input_size": list(self.input_size),
            "split_factor": self.split_factor,
            "trainable_parameters": self.num_trainable(),
            "total_parameters": sum(p.numel() for p in self.parameters()),
            "frozen_prefix": self.frozen_prefix,
            **({"lora_rank": self.lora_rank, "lora_alpha": self.lora_alpha} if self.lora_rank is not None else {}),
        }


def _calibration_noise(input_size: tuple[int, int], samples: int = 16, seed: int = 0) -> Tensor:
    """Unit-variance noise images (the scale of ImageNet-normalised inputs), reproducible and
    independent of the global RNG."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(samples, 3, *input_size, generator=generator)
