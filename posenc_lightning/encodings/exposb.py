"""ExpoSB: RoPE with a position-decayed rotation, a band-pass channel gain and distance-decayed scores.

Three changes to RoPE (interleaved pairs, ``omega_i = 10000^(-2i/d)``):

1. position-decayed rotation: ``cos'(m omega_i) = cos(m omega_i) (1 + 0.2 exp(-r_h m))`` and the
   same for sin, with the per-head learnable decay rate ``r_h`` (``decay_rates``, init 0.001);
2. band-pass gain on the rotated channels: ``x * (0.8 + 0.4 G(d))`` with
   ``G(d) = exp(-(d - d_c)^2 / (2 w^2))``, ``d`` the channel index in ``[0, head_dim)``,
   ``d_c = head_dim/4``, ``w = head_dim/8``; then the per-head learnable scale of q and k
   (``band_weights``, init 1);
3. distance decay of the attention scores: ``s'(m, n) = s(m, n) (0.7 + 0.3 exp(-0.005 |m - n|))``
   (stage 4: applied to the scaled logits before the softmax).

With the initial parameters these are exactly the formulas above. q and k both get (1) and (2),
so (1) makes scores depend on absolute positions (as defined). Needs ``n_kv_heads == n_heads``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from posenc_lightning.encodings.base import AttentionContext
from posenc_lightning.encodings.normalizer import DistanceDecay, Normalizer, Walk, modulated_softmax
from posenc_lightning.encodings.registry import register
from posenc_lightning.encodings.rope import RotaryEncoding
from posenc_lightning.functional.rope import apply_rotary, rope_cos_sin


class DistanceModulatedSoftmax(Normalizer):
    """ExpoSB's stage 4: ``softmax(s * (floor + (1 - floor) exp(-decay |m - n|)))`` of the scaled
    logits ``s``; the blockwise tiles run it as an online softmax, each tile's modulation read off
    one diagonal at arange positions (`modulation_distance_only`); the Triton kernels compute it
    per tile from the positions and flex in its ``score_mod`` (`kernel_modulation`).

    Args:
        name: the encoding's name.
        decay: the distance decay rate (``0.005``).
        floor: the modulation's floor (``0.7``).
    """

    walk = Walk.SOFTMAX
    fused_in = frozenset({"tiles", "kernel", "score_mod"})
    modulation_distance_only = True

    def __init__(self, name: str, decay: float, floor: float) -> None:
        super().__init__(name)
        self.decay, self.floor = decay, floor

    def modulation(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``0.7 + 0.3 exp(-0.005 |m - n|)``: ``[B, 1, Nq, Nk]``."""
        if q_pos.is_floating_point() or k_pos.is_floating_point():
            dist = (q_pos[:, :, None] - k_pos[:, None, :]).abs().to(torch.float32)
        else:  # integers subtracted in float64 (exact), the same float32 values: int64's abs is a scalar loop
            dist = (q_pos.double()[:, :, None] - k_pos.double()[:, None, :]).abs_().to(torch.float32)
        mod = dist.mul_(-self.decay).exp_().mul_(1 - self.floor).add_(self.floor)
        return mod[:, None]

    def kernel_modulation(self) -> DistanceDecay:
        """``(decay, floor)``: the same modulation, evaluated by the kernels per tile."""
        return DistanceDecay(self.decay, self.floor)

    def weights(self, logits: Tensor, mask: Tensor | None, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return modulated_softmax(logits, mask, self.modulation(q_pos, k_pos))


@register("exposb", "rotate", "ExpoSB: rope with position-decayed rotation, band-pass channel gain and "
          "distance-decayed scores")
class ExpoSB(RotaryEncoding):
    """ExpoSB (see the module docstring for the formulas; the defaults are the constants there).

    Its stage 4 is a `DistanceModulatedSoftmax`: ``softmax(s * distance_modulation)``, which the
    blockwise backend runs by tiles and the Triton kernels in their online softmax (the rotation
    and gains stay before them: `rotate`). ``partial_rotary_factor`` (as `RotaryEncoding`): only the first
    fraction of each head's channels rotate; the gains (2) still scale every channel."""

    normalizer_kind = DistanceModulatedSoftmax

    def __init__(self, theta: float = 10000.0, position_decay: float = 0.001, position_boost: float = 0.2,
                 band_floor: float = 0.8, band_gain: float = 0.4, band_center: float | None = None,
                 band_width: float | None = None, distance_decay: float = 0.005, distance_floor: float = 0.7,
                 layout: Literal["half", "interleaved"] = "interleaved", partial_rotary_factor: float = 1.0) -> None:
        super().__init__(theta=theta, layout=layout, partial_rotary_factor=partial_rotary_factor)
        self.position_decay, self.position_boost = float(position_decay), float(position_boost)
        self.band_floor, self.band_gain = float(band_floor), float(band_gain)
        self.band_center, self.band_width = band_center, band_width
        self.distance_decay, self.distance_floor = float(distance_decay), float(distance_floor)
        if self.band_width is not None and self.band_width <= 0:
            raise ValueError(f"exposb: band_width must be positive, got {band_width}")

    def _ready(self) -> bool:
        return self.n_heads is not None and self.head_dim is not None

    def build(self) -> None:
        self.band_weights = nn.Parameter(torch.ones(self.n_heads))
        self.decay_rates = nn.Parameter(torch.full((self.n_heads,), self.position_decay))

    def band_pass(self, device: torch.device | None = None) -> Tensor:
        """``0.8 + 0.4 G(d)`` over the channels ``d = 0 .. head_dim - 1``: ``[head_dim]``."""
        d = self.head_dim
        c = d / 4 if self.band_center is None else float(self.band_center)
        w = d / 8 if self.band_width is None else float(self.band_width)
        dims = torch.arange(d, dtype=torch.float32, device=device)
        return self.band_floor + self.band_gain * torch.exp(-((dims - c) ** 2) / (2 * w ** 2))

    def _rotate_one(self, x: Tensor, positions: Tensor) -> Tensor:
        if x.shape[1] != self.n_heads:
            raise ValueError(f"exposb has per-head parameters: needs n_kv_heads == n_heads ({self.n_heads}), "
                             f"got {x.shape[1]} kv heads")
        cos, sin = rope_cos_sin(positions, self.base_inv_freq(x.device))  # [B, N, D/2]
        pos = positions.to(torch.float32)
        boost = 1.0 + self.position_boost * torch.exp(-self.decay_rates.float()[None, :, None] * pos[:, None, :])
        # boost scales cos and sin alike, so it scales the rotated pair: rotate by the plain
        # (constant) cos, sin, then one gain per (head, position, channel); the rotation's fast
        # path takes no gradient through cos, sin (a learned cos, sin would take a complex product
        # and its backward)
        gain = (boost * self.band_weights.float()[None, :, None])[..., None] * self.band_pass(x.device)
        return (apply_rotary(x.float(), cos, sin, self.layout) * gain).to(x.dtype)

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        return self._rotated(q, ctx.q_pos), self._rotated(k, ctx.k_pos)

    def _rotated(self, x: Tensor, positions: Tensor) -> Tensor:
        """`_rotate_one`, recomputed in backward when training: its boosted cos/sin and pre-gain
        rotation (three ``[B, H, N, D]`` float32 tensors per q and k) are not kept for backward."""
        if torch.is_grad_enabled() and (x.requires_grad or self.band_weights.requires_grad):
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._rotate_one, x, positions, use_reentrant=False)
        return self._rotate_one(x, positions)

    def distance_modulation(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``0.7 + 0.3 exp(-0.005 |m - n|)``: ``[B, 1, Nq, Nk]``."""
        return self.normalize(None).modulation(q_pos, k_pos)

    def normalize(self, ctx: AttentionContext | None) -> DistanceModulatedSoftmax:
        return DistanceModulatedSoftmax(self.name, self.distance_decay, self.distance_floor)
