"""Stick-breaking attention kernels (Tan et al., 2024, eqs. 1-3) in log space.

For query i and visible keys j (before i; i itself when ``attend_current``):
``log A_ij = z_ij - sum_{k >= j visible} softplus(z_ik)``, ``o_i = sum_j A_ij v_j`` (no
normalization). Key blocks are visited from the nearest to the farthest so the running sum of
softplus is exact, as in the eager reference.

- Base 2: ``s2 = z log2(e)`` (``qk_scale = scale * log2(e)`` from the host, the bias times
  log2(e)), softplus in base 2 with one ``ex2`` and one ``lg2`` (`_softplus2`), and
  ``A = exp2(s2 - sum softplus2)``: two ``ex2`` per score.
- Matrix products take operands in the input dtype (A and dS cast to it, as FlashAttention-2's P
  and dS) and accumulate in float32 (float64 for float64 inputs); float32 inputs keep "ieee"
  products. O is written in float32: the backward's ``dO . o`` is the sum of the ``g`` it
  recomputes from the same rounded A.

Backward, with ``g_ij = A_ij (dO_i . v_j)``: ``dz_ij = g_ij - sigmoid(z_ij) P_ij`` where
``P_ij = sum_{j' <= j} g_ij' = dO_i . o_i - sum_{j' > j} g_ij'``; the same descending sweep gives
the suffix sums. Two sweeps, neither adding into another program's dQ, dK or dV:
`_sb_bwd_kernel` (one program per query block: dQ, dc_q, the bias gradients; the relative
table's by per-score atomic adds only on tiles that straddle its clamp) stores each row's sums of softplus and of
g after every key block, which `_sb_bwd_dkdv_kernel` (one program per key block of a kv head)
reads to recompute the same tiles for dK, dV and dc_k.
"""

from __future__ import annotations

import triton
import triton.language as tl

from posenc_lightning.kernels._common import bias_grads2, bias_tile, in_window, load_rotated, log2e, visible


@triton.jit
def _softplus2(s2, ACC: tl.constexpr):
    """Base-2 softplus ``log2(1 + 2^s2)`` (= softplus(z) / ln 2 for ``s2 = z log2(e)``) and
    ``e = 2^-|s2|``, with one ``ex2`` and one ``lg2``: ``max(s2, 0) + log2(1 + e)``, stable at
    either sign. Below ``e = 1e-3`` the log is its series ``e (1 - e / 2) log2(e)`` (error under
    ``e^3``): ``1 + e`` in float32 would lose ``e``'s low bits, which the row's sum adds up."""
    e = tl.math.exp2(-tl.abs(s2))
    lp = tl.where(e < 1e-3, e * (1.0 - 0.5 * e) * log2e(ACC), tl.math.log2(1.0 + e))
    return tl.maximum(s2, 0.0) + lp, e


@triton.jit
def _sb_tile(q, kd, s_bias, ok, qk_scale, PREC: tl.constexpr, ACC: tl.constexpr):
    """Base-2 logits ``s2`` (0 where hidden), base-2 softplus, the in-block inclusive suffix sums
    of the softplus, and ``e = 2^-|s2|`` (for the backward's sigmoid) for one tile."""
    s2 = tl.dot(q, tl.trans(kd), input_precision=PREC, out_dtype=ACC) * qk_scale + s_bias * log2e(ACC)
    s2 = tl.where(ok, s2, 0.0)
    sp2, e = _softplus2(s2, ACC)
    sp2 = tl.where(ok, sp2, 0.0)
    return s2, sp2, tl.cumsum(sp2, axis=1, reverse=True), e


