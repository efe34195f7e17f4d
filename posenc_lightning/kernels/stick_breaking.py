"""Stick-breaking attention kernels (Tan et al., 2024, eqs. 1-3) in log space.

For query i and visible keys j (before i; i itself when ``attend_current``):
``log A_ij = z_ij - sum_{k >= j visible} softplus(z_ik)``, ``o_i = sum_j A_ij v_j`` (no
normalization). Key blocks are visited from the nearest to the farthest so the running sum of
softplus is exact, as in the eager reference.

Backward, with ``g_ij = A_ij (dO_i . v_j)``: ``dz_ij = g_ij - sigmoid(z_ij) P_ij`` where
``P_ij = sum_{j' <= j} g_ij' = dO_i . o_i - sum_{j' > j} g_ij'``; the same descending sweep gives
the suffix sums. One program per query block accumulates dQ and scatters dK, dV, dc_k and the
bias-table gradient with atomic adds (float32).
"""

from __future__ import annotations

import triton
import triton.language as tl

from posenc_lightning.kernels._common import bias_grads, bias_tile, load_rotated, visible


@triton.jit
def _softplus(x):
    """The seed's stable softplus: x above 15, exp(x) far below, log(1 + exp(x)) between."""
    mid = tl.log(1.0 + tl.exp(tl.minimum(x, 15.0)))
    return tl.where(x > 15.0, x, tl.where(x < -15.0, tl.exp(tl.maximum(x, -80.0)), mid))


@triton.jit
def _sb_tile(q, kd, s_bias, ok, scale, PREC: tl.constexpr, ACC: tl.constexpr):
    """Logits, softplus, and in-block inclusive suffix sums of softplus for one tile."""
    s = tl.dot(q, tl.trans(kd), input_precision=PREC, out_dtype=ACC) * scale + s_bias
    s = tl.where(ok, s, 0.0)
    sp = tl.where(ok, _softplus(s), 0.0)
    return s, sp, tl.cumsum(sp, axis=1, reverse=True)


