"""FIRE (Li et al., 2024, "Functional Interpolation for Relative Positions Improves Long Context
Transformers"): a learned bias ``f_theta(psi(i - j) / psi(max(L, i)))`` (eq. 3)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posenc_lightning.encodings.base import AttentionContext, Bias, Encoding, RelativeBias
from posenc_lightning.encodings.fire import template
from posenc_lightning.encodings.fire.bias import FireBias
from posenc_lightning.encodings.registry import register
from posenc_lightning.functional.fire import fire_normalized_distance
from posenc_lightning.functional.positions import arange_offset, host_reads_ok


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
        use_relative: on CPU (where reading the positions costs no device sync) and outside
            ``torch.compile``, while every query position is below ``L`` the bias depends on
            ``i - j`` only: return it as a `RelativeBias` table (O(N) MLP calls) instead of a
            `FireBias` (the MLP per (i, j): by rows, per ``score_mod`` element or per kernel
            tile). Same values either way.

    Initialization: as the paper's listing (Li et al., 2024, appendix, ``class FIRE``): ``c`` at
    ``init_c`` = 0.1, ``L`` at ``init_L`` = 512 with a learnable multiplier starting at 1, an MLP of
    width 32 at PyTorch's ``nn.Linear`` default init.
    """

    bias_kinds = (RelativeBias, FireBias)

    def __init__(self, mlp_width: int = 32, init_c: float = 0.1, init_L: float = 512.0,
                 learn_L: bool = True, eps: float = 1e-6, use_relative: bool = True) -> None:
        super().__init__()
        if mlp_width < 1 or init_L <= 0 or init_c <= 0:
            raise ValueError(f"fire: need mlp_width >= 1, init_c > 0 and init_L > 0 "
                             f"(got {mlp_width}, {init_c}, {init_L})")
        self.mlp_width = mlp_width
        self.eps = eps
        self.use_relative = use_relative
        # 1-element vectors, not scalars: FSDP2 (fully_shard) shards dim 0 and refuses 0-d parameters
        self.c = nn.Parameter(torch.tensor([float(init_c)]))
        self.register_buffer("init_L", torch.tensor(float(init_L)))
        self.L_multiplier = nn.Parameter(torch.tensor([1.0]), requires_grad=learn_L)
        self.mlp: nn.Sequential | None = None

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object, **kwargs: object) -> None:
        for key in ("c", "L_multiplier"):  # checkpoints from before they were 1-element vectors
            v = state_dict.get(prefix + key)
            if isinstance(v, Tensor) and v.dim() == 0:
                state_dict[prefix + key] = v.reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

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
        """``[B, H, Nq, Nk]`` float32: the reference, straight through the MLP (eq. 3)."""
        if self.mlp is None:
            raise RuntimeError("fire: n_heads unknown; call bind(n_heads=...) or inject() first")
        x = self.normalized_distance(q_pos, k_pos).unsqueeze(-1)  # [B, Nq, Nk, 1] float32
        return self.mlp(x.to(self.mlp[0].weight.dtype)).float().permute(0, 3, 1, 2)

    def bias_params(self) -> tuple[Tensor, ...]:
        """What the bias is computed from: ``(c, L_multiplier, W1, b1, W2, b2)``."""
        lin1, lin2 = self.mlp[0], self.mlp[2]
        return (self.c, self.L_multiplier, lin1.weight, lin1.bias, lin2.weight, lin2.bias)

    def relative_table(self, max_distance: int) -> Tensor:
        """``[H, 2R+1]`` bias of every distance ``i - j`` in ``[-R, R]`` for queries below ``L``
        (`template.distance_table`)."""
        d = torch.arange(-max_distance, max_distance + 1, device=self.c.device)
        lin1, lin2 = self.mlp[0], self.mlp[2]
        return template.distance_table(d, self.c, self.threshold, self.eps, lin1.weight, lin1.bias, lin2.weight,
                                       lin2.bias)

    def bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Bias | None:
        if self.mlp is None:
            raise RuntimeError("fire: n_heads unknown; call bind(n_heads=...) or inject() first")
        qp, kp = ctx.q_pos, ctx.k_pos
        if self.use_relative and host_reads_ok(qp) and not qp.dtype.is_floating_point \
                and not kp.dtype.is_floating_point and qp.numel() and kp.numel():
            # host reads are free (CPU, not traced): all queries below the threshold L? then bias = f(i - j)
            q_max, q_min, k_max, k_min = torch.stack((qp.max(), qp.min(), kp.max(), kp.min())).tolist()
            if template.below_threshold(q_max, self.threshold):
                r = int(max(abs(q_max - k_min), abs(k_max - q_min)))
                return RelativeBias(self.relative_table(r), qp, kp)
        # exact for any positions: rows (sdpa), a score_mod (flex), per tile (triton); start + arange
        # positions (known, or read where free) let rows share one Toeplitz table of psi(i - j)
        return FireBias(qp, kp, self.c, self.L_multiplier, self.init_L, *self.bias_params()[2:], eps=self.eps,
                        q_start=ctx.q_start if ctx.q_start is not None else arange_offset(qp),
                        k_start=ctx.k_start if ctx.k_start is not None else arange_offset(kp),
                        tunables=ctx.mode.tunables)