@triton.jit
def _sb_grad_tile(q, kd, vd, dod, bias, ok, tail, g_tail, delta, qk_scale, DOT_T: tl.constexpr, PREC: tl.constexpr,
                  ACC: tl.constexpr):
    """One tile of the backward: A (recomputed, in the operand dtype as the forward rounds it),
    ``g = A (dO . v)``, ``dz = g - sigmoid(z) (dO . o - sum_{j' > j} g_ij')`` (0 where hidden) and the
    base-2 softplus. ``tail``/``g_tail``: the row sums of the softplus and of g over the visible keys
    after this tile."""
    s2, sp2, suffix2, e = _sb_tile(q, kd, bias, ok, qk_scale, PREC, ACC)
    a = tl.where(ok, tl.math.exp2(s2 - tail[:, None] - suffix2), 0.0).to(DOT_T)
    g = a.to(ACC) * tl.dot(dod, tl.trans(vd), input_precision=PREC, out_dtype=ACC)
    g_after = g_tail[:, None] + tl.cumsum(g, axis=1, reverse=True) - g
    sig = tl.where(s2 >= 0.0, 1.0, e) / (1.0 + e)  # sigmoid(z) from the softplus's 2^-|s2|
    ds = tl.where(ok, g - sig * (delta[:, None] - g_after), 0.0)
    return a, g, ds, sp2


