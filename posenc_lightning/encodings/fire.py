"""FIRE (Li et al., 2024, "Functional Interpolation for Relative Positions Improves Long Context
Transformers"): a learned bias ``f_theta(psi(i - j) / psi(max(L, i)))`` (eq. 3)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posenc_lightning.encodings.base import AttentionContext, Bias, DenseBias, Encoding
from posenc_lightning.encodings.registry import register
from posenc_lightning.functional.fire import fire_normalized_distance


@register("fire", "bias", "FIRE: learned MLP of the log-transformed, progressively normalized distance (Li et al., 2024)")
class FIRE(Encoding):
    """FIRE's bias: one MLP ``1 -> mlp_width -> n_heads`` (ReLU), a learnable ``c`` in
    ``psi(x) = log(c|x| + 1)`` and a learnable threshold ``L = |L_multiplier * init_L|`` (as in the
    paper's reference code, appendix).

    Args:
        mlp_width: hidden width of ``f_theta`` (32 in the paper).
        init_c: initial ``c`` (0.1).
        init_L: initial threshold ``L`` (512): below it the distances are normalized by
            ``psi(L)``, not ``psi(i)``, so short contexts are not over-stretched.
        learn_L: learn ``L`` (through a multiplier) or keep it fixed.
        eps: added to the normalizer.
    """

    def __init__(self, mlp_width: int = 32, init_c: float = 0.1, init_L: float = 512.0,
                 learn_L: bool = True, eps: float = 1e-6) -> None:
        super().__init__()
        if mlp_width < 1 or init_L <= 0 or init_c <= 0:
            raise ValueError(f"fire: need mlp_width >= 1, init_c > 0 and init_L > 0 "
                             f"(got {mlp_width}, {init_c}, {init_L})")
        self.mlp_width = mlp_width
        self.eps = eps
        self.c = nn.Parameter(torch.tensor(float(init_c)))
        self.register_buffer("init_L", torch.tensor(float(init_L)))
        self.L_multiplier = nn.Parameter(torch.tensor(1.0), requires_grad=learn_L)
        self.mlp: nn.Sequential | None = None

    def _ready(self) -> bool:
        return self.n_heads is not None

    def build(self) -> None:
        self.mlp = nn.Sequential(nn.Linear(1, self.mlp_width), nn.ReLU(), nn.Linear(self.mlp_width, self.n_heads))
        self.mlp.to(self.c.device)

    @property
    def threshold(self) -> Tensor:
        return (self.L_multiplier * self.init_L).abs()

    def normalized_distance(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The MLP input ``[B, Nq, Nk]``."""
        return fire_normalized_distance(q_pos, k_pos, self.c, self.threshold, self.eps)

    def bias_tensor(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """``[B, H, Nq, Nk]`` float32."""
        if self.mlp is None:
            raise RuntimeError("fire: n_heads unknown; call bind(n_heads=...) or inject() first")
        x = self.normalized_distance(q_pos, k_pos).unsqueeze(-1)  # [B, Nq, Nk, 1]
        return self.mlp(x).float().permute(0, 3, 1, 2)

    def bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Bias | None:
        return DenseBias(self.bias_tensor(ctx.q_pos, ctx.k_pos))
