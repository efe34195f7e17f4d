"""Biases that reduce to a key-only term under softmax (causal ALiBi ``-m (i - j)``, FoX
``c_i - c_j``): the per-row part cancels, so SDPA can take the rest as one extra q/k channel or,
on CPU, as a broadcast key mask on its flash kernel. Used by the SDPA backend (`sdpa`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext, Bias, DecayBias, LinearBias


def _linear_bias_is_key_channel(bias: Bias, mask: AttentionMask, q: Tensor, ctx: AttentionContext | None) -> bool:
    """Causal ALiBi with keys never after their queries in position (non-decreasing positions)."""
    if not isinstance(bias, LinearBias) or ctx is None or not mask.is_plain_causal:
        return False
    qp, kp = bias.q_pos, bias.k_pos
    if q.dtype not in (torch.float32, torch.float64) or qp.dim() != 2 or qp.shape != kp.shape:
        return False  # the extra channel carries m*j: bf16 cannot hold it
    if kp is not qp and not torch.equal(kp, qp):
        return False
    return bool((qp[:, 1:] >= qp[:, :-1]).all())


def _attend_linear_bias_channel(q: Tensor, k: Tensor, v: Tensor, bias: LinearBias, ctx: AttentionContext,
                                scale: float, gqa: bool) -> Tensor:
    """Causal ALiBi as one extra channel, on SDPA's ``is_causal`` kernel (O(N) extra work).

    Where ``j <= i``: ``-m_h (i - j) = m_h j - m_h i`` and softmax ignores the per-row ``m_h i``,
    so the bias is ``m_h (j - c)`` for any constant c: ``q_h -> [q_h, m_h]``,
    ``k_j -> [k_j, (j - c) / scale]``, ``v -> [v, 0]`` (the key channel is head-independent, so
    grouped kv heads work). c is the middle position, which keeps the channel small.
    """
    b, h, n, d = q.shape
    pos = bias.k_pos.to(q.dtype)
    centered = pos - (pos[:, :1] + pos[:, -1:]) / 2  # [B, N]
    q_ch = bias.slopes.to(q.dtype)[None, :, None, None].expand(b, h, n, 1)
    k_ch = (centered / scale)[:, None, :, None].expand(b, k.shape[1], n, 1)
    out = F.scaled_dot_product_attention(torch.cat((q, q_ch), -1), torch.cat((k, k_ch), -1),
                                         F.pad(v, (0, 1)), is_causal=True, scale=scale, enable_gqa=gqa)
    return out[..., :d]


def _key_mask_works(q: Tensor, k: Tensor, made_from: Tensor) -> bool:
    """`_attend_key_bias` applies: CPU, one kv head per query head, and a bias that needs no
    gradient (the kernel gives none to its mask)."""
    return (q.device.type == "cpu" and k.shape[1] == q.shape[1] and q.dtype in (torch.float32, torch.float64)
            and not (made_from.requires_grad and torch.is_grad_enabled()) and _CPU_FLASH is not None)


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_key_bias(q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor, causal: bool, scale: float) -> Tensor:
    """Attention with a bias that depends on the key only, ``key_bias [B|1, H, Nk]`` (what ALiBi's
    and FoX's ``f(i) - g(j)`` leave once softmax drops the per-row ``f(i)``), given to SDPA's
    CPU flash kernel as a broadcast ``[B, H, 1, Nk]`` mask together with its causal flag: no
    ``N x N`` mask, no copies of q and k (the extra-channel form costs two), same kernel
    backward."""
    b = max(q.shape[0], key_bias.shape[0])
    mask = key_bias.to(q.dtype).unsqueeze(-2).expand(b, -1, -1, -1)
    return _CPU_FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)[0]


def _decay_bias_is_key_channel(bias: Bias, q: Tensor) -> bool:
    return isinstance(bias, DecayBias) and q.dtype in (torch.float32, torch.float64)


def _attend_decay_bias_channel(q: Tensor, k: Tensor, v: Tensor, bias: DecayBias, mask: AttentionMask,
                               scale: float, gqa: bool) -> Tensor:
    """FoX's ``c_i - c_j`` as one extra channel: softmax ignores the per-row ``c_i``, so the bias
    is ``-(c_j - c)`` for a constant c (the middle of the range, to keep the channel small):
    ``q_h -> [q_h, 1]``, ``k_hj -> [k_hj, -(c_hj - c) / scale]``, ``v -> [v, 0]``. Any mask works
    (plain causal keeps SDPA's ``is_causal`` kernel); O(N) extra work and memory, and the
    gradient reaches ``c_k`` through the channel (``c_q``'s is exactly 0)."""
    b, h, n_q, d = q.shape
    c_k = bias.c_k.to(q.dtype).expand(b, h, -1)
    centre = (c_k.amax(-1, keepdim=True) + c_k.amin(-1, keepdim=True)).detach() / 2
    k_ch = (-(c_k - centre) / scale).unsqueeze(-1)  # [B, H, Nk, 1]
    if gqa:
        k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    q2 = torch.cat((q, q.new_ones(b, h, n_q, 1)), -1)
    k2 = torch.cat((k.expand(b, -1, -1, -1), k_ch), -1)
    v2 = F.pad(v.expand(b, -1, -1, -1), (0, 1))
    if mask.is_plain_causal or mask.is_trivial:
        out = F.scaled_dot_product_attention(q2, k2, v2, is_causal=mask.causal, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask.materialize(q.device), scale=scale)
    return out[..., :d]