@triton.jit
def _sb_fwd_kernel(Q, K, V, O, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                   H, GROUP, Nq, Nk, D, scale, qk_scale, q_offset, window,
                   QCOS, QSIN, s_qcb, s_qch, s_qcp, QIDX, KCOS, KSIN, s_kcb, s_kch, s_kcp, KIDX, R,
                   QSEG, KSEG, KVALID,
                   QP, KP, SLOPES, TABLE, RMAX, s_th, CQ, CK, s_cqb, s_cqh, s_ckb, s_ckh, DENSE, s_db, s_dh, s_dm,
                   TILE, TILE_W, tile_eps,
                   ROT: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, HAS_KVALID: tl.constexpr,
                   HAS_LIN: tl.constexpr, HAS_REL: tl.constexpr, HAS_DEC: tl.constexpr, HAS_DENSE: tl.constexpr,
                   HAS_TILE: tl.constexpr, TILE_GB: tl.constexpr, TILE_VALUE: tl.constexpr, TILE_GRADS: tl.constexpr,
                   DOT_T: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr):
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
    n_iter = n_blocks
    if WINDOW:  # key blocks before the window of every row are never visited (O(N W) work)
        n_iter = n_blocks - tl.maximum(pid_m * BM + q_offset - window + 1, 0) // BN
    for it in range(n_iter):
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
        if WINDOW:  # the sliding window's lower edge: keys below it are hidden (no softplus, no weight)
            ok = ok & in_window(offs_m, offs_n, q_offset, window)
        s2, sp2, suffix2, _ = _sb_tile(q, kd, bias, ok, qk_scale, PREC, ACC)
        # log2 A = s2 - (sum of base-2 softplus over the visible keys from j on); <= 0 where visible,
        # and s2 = sp2 = 0 where hidden: no overflow to mask
        a = tl.where(ok, tl.math.exp2(s2 - tail[:, None] - suffix2), 0.0)
        v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_T)
        # A in the operand dtype for the product (FlashAttention-2's P); the backward rounds its
        # recomputed A the same way, so that dO . o is the sum of the g it recomputes
        acc += tl.dot(a.to(DOT_T), v, input_precision=PREC, out_dtype=ACC)
        tail += tl.sum(sp2, 1)
    tl.store(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], acc,
             mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _sb_bwd_kernel(Q, K, V, DO, DELTA, TAILS, GTAILS, DQ, DCQ, DTABLE, DSLOPE, DDENSE, DTILE,
                   sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, n_qblocks, n_kblocks, s_ddb,
                   H, GROUP, Nq, Nk, D, scale, qk_scale, q_offset, window,
                   QCOS, QSIN, s_qcb, s_qch, s_qcp, QIDX, KCOS, KSIN, s_kcb, s_kch, s_kcp, KIDX, R,
                   QSEG, KSEG, KVALID,
                   QP, KP, SLOPES, TABLE, RMAX, s_th, CQ, CK, s_cqb, s_cqh, s_ckb, s_ckh, DENSE, s_db, s_dh, s_dm,
                   TILE, TILE_W, tile_eps,
                   ROT: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, HAS_KVALID: tl.constexpr,
                   HAS_LIN: tl.constexpr, HAS_REL: tl.constexpr, HAS_DEC: tl.constexpr, HAS_DENSE: tl.constexpr,
                   HAS_TILE: tl.constexpr, TILE_GB: tl.constexpr, TILE_VALUE: tl.constexpr, TILE_GRADS: tl.constexpr,
                   DOT_T: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr):
    """dQ, dc_q and the bias gradients of one query block (the descending sweep), and the row sums
    the dK/dV kernel needs per key block: ``TAILS``/``GTAILS [B * H, n_kblocks, Nq]``, the sums of
    the base-2 softplus and of g over the visible keys after key block ``jb``. Bias gradients as
    `_common.bias_grads2`: the dense bias's stored (one buffer per batch row, ``s_ddb``), the
    relative table's scattered only on tiles that straddle its clamp, its edges added once."""
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
    dod = tl.load(DO + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :],
                  mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_T)
    delta = tl.load(DELTA + pid_bh * Nq + offs_m, mask=m_mask, other=0.0)
    kcos = KCOS + b * s_kcb + hk * s_kch
    ksin = KSIN + b * s_kcb + hk * s_kch
    dq = tl.zeros((BM, BD), ACC)
    dcq = tl.zeros((BM,), ACC)
    dslope = tl.zeros((1,), ACC).sum(0)
    dtile = tl.zeros((TILE_GB,), ACC)
    dhi = tl.zeros((1,), ACC).sum(0)  # the relative table's edge entries, summed in the program
    dlo = tl.zeros((1,), ACC).sum(0)
    qp = tl.zeros((BM,), ACC)
    if HAS_LIN or HAS_REL or HAS_TILE:
        qp = tl.load(QP + b * Nq + offs_m, mask=m_mask, other=0.0).to(ACC)
    tail = tl.zeros((BM,), ACC)
    g_tail = tl.zeros((BM,), ACC)  # sum of g over the visible keys after this block
    n_blocks = tl.cdiv(tl.minimum(Nk, q_offset + (pid_m + 1) * BM), BN)
    n_iter = n_blocks
    if WINDOW:  # key blocks before the window of every row are never visited (O(N W) work)
        n_iter = n_blocks - tl.maximum(pid_m * BM + q_offset - window + 1, 0) // BN
    for it in range(n_iter):
        jb = n_blocks - 1 - it
        offs_n = jb * BN + tl.arange(0, BN)
        n_mask = offs_n < Nk
        tl.store(TAILS + (pid_bh * n_kblocks + jb) * Nq + offs_m, tail, mask=m_mask)
        tl.store(GTAILS + (pid_bh * n_kblocks + jb) * Nq + offs_m, g_tail, mask=m_mask)
        kd = (load_rotated(K + b * skb + hk * skh, skn, offs_n, n_mask, offs_d, D, kcos, ksin, s_kcp,
                           KIDX + b * Nk, R, ROT, 1, ACC)).to(DOT_T)
        vd = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :],
                     mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_T)
        bias = bias_tile(h, offs_m, offs_n, m_mask, n_mask, QP + b * Nq, KP + b * Nk, SLOPES, TABLE, RMAX, s_th,
                         CQ + b * s_cqb + h * s_cqh, CK + b * s_ckb + h * s_ckh, DENSE + b * s_db + h * s_dh, s_dm,
                         TILE, TILE_W, H, tile_eps, HAS_LIN, HAS_REL, HAS_DEC, HAS_DENSE, HAS_TILE, TILE_VALUE, BM, BN, ACC)
        ok = visible(offs_m, offs_n, m_mask, n_mask, q_offset, QSEG + b * Nq, KSEG + b * Nk, KVALID + b * Nk,
                     CAUSAL, HAS_SEG, HAS_KVALID)
        if WINDOW:  # the sliding window's lower edge: keys below it are hidden (no softplus, no weight)
            ok = ok & in_window(offs_m, offs_n, q_offset, window)
        _, g, ds, sp2 = _sb_grad_tile(q, kd, vd, dod, bias, ok, tail, g_tail, delta, qk_scale, DOT_T, PREC, ACC)
        dq += tl.dot(ds.to(DOT_T), kd, input_precision=PREC, out_dtype=ACC)  # dS in the operand dtype
        dcq += tl.sum(ds, 1)
        if HAS_LIN or HAS_REL or HAS_DENSE or HAS_TILE:
            kp = qp  # unused without position biases
            if HAS_LIN or HAS_REL or HAS_TILE:
                kp = tl.load(KP + b * Nk + offs_n, mask=n_mask, other=0.0).to(ACC)
            dsl, dti, dh, dl = bias_grads2(ds, h, offs_m, offs_n, m_mask, n_mask, qp, kp, DTABLE, RMAX, s_th,
                                           DDENSE + b * s_ddb + h * s_dh, s_dm, TILE, TILE_W, H, tile_eps, HAS_LIN,
                                           HAS_REL, HAS_DENSE, HAS_TILE, TILE_GRADS, TILE_GB, ACC)
            dslope += dsl
            dtile += dti
            dhi += dh
            dlo += dl
        tail += tl.sum(sp2, 1)
        g_tail += tl.sum(g, 1)
    tl.store(DQ + pid_bh * Nq * D + offs_m[:, None] * D + offs_d[None, :], dq * scale,
             mask=m_mask[:, None] & d_mask[None, :])
    if HAS_DEC:
        tl.store(DCQ + pid_bh * Nq + offs_m, dcq, mask=m_mask)
    if HAS_LIN:
        tl.store(DSLOPE + pid_bh * n_qblocks + pid_m, dslope)
    if HAS_REL:  # one add per program and edge, for the tiles wholly past the clamp
        tl.atomic_add(DTABLE + h * s_th + 2 * RMAX, dhi)
        tl.atomic_add(DTABLE + h * s_th, dlo)
    if HAS_TILE:
        tl.store(DTILE + (pid_bh * n_qblocks + pid_m) * TILE_GB + tl.arange(0, TILE_GB), dtile)


