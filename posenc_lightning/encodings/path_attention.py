"""PaTH's causal softmax attention computed by its own walk (`path_attention`): the logits are
``q~_i . k~_j`` carried through the chunks between them, so neither a separate ``q . k`` nor a
block of bias rows is formed.

Tokens in chunks of ``C`` (`functional.path`). The keys' side (each key carried to its chunk's end,
``k~``; each chunk's product as a ``D x D`` matrix ``P``) and the queries' side in their own chunk
(``q~``, the query carried to its chunk's start; the logits ``s0`` of its own chunk) are computed
once per call by autograd. `_PaTHWalk` then walks every query chunk of a block down the key chunks
before it, nearest first, all query chunks at once (step ``delta``: query chunk ``c`` meets key
chunk ``c - delta``): logits ``r . k~`` (``r`` starts at ``q~``), an online softmax and ``P V``,
then ``r <- r P``. Its backward recomputes a block's walk, keeping ``r`` and its logits' gradient
for every step (``rows x D x N / C`` per block, within `Tunables.path_walk_bytes`), then runs the
carry's adjoint back from the farthest chunk: ``g <- g P^T + dS k~`` and ``dP += r^T g``. Logits
are in base 2 (``exp2``). Tensors are chunks first (``[n, B * H, C, .]``): a range of chunks is one
contiguous batch of matrices.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc_lightning.functional.path import path_carries, path_query_chunks

__all__ = ["path_attention", "walk_blocks"]

#: tensors of one step's size a forward block keeps alive together (logits, weights, their temporaries)
_FORWARD_LIVE = 6
#: the walk's logits are in base 2 (``exp2``: ``exp``'s slow path for results below float32's
#: smallest normal, logits far below their row's maximum as FoX's gates make them, is many times slower)
_LOG2E = math.log2(math.e)


def walk_blocks(batch_heads: int, c0: int, n_q: int, chunk: int, head_dim: int, item: int,
                budget: int) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """The blocks of query chunks ``(j_lo, j_hi)`` of the forward and of the backward walk, each
    within ``budget`` bytes (at least one chunk).

    The forward keeps a few step-sized tensors (``[chunks, B * H, C, max(C, D)]``): equal blocks.
    The backward keeps the carried queries and their gradients of every step: query chunk ``c0 +
    j`` takes ``c0 + j`` steps of ``2 x [B * H, C, D]``, so a block takes chunks while their steps
    fit (the first chunks, with the fewest steps, share a block).

    Args:
        batch_heads: ``B * H``; c0: the first query chunk; n_q: the query chunks; chunk: ``C``;
        head_dim: ``D``; item: bytes per element; budget: bytes per block.
    """
    step = item * batch_heads * chunk * max(chunk, head_dim)
    n_fwd = max(1, budget // (_FORWARD_LIVE * step))
    fwd = tuple((j, min(n_q, j + n_fwd)) for j in range(0, n_q, n_fwd))
    cap = budget // (2 * item * batch_heads * chunk * head_dim)  # chunk-steps per backward block
    bwd, j_lo, held = [], 0, 0
    for j in range(n_q):
        if j > j_lo and held + c0 + j > cap:
            bwd.append((j_lo, j))
            j_lo, held = j, 0
        held += c0 + j
    bwd.append((j_lo, n_q))
    return fwd, tuple(bwd)


def path_attention(q: Tensor, parts: tuple[Tensor, ...], v: Tensor, q_offset: int, scale: float,
                   budget: int, key_bias: Tensor | None = None,
                   segments: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Causal PaTH attention ``softmax(scale * q_i^T H_i ... H_{j+1} k_j) v`` of the queries at key
    indices ``q_offset .. q_offset + m - 1`` over keys ``0 .. q_offset + m - 1``.

    Args:
        q: ``[B, H, m, D]``.
        parts: the keys' chunks, `functional.path.path_chunk_parts` of every key (heads repeated).
        v: ``[B, H, q_offset + m, D]`` (heads repeated).
        q_offset: the key index of the first query.
        scale: the logit scale.
        budget: bytes a block of the walk may keep (`walk_blocks`).
        key_bias: ``[B|1, H|1, q_offset + m]`` added to every query's scaled logits (a key-only
            term beside PaTH's: FoX's gates), or None.
        segments: ``(q_seg [B, m], k_seg [B, q_offset + m])`` contiguous document ids: a query
            sees only the keys of its document; or None.

    Returns:
        ``[B, H, m, D]`` in q's dtype (computed in float32 at least).
    """
    b, h, m, d = q.shape
    wc, t, wk, kc, kt = parts
    n_ch, c = wc.shape[2], wc.shape[3]
    qt, s0, front = path_query_chunks(q, wc, t, wk, kc, q_offset)
    vc = F.pad(v.to(wc.dtype).contiguous(), (0, 0, 0, n_ch * c - v.shape[-2])).view(b, h, n_ch, c, d)
    fwd, bwd = walk_blocks(b * h, q_offset // c, qt.shape[2], c, d, qt.element_size(), budget)
    kb, scale2 = None, scale * _LOG2E
    if key_bias is not None:
        kb = F.pad(key_bias.to(wc.dtype).expand(b, h, -1) * _LOG2E, (0, n_ch * c - key_bias.shape[-1]))
        kb = kb.view(b, h, n_ch, 1, c)
    ins = (qt, s0, kt * scale2, path_carries(wc, t), vc, kb)
    seg_q = seg_k = None
    if segments is not None:  # [chunks, B, C]; padded rows see their own key (no row without a key)
        q_seg, k_seg = segments
        rows = torch.cat((k_seg[:, :q_offset], q_seg), dim=1)
        seg_k, seg_q = (F.pad(x, (0, n_ch * c - x.shape[1]), value=-1).view(b, n_ch, c).transpose(0, 1).contiguous()
                        for x in (k_seg, rows))
        seg_q = seg_q[q_offset // c:]
    out = _PaTHWalk.apply(*(None if x is None else _chunk_major(x) for x in ins), seg_q, seg_k, q_offset // c, scale2,
                          fwd, bwd)
    out = out.transpose(0, 1).reshape(b, h, -1, d)  # back from [chunks, B * H, C, D]
    return out[:, :, front:front + m].to(q.dtype)


def _chunk_major(x: Tensor) -> Tensor:
    """``[B, H, n, ...]`` as ``[n, B * H, ...]``, contiguous: a range of chunks is then one
    contiguous batch of matrices (a product over it needs no copy)."""
    return x.flatten(0, 1).transpose(0, 1).contiguous()


def _steps(c0: int, j_lo: int, j_hi: int, delta: int) -> tuple[int, int, int]:
    """Step ``delta`` of the query chunks ``j_lo .. j_hi - 1`` (absolute ``c0 + j``): the first
    active one (``c0 + j >= delta``) and the key chunks ``a0 .. a1 - 1`` they meet."""
    j0 = max(j_lo, delta - c0)
    return j0, c0 + j0 - delta, c0 + j_hi - delta


def _mm(a: Tensor, b: Tensor, add: Tensor | None = None) -> Tensor:
    """``a @ b (+ add)``, batched over the leading dims as one ``bmm`` (``baddbmm`` with ``add``
    broadcast), a new tensor."""
    a3, b3 = a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])
    out = torch.bmm(a3, b3) if add is None else torch.baddbmm(add.reshape(-1, *add.shape[-2:]), a3, b3)
    return out.view(*a.shape[:-2], a.shape[-2], b.shape[-1])