@triton.jit
def _sb_fwd_kernel(Q, K, V, O, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                   H, GROUP, Nq, Nk, D, scale, q_offset,
                   QCOS, QSIN, s_qcb, s_qch, s_qcp, QIDX, KCOS, KSIN, s_kcb, s_kch, s_kcp, KIDX, R,
                   QSEG, KSEG, KVALID,
                   QP, KP, SLOPES, TABLE, RMAX, s_th, CQ, CK, s_cqb, s_cqh, s_ckb, s_ckh, DENSE, s_db, s_dh, s_dm,
                   TILE, TILE_W, tile_eps,
                   ROT: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, HAS_KVALID: tl.constexpr,
                   HAS_LIN: tl.constexpr, HAS_REL: tl.constexpr, HAS_DEC: tl.constexpr, HAS_DENSE: tl.constexpr,
                   HAS_TILE: tl.constexpr, TILE_GB: tl.constexpr, TILE_VALUE: tl.constexpr, TILE_GRADS: tl.constexpr,
                   DOT_T: tl.constexpr, PREC: tl.constexpr, PREC_G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    m_mask = offs_m < Nq
    d_mask = offs_d < D
    q = (load_rotated(Q + b * sqb + h * sqh, sqn, offs_m, m_mask, offs_d, D,
                            QCOS + b * s_qcb + h * s_qch, QSIN + b * s_qcb + h * s_qch, s_qcp, QIDX + b * Nq,
                            R, ROT, 1, ACC)).to(DOT_T)
    kcos = KCOS + b * s_kcb + hk * s_kch
    ksin = KSIN + b * s_kcb + hk * s_kch
    acc = tl.zeros((BM, BD), ACC)
    tail = tl.zeros((BM,), ACC)  # sum of softplus over the visible keys after this block
    n_blocks = tl.cdiv(tl.minimum(Nk, q_offset + (pid_m + 1) * BM), BN)
    for it in range(n_blocks):
        start_n = (n_blocks - 1 - it) * BN
        offs_n = start_n + tl.arange(0, BN)
        n_mask = offs_n < Nk
        kd = (load_rotated(K + b * skb + hk * skh, skn, offs_n, n_mask, offs_d, D, kcos, ksin, s_kcp,
                                 KIDX + b * Nk, R, ROT, 1, ACC)).to(DOT_T)
        bias = bias_tile(h, offs_m, offs_n, m_mask, n_mask, QP + b * Nq, KP + b * Nk, SLOPES, TABLE, RMAX, s_th,
                         CQ + b * s_cqb + h * s_cqh, CK + b * s_ckb + h * s_ckh, DENSE + b * s_db + h * s_dh, s_dm,
                         TILE, TILE_W, H, tile_eps, HAS_LIN, HAS_REL, HAS_DEC, HAS_DENSE, HAS_TILE, TILE_VALUE, BM, BN, ACC)
        ok = visible(offs_m, offs_n, m_mask, n_mask, q_offset, QSEG + b * Nq, KSEG + b * Nk, KVALID + b * Nk,
                     CAUSAL, HAS_SEG, HAS_KVALID)
        s, sp, suffix = _sb_tile(q, kd, bias, ok, scale, PREC, ACC)
        a = tl.where(ok, tl.exp(tl.where(ok, s - tail[:, None] - suffix, 0.0)), 0.0)
        v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(ACC)
        # a stays float32: the backward's dO.o must equal the sum of the g it recomputes, and
        # stick-breaking weights are not normalized, so a rounding of a would add up over the keys
        acc += tl.dot(a, v, input_precision=PREC_G, out_dtype=ACC)
        tail += tl.sum(sp, 1)
    tl.store(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], acc,
             mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _sb_bwd_kernel(Q, K, V, DO, DELTA, DQ, DK, DV, DCQ, DCK, DTABLE, DSLOPE, DDENSE, DTILE,
                   sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, n_qblocks,
                   H, GROUP, Nq, Nk, D, scale, q_offset,
                   QCOS, QSIN, s_qcb, s_qch, s_qcp, QIDX, KCOS, KSIN, s_kcb, s_kch, s_kcp, KIDX, R,
                   QSEG, KSEG, KVALID,
                   QP, KP, SLOPES, TABLE, RMAX, s_th, CQ, CK, s_cqb, s_cqh, s_ckb, s_ckh, DENSE, s_db, s_dh, s_dm,
                   TILE, TILE_W, tile_eps,
                   ROT: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, HAS_KVALID: tl.constexpr,
                   HAS_LIN: tl.constexpr, HAS_REL: tl.constexpr, HAS_DEC: tl.constexpr, HAS_DENSE: tl.constexpr,
                   HAS_TILE: tl.constexpr, TILE_GB: tl.constexpr, TILE_VALUE: tl.constexpr, TILE_GRADS: tl.constexpr,
                   ATOMIC_DENSE: tl.constexpr,
                   DOT_T: tl.constexpr, PREC: tl.constexpr, PREC_G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    m_mask = offs_m < Nq
    d_mask = offs_d < D
    q = (load_rotated(Q + b * sqb + h * sqh, sqn, offs_m, m_mask, offs_d, D,
                            QCOS + b * s_qcb + h * s_qch, QSIN + b * s_qcb + h * s_qch, s_qcp, QIDX + b * Nq,
                            R, ROT, 1, ACC)).to(DOT_T)
    do = tl.load(DO + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :],
                 mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(ACC)
    dod = do.to(DOT_T)
    delta = tl.load(DELTA + pid_bh * Nq + offs_m, mask=m_mask, other=0.0)
    kcos = KCOS + b * s_kcb + hk * s_kch
    ksin = KSIN + b * s_kcb + hk * s_kch
    dq = tl.zeros((BM, BD), ACC)
    dcq = tl.zeros((BM,), ACC)
    dslope = 0.0
    dtile = tl.zeros((TILE_GB,), ACC)
    tail = tl.zeros((BM,), ACC)
    g_tail = tl.zeros((BM,), ACC)  # sum of g over the visible keys after this block
    n_blocks = tl.cdiv(tl.minimum(Nk, q_offset + (pid_m + 1) * BM), BN)
    for it in range(n_blocks):
        start_n = (n_blocks - 1 - it) * BN
        offs_n = start_n + tl.arange(0, BN)
        n_mask = offs_n < Nk
        kd = (load_rotated(K + b * skb + hk * skh, skn, offs_n, n_mask, offs_d, D, kcos, ksin, s_kcp,
                                 KIDX + b * Nk, R, ROT, 1, ACC)).to(DOT_T)
        vd = (tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :],
                            mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(ACC)).to(DOT_T)
        bias = bias_tile(h, offs_m, offs_n, m_mask, n_mask, QP + b * Nq, KP + b * Nk, SLOPES, TABLE, RMAX, s_th,
                         CQ + b * s_cqb + h * s_cqh, CK + b * s_ckb + h * s_ckh, DENSE + b * s_db + h * s_dh, s_dm,
                         TILE, TILE_W, H, tile_eps, HAS_LIN, HAS_REL, HAS_DEC, HAS_DENSE, HAS_TILE, TILE_VALUE, BM, BN, ACC)
        ok = visible(offs_m, offs_n, m_mask, n_mask, q_offset, QSEG + b * Nq, KSEG + b * Nk, KVALID + b * Nk,
                     CAUSAL, HAS_SEG, HAS_KVALID)
        s, sp, suffix = _sb_tile(q, kd, bias, ok, scale, PREC, ACC)
        a = tl.where(ok, tl.exp(tl.where(ok, s - tail[:, None] - suffix, 0.0)), 0.0)
        g = a * tl.dot(dod, tl.trans(vd), input_precision=PREC, out_dtype=ACC)
        g_after = g_tail[:, None] + tl.cumsum(g, axis=1, reverse=True) - g
        ds = tl.where(ok, g - tl.sigmoid(s) * (delta[:, None] - g_after), 0.0)
        dq += tl.dot(ds, kd.to(ACC), input_precision=PREC_G, out_dtype=ACC)
        kv_off = (b * (H // GROUP) + hk) * Nk * D + offs_n[:, None] * D + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        tl.atomic_add(DK + kv_off, tl.dot(tl.trans(ds), q.to(ACC), input_precision=PREC_G, out_dtype=ACC) * scale, mask=kv_mask)
        tl.atomic_add(DV + kv_off, tl.dot(tl.trans(a.to(DOT_T)), dod, input_precision=PREC, out_dtype=ACC), mask=kv_mask)
        dcq += tl.sum(ds, 1)
        if HAS_DEC:
            tl.atomic_add(DCK + pid_bh * Nk + offs_n, -tl.sum(ds, 0), mask=n_mask)
        dsl, dti = bias_grads(ds, h, offs_m, offs_n, m_mask, n_mask, QP + b * Nq, KP + b * Nk, DTABLE, RMAX,
                              s_th, DDENSE + b * s_db + h * s_dh, s_dm, TILE, TILE_W, H, tile_eps, HAS_LIN, HAS_REL,
                              HAS_DENSE, ATOMIC_DENSE, HAS_TILE, TILE_GRADS, TILE_GB, ACC)
        dslope += dsl
        dtile += dti
        tail += tl.sum(sp, 1)
        g_tail += tl.sum(g, 1)
    tl.store(DQ + pid_bh * Nq * D + offs_m[:, None] * D + offs_d[None, :], dq * scale,
             mask=m_mask[:, None] & d_mask[None, :])
    if HAS_DEC:
        tl.store(DCQ + pid_bh * Nq + offs_m, dcq, mask=m_mask)
    if HAS_LIN:
        tl.store(DSLOPE + pid_bh * n_qblocks + pid_m, dslope)
    if HAS_TILE:
        tl.store(DTILE + (pid_bh * n_qblocks + pid_m) * TILE_GB + tl.arange(0, TILE_GB), dtile)
