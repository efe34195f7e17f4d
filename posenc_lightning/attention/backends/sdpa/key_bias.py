"""Biases that reduce to a key-only term under softmax (`Bias.key_only`: a causal linear
distance penalty ``-m (i - j)``, cumulative gates ``c_i - c_j``): the per-row part cancels, so SDPA can take the rest as one
extra q/k channel or, on CPU, as a broadcast key mask on its flash kernel. Used by `sdpa`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import KeyOnly


def _attend_key_channel(q: Tensor, k: Tensor, v: Tensor, key_only: KeyOnly, mask: AttentionMask, scale: float,
                        gqa: bool) -> Tensor:
    """Attention with a key-only bias ``q_ch[h] * k_ch[b, h, j]`` as one extra channel:
    ``q_h -> [q_h, q_ch[h]]``, ``k_j -> [k_j, k_ch[j] / scale]``, ``v -> [v, 0]``. A key channel
    shared by all heads (positions) keeps grouped kv heads grouped; a per-head one (gates)
    repeats them. Plain causal or no mask keeps SDPA's ``is_causal`` kernel; O(N) extra
    work and memory, and gradients reach ``q_ch`` and ``k_ch`` through the channels."""
    b, h, n_q, d = q.shape
    k_ch = key_only.k_ch.to(q.dtype)
    if k_ch.shape[1] != 1 and gqa:
        k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    h_kv = k.shape[1]
    q_ch = (q.new_ones(b, h, n_q, 1) if key_only.q_ch is None
            else key_only.q_ch.to(q.dtype)[None, :, None, None].expand(b, h, n_q, 1))
    q2 = torch.cat((q, q_ch), -1)
    k2 = torch.cat((k.expand(b, -1, -1, -1), (k_ch / scale).unsqueeze(-1).expand(b, h_kv, -1, 1)), -1)
    v2 = F.pad(v.expand(b, -1, -1, -1), (0, 1))
    if mask.is_plain_causal or mask.is_trivial:
        out = F.scaled_dot_product_attention(q2, k2, v2, is_causal=mask.causal, scale=scale, enable_gqa=h_kv != h)
    else:
        out = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask.materialize(q.device), scale=scale,
                                             enable_gqa=h_kv != h)
    return out[..., :d]


def _key_mask_works(q: Tensor, k: Tensor, made_from: Tensor) -> bool:
    """`_attend_key_bias` applies: CPU, one kv head per query head, and a bias that needs no
    gradient (the kernel gives none to its mask)."""
    return (q.device.type == "cpu" and k.shape[1] == q.shape[1] and q.dtype in (torch.float32, torch.float64)
            and not (made_from.requires_grad and torch.is_grad_enabled()) and _CPU_FLASH is not None)


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_key_bias(q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor, causal: bool, scale: float) -> Tensor:
    """Attention with a bias that depends on the key only, ``key_bias [B|1, H, Nk]`` (what an
    ``f(i) - g(j)`` bias leaves once softmax drops the per-row ``f(i)``), given to SDPA's
    CPU flash kernel as a broadcast ``[B, H, 1, Nk]`` mask together with its causal flag: no
    ``N x N`` mask, no copies of q and k (the extra-channel form costs two), same kernel
    backward."""
    b = max(q.shape[0], key_bias.shape[0])
    mask = key_bias.to(q.dtype).unsqueeze(-2).expand(b, -1, -1, -1)
    return _CPU_FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)[0]