@triton.jit
def _sb_bwd_dkdv_kernel(Q, K, V, DO, DELTA, TAILS, GTAILS, DK, DV, DCK,
                        sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, n_kblocks,
                        H, GROUP, Nq, Nk, D, scale, qk_scale, q_offset, window,
                        QCOS, QSIN, s_qcb, s_qch, s_qcp, QIDX, KCOS, KSIN, s_kcb, s_kch, s_kcp, KIDX, R,
                        QSEG, KSEG, KVALID,
                        QP, KP, SLOPES, TABLE, RMAX, s_th, CQ, CK, s_cqb, s_cqh, s_ckb, s_ckh, DENSE, s_db, s_dh,
                        s_dm, TILE, TILE_W, tile_eps,
                        ROT: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, HAS_KVALID: tl.constexpr,
                        HAS_LIN: tl.constexpr, HAS_REL: tl.constexpr, HAS_DEC: tl.constexpr,
                        HAS_DENSE: tl.constexpr, HAS_TILE: tl.constexpr, TILE_VALUE: tl.constexpr,
                        DOT_T: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BD: tl.constexpr, ACC: tl.constexpr):
    """dK, dV (float32, ``[B, Hkv, Nk, D]``) and dc_k of one key block of one kv head, summed over
    the query blocks of its query heads that see it: the row sums after the block come from
    ``TAILS``/``GTAILS`` (`_sb_bwd_kernel`, same ``BN``). No program adds into another's."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    hkv = H // GROUP
    b = pid_bh // hkv
    hk = pid_bh % hkv
    n0 = pid_n * BN
    offs_n = n0 + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    n_mask = offs_n < Nk
    d_mask = offs_d < D
    kv_mask = n_mask[:, None] & d_mask[None, :]
    kd = (load_rotated(K + b * skb + hk * skh, skn, offs_n, n_mask, offs_d, D, KCOS + b * s_kcb + hk * s_kch,
                       KSIN + b * s_kcb + hk * s_kch, s_kcp, KIDX + b * Nk, R, ROT, 1, ACC)).to(DOT_T)
    vd = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :], mask=kv_mask,
                 other=0.0).to(DOT_T)
    dk = tl.zeros((BN, BD), ACC)
    dv = tl.zeros((BN, BD), ACC)
    lo = tl.maximum(n0 - q_offset, 0) // BM * BM  # causal: earlier queries see none of these keys
    hi = Nq
    if WINDOW:  # queries from `hi` on are past the window of every key of this block
        hi = tl.minimum(n0 + BN - 1 + window - q_offset, Nq)
    for gi in range(GROUP):
        h = hk * GROUP + gi
        bh = b * H + h
        dck = tl.zeros((BN,), ACC)
        for start_m in range(lo, hi, BM):
            offs_m = start_m + tl.arange(0, BM)
            m_mask = offs_m < Nq
            q = (load_rotated(Q + b * sqb + h * sqh, sqn, offs_m, m_mask, offs_d, D,
                              QCOS + b * s_qcb + h * s_qch, QSIN + b * s_qcb + h * s_qch, s_qcp, QIDX + b * Nq,
                              R, ROT, 1, ACC)).to(DOT_T)
            dod = tl.load(DO + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :],
                          mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_T)
            delta = tl.load(DELTA + bh * Nq + offs_m, mask=m_mask, other=0.0)
            tail = tl.load(TAILS + (bh * n_kblocks + pid_n) * Nq + offs_m, mask=m_mask, other=0.0)
            g_tail = tl.load(GTAILS + (bh * n_kblocks + pid_n) * Nq + offs_m, mask=m_mask, other=0.0)
            bias = bias_tile(h, offs_m, offs_n, m_mask, n_mask, QP + b * Nq, KP + b * Nk, SLOPES, TABLE, RMAX,
                             s_th, CQ + b * s_cqb + h * s_cqh, CK + b * s_ckb + h * s_ckh,
                             DENSE + b * s_db + h * s_dh, s_dm, TILE, TILE_W, H, tile_eps, HAS_LIN, HAS_REL,
                             HAS_DEC, HAS_DENSE, HAS_TILE, TILE_VALUE, BM, BN, ACC)
            ok = visible(offs_m, offs_n, m_mask, n_mask, q_offset, QSEG + b * Nq, KSEG + b * Nk, KVALID + b * Nk,
                         CAUSAL, HAS_SEG, HAS_KVALID)
            if WINDOW:
                ok = ok & in_window(offs_m, offs_n, q_offset, window)
            a, _, ds, _ = _sb_grad_tile(q, kd, vd, dod, bias, ok, tail, g_tail, delta, qk_scale, DOT_T, PREC,
                                          ACC)
            dv += tl.dot(tl.trans(a), dod, input_precision=PREC, out_dtype=ACC)
            dk += tl.dot(tl.trans(ds.to(DOT_T)), q, input_precision=PREC, out_dtype=ACC)
            if HAS_DEC:
                dck -= tl.sum(ds, 0)
        if HAS_DEC:
            tl.store(DCK + bh * Nk + offs_n, dck, mask=n_mask)
    out = (b * hkv + hk) * Nk * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(DK + out, dk * scale, mask=kv_mask)
    tl.store(DV + out, dv, mask=kv_mask)
