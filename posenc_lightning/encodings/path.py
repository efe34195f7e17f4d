"""PaTH (Yang et al., 2025, "PaTH Attention: Position Encoding via Accumulating Householder
Transformations", arXiv 2505.16381) and PaTH-FoX (the paper's PaTH with FoX's forget gates)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posenc_lightning.encodings.base import AttentionContext, Bias, DenseBias, Encoding, span
from posenc_lightning.encodings.bias import OwnAttention
from posenc_lightning.encodings.fox import ForgettingAttention
from posenc_lightning.encodings.hybrid import CompositeEncoding
from posenc_lightning.encodings.path_attention import path_attention
from posenc_lightning.encodings.registry import register
from posenc_lightning.functional.path import path_chunk_parts, path_householder, path_walk_rows

#: where the reflections of cached tokens live in ``LayerKVCache.extra``
CACHE_KEY = "path_householder"


@register("path", "bias", "PaTH: data-dependent accumulated Householder reflections between key and query, "
                          "q_i^T H_i...H_{j+1} k_j (Yang et al., 2025)")
class PaTH(Encoding):
    """``s_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j`` with ``H_t = I - beta_t w_t w_t^T`` per head, from
    the layer input ``x`` (``hidden``): ``w_t = normalize(W_w x_t)`` (one direction of ``head_dim`` per
    head; the paper adds a short convolution, not here) and ``beta_t = 2 sigmoid(W_b x_t + b)``
    (eq. 3). The change to the logits, ``scale * q_i^T (M_ij - I) k_j``, is a `DenseBias` computed by
    blocks of query rows with the blockwise UT-transform algorithm (`functional.path`), so no
    backend holds an ``N x N`` tensor of it and gradients reach q, k and both projections. Under a
    causal mask (documents allowed) the bias also declares its own attention (`Bias.own_attention`):
    sdpa then runs `encodings.path_attention` (the logits ``q~ . k~`` themselves, no ``q . k`` of
    the backend's and no rows).

    Tokens are ordered by index (positions are not read): a product never crosses a document
    boundary when ``segment_ids`` keep attention inside documents. Causal only. The reflections of
    cached tokens stay in the KV cache's ``extra``; a decoding step carries every cached key to
    the new query (``O(L d^2)`` for ``L`` cached tokens; the paper updates the cached keys instead).

    Args:
        chunk: tokens per chunk of the blockwise algorithm (``C``; its ``C x C`` triangular solves).
        beta_bias_init: initial ``b`` (``beta = 2 sigmoid(b)`` at init; 0 gives 1, a projection).
    """

    #: rows read q, k and the reflections: computed by blocks of rows only
    bias_kinds = (DenseBias,)
    requires_hidden = True
    keeps_cache_state = True
    context_parallel = True  # reflections of gathered keys from ctx.k_hidden (`bias`)
    #: the share of a backend's backward blocks of rows these rows take (`Bias.backward_share`):
    #: their recomputation keeps the chunk transforms and the keys' carried copies alive too
    BACKWARD_SHARE = 0.5

    def __init__(self, chunk: int = 64, beta_bias_init: float = 0.0) -> None:
        super().__init__()
        if chunk < 1:
            raise ValueError(f"path: chunk must be >= 1, got {chunk}")
        self.chunk = chunk
        self.beta_bias_init = beta_bias_init
        self.w_proj: nn.Linear | None = None
        self.beta_proj: nn.Linear | None = None

    def _ready(self) -> bool:
        return self.n_heads is not None and self.head_dim is not None and self.d_model is not None

    def build(self) -> None:
        self.w_proj = nn.Linear(self.d_model, self.n_heads * self.head_dim, bias=False)
        nn.init.normal_(self.w_proj.weight, std=self.d_model ** -0.5)
        self.beta_proj = nn.Linear(self.d_model, self.n_heads)
        nn.init.normal_(self.beta_proj.weight, std=self.d_model ** -0.5)
        nn.init.constant_(self.beta_proj.bias, self.beta_bias_init)

    def householder(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """The reflections of the tokens of ``hidden`` ``[B, N, d_model]``.

        Returns:
            ``(w [B, H, N, D], beta [B, H, N])`` (`functional.path.path_householder`).

        Raises:
            RuntimeError: the sizes are not bound yet.
        """
        if self.w_proj is None or self.beta_proj is None:
            raise RuntimeError("path: n_heads/head_dim/d_model unknown; call bind(n_heads=..., head_dim=..., "
                               "d_model=...) or inject() first")
        x = hidden.to(self.w_proj.weight.dtype)
        b, n, _ = x.shape
        w = self.w_proj(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        return path_householder(w, self.beta_proj(x).transpose(1, 2))

    def _reflections(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        """Every key's reflection: from the gathered layer input (context parallelism), or the
        new tokens' appended to the cached ones."""
        if ctx.k_hidden is not None:  # keys gathered over a context-parallel group: queries are the last Nq
            return self.householder(ctx.k_hidden)
        if ctx.hidden is None:
            raise ValueError("path is content-dependent: pass hidden=<layer input> to attend()")
        w, beta = self.householder(ctx.hidden)
        cache = ctx.cache
        if cache is None:
            return w, beta
        prev = cache.extra.get(CACHE_KEY)
        n_prev = k.shape[-2] - q.shape[-2]
        have = 0 if prev is None else prev[1].shape[-1]
        if have != n_prev:
            raise RuntimeError(f"path: the KV cache holds {n_prev} keys but reflections for {have}; "
                               f"reset() the cache after injecting an encoding")
        if prev is not None:
            w, beta = torch.cat((prev[0], w), dim=-2), torch.cat((prev[1], beta), dim=-1)
        cache.extra[CACHE_KEY] = (w, beta)  # with their graph, as the cached keys
        return w, beta

    def bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Bias | None:
        if not ctx.causal:
            raise ValueError("path is causal by construction (H_i...H_{j+1} for keys j <= i); call "
                             "attend(..., causal=True) or use a non-causal encoding such as 'alibi'")
        w, beta = self._reflections(q, k, ctx)
        n_q, n_k, c = q.shape[-2], k.shape[-2], self.chunk
        off, scale = n_k - n_q, self.softmax_scale(q.shape[-1])
        given, rep = k, q.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
        # the keys' chunks once per call (linear in N); each block of rows walks its queries down
        # them, or the whole attention does (`attend`)
        parts = path_chunk_parts(k, w[..., :n_k, :], beta[..., :n_k], c)
        budget = ctx.mode.tunables.path_walk_bytes

        def attend(v: Tensor, q_offset: int, s: float, key_bias: Tensor | None,
                   segments: tuple[Tensor, Tensor] | None) -> Tensor | None:
            if s != scale or q_offset != off:
                return None  # the rows form adds the bias at its own scale to the backend's logits
            return path_attention(q, parts, v.repeat_interleave(rep, dim=1) if rep > 1 else v, off, scale, budget,
                                  key_bias, segments)

        def rows(s: int, e: int, ke: int, q_rows: Tensor, wc: Tensor, t: Tensor, wk: Tensor, kc: Tensor,
                 kt: Tensor) -> Tensor:
            return path_walk_rows(q_rows, wc, t, wk, torch.cat((kt, kt - kc), dim=-1), off + s, ke) * scale

        def window(s: int, e: int, ke: int) -> tuple:
            stop = -(-max(ke, off + e) // c)  # the chunks of the rows' keys and of their queries
            return (span(s, e, -2), *(span(0, stop, -3),) * 5)

        return DenseBias.lazy(rows, n_q, n_k, inputs=(q, *parts), window=window,
                              backward_share=self.BACKWARD_SHARE, own_attention=OwnAttention(q, given, attend))


@register("path_fox", "hybrid", "PaTH-FoX: PaTH's Householder products plus FoX's data-dependent forget gates "
                                "(Yang et al., 2025)")
class PaTHFoX(CompositeEncoding):
    """PaTH (``chunk``, ``beta_bias_init``) and FoX's forget gates (``gate_bias_init``) added to
    the logits: ``s_ij = q_i^T H_i...H_{j+1} k_j / sqrt(d) + sum_{l=j+1}^{i} log f_l``."""

    keeps_cache_state = True
    context_parallel = True

    def __init__(self, chunk: int = 64, beta_bias_init: float = 0.0, gate_bias_init: float = 0.0) -> None:
        super().__init__()
        self._set_members([PaTH(chunk=chunk, beta_bias_init=beta_bias_init),
                           ForgettingAttention(gate_bias_init=gate_bias_init)])
