"""Score transforms a model applies inside its attention, kept on posenc's fused path."""

from __future__ import annotations

import torch
from torch import Tensor

from posenc_lightning.attention.backends.eager import repeat_kv
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext, Bias, Normalizer


def softcapped_attend(q: Tensor, k: Tensor, v: Tensor, softcap: float | None, *, bias: Bias | None,
                      mask: AttentionMask, scale: float, normalizer: Normalizer | None = None,
                      ctx: AttentionContext | None = None, sinks: Tensor | None = None) -> Tensor:
    """Attention with the score transforms a model passes to its attention function, in float32:
    Gemma 2's logit softcapping ``cap * tanh(q.k * scale / cap)``, then the encoding's bias and the
    mask (where the model adds its own mask), then softmax or the encoding's normalizer; with
    gpt-oss's attention sinks, one more logit per head in each row's softmax whose weight is dropped
    (``softmax([s_i, sink])[:-1]``).

    Args:
        q: ``[B, H, Nq, D]``; k, v: ``[B, Hkv, Nk, D]``.
        softcap: the cap (``config.attn_logit_softcapping``), or None.
        bias, mask, scale, normalizer, ctx: as for a posenc backend's ``attend``.
        sinks: ``[H]`` sink logits (the module's ``sinks``, passed as ``s_aux``), or None.

    Returns:
        ``[B, H, Nq, D]`` in q's dtype.

    Raises:
        ValueError: sinks with an encoding's normalizer (no sink term is defined for it).
    """
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    wt = torch.promote_types(q.dtype, torch.float32)
    logits = torch.matmul(q.to(wt), k.to(wt).transpose(-1, -2)) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if bias is not None:
        logits = logits + bias.materialize()
    m = mask.materialize(q.device)
    if sinks is not None:
        if normalizer is not None:
            raise ValueError("attention sinks (s_aux) with an encoding that replaces softmax: no sink term is "
                             "defined for its normalizer; use a rotary or bias encoding on this model")
        if m is not None:
            logits = logits.masked_fill(~m, float("-inf"))
        sink = sinks.to(wt).reshape(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        w = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
    elif normalizer is not None:
        normalizer.check_causal(ctx.causal)
        w = normalizer.weights(logits, m, ctx.q_pos, ctx.k_pos)
    elif m is not None:
        w = torch.nan_to_num(torch.softmax(logits.masked_fill(~m, float("-inf")), dim=-1), nan=0.0)
    else:
        w = torch.softmax(logits, dim=-1)
    return torch.matmul(w, v.to(w.dtype)).to(q.dtype)
