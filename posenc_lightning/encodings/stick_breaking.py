"""Stick-breaking attention (Tan et al., 2024) and RSE, rotary stick-breaking with a learned
distance penalty: both replace softmax (stage 4)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from posenc_lightning.encodings.base import AttentionContext, Bias, Encoding, LinearBias
from posenc_lightning.encodings.normalizer import Normalizer, Walk
from posenc_lightning.encodings.registry import register
from posenc_lightning.encodings.rope import RoPE
from posenc_lightning.functional.stick_breaking import stick_breaking_mask, stick_breaking_weights


class StickBreakingNormalizer(Normalizer):
    """Stick-breaking (Tan et al., 2024, eqs. 1-3): ``A_ij = beta_ij prod_{j < k <= i} (1 - beta_ik)``,
    ``beta = sigmoid(logits)``, keys broken off nearest first; causal only. Its tile math is
    `functional.stick_breaking` (walked by the blockwise tiles and the Triton kernels)."""

    walk = Walk.STICK_BREAKING
    fused_in = frozenset({"tiles", "kernel"})
    causal_only = True

    def weights(self, logits: Tensor, mask: Tensor | None, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        nq, nk = logits.shape[-2:]
        order = stick_breaking_mask(nq, nk, nk - nq, self.attend_current, logits.device)
        m = order if mask is None else (mask & order)
        return stick_breaking_weights(logits, m)


@register("sba", "normalize", "Stick-breaking attention: A_ij = beta_ij prod (1 - beta_ik), no softmax (Tan et al., 2024)")
class StickBreaking(Encoding):
    """Softmax replaced by stick-breaking in log space (numerically stable); needs no other
    positional encoding. Causal only. Weights of a query sum to at most 1; the rest of the stick
    goes nowhere.

    Args:
        attend_current: may a query attend to its own key (off in the reference implementations,
            so the first token attends to nothing and outputs 0).
    """

    normalizer_kind = StickBreakingNormalizer

    def __init__(self, attend_current: bool = False) -> None:
        super().__init__()
        self.attend_current = attend_current

    def normalize(self, ctx: AttentionContext) -> StickBreakingNormalizer:
        return StickBreakingNormalizer(self.name, self.attend_current)


@register("rse", "normalize", "Rotary stick-breaking encoding: RoPE + stick-breaking with a learned distance penalty lambda*|i-j|")
class RotaryStickBreaking(StickBreaking):
    """RSE: ``beta_ij = sigmoid(q_i^RoPE . k_j^RoPE / sqrt(d) - lambda_h |i - j|)``, then stick-breaking.

    RoPE is composed (a submodule), the penalty is a `LinearBias` with learnable per-head slopes
    ``lambda_h`` (so fused backends see a plain ALiBi-shaped term).

    Args:
        theta, layout, partial_rotary_factor: RoPE's arguments.
        penalty_init: initial ``lambda`` of every head.
        attend_current: as in `StickBreaking`.
    """

    needs_even_head_dim = True
    bias_kinds = (LinearBias,)

    def __init__(self, theta: float = 10000.0, layout: Literal["half", "interleaved"] = "half",
                 partial_rotary_factor: float = 1.0, penalty_init: float = 0.01,
                 attend_current: bool = False) -> None:
        super().__init__(attend_current=attend_current)
        self.rope = RoPE(theta=theta, layout=layout, partial_rotary_factor=partial_rotary_factor)
        self.penalty_init = penalty_init
        self.penalty: nn.Parameter | None = None

    def _ready(self) -> bool:
        return self.n_heads is not None and self.head_dim is not None

    def bind(self, **sizes: int | None) -> Encoding:
        self.rope.bind(head_dim=sizes.get("head_dim"))
        return super().bind(**sizes)

    def build(self) -> None:
        self.penalty = nn.Parameter(torch.full((self.n_heads,), float(self.penalty_init)))

    @property
    def fused_rotary(self) -> Encoding | None:
        """The rotation, for backends that fuse it (the triton kernels)."""
        return self.rope.fused_rotary

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        return self.rope.rotate(q, k, ctx)

    def bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Bias | None:
        if self.penalty is None:
            raise RuntimeError("rse: n_heads unknown; call bind(n_heads=...) or inject() first")
        return LinearBias(self.penalty, ctx.q_pos, ctx.k_pos)
