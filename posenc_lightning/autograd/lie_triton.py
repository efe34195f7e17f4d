"""``posenc::lie_rotate_pair`` and its backward on CUDA: q and k rotated by ``Q R(theta) Q^T`` in one
Triton launch each way (imported only there; tested on CPU under ``TRITON_INTERPRET=1`` against the
torch math of `autograd.lie`).

A program takes ``BLOCK_T`` token rows ``x`` of q (the first programs) or of k (the rest) and the
whole basis ``Q`` (``D <= 128``: its two halves, ``[D, D/2]`` each, fit one program): ``v = x Q``
(the planes' coordinates), the angles ``theta = pos @ F`` of each row and their ``cos - 1``, ``sin``
in float64, ``w = (R - I) v`` (RoPE's half layout) and ``y = x + w Q^T``, computed in ``Q``'s dtype
(float32 products in IEEE precision, float64 ones as sums of products). Backward programs loop over
row blocks: ``dx = g + ((R - I)^T (g Q)) Q^T``, and, when the parameters take a gradient, each
program sums ``dQ = g^T w + x^T (R - I)^T (g Q)`` and ``dF = pos^T dtheta`` over its rows and adds
them to the outputs atomically (zeroed before the launch).
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
def _basis_halves(BASIS, D, M, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """``Q[:, :M]`` and ``Q[:, M:]`` (contiguous ``[D, D]``), zero-padded to ``[BLOCK_D, BLOCK_M]``."""
    d = tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_M)
    ok = (d < D)[:, None] & (j < M)[None, :]
    q1 = tl.load(BASIS + d[:, None] * D + j[None, :], mask=ok, other=0.0)
    q2 = tl.load(BASIS + d[:, None] * D + (j + M)[None, :], mask=ok, other=0.0)
    return q1, q2


@triton.jit
def _forward_rows(X, O, BASIS, FREQ, POS, row0, n_rows, H, N, D, M,
                  sxb, sxh, sxn, sxd, sob, soh, son, spb, spn, spa, sfa, sfk, sfj,
                  A: tl.constexpr, MB: tl.constexpr, DOT: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr):
    row_ok, b, h, n = _rows(row0, n_rows, H, N, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    ok = row_ok[:, None] & (d < D)[None, :]
    ct = BASIS.dtype.element_ty
    x_row = b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + n.to(tl.int64) * sxn
    x = tl.load(X + x_row[:, None] + d[None, :] * sxd, mask=ok, other=0.0).to(ct)
    q1, q2 = _basis_halves(BASIS, D, M, BLOCK_D, BLOCK_M)
    v1 = _mm(x, q1, DOT)
    v2 = _mm(x, q2, DOT)
    theta = _angles(FREQ, _positions(POS, b, n, row_ok, spb, spn, spa, A, BLOCK_A), sfa, sfk, sfj, M, A, MB,
                    BLOCK_A, BLOCK_M)
    half = tl.sin(0.5 * theta)
    cm1 = (-2.0 * half * half).to(ct)  # cos - 1, exact for small angles
    s = tl.sin(theta).to(ct)
    w1 = v1 * cm1 - v2 * s
    w2 = v2 * cm1 + v1 * s
    y = x + _mm_nt(w1, q1, DOT) + _mm_nt(w2, q2, DOT)
    o_row = b.to(tl.int64) * sob + h.to(tl.int64) * soh + n.to(tl.int64) * son
    tl.store(O + o_row[:, None] + d[None, :], y.to(O.dtype.element_ty), mask=ok)


@triton.jit
def _lie_forward_kernel(Q, K, QO, KO, BASIS, FREQ, PQ, PK, rows_q, rows_k, progs_q, HQ, NQ, HK, NK, D, M,
                        sqb, sqh, sqn, sqd, skb, skh, skn, skd, sqob, sqoh, sqon, skob, skoh, skon,
                        spqb, spqn, spqa, spkb, spkn, spka, sfa, sfk, sfj,
                        A: tl.constexpr, MB: tl.constexpr, DOT: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr):
    pid = tl.program_id(0)
    if pid < progs_q:
        _forward_rows(Q, QO, BASIS, FREQ, PQ, pid * BLOCK_T, rows_q, HQ, NQ, D, M, sqb, sqh, sqn, sqd,
                      sqob, sqoh, sqon, spqb, spqn, spqa, sfa, sfk, sfj, A, MB, DOT, BLOCK_T, BLOCK_D, BLOCK_M, BLOCK_A)
    else:
        _forward_rows(K, KO, BASIS, FREQ, PK, (pid - progs_q) * BLOCK_T, rows_k, HK, NK, D, M, skb, skh, skn, skd,
                      skob, skoh, skon, spkb, spkn, spka, sfa, sfk, sfj, A, MB, DOT, BLOCK_T, BLOCK_D, BLOCK_M,
                      BLOCK_A)


@triton.jit
def _backward_rows(X, G, DX, BASIS, FREQ, POS, DB, DF, first, step, n_rows, H, N, D, M,
                   sxb, sxh, sxn, sxd, sgb, sgh, sgn, sgd, sob, soh, son, spb, spn, spa, sfa, sfk, sfj,
                   A: tl.constexpr, MB: tl.constexpr, NEED: tl.constexpr, DOT: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr):
    ct = BASIS.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_M)
    q1, q2 = _basis_halves(BASIS, D, M, BLOCK_D, BLOCK_M)
    acc1 = tl.zeros((BLOCK_D, BLOCK_M), dtype=ct)
    acc2 = tl.zeros((BLOCK_D, BLOCK_M), dtype=ct)
    accf = tl.zeros((BLOCK_A, BLOCK_M), dtype=tl.float64)
    for blk in range(first, tl.cdiv(n_rows, BLOCK_T), step):
        row_ok, b, h, n = _rows(blk * BLOCK_T, n_rows, H, N, BLOCK_T)
        ok = row_ok[:, None] & (d < D)[None, :]
        b64, h64, n64 = b.to(tl.int64), h.to(tl.int64), n.to(tl.int64)
        x = tl.load(X + (b64 * sxb + h64 * sxh + n64 * sxn)[:, None] + d[None, :] * sxd, mask=ok, other=0.0).to(ct)
        g = tl.load(G + (b64 * sgb + h64 * sgh + n64 * sgn)[:, None] + d[None, :] * sgd, mask=ok, other=0.0).to(ct)
        p = _positions(POS, b, n, row_ok, spb, spn, spa, A, BLOCK_A)
        theta = _angles(FREQ, p, sfa, sfk, sfj, M, A, MB, BLOCK_A, BLOCK_M)
        half = tl.sin(0.5 * theta)
        cm1 = (-2.0 * half * half).to(ct)
        s = tl.sin(theta).to(ct)
        gh1 = _mm(g, q1, DOT)  # the gradient of w = (R - I) Q^T x
        gh2 = _mm(g, q2, DOT)
        gv1 = gh1 * cm1 + gh2 * s  # (R - I)^T: the gradient of v = Q^T x
        gv2 = gh2 * cm1 - gh1 * s
        dx = g + _mm_nt(gv1, q1, DOT) + _mm_nt(gv2, q2, DOT)
        tl.store(DX + (b64 * sob + h64 * soh + n64 * son)[:, None] + d[None, :], dx.to(DX.dtype.element_ty), mask=ok)
        if NEED:
            v1 = _mm(x, q1, DOT)
            v2 = _mm(x, q2, DOT)
            # y = x + Q w: the outer Q takes g w^T, the inner x gv^T
            acc1 += _mm_tn(g, v1 * cm1 - v2 * s, DOT) + _mm_tn(x, gv1, DOT)
            acc2 += _mm_tn(g, v2 * cm1 + v1 * s, DOT) + _mm_tn(x, gv2, DOT)
            gc = (gh1 * v1 + gh2 * v2).to(tl.float64)  # d / d(cos - 1)
            gs = (gh2 * v1 - gh1 * v2).to(tl.float64)  # d / d sin
            g_theta = gs * tl.cos(theta) - gc * tl.sin(theta)
            accf += tl.sum(p[:, :, None] * g_theta[:, None, :], axis=0)
    if NEED:
        okq = (d < D)[:, None] & (j < M)[None, :]
        tl.atomic_add(DB + d[:, None] * D + j[None, :], acc1, mask=okq)
        tl.atomic_add(DB + d[:, None] * D + (j + M)[None, :], acc2, mask=okq)
        a = tl.arange(0, BLOCK_A)
        tl.atomic_add(DF + a[:, None] * M + j[None, :], accf, mask=(a < A)[:, None] & (j < M)[None, :])


@triton.jit
def _lie_backward_kernel(Q, K, GQ, GK, DQ, DK, BASIS, FREQ, PQ, PK, DB, DF, rows_q, rows_k, progs_q, progs_k,
                         HQ, NQ, HK, NK, D, M,
                         sqb, sqh, sqn, sqd, skb, skh, skn, skd, sgqb, sgqh, sgqn, sgqd, sgkb, sgkh, sgkn, sgkd,
                         sdqb, sdqh, sdqn, sdkb, sdkh, sdkn, spqb, spqn, spqa, spkb, spkn, spka, sfa, sfk, sfj,
                         A: tl.constexpr, MB: tl.constexpr, NEED: tl.constexpr, DOT: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_A: tl.constexpr):
    pid = tl.program_id(0)
    if pid < progs_q:
        _backward_rows(Q, GQ, DQ, BASIS, FREQ, PQ, DB, DF, pid, progs_q, rows_q, HQ, NQ, D, M,
                       sqb, sqh, sqn, sqd, sgqb, sgqh, sgqn, sgqd, sdqb, sdqh, sdqn, spqb, spqn, spqa, sfa, sfk, sfj,
                       A, MB, NEED, DOT, BLOCK_T, BLOCK_D, BLOCK_M, BLOCK_A)
    else:
        _backward_rows(K, GK, DK, BASIS, FREQ, PK, DB, DF, pid - progs_q, progs_k, rows_k, HK, NK, D, M,
                       skb, skh, skn, skd, sgkb, sgkh, sgkn, sgkd, sdkb, sdkh, sdkn, spkb, spkn, spka, sfa, sfk, sfj,
                       A, MB, NEED, DOT, BLOCK_T, BLOCK_D, BLOCK_M, BLOCK_A)


def _pos_strides(pos: Tensor) -> tuple[int, int, int]:
    """``(batch, token, axis)`` strides of positions ``[B|1, N]`` or ``[B|1, N, A]`` (a batch of one
    broadcast)."""
    sb = 0 if pos.shape[0] == 1 else pos.stride(0)
    return sb, pos.stride(1), pos.stride(2) if pos.dim() == 3 else 0


#: warps of a program by ``(backward, BLOCK_D)``: the float32 products run as FMA (IEEE precision), with
#: the basis halves and (backward) the ``dQ`` sums held in registers. ptxas for sm90 (float32, 16 rows,
#: one axis), spill bytes stored / loaded: forward 0 up to D = 64, 1356 / 1356 at D = 128; backward 0 up
#: to D = 32, 184 / 104 at 64, 3320 / 2952 at 128 (4724 / 4132 with 8 warps; chunking D or 3xTF32
#: products spilled more or overran shared memory)
WARPS = {(False, 16): 4, (False, 32): 4, (False, 64): 4, (False, 128): 8,
         (True, 16): 4, (True, 32): 8, (True, 64): 8, (True, 128): 16}


def _sizes(q: Tensor, basis: Tensor, freq: Tensor, block_t: int, backward: bool) -> dict[str, int | bool]:
    d = q.shape[-1]
    block_d = max(16, triton.next_power_of_2(d))
    return {"num_warps": WARPS[(backward, block_d)],"A": freq.shape[0], "MB": freq.shape[-1], "DOT": basis.dtype != torch.float64, "BLOCK_T": block_t,
            "BLOCK_D": max(16, triton.next_power_of_2(d)), "BLOCK_M": max(16, triton.next_power_of_2(d // 2)),
            "BLOCK_A": triton.next_power_of_2(freq.shape[0])}


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
    _lie_backward_kernel[(progs_q + progs_k,)](
        q, k, gq, gk, dq, dk, basis, freq, pos_q, pos_k, db, df, rows_q, rows_k, progs_q, progs_k,
        q.shape[1], q.shape[2], k.shape[1], k.shape[2], d, d // 2, *q.stride(), *k.stride(), *gq.stride(),
        *gk.stride(), *dq.stride()[:3], *dk.stride()[:3], *_pos_strides(pos_q), *_pos_strides(pos_k),
        *freq.stride(), NEED=need_params, **_sizes(q, basis, freq, block_t, True))
    return db, df
