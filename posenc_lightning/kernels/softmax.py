"""Flash-attention kernels (Dao et al., 2022, alg. 1-2: tiled online softmax, recomputation in
the backward) with rotary, structured biases and packed-document masks fused in.

Three kernels: `_fwd_kernel` (query blocks; writes O and the log-sum-exp), `_bwd_dkdv_kernel`
(key blocks over the query blocks of every query head of the kv group; dK, dV, dc_k, the
relative-table, slope and tile-bias parameter gradients) and `_bwd_dq_kernel` (query blocks; dQ, dc_q). Gradients of
q and k are produced for the *rotated* q, k and rotated back by `_common._rotate_kernel`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from posenc_lightning.kernels._common import bias_grads, bias_tile, load_rotated, visible


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
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
    q = load_rotated(Q + b * sqb + h * sqh, sqn, offs_m, m_mask, offs_d, D,
                     QCOS + b * s_qcb + h * s_qch, QSIN + b * s_qcb + h * s_qch, s_qcp, QIDX + b * Nq, R, ROT, 1, ACC)
    q = q.to(DOT_T)
    kcos = KCOS + b * s_kcb + hk * s_kch
    ksin = KSIN + b * s_kcb + hk * s_kch
    m_i = tl.full((BM,), float("-inf"), ACC)
    l_i = tl.zeros((BM,), ACC)
    acc = tl.zeros((BM, BD), ACC)
    end = Nk
    if CAUSAL != 0:
        end = tl.minimum(Nk, q_offset + (pid_m + 1) * BM)
    for start_n in range(0, end, BN):
        offs_n = start_n + tl.arange(0, BN)
        n_mask = offs_n < Nk
        k = load_rotated(K + b * skb + hk * skh, skn, offs_n, n_mask, offs_d, D, kcos, ksin, s_kcp,
                         KIDX + b * Nk, R, ROT, 1, ACC)
        s = tl.dot(q, tl.trans(k.to(DOT_T)), input_precision=PREC, out_dtype=ACC) * scale
        s += bias_tile(h, offs_m, offs_n, m_mask, n_mask, QP + b * Nq, KP + b * Nk, SLOPES, TABLE, RMAX, s_th,
                       CQ + b * s_cqb + h * s_cqh, CK + b * s_ckb + h * s_ckh, DENSE + b * s_db + h * s_dh, s_dm,
                       TILE, TILE_W, H, tile_eps, HAS_LIN, HAS_REL, HAS_DEC, HAS_DENSE, HAS_TILE, TILE_VALUE, BM, BN, ACC)
        ok = visible(offs_m, offs_n, m_mask, n_mask, q_offset, QSEG + b * Nq, KSEG + b * Nk, KVALID + b * Nk,
                     CAUSAL, HAS_SEG, HAS_KVALID)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :],
                    mask=n_mask[:, None] & (offs_d < D)[None, :], other=0.0).to(ACC)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_T), v.to(DOT_T), input_precision=PREC, out_dtype=ACC)
        m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], out,
             mask=m_mask[:, None] & (offs_d < D)[None, :])
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), 0.0)
    tl.store(LSE + pid_bh * Nq + offs_m, lse, mask=m_mask)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DCK, DTABLE, DSLOPE, DDENSE, DTILE,
                     sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, n_kblocks,
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
    """dK, dV (rotated space, float32) for one key block of one kv head; ``DO`` has O's strides."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    hkv = H // GROUP
    b = pid_bh // hkv
    hk = pid_bh % hkv
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    n_mask = offs_n < Nk
    d_mask = offs_d < D
    k = load_rotated(K + b * skb + hk * skh, skn, offs_n, n_mask, offs_d, D,
                     KCOS + b * s_kcb + hk * s_kch, KSIN + b * s_kcb + hk * s_kch, s_kcp, KIDX + b * Nk, R, ROT, 1, ACC)
    kd = k.to(DOT_T)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :],
                mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(ACC)
    vd = v.to(DOT_T)
    dk = tl.zeros((BN, BD), ACC)
    dv = tl.zeros((BN, BD), ACC)
    lo = 0
    if CAUSAL != 0:
        lo = tl.maximum(pid_n * BN - q_offset, 0) // BM * BM
    for g in range(GROUP):
        h = hk * GROUP + g
        qcos = QCOS + b * s_qcb + h * s_qch
        qsin = QSIN + b * s_qcb + h * s_qch
        dck = tl.zeros((BN,), ACC)
        dslope = 0.0
        dtile = tl.zeros((TILE_GB,), ACC)
        for start_m in range(lo, Nq, BM):
            offs_m = start_m + tl.arange(0, BM)
            m_mask = offs_m < Nq
            q = (load_rotated(Q + b * sqb + h * sqh, sqn, offs_m, m_mask, offs_d, D, qcos, qsin, s_qcp,
                                    QIDX + b * Nq, R, ROT, 1, ACC)).to(DOT_T)
            do = tl.load(DO + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :],
                         mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(ACC)
            dod = do.to(DOT_T)
            lse = tl.load(LSE + (b * H + h) * Nq + offs_m, mask=m_mask, other=0.0)
            delta = tl.load(DELTA + (b * H + h) * Nq + offs_m, mask=m_mask, other=0.0)
            s = tl.dot(q, tl.trans(kd), input_precision=PREC, out_dtype=ACC) * scale
            s += bias_tile(h, offs_m, offs_n, m_mask, n_mask, QP + b * Nq, KP + b * Nk, SLOPES, TABLE, RMAX, s_th,
                           CQ + b * s_cqb + h * s_cqh, CK + b * s_ckb + h * s_ckh, DENSE + b * s_db + h * s_dh,
                           s_dm, TILE, TILE_W, H, tile_eps, HAS_LIN, HAS_REL, HAS_DEC, HAS_DENSE, HAS_TILE, TILE_VALUE, BM, BN, ACC)
            ok = visible(offs_m, offs_n, m_mask, n_mask, q_offset, QSEG + b * Nq, KSEG + b * Nk, KVALID + b * Nk,
                         CAUSAL, HAS_SEG, HAS_KVALID)
            p = tl.exp(tl.where(ok, s - lse[:, None], float("-inf")))
            dv += tl.dot(tl.trans(p.to(DOT_T)), dod, input_precision=PREC, out_dtype=ACC)
            dp = tl.dot(dod, tl.trans(vd), input_precision=PREC, out_dtype=ACC)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds), q.to(ACC), input_precision=PREC_G, out_dtype=ACC)
            dck += -tl.sum(ds, 0)
            dsl, dti = bias_grads(ds, h, offs_m, offs_n, m_mask, n_mask, QP + b * Nq, KP + b * Nk, DTABLE, RMAX,
                                  s_th, DDENSE + b * s_db + h * s_dh, s_dm, TILE, TILE_W, H, tile_eps, HAS_LIN, HAS_REL,
                                  HAS_DENSE, ATOMIC_DENSE, HAS_TILE, TILE_GRADS, TILE_GB, ACC)
            dslope += dsl
            dtile += dti
        if HAS_DEC:
            tl.store(DCK + (b * H + h) * Nk + offs_n, dck, mask=n_mask)
        if HAS_LIN:
            tl.store(DSLOPE + (b * H + h) * n_kblocks + pid_n, dslope)
        if HAS_TILE:  # this program's partial sums, reduced after the launch
            tl.store(DTILE + ((b * H + h) * n_kblocks + pid_n) * TILE_GB + tl.arange(0, TILE_GB), dtile)
    out_mask = n_mask[:, None] & d_mask[None, :]
    kv_off = (b * hkv + hk) * Nk * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(DK + kv_off, dk * scale, mask=out_mask)
    tl.store(DV + kv_off, dv, mask=out_mask)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, DCQ,
                   sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                   H, GROUP, Nq, Nk, D, scale, q_offset,
                   QCOS, QSIN, s_qcb, s_qch, s_qcp, QIDX, KCOS, KSIN, s_kcb, s_kch, s_kcp, KIDX, R,
                   QSEG, KSEG, KVALID,
                   QP, KP, SLOPES, TABLE, RMAX, s_th, CQ, CK, s_cqb, s_cqh, s_ckb, s_ckh, DENSE, s_db, s_dh, s_dm,
                   TILE, TILE_W, tile_eps,
                   ROT: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, HAS_KVALID: tl.constexpr,
                   HAS_LIN: tl.constexpr, HAS_REL: tl.constexpr, HAS_DEC: tl.constexpr, HAS_DENSE: tl.constexpr,
                   HAS_TILE: tl.constexpr, TILE_GB: tl.constexpr, TILE_VALUE: tl.constexpr, TILE_GRADS: tl.constexpr,
                   DOT_T: tl.constexpr, PREC: tl.constexpr, PREC_G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr):
    """dQ (rotated space, float32) and dc_q for one query block."""
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
    lse = tl.load(LSE + pid_bh * Nq + offs_m, mask=m_mask, other=0.0)
    delta = tl.load(DELTA + pid_bh * Nq + offs_m, mask=m_mask, other=0.0)
    kcos = KCOS + b * s_kcb + hk * s_kch
    ksin = KSIN + b * s_kcb + hk * s_kch
    dq = tl.zeros((BM, BD), ACC)
    dcq = tl.zeros((BM,), ACC)
    end = Nk
    if CAUSAL != 0:
        end = tl.minimum(Nk, q_offset + (pid_m + 1) * BM)
    for start_n in range(0, end, BN):
        offs_n = start_n + tl.arange(0, BN)
        n_mask = offs_n < Nk
        kd = (load_rotated(K + b * skb + hk * skh, skn, offs_n, n_mask, offs_d, D, kcos, ksin, s_kcp,
                                 KIDX + b * Nk, R, ROT, 1, ACC)).to(DOT_T)
        vd = (tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :],
                            mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(ACC)).to(DOT_T)
        s = tl.dot(q, tl.trans(kd), input_precision=PREC, out_dtype=ACC) * scale
        s += bias_tile(h, offs_m, offs_n, m_mask, n_mask, QP + b * Nq, KP + b * Nk, SLOPES, TABLE, RMAX, s_th,
                       CQ + b * s_cqb + h * s_cqh, CK + b * s_ckb + h * s_ckh, DENSE + b * s_db + h * s_dh, s_dm,
                       TILE, TILE_W, H, tile_eps, HAS_LIN, HAS_REL, HAS_DEC, HAS_DENSE, HAS_TILE, TILE_VALUE, BM, BN, ACC)
        ok = visible(offs_m, offs_n, m_mask, n_mask, q_offset, QSEG + b * Nq, KSEG + b * Nk, KVALID + b * Nk,
                     CAUSAL, HAS_SEG, HAS_KVALID)
        p = tl.exp(tl.where(ok, s - lse[:, None], float("-inf")))
        dp = tl.dot(dod, tl.trans(vd), input_precision=PREC, out_dtype=ACC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds, kd.to(ACC), input_precision=PREC_G, out_dtype=ACC)
        dcq += tl.sum(ds, 1)
    tl.store(DQ + pid_bh * Nq * D + offs_m[:, None] * D + offs_d[None, :], dq * scale,
             mask=m_mask[:, None] & d_mask[None, :])
    if HAS_DEC:
        tl.store(DCQ + pid_bh * Nq + offs_m, dcq, mask=m_mask)
