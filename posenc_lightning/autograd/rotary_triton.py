"""`posenc::rotate_pair` on CUDA: q and k rotated in one Triton launch (imported only there; tested
on CPU under ``TRITON_INTERPRET=1`` against `autograd.rotary.rotate_into`).

Each program rotates ``BLOCK_ROWS`` token rows of q (the first programs) or of k (the rest): it loads
the pairs ``(j, j + R/2)`` (half layout) or ``(2j, 2j + 1)`` (interleaved) and the row's cos/sin,
computes in float32 (float64 for float64 tables), stores into a new contiguous tensor in the input's
dtype, and copies the channels from ``R`` on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rotate_rows(X, O, C, S, row0, n_rows, H, N,
                 sxb, sxh, sxn, sxd, scb, sch, scn, scd, ssb, ssh, ssn, ssd,
                 D: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr,
                 BLOCK_ROWS: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr):
    rows = row0 + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    n = rows % N
    bh = rows // N
    h = bh % H
    b = bh // H
    x_row = b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + n.to(tl.int64) * sxn
    c_row = b.to(tl.int64) * scb + h.to(tl.int64) * sch + n.to(tl.int64) * scn
    s_row = b.to(tl.int64) * ssb + h.to(tl.int64) * ssh + n.to(tl.int64) * ssn
    o_row = rows.to(tl.int64) * D
    j = tl.arange(0, BLOCK_J)
    j_ok = j < HALF
    ok = row_ok[:, None] & j_ok[None, :]
    if INTERLEAVED:
        i1 = 2 * j
        i2 = 2 * j + 1
    else:
        i1 = j
        i2 = j + HALF
    c = tl.load(C + c_row[:, None] + j[None, :] * scd, mask=ok, other=0.0)
    s = tl.load(S + s_row[:, None] + j[None, :] * ssd, mask=ok, other=0.0)
    x1 = tl.load(X + x_row[:, None] + i1[None, :] * sxd, mask=ok, other=0.0).to(c.dtype)
    x2 = tl.load(X + x_row[:, None] + i2[None, :] * sxd, mask=ok, other=0.0).to(c.dtype)
    if INVERSE:
        s = -s
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    tl.store(O + o_row[:, None] + i1[None, :], o1.to(O.dtype.element_ty), mask=ok)
    tl.store(O + o_row[:, None] + i2[None, :], o2.to(O.dtype.element_ty), mask=ok)
    if BLOCK_P > 0:  # the channels past the rotary dim, copied
        p = 2 * HALF + tl.arange(0, BLOCK_P)
        pk = row_ok[:, None] & (p < D)[None, :]
        xp = tl.load(X + x_row[:, None] + p[None, :] * sxd, mask=pk, other=0.0)
        tl.store(O + o_row[:, None] + p[None, :], xp.to(O.dtype.element_ty), mask=pk)


@triton.jit
def _rotate_pair_kernel(Q, K, QO, KO, CQ, SQ, CK, SK, rows_q, rows_k, progs_q, HQ, NQ, HK, NK,
                        sqb, sqh, sqn, sqd, skb, skh, skn, skd,
                        scqb, scqh, scqn, scqd, ssqb, ssqh, ssqn, ssqd,
                        sckb, sckh, sckn, sckd, sskb, sskh, sskn, sskd,
                        D: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr,
                        BLOCK_ROWS: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr):
    pid = tl.program_id(0)
    if pid < progs_q:
        _rotate_rows(Q, QO, CQ, SQ, pid * BLOCK_ROWS, rows_q, HQ, NQ, sqb, sqh, sqn, sqd,
                     scqb, scqh, scqn, scqd, ssqb, ssqh, ssqn, ssqd,
                     D, HALF, INTERLEAVED, INVERSE, BLOCK_ROWS, BLOCK_J, BLOCK_P)
    else:
        _rotate_rows(K, KO, CK, SK, (pid - progs_q) * BLOCK_ROWS, rows_k, HK, NK, skb, skh, skn, skd,
                     sckb, sckh, sckn, sckd, sskb, sskh, sskn, sskd,
                     D, HALF, INTERLEAVED, INVERSE, BLOCK_ROWS, BLOCK_J, BLOCK_P)


def _table_strides(t: Tensor) -> tuple[int, int, int, int]:
    """Strides of a ``[B|1, H|1, N, R/2]`` table with its size-1 dims broadcast (stride 0)."""
    return tuple(0 if t.shape[i] == 1 else t.stride(i) for i in range(4))  # type: ignore[return-value]


def rotate_pair_triton(q: Tensor, k: Tensor, cos_q: Tensor, sin_q: Tensor, cos_k: Tensor, sin_k: Tensor,
                       interleaved: bool, inverse: bool, block_rows: int = 16) -> tuple[Tensor, Tensor]:
    """`autograd.rotary.rotate_pair` in one launch: q ``[B, H, Nq, D]``, k ``[B, Hkv, Nk, D]``,
    tables ``[B|1, H|1, N, R/2]`` (float32 or float64); ``block_rows`` token rows per program (a
    power of two)."""
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows={block_rows} must be a power of two, e.g. 16")
    d = q.shape[-1]
    half = cos_q.shape[-1]
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    rows_q, rows_k = q.shape[0] * q.shape[1] * q.shape[2], k.shape[0] * k.shape[1] * k.shape[2]
    br = block_rows
    progs_q, progs_k = triton.cdiv(rows_q, br), triton.cdiv(rows_k, br)
    if progs_q + progs_k == 0:
        return qo, ko
    rest = d - 2 * half
    _rotate_pair_kernel[(progs_q + progs_k,)](
        q, k, qo, ko, cos_q, sin_q, cos_k, sin_k, rows_q, rows_k, progs_q, q.shape[1], q.shape[2], k.shape[1],
        k.shape[2], *q.stride(), *k.stride(), *_table_strides(cos_q), *_table_strides(sin_q),
        *_table_strides(cos_k), *_table_strides(sin_k),
        D=d, HALF=half, INTERLEAVED=interleaved, INVERSE=inverse, BLOCK_ROWS=br,
        BLOCK_J=triton.next_power_of_2(half), BLOCK_P=triton.next_power_of_2(rest) if rest else 0)
    return qo, ko
