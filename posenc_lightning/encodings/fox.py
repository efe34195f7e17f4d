"""FoX (Lin et al., 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate"):
a data-dependent forget gate whose cumulative log is a `DecayBias` on the logits."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from posenc_lightning.encodings.base import AttentionContext, Bias, DecayBias, Encoding
from posenc_lightning.encodings.registry import register
from posenc_lightning.encodings.rope import RoPE
from posenc_lightning.functional.fox import fox_cumulative, fox_log_forget

#: where the cumulative log-gates of cached tokens live in ``LayerKVCache.extra``
CACHE_KEY = "fox_cum_log_forget"


@register("fox", "bias", "Forgetting Transformer: softmax attention with a data-dependent forget gate, D_ij = sum log f (Lin et al., 2025)")
class ForgettingAttention(Encoding):
    """``f_t = sigmoid(w_h . x_t + b_h)`` per head from the layer input ``x`` (``hidden``);
    ``D_ij = c_i - c_j`` with ``c_t = sum_{l<=t} log f_l`` (eq. 6), held as cumulative sums
    (O(N) memory). The cumulative gates of cached tokens stay in the KV cache's ``extra``.

    Args:
        gate_bias_init: initial ``b`` (f = sigmoid(b) at init; 0 gives f = 0.5).
        rope: also rotate q and k with RoPE (the paper's "FoX + RoPE" ablation); default off
            (FoX needs no positional encoding).
        theta, layout: RoPE's arguments when ``rope`` is on.
        gate_init_std: the gate weight ``w`` starts at ``N(0, gate_init_std)``.

    Initialization: the paper's reference code (github.com/zhixuan-lin/forgetting-transformer,
    ``ForgettingAttentionLayer``) starts the data-dependent gate with weight ``N(0, 0.02)`` and bias
    0, so ``f ~ 0.5`` per token; the defaults are those values. Its special bias initialization
    (decay times between ``T_min`` and ``T_max``) is only for its data-independent gates.
    """

    bias_kinds = (DecayBias,)

    requires_hidden = True
    keeps_cache_state = True
    context_parallel = True  # gates of gathered keys from ctx.k_hidden (`bias`)

    def __init__(self, gate_bias_init: float = 0.0, rope: bool = False, theta: float = 10000.0,
                 layout: Literal["half", "interleaved"] = "half", gate_init_std: float = 0.02) -> None:
        super().__init__()
        if gate_init_std < 0:
            raise ValueError(f"fox: gate_init_std must be >= 0, got {gate_init_std}")
        self.gate_bias_init = gate_bias_init
        self.gate_init_std = float(gate_init_std)
        self.rope = RoPE(theta=theta, layout=layout) if rope else None
        if rope:
            self.needs_even_head_dim = True
        self.gate: nn.Linear | None = None

    def _ready(self) -> bool:
        return self.n_heads is not None and self.d_model is not None

    def bind(self, **sizes: int | None) -> Encoding:
        if self.rope is not None:
            self.rope.bind(head_dim=sizes.get("head_dim"))
        return super().bind(**sizes)

    def build(self) -> None:
        self.gate = nn.Linear(self.d_model, self.n_heads)
        # the paper's data-dependent ("full") gate as its reference code starts it: weight
        # N(0, initializer_range = 0.02), bias 0, so f = sigmoid(~0) = 0.5 at every token
        # (zhixuan-lin/forgetting-transformer, ForgettingAttentionLayer._initialize_weights)
        nn.init.normal_(self.gate.weight, std=self.gate_init_std)
        nn.init.constant_(self.gate.bias, self.gate_bias_init)

    @property
    def stages(self) -> frozenset[str]:
        return frozenset({"bias", "rotate"}) if self.rope is not None else frozenset({"bias"})

    @property
    def fused_rotary(self) -> Encoding | None:
        """The rotation, for backends that fuse it (the triton kernels)."""
        return self.rope.fused_rotary if self.rope is not None else None

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        return self.rope.rotate(q, k, ctx) if self.rope is not None else (q, k)

    def log_forget(self, hidden: Tensor) -> Tensor:
        """``log f`` ``[B, H, N]`` float32 (float64 for a float64 gate) from the layer input
        ``[B, N, d_model]`` (cast to the gate's dtype)."""
        if self.gate is None:
            raise RuntimeError("fox: n_heads/d_model unknown; call bind(n_heads=..., d_model=...) or inject() first")
        return fox_log_forget(self.gate(hidden.to(self.gate.weight.dtype))).transpose(1, 2)

    def bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Bias | None:
        if ctx.hidden is None:
            raise ValueError("fox is content-dependent: pass hidden=<layer input> to attend()")
        if ctx.k_hidden is not None:  # keys gathered over a context-parallel group: queries are the last Nq
            c = fox_cumulative(self.log_forget(ctx.k_hidden))
            return DecayBias(c[..., c.shape[-1] - q.shape[-2]:], c)
        log_f = self.log_forget(ctx.hidden)
        cache = ctx.cache
        if cache is None:
            c = fox_cumulative(log_f)
            return DecayBias(c, c)
        prev = cache.extra.get(CACHE_KEY)
        n_prev = k.shape[-2] - q.shape[-2]
        have = 0 if prev is None else prev.shape[-1]
        if have != n_prev:
            raise RuntimeError(f"fox: the KV cache holds {n_prev} keys but forget gates for {have}; "
                               f"reset() the cache after injecting an encoding")
        c_new = fox_cumulative(log_f, None if prev is None else prev[..., -1])
        c_all = c_new if prev is None else torch.cat((prev, c_new), dim=-1)
        cache.extra[CACHE_KEY] = c_all  # with its graph, as the cached keys: later tokens' gradients reach earlier gates
        return DecayBias(c_new, c_all)
