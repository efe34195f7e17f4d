"""Eager attention: everything in plain PyTorch, in float32 (float64 for float64 inputs). The reference for every other path."""

from __future__ import annotations

import torch
from torch import Tensor

from posenc_lightning.attention.mask import LOCAL_KINDS, AttentionMask
from posenc_lightning.encodings.base import AttentionContext, Bias, Encoding, Normalizer

NAME = "eager"
#: rotates q, k in-kernel with ``ctx.rotary`` (the mixin then skips ``encoding.rotate``)
FUSES_ROTARY = False
#: the local masks it honors (`attention.mask.LOCAL_KINDS`): a sliding window, a chunk
LOCAL_MASKS = LOCAL_KINDS


def supports(encoding: Encoding, device: torch.device, requires_grad: bool) -> str | None:
    return None


def repeat_kv(x: Tensor, n_heads: int) -> Tensor:
    """Grouped-query attention: repeat each kv head for the query heads of its group."""
    if x.shape[1] == n_heads:
        return x
    if n_heads % x.shape[1]:
        raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={x.shape[1]}")
    return x.repeat_interleave(n_heads // x.shape[1], dim=1)


def attention_weights(q: Tensor, k: Tensor, *, bias: Bias | None, mask: AttentionMask, scale: float,
                      normalizer: Normalizer | None = None, ctx: AttentionContext | None = None) -> Tensor:
    """The attention matrix ``[B, H, Nq, Nk]`` in float32, float64 for float64 inputs (used by the
    visualizer too)."""
    k = repeat_kv(k, q.shape[1])
    wt = torch.promote_types(q.dtype, torch.float32)
    logits = torch.matmul(q.to(wt), k.to(wt).transpose(-1, -2)) * scale
    if bias is not None:
        logits = logits + bias.materialize()
    m = mask.materialize(q.device)
    if normalizer is not None:
        if ctx is None:
            raise ValueError(f"{normalizer.name}: the eager normalizer needs the positions (ctx)")
        normalizer.check_causal(ctx.causal)
        return normalizer.weights(logits, m, ctx.q_pos, ctx.k_pos)
    if m is not None:
        logits = logits.masked_fill(~m, float("-inf"))
        return torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    return torch.softmax(logits, dim=-1)


def attend(q: Tensor, k: Tensor, v: Tensor, *, bias: Bias | None, mask: AttentionMask, scale: float,
           normalizer: Normalizer | None = None, ctx: AttentionContext | None = None) -> Tensor:
    w = attention_weights(q, k, bias=bias, mask=mask, scale=scale, normalizer=normalizer, ctx=ctx)
    out = torch.matmul(w, repeat_kv(v, q.shape[1]).to(w.dtype))
    return out.to(q.dtype)