def _acc(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out += a @ b`` in place, batched over the leading dims (``out`` contiguous)."""
    out.view(-1, *out.shape[-2:]).baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))


class _PaTHWalk(torch.autograd.Function):
    """``softmax`` attention of the walk (module docstring), chunks first (`_chunk_major`). Inputs:
    ``q~ [nq, B * H, C, D]`` and ``s0 [nq, B * H, C, C]`` of the query chunks ``c0 ..``; ``k~ *
    scale``, ``P [.., D, D]``, ``v`` and a key bias ``[.., 1, C]`` (or None) as ``[c0 + nq, B * H,
    C, .]``; ``scale`` and the key bias in base 2 (times ``log2 e``). Output: ``[nq, B * H, C, D]``."""

    @staticmethod
    def forward(ctx, qt: Tensor, s0: Tensor, kts: Tensor, pc: Tensor, vc: Tensor, kb: Tensor | None,
                seg_q: Tensor | None, seg_k: Tensor | None, c0: int, scale: float,
                fwd_blocks: tuple[tuple[int, int], ...], bwd_blocks: tuple[tuple[int, int], ...]) -> Tensor:
        c = qt.shape[2]
        hidden = ~torch.ones(c, c, dtype=torch.bool, device=qt.device).tril()
        out = torch.empty_like(qt)
        lse = qt.new_empty(qt.shape[:-1])
        for j_lo, j_hi in fwd_blocks:
            s = _own_chunk(s0[j_lo:j_hi], scale, hidden, None if kb is None else kb[c0 + j_lo:c0 + j_hi])
            _hide(s, seg_q, seg_k, j_lo, j_hi, c0 + j_lo)
            mx = s.amax(-1)
            p = s.sub_(mx[..., None]).exp2_()
            den = p.sum(-1)
            acc = p @ vc[c0 + j_lo:c0 + j_hi]
            r = qt[j_lo:j_hi]
            last = c0 + j_hi - 1
            for delta in range(1, last + 1):
                j0, a0, a1 = _steps(c0, j_lo, j_hi, delta)
                r = r[r.shape[0] - (j_hi - j0):]
                s = r @ kts[a0:a1].transpose(-1, -2)
                if kb is not None:
                    s += kb[a0:a1]
                _hide(s, seg_q, seg_k, j0, j_hi, a0)
                m_old = mx[j0 - j_lo:]
                m_new = torch.maximum(m_old, s.amax(-1))
                alpha = m_old.sub_(m_new).exp2_()
                p = s.sub_(m_new[..., None]).exp2_()
                den[j0 - j_lo:].mul_(alpha).add_(p.sum(-1))
                acc_a = acc[j0 - j_lo:]
                acc_a.mul_(alpha[..., None])
                _acc(acc_a, p, vc[a0:a1])
                m_old.copy_(m_new)
                if delta < last:
                    j1 = _steps(c0, j_lo, j_hi, delta + 1)[0]
                    r = r[j1 - j0:] @ pc[a0 + j1 - j0:a1]
            out[j_lo:j_hi] = acc.div_(den[..., None])
            lse[j_lo:j_hi] = mx.add_(den.log2_())
        ctx.save_for_backward(qt, s0, kts, pc, vc, kb, seg_q, seg_k, out, lse)
        ctx.c0, ctx.scale, ctx.bwd_blocks = c0, scale, bwd_blocks
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor) -> tuple[Tensor | None, ...]:
        qt, s0, kts, pc, vc, kb, seg_q, seg_k, out, lse = ctx.saved_tensors
        c0, scale = ctx.c0, ctx.scale
        c = qt.shape[2]
        hidden = ~torch.ones(c, c, dtype=torch.bool, device=qt.device).tril()
        # d_out times ln 2: the logits' gradient comes out in base 2 (d_v takes log2 e back at the end)
        d_out = torch.mul(d_out, 1.0 / _LOG2E, out=torch.empty_like(d_out, memory_format=torch.contiguous_format))
        d_qt, d_s0 = torch.zeros_like(qt), torch.empty_like(s0)
        d_kts, d_pc, d_vc = torch.zeros_like(kts), torch.zeros_like(pc), torch.zeros_like(vc)
        d_kb = None if kb is None else torch.zeros_like(kb)
        rowdot = (d_out * out).sum(-1)
        for j_lo, j_hi in ctx.bwd_blocks:
            do, dl, ls = d_out[j_lo:j_hi], rowdot[j_lo:j_hi, ..., None], lse[j_lo:j_hi, ..., None]
            n_dl, n_ls = -dl, -ls  # added by the products themselves (baddbmm), one pass fewer per step
            # the queries' own chunk
            own = slice(c0 + j_lo, c0 + j_hi)
            s = _own_chunk(s0[j_lo:j_hi], scale, hidden, None if kb is None else kb[own])
            p = _hide(s, seg_q, seg_k, j_lo, j_hi, own.start).sub_(ls).exp2_()
            _acc(d_vc[own], p.transpose(-1, -2), do)
            ds = p.mul_((do @ vc[own].transpose(-1, -2)).sub_(dl))
            if d_kb is not None:
                d_kb[own] += ds.sum(-2, keepdim=True)
            d_s0[j_lo:j_hi] = ds.mul_(scale)
            # the walk, recomputed: each step's carried queries and their logits' gradient
            rs, gs = [], []
            r = qt[j_lo:j_hi]
            last = c0 + j_hi - 1
            for delta in range(1, last + 1):
                j0, a0, a1 = _steps(c0, j_lo, j_hi, delta)
                r = r[r.shape[0] - (j_hi - j0):]
                k_a, do_a = kts[a0:a1], do[j0 - j_lo:]
                s = _mm(r, k_a.transpose(-1, -2), n_ls[j0 - j_lo:])
                if kb is not None:
                    s += kb[a0:a1]
                p = _hide(s, seg_q, seg_k, j0, j_hi, a0).exp2_()
                _acc(d_vc[a0:a1], p.transpose(-1, -2), do_a)
                ds = p.mul_(_mm(do_a, vc[a0:a1].transpose(-1, -2), n_dl[j0 - j_lo:]))
                if d_kb is not None:
                    d_kb[a0:a1] += ds.sum(-2, keepdim=True)
                _acc(d_kts[a0:a1], ds.transpose(-1, -2), r)
                rs.append(r)
                gs.append(ds @ k_a)
                if delta < last:
                    j1 = _steps(c0, j_lo, j_hi, delta + 1)[0]
                    r = r[j1 - j0:] @ pc[a0 + j1 - j0:a1]
            # the carry's adjoint, from the farthest step back: g_delta = dS k~ + g_{delta+1} P^T
            # (``g``: the chunks active at the step, ``j0 ..``)
            g = None
            for delta in range(last, 0, -1):
                j0, a0, a1 = _steps(c0, j_lo, j_hi, delta)
                r, g_own = rs.pop(), gs.pop()
                if g is None:
                    g = g_own
                    continue
                j1 = _steps(c0, j_lo, j_hi, delta + 1)[0]
                p_a = pc[a0 + j1 - j0:a1]
                _acc(d_pc[a0 + j1 - j0:a1], r[j1 - j0:].transpose(-1, -2), g)
                g = _mm(g, p_a.transpose(-1, -2), g_own[j1 - j0:])
                if j1 > j0:  # chunks that join the walk at this step
                    g = torch.cat((g_own[:j1 - j0], g))
            if g is not None:
                d_qt[j_hi - g.shape[0]:j_hi] = g
        return d_qt, d_s0, d_kts, d_pc, d_vc.mul_(_LOG2E), d_kb, None, None, None, None, None, None


def _hide(s: Tensor, seg_q: Tensor | None, seg_k: Tensor | None, j0: int, j1: int, a0: int) -> Tensor:
    """``s`` (the logits of query chunks ``j0 .. j1 - 1`` and key chunks from ``a0``, ``[chunks, B * H,
    C, C]``) with ``-inf`` where query and key are in different documents, in place."""
    if seg_q is None:
        return s
    other = seg_q[j0:j1, :, :, None] != seg_k[a0:a0 + j1 - j0, :, None, :]  # [chunks, B, C, C]
    s.view(s.shape[0], other.shape[1], -1, *s.shape[-2:]).masked_fill_(other[:, :, None], float("-inf"))
    return s


def _own_chunk(s0: Tensor, scale: float, hidden: Tensor, kb: Tensor | None) -> Tensor:
    """The scaled logits of the queries' own chunk (a new tensor), ``-inf`` past the diagonal."""
    s = s0 * scale
    if kb is not None:
        s += kb
    return s.masked_fill_(hidden, float("-inf"))
