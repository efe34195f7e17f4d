"""``torch.nn.functional.scaled_dot_product_attention``: rotary is applied before; a bias is
materialized into the float mask one block of query rows at a time (`Bias.rows`); the plain
causal case uses SDPA's ``is_causal`` fast path."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext, Bias, BiasSum, Encoding, LinearBias, RelativeBias

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
    if bias is not None:
        with _flush_denormals(q.device):
            if _linear_bias_is_key_channel(bias, mask, q, ctx):
                return _attend_linear_bias_channel(q, k, v, bias, ctx, scale, gqa)
            u = _toeplitz_template(bias, mask, q.shape[-2], k.shape[-2], ctx)
            if u is not None:
                return _attend_toeplitz(q, k, v, u.to(q.dtype), mask, scale, gqa)
            return _attend_blockwise(q, k, v, bias, mask, scale, gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.materialize(q.device), scale=scale,
                                          enable_gqa=gqa)


#: biased softmax weights decay into the denormal range (exp(-90)), where x86 CPU arithmetic
#: is many times slower; flush them to zero inside the biased SDPA calls (CPU only). The
#: setting is restored to PyTorch's default (off) afterwards.
FLUSH_DENORMALS = True


@contextlib.contextmanager
def _flush_denormals(device: torch.device):
    if not (FLUSH_DENORMALS and device.type == "cpu" and torch.set_flush_denormal(True)):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


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


def _arange_offset(pos: Tensor) -> int | None:
    """``a`` if every row of ``pos`` is ``a + arange(N)`` (integers), else None."""
    if pos.dim() != 2 or pos.dtype.is_floating_point or pos.dtype == torch.bool or not pos.numel():
        return None
    a = pos[:1, :1]
    ok = torch.equal(pos, (a + torch.arange(pos.shape[1], device=pos.device)).expand_as(pos))
    return int(a.item()) if ok else None


def _kind_at(bias: Bias, q_pos: Tensor, k_pos: Tensor) -> Bias | None:
    """The same bias at other positions, for the kinds that depend on ``i - j`` only."""
    if isinstance(bias, LinearBias):
        return LinearBias(bias.slopes, q_pos, k_pos)
    if isinstance(bias, RelativeBias):
        return RelativeBias(bias.table, q_pos, k_pos)
    if isinstance(bias, BiasSum):
        parts = [_kind_at(p, q_pos, k_pos) for p in bias.terms]
        return None if any(p is None for p in parts) else BiasSum(parts)
    return None


def _toeplitz_template(bias: Bias, mask: AttentionMask, n_q: int, n_k: int,
                       ctx: AttentionContext | None) -> Tensor | None:
    """``u [H, n_q + n_k - 1]`` with ``bias[h, i, j] = u[h, j - i + n_q - 1]``, causal -inf folded
    in, when the bias depends on ``i - j`` only and positions are a plain ``arange`` (else None).

    O(H N) work and memory instead of O(H N^2): the ``[H, N, N]`` mask is a strided view of it.
    """
    if ctx is None or mask.q_segments is not None or mask.k_valid is not None:
        return None
    if not isinstance(bias, (LinearBias, RelativeBias, BiasSum)):
        return None
    a, c = _arange_offset(ctx.q_pos), _arange_offset(ctx.k_pos)
    if a is None or c is None or ctx.q_pos.shape[1] != n_q or ctx.k_pos.shape[1] != n_k:
        return None
    dev = ctx.q_pos.device
    d = torch.arange(-(n_q - 1), n_k, device=dev)  # j - i
    # position distance i_pos - j_pos = (a - c) - (j - i)
    kind = _kind_at(bias, torch.full((1, 1), a - c, device=dev), d[None])
    if kind is None:
        return None
    u = kind.materialize()[0, :, 0, :]  # [H, L]
    if u.requires_grad:  # a learned table: SDPA would fall back to its math kernel; go blockwise
        return None
    if mask.causal:
        u = u.masked_fill(d[None, :] > mask.q_offset, float("-inf"))
    return u.contiguous()


def _attend_toeplitz(q: Tensor, k: Tensor, v: Tensor, u: Tensor, mask: AttentionMask, scale: float,
                     gqa: bool) -> Tensor:
    """SDPA with a Toeplitz bias given by its template ``u`` as a zero-copy strided mask.

    Rows are taken in reverse order so that both strides of the view are +1
    (``bias[h, r, j] = u[h, j + r + n_q - stop]`` for ``r = stop - 1 - i``); causal runs go by
    blocks of query rows, each seeing only the keys up to its last query.
    """
    n_q, n_k, n_h, length = q.shape[-2], k.shape[-2], u.shape[0], u.shape[1]
    rows = max(128, -(-n_q // 8)) if mask.causal else n_q
    outs = []
    for start in range(0, n_q, rows):
        stop = min(n_q, start + rows)
        k_stop = min(n_k, mask.q_offset + stop) if mask.causal else n_k
        m = u.as_strided((1, n_h, stop - start, k_stop), (n_h * length, length, 1, 1),
                         u.storage_offset() + n_q - stop)
        o = F.scaled_dot_product_attention(q[:, :, start:stop].flip(-2), k[:, :, :k_stop], v[:, :, :k_stop],
                                           attn_mask=m, scale=scale, enable_gqa=gqa)
        outs.append(o.flip(-2))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


#: a bias is materialized one block of query rows at a time, about this many bytes per block
#: (``[B|1, H, rows, keys]`` float), never the whole ``[H, N, N]``
BIAS_BLOCK_BYTES = 16 * 2**20
#: recompute each block's bias in backward instead of keeping every block alive until then
CHECKPOINT_BLOCKS = True


def block_rows(n_heads: int, n_q: int, n_k: int) -> int:
    """Query rows per SDPA call so that one block of bias is about `BIAS_BLOCK_BYTES`."""
    rows = BIAS_BLOCK_BYTES // (4 * n_heads * max(n_k, 1))
    return int(min(n_q, max(64, rows)))


def _mask_rows(mask: AttentionMask, start: int, stop: int, k_stop: int, device: torch.device) -> Tensor | None:
    """``mask.materialize()[..., start:stop, :k_stop]``, built for those rows only."""
    m = None
    if mask.causal:
        qi = torch.arange(start, stop, device=device)[:, None] + mask.q_offset
        m = (torch.arange(k_stop, device=device)[None, :] <= qi)[None, None]
    if mask.q_segments is not None:
        ks = mask.k_segments if mask.k_segments is not None else mask.q_segments
        seg = mask.q_segments[:, None, start:stop, None] == ks[:, None, None, :k_stop]
        m = seg if m is None else m & seg
    if mask.k_valid is not None:
        kv = mask.k_valid[:, None, None, :k_stop]
        m = kv if m is None else m & kv
    return m


def _attend_rows(q: Tensor, k: Tensor, v: Tensor, bias: Bias, mask: AttentionMask, scale: float, gqa: bool,
                 start: int, stop: int) -> Tensor:
    # causal by index: the queries [start, stop) see keys [0, q_offset + stop) only
    k_stop = min(k.shape[-2], mask.q_offset + stop) if mask.causal else k.shape[-2]
    attn_mask = bias.rows(start, stop, k_stop).to(q.dtype)
    m = _mask_rows(mask, start, stop, k_stop, q.device)
    if m is not None:
        attn_mask = attn_mask.masked_fill(~m, float("-inf"))
    return F.scaled_dot_product_attention(q[:, :, start:stop], k[:, :, :k_stop], v[:, :, :k_stop],
                                          attn_mask=attn_mask, scale=scale, enable_gqa=gqa)


def _attend_blockwise(q: Tensor, k: Tensor, v: Tensor, bias: Bias, mask: AttentionMask, scale: float,
                      gqa: bool) -> Tensor:
    """SDPA over blocks of query rows, each with its own slice of the bias (`Bias.rows`).

    Exact (softmax is per row). Memory is one block of bias instead of ``H x N x N``; causal
    blocks skip the keys after their last query, which the float-mask kernel cannot know to skip.
    """
    n_q = q.shape[-2]
    rows = block_rows(q.shape[1], n_q, k.shape[-2])
    if rows >= n_q:
        return _attend_rows(q, k, v, bias, mask, scale, gqa, 0, n_q)
    ckpt = CHECKPOINT_BLOCKS and torch.is_grad_enabled()
    outs = []
    for start in range(0, n_q, rows):
        stop = min(n_q, start + rows)
        if ckpt:
            from torch.utils.checkpoint import checkpoint

            outs.append(checkpoint(_attend_rows, q, k, v, bias, mask, scale, gqa, start, stop, use_reentrant=False))
        else:
            outs.append(_attend_rows(q, k, v, bias, mask, scale, gqa, start, stop))
    return torch.cat(outs, dim=-2)
