"""``posenc::lie_rotate_pair`` and its backward on CUDA: q and k rotated by ``Q R(theta) Q^T`` in one
Triton launch each way (imported only there; tested on CPU under ``TRITON_INTERPRET=1`` against the
torch math of `autograd.lie`).

A program takes ``BLOCK_T`` token rows ``x`` of q (the first programs) or of k (the rest): ``v = x Q``
(the planes' coordinates, ``Q``'s halves ``[D, D/2]`` each), the angles ``theta = pos @ F`` of each row
and their ``cos - 1``, ``sin`` in float64, ``w = (R - I) v`` (RoPE's half layout) and ``y = x + w Q^T``,
computed in ``Q``'s dtype (float32 products in IEEE precision, float64 ones as sums of products). No
program holds the basis: the products loop over ``[CHUNK, D/2]`` tiles of its rows (``x Q`` sums
over them, ``w Q^T`` writes ``y`` a chunk of columns at a time), so nothing spills up to D = 128.
Backward programs loop over row blocks: ``dx = g + ((R - I)^T (g Q)) Q^T``, and, when the parameters
take a gradient, each program sums a ``[DQ_ROWS, D]`` slice of ``dQ = g^T w + x^T (R - I)^T (g Q)``
(its chunk of rows, the second grid axis; it writes the same chunk of ``dx``) and the first chunk's
programs ``dF = pos^T dtheta`` over their rows, added to the outputs atomically once per program
(zeroed before the launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _mm(a, b, DOT: tl.constexpr):
    """``a [R, K] @ b [K, C]``."""
    if DOT:
        return tl.dot(a, b, input_precision="ieee")
    return tl.sum(a[:, :, None] * b[None, :, :], axis=1)


@triton.jit
def _mm_nt(a, b, DOT: tl.constexpr):
    """``a [R, K] @ b[C, K]^T``."""
    if DOT:
        return tl.dot(a, tl.trans(b), input_precision="ieee")
    return tl.sum(a[:, None, :] * b[None, :, :], axis=2)


@triton.jit
def _mm_tn(a, b, DOT: tl.constexpr):
    """``a[K, R]^T @ b [K, C]``."""
    if DOT:
        return tl.dot(tl.trans(a), b, input_precision="ieee")
    return tl.sum(a[:, :, None] * b[:, None, :], axis=0)


@triton.jit
def _rows(row0, n_rows, H, N, BLOCK_T: tl.constexpr):
    """Rows ``(b, h, n)`` of a ``[B, H, N, D]`` tensor, ``n`` fastest."""
    rows = row0 + tl.arange(0, BLOCK_T)
    n = rows % N
    bh = rows // N
    return rows < n_rows, bh // H, bh % H, n


@triton.jit
def _positions(POS, b, n, row_ok, spb, spn, spa, A: tl.constexpr, BLOCK_A: tl.constexpr):
    """The rows' positions ``[BLOCK_T, BLOCK_A]`` in float64 (0 past ``A`` axes or ``n_rows``)."""
    a = tl.arange(0, BLOCK_A)
    ptr = POS + (b.to(tl.int64) * spb + n.to(tl.int64) * spn)[:, None] + a[None, :] * spa
    return tl.load(ptr, mask=row_ok[:, None] & (a < A)[None, :], other=0).to(tl.float64)


