"""``torch.nn.functional.scaled_dot_product_attention``: rotary is applied before; any bias is
materialized into the float mask; the plain causal case uses SDPA's ``is_causal`` fast path."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext, Bias, Encoding

NAME = "sdpa"


def supports(encoding: Encoding, device: torch.device, requires_grad: bool) -> str | None:
    if "normalize" in encoding.stages:
        return f"{encoding.name} replaces softmax (stage 4), which SDPA cannot do"
    return None


def attend(q: Tensor, k: Tensor, v: Tensor, *, bias: Bias | None, mask: AttentionMask, scale: float,
           normalize: Callable | None = None, ctx: AttentionContext | None = None) -> Tensor:
    if normalize is not None:
        raise ValueError("the sdpa backend cannot replace softmax; use backend='eager'")
    gqa = k.shape[1] != q.shape[1]
    if bias is None and (mask.is_plain_causal or mask.is_trivial):
        return F.scaled_dot_product_attention(q, k, v, is_causal=mask.causal, scale=scale, enable_gqa=gqa)
    m = mask.materialize(q.device)
    if bias is None:
        attn_mask = m
    else:
        attn_mask = bias.materialize().to(q.dtype)
        if m is not None:
            attn_mask = attn_mask.masked_fill(~m, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=gqa)
