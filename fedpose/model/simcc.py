"""SimCC coordinate classification (Li et al., 2022): head, Gaussian label smoothing, loss, decoding.

Each joint's x and y are classified independently over ``size · k`` bins (k = split factor);
bin ``i`` stands for the pixel coordinate ``i / k``. Targets are 1-D Gaussians centred on the
continuous coordinate ``x · k`` with σ in bins (label smoothing), normalised in log space so a
joint far outside the image still gives finite targets. Everything here is batch-size agnostic
and free of data-dependent Python control flow, so it runs under ``torch.func.vmap``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from timm.layers import LayerNorm2d
from torch import Tensor, nn

from fedpose.joints import flip_permutation


class SimCCHead(nn.Module):
    """Final-stage features (B, C, h, w) → per-joint x/y bin logits.

    LayerNorm over channels → 3×3 conv to ``channels_per_joint`` maps per joint → flatten each
    joint's M·h·w values → (optional) shared Linear+GELU to ``hidden`` → Linear to the x bins and
    the y bins. Several maps per joint matter: with one map (the original SimCC layout) a joint is
    described by only h·w numbers (12 at 128×96, stride 32), which measurably could not fit the
    synthetic data (benchmarks/learnability).
    """

    def __init__(
        self, in_channels: int, feature_size: tuple[int, int], num_joints: int,
        bins: tuple[int, int], hidden: int = 256, channels_per_joint: int = 32,
    ) -> None:
        super().__init__()
        h, w = feature_size
        self.num_joints = num_joints
        self.channels_per_joint = channels_per_joint
        self.norm = LayerNorm2d(in_channels)
        self.joint_conv = nn.Conv2d(in_channels, num_joints * channels_per_joint, kernel_size=3, padding=1)
        flat = channels_per_joint * h * w
        self.mlp = nn.Sequential(nn.Linear(flat, hidden), nn.GELU()) if hidden > 0 else nn.Identity()
        width = hidden if hidden > 0 else flat
        bins_y, bins_x = bins
        self.cls_x = nn.Linear(width, bins_x)
        self.cls_y = nn.Linear(width, bins_y)

    def forward(self, features: Tensor) -> tuple[Tensor, Tensor]:
        joint_maps = self.joint_conv(self.norm(features))  # (B, J·M, h, w)
        per_joint = joint_maps.unflatten(1, (self.num_joints, self.channels_per_joint)).flatten(2)  # (B, J, M·h·w)
        tokens = self.mlp(per_joint)  # (B, J, hidden)
        return self.cls_x(tokens), self.cls_y(tokens)


#: a peak probability this many times a training target's peak is saturation, not confidence
SATURATION_FACTOR = 2.0


@dataclass(frozen=True)
class SimCCCodec:
    """Maps coordinates in the input frame ↔ SimCC bins for an input of ``input_size`` (H, W)."""

    input_size: tuple[int, int]
    split_factor: int = 2
    sigma: float = 6.0  # Gaussian label smoothing, in bins
    refine_radius: int = 3  # bins either side of the argmax used by sub-bin refinement

    @property
    def bins(self) -> tuple[int, int]:
        """(y bins, x bins)."""
        h, w = self.input_size
        return h * self.split_factor, w * self.split_factor

    def log_targets(self, coords: Tensor, num_bins: int) -> Tensor:
        """(…, J) coordinates in pixels → (…, J, num_bins) log-probabilities of the smoothed target."""
        centres = torch.arange(num_bins, device=coords.device, dtype=coords.dtype)
        offset = centres - coords.unsqueeze(-1) * self.split_factor
        return torch.log_softmax(-offset.square() / (2 * self.sigma**2), dim=-1)

    def target_peak(self) -> float:
        """The largest probability a training target puts on one bin (a joint on a bin centre, far
        from the edges): the sharpest output the loss ever asks for."""
        bins = min(self.bins)
        return float(self.log_targets(torch.tensor([bins / 2 / self.split_factor]), bins).exp().max())

    def normalized_confidence(self, peak: Tensor) -> tuple[Tensor, Tensor]:
        """(confidence, saturated) of :meth:`decode`'s peak probabilities.

        confidence = peak / :meth:`target_peak`, capped at 1: 1 is as sharp as a training target, so
        the raw peak (about 0.07 at σ = 6 bins for a well-trained model) reads on a scale that means
        something. ``saturated`` marks peaks more than :data:`SATURATION_FACTOR` × sharper than any
        target — logits blown up (typically a diverged model), which is not certainty."""
        target = self.target_peak()
        saturated = ~(peak <= SATURATION_FACTOR * target)  # a non-finite peak (NaN logits) included
        return (peak / target).clamp(max=1.0), saturated

    def targets(self, joints: Tensor) -> tuple[Tensor, Tensor]:
        """(…, J, 2) joints → (target_x, target_y) probability vectors."""
        bins_y, bins_x = self.bins
        return self.log_targets(joints[..., 0], bins_x).exp(), self.log_targets(joints[..., 1], bins_y).exp()

    def loss(self, logits_x: Tensor, logits_y: Tensor, joints: Tensor, weight: Tensor) -> Tensor:
        """KL(target ‖ softmax(logits)) for x and y, weighted per joint, averaged over joints → (B,).

        Joints with weight 0 (unannotated / outside the crop) contribute exactly nothing. The
        normaliser is the constant joint count, not the number of visible joints, so a sample's
        loss depends only on that sample (vmap-safe, and a per-sample gradient bound is meaningful).
        """
        bins_y, bins_x = self.bins
        kl_x = _kl(self.log_targets(joints[..., 0], bins_x), torch.log_softmax(logits_x, dim=-1))
        kl_y = _kl(self.log_targets(joints[..., 1], bins_y), torch.log_softmax(logits_y, dim=-1))
        return ((kl_x + kl_y) * weight).mean(dim=-1)

    def decode(
        self, logits_x: Tensor, logits_y: Tensor, refine: bool = True, mirrored: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Logits → (coords (B, J, 2) in input pixels, confidence (B, J)).

        Coordinate = argmax / k, optionally refined to the probability-weighted mean of the
        bins within ``refine_radius`` of the argmax. Confidence = the smaller of the two axes'
        peak probabilities (a joint is only as certain as its least certain coordinate).
        ``mirrored`` (flip test): the logits of the same crops mirrored horizontally; the decoded
        distribution is then the mean of the crop's and the mirror's mapped back (:meth:`unmirror`).
        """
        prob_x, prob_y = logits_x.softmax(dim=-1), logits_y.softmax(dim=-1)
        if mirrored is not None:
            back_x, back_y = self.unmirror(mirrored[0].softmax(dim=-1), mirrored[1].softmax(dim=-1))
            prob_x, prob_y = (prob_x + back_x) / 2, (prob_y + back_y) / 2
        x, conf_x = self._decode_axis(prob_x, refine)
        y, conf_y = self._decode_axis(prob_y, refine)
        return torch.stack([x, y], dim=-1) / self.split_factor, torch.minimum(conf_x, conf_y)

    def unmirror(self, prob_x: Tensor, prob_y: Tensor) -> tuple[Tensor, Tensor]:
        """Distributions (B, J, bins) predicted on horizontally mirrored crops → the same
        distributions in the unmirrored crops' frame.

        The mirror maps x → W − 1 − x (:func:`fedpose.data.transforms.flip_matrix`), so bin b
        (x = b / k) is the mirror's bin k(W − 1) − b: the x bins reversed and moved k − 1 bins
        towards 0; the last k − 1 bins have no source and get probability 0. Left and right joints
        swap (:data:`fedpose.joints.FLIP_PAIRS`); y is unchanged.
        """
        swap = flip_permutation()
        if prob_x.shape[-2] != len(swap):
            raise ValueError(f"flip test needs the {len(swap)} MPII joints, got {prob_x.shape[-2]}")
        reversed_x = prob_x[..., swap, :].flip(-1)
        shift = self.split_factor - 1
        back_x = torch.zeros_like(reversed_x)
        back_x[..., : reversed_x.shape[-1] - shift] = reversed_x[..., shift:]
        return back_x, prob_y[..., swap, :]

    def _decode_axis(self, prob: Tensor, refine: bool) -> tuple[Tensor, Tensor]:
        peak, index = prob.max(dim=-1)
        if not refine or self.refine_radius == 0:
            return index.to(prob.dtype), peak
        offsets = torch.arange(-self.refine_radius, self.refine_radius + 1, device=prob.device)
        window = (index.unsqueeze(-1) + offsets).clamp(0, prob.shape[-1] - 1)
        mass = prob.gather(-1, window)
        # clamped duplicates at the border must not count twice
        valid = ((index.unsqueeze(-1) + offsets) >= 0) & ((index.unsqueeze(-1) + offsets) < prob.shape[-1])
        mass = mass * valid
        position = (mass * window.to(prob.dtype)).sum(-1) / mass.sum(-1).clamp_min(1e-12)
        return position, peak


def _kl(log_target: Tensor, log_pred: Tensor) -> Tensor:
    return (log_target.exp() * (log_target - log_pred)).sum(dim=-1)
