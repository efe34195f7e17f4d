"""ALiBi (Press et al., 2022): a fixed per-head linear penalty ``-m_h |i - j|`` on the logits."""

from __future__ import annotations

import torch
from torch import Tensor

from posenc_lightning.encodings.base import AttentionContext, Bias, Encoding, LinearBias
from posenc_lightning.encodings.registry import register
from posenc_lightning.functional.alibi import alibi_slopes


@register("alibi", "bias", "Attention with linear biases: -m_h*|i-j| with the paper's geometric slopes (Press et al., 2022)")
class ALiBi(Encoding):
    """ALiBi with the paper's slopes (any head count).

    Args:
        slope_scale: multiply every slope (1.0 is the paper).
    """

    bias_kinds = (LinearBias,)

    def __init__(self, slope_scale: float = 1.0) -> None:
        super().__init__()
        self.slope_scale = slope_scale
        self.register_buffer("slopes", torch.empty(0), persistent=False)

    def _ready(self) -> bool:
        return self.n_heads is not None

    def build(self) -> None:
        self.slopes = alibi_slopes(self.n_heads) * self.slope_scale

    def bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Bias | None:
        slopes = self.slopes.to(q.device)
        return LinearBias(slopes, ctx.q_pos, ctx.k_pos)
