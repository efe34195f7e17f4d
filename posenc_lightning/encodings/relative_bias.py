"""T5 relative position bias (Raffel et al., 2020): a learned scalar per head and bucket."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posenc_lightning.encodings.base import AttentionContext, Bias, Encoding, RelativeBias
from posenc_lightning.encodings.registry import register
from posenc_lightning.functional.t5 import t5_relative_position_bucket


@register("relative_bias", "bias", "T5 learned relative bias over log-spaced distance buckets (Raffel et al., 2020)")
class T5RelativeBias(Encoding):
    """``b[h, bucket(j - i)]`` added to the logits, buckets as in T5.

    Because distances past ``max_distance`` share the last bucket, the bias is exactly a
    `RelativeBias` table over ``i - j`` in ``[-max_distance, max_distance]``.

    Args:
        num_buckets: 32 in T5.
        max_distance: 128 in T5.
        bidirectional: T5's encoder (True); decoders use one direction (False).
    """

    bias_kinds = (RelativeBias,)

    def __init__(self, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = False) -> None:
        super().__init__()
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional
        self.relative_attention_bias: nn.Embedding | None = None

    def _ready(self) -> bool:
        return self.n_heads is not None

    def build(self) -> None:
        self.relative_attention_bias = nn.Embedding(self.num_buckets, self.n_heads)
        nn.init.normal_(self.relative_attention_bias.weight, std=0.02)

    def buckets(self, device: torch.device | None = None) -> Tensor:
        """Bucket of every ``i - j`` in ``[-R, R]`` (T5 takes ``j - i``)."""
        r = self.max_distance
        d = torch.arange(-r, r + 1, device=device)
        return t5_relative_position_bucket(-d, self.bidirectional, self.num_buckets, self.max_distance)

    def bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Bias | None:
        table = self.relative_attention_bias(self.buckets(q.device)).t()  # [H, 2R+1]
        return RelativeBias(table, ctx.q_pos, ctx.k_pos)