@triton.jit
def _angles(FREQ, p, sfa, sfk, sfj, M, A: tl.constexpr, MB: tl.constexpr, BLOCK_A: tl.constexpr,
            BLOCK_M: tl.constexpr):
    """``theta [BLOCK_T, BLOCK_M]`` float64: ``sum_a p[:, a] F[a, j // MB, j % MB]``."""
    a = tl.arange(0, BLOCK_A)
    j = tl.arange(0, BLOCK_M)
    f = tl.load(FREQ + a[:, None] * sfa + (j // MB)[None, :] * sfk + (j % MB)[None, :] * sfj,
                mask=(a < A)[:, None] & (j < M)[None, :], other=0.0).to(tl.float64)
    return tl.sum(p[:, :, None] * f[None, :, :], axis=1)


@triton.jit
def _basis_rows(BASIS, c, D, M, j0, BLOCK_M: tl.constexpr, EVEN: tl.constexpr):
    """Rows ``c`` of ``Q[:, j0:j0 + M]`` (a half of the contiguous ``[D, D]`` basis), ``[BLOCK_J, BLOCK_M]``,
    zero past ``D`` rows or ``M`` columns (``EVEN``: ``D`` fills the blocks, no mask)."""
    j = tl.arange(0, BLOCK_M)
    ptr = BASIS + c[:, None] * D + (j0 + j)[None, :]
    if EVEN:
        return tl.load(ptr)
    return tl.load(ptr, mask=(c < D)[:, None] & (j < M)[None, :], other=0.0)


@triton.jit
def _load_cols(X, row, c, row_ok, D, sxd, ct, EVEN: tl.constexpr):
    """Columns ``c`` of the rows at offsets ``row``, ``[BLOCK_T, BLOCK_J]`` in ``ct`` (0 when masked)."""
    if EVEN:
        return tl.load(X + row[:, None] + c[None, :] * sxd, mask=row_ok[:, None], other=0.0).to(ct)
    return tl.load(X + row[:, None] + c[None, :] * sxd, mask=row_ok[:, None] & (c < D)[None, :], other=0.0).to(ct)


@triton.jit
def _forward_rows(X, O, BASIS, FREQ, POS, row0, n_rows, H, N, D, M,
                  sxb, sxh, sxn, sxd, sob, soh, son, spb, spn, spa, sfa, sfk, sfj,
                  A: tl.constexpr, MB: tl.constexpr, DOT: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_J: tl.constexpr,
                  EVEN: tl.constexpr):
    row_ok, b, h, n = _rows(row0, n_rows, H, N, BLOCK_T)
    ct = BASIS.dtype.element_ty
    x_row = b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + n.to(tl.int64) * sxn
    # v = x Q, a chunk of Q's rows (x's columns) at a time: the program never holds all of Q
    v1 = tl.zeros((BLOCK_T, BLOCK_M), dtype=ct)
    v2 = tl.zeros((BLOCK_T, BLOCK_M), dtype=ct)
    for c0 in range(0, D, BLOCK_J):
        c = c0 + tl.arange(0, BLOCK_J)
        x = _load_cols(X, x_row, c, row_ok, D, sxd, ct, EVEN)
        q1, q2 = _basis_rows(BASIS, c, D, M, 0, BLOCK_M, EVEN), _basis_rows(BASIS, c, D, M, M, BLOCK_M, EVEN)
        v1 += _mm(x, q1, DOT)
        v2 += _mm(x, q2, DOT)
    theta = _angles(FREQ, _positions(POS, b, n, row_ok, spb, spn, spa, A, BLOCK_A), sfa, sfk, sfj, M, A, MB,
                    BLOCK_A, BLOCK_M)
    half = tl.sin(0.5 * theta)
    cm1 = (-2.0 * half * half).to(ct)  # cos - 1, exact for small angles
    s = tl.sin(theta).to(ct)
    w1 = v1 * cm1 - v2 * s
    w2 = v2 * cm1 + v1 * s
    # y = x + w Q^T, a chunk of y's columns (Q's rows) at a time
    o_row = b.to(tl.int64) * sob + h.to(tl.int64) * soh + n.to(tl.int64) * son
    for c0 in range(0, D, BLOCK_J):
        c = c0 + tl.arange(0, BLOCK_J)
        q1, q2 = _basis_rows(BASIS, c, D, M, 0, BLOCK_M, EVEN), _basis_rows(BASIS, c, D, M, M, BLOCK_M, EVEN)
        y = _load_cols(X, x_row, c, row_ok, D, sxd, ct, EVEN) + _mm_nt(w1, q1, False) + _mm_nt(w2, q2, False)
        tl.store(O + o_row[:, None] + c[None, :], y.to(O.dtype.element_ty), mask=row_ok[:, None] & (c < D)[None, :])


@triton.jit
def _lie_forward_kernel(Q, K, QO, KO, BASIS, FREQ, PQ, PK, rows_q, rows_k, progs_q, HQ, NQ, HK, NK, D, M,
                        sqb, sqh, sqn, sqd, skb, skh, skn, skd, sqob, sqoh, sqon, skob, skoh, skon,
                        spqb, spqn, spqa, spkb, spkn, spka, sfa, sfk, sfj,
                        A: tl.constexpr, MB: tl.constexpr, DOT: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr,
                        BLOCK_J: tl.constexpr, EVEN: tl.constexpr):
    pid = tl.program_id(0)
    if pid < progs_q:
        _forward_rows(Q, QO, BASIS, FREQ, PQ, pid * BLOCK_T, rows_q, HQ, NQ, D, M, sqb, sqh, sqn, sqd,
                      sqob, sqoh, sqon, spqb, spqn, spqa, sfa, sfk, sfj, A, MB, DOT, BLOCK_T, BLOCK_M, BLOCK_A, BLOCK_J, EVEN)
    else:
        _forward_rows(K, KO, BASIS, FREQ, PK, (pid - progs_q) * BLOCK_T, rows_k, HK, NK, D, M, skb, skh, skn, skd,
                      skob, skoh, skon, spkb, spkn, spka, sfa, sfk, sfj, A, MB, DOT, BLOCK_T, BLOCK_M,
                      BLOCK_A, BLOCK_J, EVEN)


@triton.jit
def _backward_rows(X, G, DX, BASIS, FREQ, POS, DB, DF, first, step, n_rows, H, N, D, M,
                   sxb, sxh, sxn, sxd, sgb, sgh, sgn, sgd, sob, soh, son, spb, spn, spa, sfa, sfk, sfj,
                   A: tl.constexpr, MB: tl.constexpr, NEED: tl.constexpr, DOT: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr,
                   BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr, EVEN: tl.constexpr):
    ct = BASIS.dtype.element_ty
    j = tl.arange(0, BLOCK_M)
    # the program's rows of dQ (and columns of dx): dQ[e] with e = BLOCK_C channels of chunk
    # `tl.program_id(1)`; every program of a row group computes the block's g Q and x Q over all D
    # (the whole [D, D] sums do not fit one program's registers past D = 32)
    chunk = tl.program_id(1)
    e = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
    acc1 = tl.zeros((BLOCK_C, BLOCK_M), dtype=ct)
    acc2 = tl.zeros((BLOCK_C, BLOCK_M), dtype=ct)
    accf = tl.zeros((BLOCK_A, BLOCK_M), dtype=tl.float64)
    for blk in range(first, tl.cdiv(n_rows, BLOCK_T), step):
        row_ok, b, h, n = _rows(blk * BLOCK_T, n_rows, H, N, BLOCK_T)
        b64, h64, n64 = b.to(tl.int64), h.to(tl.int64), n.to(tl.int64)
        x_row = b64 * sxb + h64 * sxh + n64 * sxn
        g_row = b64 * sgb + h64 * sgh + n64 * sgn
        gh1 = tl.zeros((BLOCK_T, BLOCK_M), dtype=ct)  # g Q: the gradient of w = (R - I) Q^T x
        gh2 = tl.zeros((BLOCK_T, BLOCK_M), dtype=ct)
        v1 = tl.zeros((BLOCK_T, BLOCK_M), dtype=ct)  # x Q
        v2 = tl.zeros((BLOCK_T, BLOCK_M), dtype=ct)
        for c0 in range(0, D, BLOCK_J):  # one half of the basis a loop: fewer operands live at once
            c = c0 + tl.arange(0, BLOCK_J)
            q1 = _basis_rows(BASIS, c, D, M, 0, BLOCK_M, EVEN)
            gh1 += _mm(_load_cols(G, g_row, c, row_ok, D, sgd, ct, EVEN), q1, DOT)
            if NEED:
                v1 += _mm(_load_cols(X, x_row, c, row_ok, D, sxd, ct, EVEN), q1, DOT)
        for c0 in range(0, D, BLOCK_J):
            c = c0 + tl.arange(0, BLOCK_J)
            q2 = _basis_rows(BASIS, c, D, M, M, BLOCK_M, EVEN)
            gh2 += _mm(_load_cols(G, g_row, c, row_ok, D, sgd, ct, EVEN), q2, DOT)
            if NEED:
                v2 += _mm(_load_cols(X, x_row, c, row_ok, D, sxd, ct, EVEN), q2, DOT)
        p = _positions(POS, b, n, row_ok, spb, spn, spa, A, BLOCK_A)
        theta = _angles(FREQ, p, sfa, sfk, sfj, M, A, MB, BLOCK_A, BLOCK_M)
        half = tl.sin(0.5 * theta)
        cm1 = (-2.0 * half * half).to(ct)
        s = tl.sin(theta).to(ct)
        gv1 = gh1 * cm1 + gh2 * s  # (R - I)^T: the gradient of v = Q^T x
        gv2 = gh2 * cm1 - gh1 * s
        o_row = b64 * sob + h64 * soh + n64 * son
        for c0 in range(0, BLOCK_C, BLOCK_J // 2):  # dx = g + gv Q^T on the chunk's columns, 8 at a time
            c = chunk * BLOCK_C + c0 + tl.arange(0, BLOCK_J // 2)
            q1, q2 = _basis_rows(BASIS, c, D, M, 0, BLOCK_M, EVEN), _basis_rows(BASIS, c, D, M, M, BLOCK_M, EVEN)
            dx = _load_cols(G, g_row, c, row_ok, D, sgd, ct, EVEN) + _mm_nt(gv1, q1, False) + _mm_nt(gv2, q2, False)
            tl.store(DX + o_row[:, None] + c[None, :], dx.to(DX.dtype.element_ty),
                     mask=row_ok[:, None] & (c < D)[None, :])
        if NEED:
            x = _load_cols(X, x_row, e, row_ok, D, sxd, ct, EVEN)
            g = _load_cols(G, g_row, e, row_ok, D, sgd, ct, EVEN)
            # y = x + Q w: the outer Q takes g w^T, the inner x gv^T
            acc1 += _mm_tn(g, v1 * cm1 - v2 * s, DOT) + _mm_tn(x, gv1, DOT)
            acc2 += _mm_tn(g, v2 * cm1 + v1 * s, DOT) + _mm_tn(x, gv2, DOT)
            if chunk == 0:  # dF once per row group
                gc = (gh1 * v1 + gh2 * v2).to(tl.float64)  # d / d(cos - 1)
                gs = (gh2 * v1 - gh1 * v2).to(tl.float64)  # d / d sin
                g_theta = gs * tl.cos(theta) - gc * tl.sin(theta)
                accf += tl.sum(p[:, :, None] * g_theta[:, None, :], axis=0)
    if NEED:
        okq = (e < D)[:, None] & (j < M)[None, :]
        tl.atomic_add(DB + e[:, None] * D + j[None, :], acc1, mask=okq)
        tl.atomic_add(DB + e[:, None] * D + (j + M)[None, :], acc2, mask=okq)
        a = tl.arange(0, BLOCK_A)
        tl.atomic_add(DF + a[:, None] * M + j[None, :], accf, mask=(a < A)[:, None] & (j < M)[None, :] & (chunk == 0))


@triton.jit
def _lie_backward_kernel(Q, K, GQ, GK, DQ, DK, BASIS, FREQ, PQ, PK, DB, DF, rows_q, rows_k, progs_q, progs_k,
                         HQ, NQ, HK, NK, D, M,
                         sqb, sqh, sqn, sqd, skb, skh, skn, skd, sgqb, sgqh, sgqn, sgqd, sgkb, sgkh, sgkn, sgkd,
                         sdqb, sdqh, sdqn, sdkb, sdkh, sdkn, spqb, spqn, spqa, spkb, spkn, spka, sfa, sfk, sfj,
                         A: tl.constexpr, MB: tl.constexpr, NEED: tl.constexpr, DOT: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_A: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_C: tl.constexpr, EVEN: tl.constexpr):
    pid = tl.program_id(0)
    if pid < progs_q:
        _backward_rows(Q, GQ, DQ, BASIS, FREQ, PQ, DB, DF, pid, progs_q, rows_q, HQ, NQ, D, M,
                       sqb, sqh, sqn, sqd, sgqb, sgqh, sgqn, sgqd, sdqb, sdqh, sdqn, spqb, spqn, spqa, sfa, sfk, sfj,
                       A, MB, NEED, DOT, BLOCK_T, BLOCK_M, BLOCK_A, BLOCK_J, BLOCK_C, EVEN)
    else:
        _backward_rows(K, GK, DK, BASIS, FREQ, PK, DB, DF, pid - progs_q, progs_k, rows_k, HK, NK, D, M,
                       skb, skh, skn, skd, sgkb, sgkh, sgkn, sgkd, sdkb, sdkh, sdkn, spkb, spkn, spka, sfa, sfk, sfj,
                       A, MB, NEED, DOT, BLOCK_T, BLOCK_M, BLOCK_A, BLOCK_J, BLOCK_C, EVEN)


def _pos_strides(pos: Tensor) -> tuple[int, int, int]:
    """``(batch, token, axis)`` strides of positions ``[B|1, N]`` or ``[B|1, N, A]`` (a batch of one
    broadcast)."""
    sb = 0 if pos.shape[0] == 1 else pos.stride(0)
    return sb, pos.stride(1), pos.stride(2) if pos.dim() == 3 else 0


#: warps of a program by ``(backward, block_d)`` (the head dim's power-of-two block, >= 16): the float32 products run as FMA (IEEE precision) on
#: ``[BLOCK_T, CHUNK]`` slices of the rows and ``[CHUNK, D/2]`` tiles of the basis halves, loaded again
#: from memory (L1 / L2) each loop step, never the whole basis (ptxas: see
#: benchmarks/results/lie_compile_report-cpu-20261207.md)
WARPS = {(False, 16): 4, (False, 32): 4, (False, 64): 4, (False, 128): 8,
         (True, 16): 4, (True, 32): 8, (True, 64): 8, (True, 128): 8}

#: rows of the basis (channels of the token rows) a loop step takes
CHUNK = 16

#: rows of ``dQ`` a backward program sums when the parameters take a gradient, by ``block_d``: the
#: ``block_d / DQ_ROWS`` programs of a row group each recompute ``g Q`` and ``x Q`` and hold a
#: ``[DQ_ROWS, D]`` slice of the sums (the whole ``[D, D]`` does not fit the registers past D = 32)
DQ_ROWS = {16: 16, 32: 32, 64: 32, 128: 16}


def _sizes(q: Tensor, basis: Tensor, freq: Tensor, block_t: int, backward: bool,
           need: bool = False) -> dict[str, int | bool]:
    d = q.shape[-1]
    block_d = max(16, triton.next_power_of_2(d))
    sizes = {"num_warps": WARPS[(backward, block_d)], "A": freq.shape[0], "MB": freq.shape[-1],
             "DOT": basis.dtype != torch.float64, "BLOCK_T": block_t,
             "BLOCK_M": max(16, triton.next_power_of_2(d // 2)), "BLOCK_A": triton.next_power_of_2(freq.shape[0]),
             "BLOCK_J": CHUNK, "EVEN": d == block_d and d // 2 >= 16}
    if backward:
        sizes["BLOCK_C"] = DQ_ROWS[block_d] if need else block_d
    return sizes


def _check(block_t: int, basis: Tensor) -> Tensor:
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"block_t={block_t} must be a power of two >= 16 (a tl.dot operand)")
    return basis.contiguous()


def lie_pair_forward(q: Tensor, k: Tensor, qo: Tensor, ko: Tensor, basis: Tensor, freq: Tensor, pos_q: Tensor,
                     pos_k: Tensor, block_t: int = 16) -> tuple[Tensor, Tensor]:
    """`autograd.lie.lie_rotate_pair_op` in one launch, written into ``qo``, ``ko`` (shaped as q, k,
    any strides): q ``[B, H, Nq, D]``, k ``[B, Hkv, Nk, D]`` (``D <= 128``, even), basis ``[D, D]``
    float32 or float64, freq ``[A, K, b/2]``, positions ``[B|1, N(, A)]``; ``block_t`` rows a program."""
    basis = _check(block_t, basis)
    d = q.shape[-1]
    rows_q, rows_k = q.shape[0] * q.shape[1] * q.shape[2], k.shape[0] * k.shape[1] * k.shape[2]
    progs_q, progs_k = triton.cdiv(rows_q, block_t), triton.cdiv(rows_k, block_t)
    if progs_q + progs_k == 0:
        return qo, ko
    _lie_forward_kernel[(progs_q + progs_k,)](
        q, k, qo, ko, basis, freq, pos_q, pos_k, rows_q, rows_k, progs_q, q.shape[1], q.shape[2], k.shape[1],
        k.shape[2], d, d // 2, *q.stride(), *k.stride(), *qo.stride()[:3], *ko.stride()[:3], *_pos_strides(pos_q),
        *_pos_strides(pos_k), *freq.stride(), **_sizes(q, basis, freq, block_t, False))
    return qo, ko


def lie_pair_backward(q: Tensor, k: Tensor, gq: Tensor, gk: Tensor, dq: Tensor, dk: Tensor, basis: Tensor,
                      freq: Tensor, pos_q: Tensor, pos_k: Tensor, need_params: bool, block_t: int = 16,
                      max_programs: int = 512) -> tuple[Tensor, Tensor]:
    """`autograd.lie.lie_rotate_pair_backward_op` in one launch: ``dq``, ``dk`` written in place,
    returns ``(dQ, dF)`` (``dQ`` ``[D, D]`` in basis' dtype, ``dF`` float64 shaped as freq; empty
    unless ``need_params``), summed over rows by at most ``max_programs`` programs per tensor."""
    basis = _check(block_t, basis)
    d = q.shape[-1]
    if need_params:
        db = torch.zeros(basis.shape, dtype=basis.dtype, device=basis.device)
        df = torch.zeros(freq.shape, dtype=torch.float64, device=freq.device)
    else:
        db, df = basis.new_empty(0), freq.new_empty(0, dtype=torch.float64)
    rows_q, rows_k = q.shape[0] * q.shape[1] * q.shape[2], k.shape[0] * k.shape[1] * k.shape[2]
    progs_q = min(triton.cdiv(rows_q, block_t), max_programs)
    progs_k = min(triton.cdiv(rows_k, block_t), max_programs)
    if progs_q + progs_k == 0:
        return db, df
    sizes = _sizes(q, basis, freq, block_t, True, need_params)
    _lie_backward_kernel[(progs_q + progs_k, triton.cdiv(d, sizes["BLOCK_C"]))](
        q, k, gq, gk, dq, dk, basis, freq, pos_q, pos_k, db, df, rows_q, rows_k, progs_q, progs_k,
        q.shape[1], q.shape[2], k.shape[1], k.shape[2], d, d // 2, *q.stride(), *k.stride(), *gq.stride(),
        *gk.stride(), *dq.stride()[:3], *dk.stride()[:3], *_pos_strides(pos_q), *_pos_strides(pos_k),
        *freq.stride(), NEED=need_params, **sizes)
    return db, df
