"""Flash-attention kernels on FlashAttention-2's structure (Dao, 2023, alg. 1-2: tiled online
softmax, recomputation in the backward) with structured biases and packed-document masks fused in.

Three kernels: `_fwd_kernel` (query blocks; writes O in the operand dtype and the base-2
log-sum-exp), `_bwd_dkdv_kernel` (one program per key block, over the query blocks of every query
head of its kv group; dK, dV, dc_k, the dense, relative-table, slope and tile-bias gradients) and
`_bwd_dq_kernel` (one program per query block; dQ, dc_q); ``delta = rowsum(dO * O)`` comes from
`_common._rowdot_kernel` first. No program adds into another's dQ, dK or dV.

- q and k arrive rotated (`fused` rotates them once before the launch and the gradients back once
  after): no rotation inside the loops.
- Logits are in base 2: ``scale * log2(e)`` multiplies ``q k^T``, every bias term is scaled by
  log2(e) (`_common.logits2`), and the weights are ``exp2`` of them: one ``ex2`` per score.
- Causal loops are split: the tiles that the causal diagonal and the bounds cannot touch run
  without the causal mask (`logits2` ``MASKED=0``; segments and padding, which may hide any pair,
  still apply), the tiles on the diagonal with every mask (``MASKED=1``).
- Matrix products take operands in the input dtype (P and dS cast to it, as FlashAttention-2) and
  accumulate in float32 (float64 for float64 inputs); float32 inputs keep full-precision
  ("ieee") products.
"""

from __future__ import annotations

import triton
import triton.language as tl

from posenc_lightning.kernels._common import bias_grads2, distance_decay, in_window, log2e, logits2, positions


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, lo, hi, gap_at, gap, h, offs_m, m_mask, offs_d, d_mask, qp, cq2, Kh, Vh, skn, svn, Nk,
               qk_scale, q_offset, window, QSEG, KSEG, KVALID, KP, k_start, CK, SLOPES, TABLE, RMAX, s_th, DENSE, s_dm,
               TILE, TILE_W, H, tile_eps,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, HAS_KVALID: tl.constexpr,
               HAS_LIN: tl.constexpr, HAS_REL: tl.constexpr, HAS_DEC: tl.constexpr, HAS_DENSE: tl.constexpr,
               HAS_TILE: tl.constexpr, TILE_VALUE: tl.constexpr, POS_RANGE: tl.constexpr, DOT_T: tl.constexpr,
               PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, ACC: tl.constexpr,
               mod_a, mod_floor, HAS_MOD: tl.constexpr):
    """The online softmax over key tiles ``[lo, hi)``. With ``WINDOW``, the masked loop (``MASKED`` 1)
    jumps ``gap`` at ``gap_at``: its tiles are ``[lo, gap_at)`` and ``[gap_at + gap, hi + gap)``, the
    edge tiles on both sides of the unmasked ones."""
    for start_n in range(lo, hi, BN):
        if WINDOW and MASKED == 1:
            start_n = start_n + tl.where(start_n >= gap_at, gap, 0)
        offs_n = start_n + tl.arange(0, BN)
        n_mask = offs_n < Nk
        kt = tl.load(Kh + offs_n[None, :] * skn + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None],
                     other=0.0).to(DOT_T)
        kp = positions(KP, offs_n, n_mask, k_start, POS_RANGE, ACC)
        ck2 = cq2  # unused without decays
        if HAS_DEC:
            ck2 = tl.load(CK + offs_n, mask=n_mask, other=0.0).to(ACC) * log2e(ACC)
        s = tl.dot(q, kt, input_precision=PREC, out_dtype=ACC) * qk_scale
        mod = qk_scale  # no modulation: unused
        if HAS_MOD:  # the normalizer's modulation of this tile, for the logits (and dS)
            mod = distance_decay(qp, kp, mod_a, mod_floor, ACC)
        s = logits2(s, h, offs_m, offs_n, m_mask, n_mask, qp, kp, cq2, ck2, q_offset, QSEG, KSEG, KVALID,
                    SLOPES, TABLE, RMAX, s_th, DENSE, s_dm, TILE, TILE_W, H, tile_eps, MASKED, CAUSAL, HAS_SEG,
                    HAS_KVALID, HAS_LIN, HAS_REL, HAS_DEC, HAS_DENSE, HAS_TILE, TILE_VALUE, BM, BN, ACC,
                    mod, HAS_MOD)
        if WINDOW and MASKED == 1:  # a tile that the window's lower edge may cut (the others lie inside it)
            s = tl.where(in_window(offs_m, offs_n, q_offset, window), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(Vh + offs_n[:, None] * svn + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :],
                    other=0.0).to(DOT_T)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_T), v, input_precision=PREC, out_dtype=ACC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _key_split(m0, Nk, q_offset, CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """``(full, end)`` for the query block at ``m0``: key tiles ``[0, full)`` lie inside the bounds and
    are visible to every row of the block by the causal rule; ``[full, end)`` may be hidden in part."""
    end = Nk
    full = Nk // BN * BN
    if CAUSAL != 0:  # keys <= m0 + q_offset are visible to every row
        end = tl.minimum(Nk, q_offset + m0 + BM)
        full = tl.minimum(full, tl.maximum(q_offset + m0 + 1, 0) // BN * BN)
    return full, end


@triton.jit
def _window_split(m0, full, q_offset, window, BM: tl.constexpr, BN: tl.constexpr):
    """``(edge, inner)`` for the query block at ``m0`` under a sliding window ``window``: key tiles
    before ``edge`` lie below the window of every row and are never visited (O(N W) work); tiles
    ``[edge, inner)`` straddle its lower edge (masked); ``[inner, full)`` lie inside it for every
    row. Both are clamped to ``full`` (`_key_split`), where the diagonal tiles, masked, take over."""
    edge = tl.minimum(tl.maximum(m0 + q_offset - window + 1, 0) // BN * BN, full)
    inner = tl.minimum(tl.maximum(edge, tl.cdiv(tl.maximum(m0 + BM + q_offset - window, 0), BN) * BN), full)
    return edge, inner


@triton.jit
def _query_block_tiles(m0, Nk, q_offset, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr):
    """``(lo, full, edge, end, gap)`` of the key tiles of the query block at ``m0``: unmasked
    ``[lo, full)``; masked ``[edge, lo)`` and ``[full, end)``, walked by one loop that jumps ``gap``
    (`_key_split`; with ``WINDOW``, `_window_split`: the tiles before ``edge`` lie below the window of
    every row and are never visited, O(N W) work)."""
    full, end = _key_split(m0, Nk, q_offset, CAUSAL, BM, BN)
    lo = 0
    edge = full
    gap = 0
    if WINDOW:
        edge, lo = _window_split(m0, full, q_offset, window, BM, BN)
        gap = full - lo
        end = end - gap
    return lo, full, edge, end, gap


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                H, GROUP, Nq, Nk, D, scale, qk_scale, q_offset, window, q_start, k_start,
                QSEG, KSEG, KVALID,
                QP, KP, SLOPES, TABLE, RMAX, s_th, CQ, CK, s_cqb, s_cqh, s_ckb, s_ckh, DENSE, s_db, s_dh, s_dm,
                TILE, TILE_W, tile_eps,
                CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, HAS_KVALID: tl.constexpr,
                HAS_LIN: tl.constexpr, HAS_REL: tl.constexpr, HAS_DEC: tl.constexpr, HAS_DENSE: tl.constexpr,
                HAS_TILE: tl.constexpr, TILE_VALUE: tl.constexpr, POS_RANGE: tl.constexpr,
                DOT_T: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                ACC: tl.constexpr, mod_a, mod_floor, HAS_MOD: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    m0 = pid_m * BM
    offs_m = m0 + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    m_mask = offs_m < Nq
    d_mask = offs_d < D
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_T)
    qp = positions(QP + b * Nq, offs_m, m_mask, q_start, POS_RANGE, ACC)
    cq2 = tl.zeros((BM,), ACC)
    if HAS_DEC:
        cq2 = tl.load(CQ + b * s_cqb + h * s_cqh + offs_m, mask=m_mask, other=0.0).to(ACC) * log2e(ACC)
    m_i = tl.full((BM,), float("-inf"), ACC)
    l_i = tl.zeros((BM,), ACC)
    acc = tl.zeros((BM, BD), ACC)
    lo, full, edge, end, gap = _query_block_tiles(m0, Nk, q_offset, window, CAUSAL, WINDOW, BM, BN)
    Kh = K + b * skb + hk * skh
    Vh = V + b * svb + hk * svh
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, lo, full, lo, gap, h, offs_m, m_mask, offs_d, d_mask, qp, cq2, Kh, Vh,
                               skn, svn, Nk, qk_scale, q_offset, window, QSEG + b * Nq, KSEG + b * Nk, KVALID + b * Nk, KP + b * Nk, k_start, CK + b * s_ckb + h * s_ckh, SLOPES, TABLE, RMAX, s_th,
                               DENSE + b * s_db + h * s_dh, s_dm, TILE, TILE_W, H, tile_eps, 0, CAUSAL, WINDOW, HAS_SEG,
                               HAS_KVALID, HAS_LIN, HAS_REL, HAS_DEC, HAS_DENSE, HAS_TILE, TILE_VALUE, POS_RANGE,
                               DOT_T, PREC, BM, BN, ACC, mod_a, mod_floor, HAS_MOD)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, edge, end, lo, gap, h, offs_m, m_mask, offs_d, d_mask, qp, cq2, Kh, Vh,
                               skn, svn, Nk, qk_scale, q_offset, window, QSEG + b * Nq, KSEG + b * Nk, KVALID + b * Nk, KP + b * Nk, k_start, CK + b * s_ckb + h * s_ckh, SLOPES, TABLE, RMAX, s_th,
                               DENSE + b * s_db + h * s_dh, s_dm, TILE, TILE_W, H, tile_eps, 1, CAUSAL, WINDOW, HAS_SEG,
                               HAS_KVALID, HAS_LIN, HAS_REL, HAS_DEC, HAS_DENSE, HAS_TILE, TILE_VALUE, POS_RANGE,
                               DOT_T, PREC, BM, BN, ACC, mod_a, mod_floor, HAS_MOD)
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])
    # base 2; +inf for a row that sees no key, so that its weights recompute to 0 in the backward
    lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("inf"))
    tl.store(LSE + pid_bh * Nq + offs_m, lse, mask=m_mask)


@triton.jit
def _dkdv_tiles(dk, dv, dck, dslope, dtile, dhi, dlo, k, v, lo, hi, gap_at, gap, h, offs_n, n_mask, offs_d, d_mask, kp, ck2,
                Qh, DOh, LSEh, DELTAh, sqn, son, Nq, qk_scale, q_offset, window, QSEG, KSEG, KVALID, QP, q_start, CQ,
                SLOPES, TABLE, DTABLE, RMAX, s_th, DENSE, DDENSE, s_dm, TILE, TILE_W, H, tile_eps,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, HAS_KVALID: tl.constexpr,
                HAS_LIN: tl.constexpr, HAS_REL: tl.constexpr, HAS_DEC: tl.constexpr, HAS_DENSE: tl.constexpr,
                HAS_TILE: tl.constexpr, TILE_VALUE: tl.constexpr, TILE_GRADS: tl.constexpr, TILE_GB: tl.constexpr,
                POS_RANGE: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, ACC: tl.constexpr,
                mod_a, mod_floor, HAS_MOD: tl.constexpr):
    """dK, dV (and the bias gradients) of one key block over query tiles ``[lo, hi)`` of head ``h``.
    With ``WINDOW``, the masked loop (``MASKED`` 1) jumps ``gap`` at ``gap_at``: its tiles are ``[lo, gap_at)`` and
    ``[gap_at + gap, hi + gap)``, the edge tiles on both sides of the unmasked ones."""
    for start_m in range(lo, hi, BM):
        if WINDOW and MASKED == 1:
            start_m = start_m + tl.where(start_m >= gap_at, gap, 0)
        offs_m = start_m + tl.arange(0, BM)
        m_mask = offs_m < Nq
        qd_mask = m_mask[:, None] & d_mask[None, :]
        q = tl.load(Qh + offs_m[:, None] * sqn + offs_d[None, :], mask=qd_mask, other=0.0).to(DOT_T)
        do = tl.load(DOh + offs_m[:, None] * son + offs_d[None, :], mask=qd_mask, other=0.0).to(DOT_T)
        lse = tl.load(LSEh + offs_m, mask=m_mask, other=float("inf"))  # rows past Nq: weight 0
        delta = tl.load(DELTAh + offs_m, mask=m_mask, other=0.0)
        qp = positions(QP, offs_m, m_mask, q_start, POS_RANGE, ACC)
        cq2 = ck2  # unused without decays
        if HAS_DEC:
            cq2 = tl.load(CQ + offs_m, mask=m_mask, other=0.0).to(ACC) * log2e(ACC)
        s = tl.dot(q, tl.trans(k), input_precision=PREC, out_dtype=ACC) * qk_scale
        mod = qk_scale  # no modulation: unused
        if HAS_MOD:  # the normalizer's modulation of this tile, for the logits (and dS)
            mod = distance_decay(qp, kp, mod_a, mod_floor, ACC)
        s = logits2(s, h, offs_m, offs_n, m_mask, n_mask, qp, kp, cq2, ck2, q_offset, QSEG, KSEG, KVALID,
                    SLOPES, TABLE, RMAX, s_th, DENSE, s_dm, TILE, TILE_W, H, tile_eps, MASKED, CAUSAL, HAS_SEG,
                    HAS_KVALID, HAS_LIN, HAS_REL, HAS_DEC, HAS_DENSE, HAS_TILE, TILE_VALUE, BM, BN, ACC,
                    mod, HAS_MOD)
        if WINDOW and MASKED == 1:  # a tile that the window's lower edge may cut (the others lie inside it)
            s = tl.where(in_window(offs_m, offs_n, q_offset, window), s, float("-inf"))
        p = tl.math.exp2(s - lse[:, None])
        dv += tl.dot(tl.trans(p.to(DOT_T)), do, input_precision=PREC, out_dtype=ACC)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC, out_dtype=ACC)
        ds = p * (dp - delta[:, None])
        if HAS_MOD:  # dS of the logits before the normalizer's modulation
            ds = ds * mod
        dk += tl.dot(tl.trans(ds.to(DOT_T)), q, input_precision=PREC, out_dtype=ACC)
        if HAS_DEC:
            dck -= tl.sum(ds, 0)
        if HAS_LIN or HAS_REL or HAS_DENSE or HAS_TILE:
            dsl, dti, dh, dl = bias_grads2(ds, h, offs_m, offs_n, m_mask, n_mask, qp, kp, DTABLE, RMAX, s_th, DDENSE,
                                   s_dm, TILE, TILE_W, H, tile_eps, HAS_LIN, HAS_REL, HAS_DENSE, HAS_TILE,
                                   TILE_GRADS, TILE_GB, ACC)
            dslope += dsl
            dtile += dti
            dhi += dh
            dlo += dl
    return dk, dv, dck, dslope, dtile, dhi, dlo


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DCK, DTABLE, DSLOPE, DDENSE, DTILE,
                     sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sgb, sgh, sgn, n_kblocks,
                     H, GROUP, Nq, Nk, D, scale, qk_scale, q_offset, window, q_start, k_start,
                     QSEG, KSEG, KVALID,
                     QP, KP, SLOPES, TABLE, RMAX, s_th, CQ, CK, s_cqb, s_cqh, s_ckb, s_ckh, DENSE, s_db, s_dh, s_dm,
                     s_ddb, TILE, TILE_W, tile_eps,
                     CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, HAS_KVALID: tl.constexpr,
                     HAS_LIN: tl.constexpr, HAS_REL: tl.constexpr, HAS_DEC: tl.constexpr, HAS_DENSE: tl.constexpr,
                     HAS_TILE: tl.constexpr, TILE_GB: tl.constexpr, TILE_VALUE: tl.constexpr,
                     TILE_GRADS: tl.constexpr, POS_RANGE: tl.constexpr, EVEN_N: tl.constexpr,
                     DOT_T: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                     ACC: tl.constexpr, mod_a, mod_floor, HAS_MOD: tl.constexpr):
    """dK, dV (of the rotated k; the operand dtype, strides ``sg*``) of one key block of one kv head,
    summed over its query heads; ``DO`` has O's strides. ``DDENSE``: one gradient per batch row
    (``s_ddb``), summed after the launch where the dense bias is shared across the batch."""
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
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT_T)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT_T)
    kp = positions(KP + b * Nk, offs_n, n_mask, k_start, POS_RANGE, ACC)
    dk = tl.zeros((BN, BD), ACC)
    dv = tl.zeros((BN, BD), ACC)
    lo = 0
    mid = 0
    if CAUSAL != 0:  # query blocks from `mid` on see every key of this block
        lo = tl.maximum(n0 - q_offset, 0) // BM * BM
        mid = tl.minimum(tl.maximum(lo, tl.cdiv(tl.maximum(n0 + BN - 1 - q_offset, 0), BM) * BM), Nq)
    inner = Nq  # unmasked query tiles [mid, inner); masked [lo, mid) and [inner, hi), one loop jumping the gap
    edge = mid
    gap = 0
    if WINDOW:  # query blocks `[mid, inner)` see every key of this block, `[inner, hi)` are cut by the
        # window's lower edge, those from `hi` on see none: never visited (O(N W) work)
        hi = tl.maximum(tl.minimum(n0 + BN - 1 + window - q_offset, Nq), mid)
        inner = tl.minimum(tl.maximum(tl.maximum(n0 + window - q_offset, 0) // BM * BM, mid), hi)
        gap = inner - mid
        edge = hi - gap
    for g in range(GROUP):
        h = hk * GROUP + g
        ck2 = tl.zeros((BN,), ACC)
        if HAS_DEC:
            ck2 = tl.load(CK + b * s_ckb + h * s_ckh + offs_n, mask=n_mask, other=0.0).to(ACC) * log2e(ACC)
        dck = tl.zeros((BN,), ACC)
        dslope = tl.zeros((1,), ACC).sum(0)
        dtile = tl.zeros((TILE_GB,), ACC)
        dhi = tl.zeros((1,), ACC).sum(0)  # the relative table's edge entries, summed in the program
        dlo = tl.zeros((1,), ACC).sum(0)
        dk, dv, dck, dslope, dtile, dhi, dlo = _dkdv_tiles(
            dk, dv, dck, dslope, dtile, dhi, dlo, k, v, lo, edge, mid, gap, h, offs_n, n_mask, offs_d, d_mask, kp, ck2, Q + b * sqb + h * sqh, DO + b * sob + h * soh, LSE + (b * H + h) * Nq, DELTA + (b * H + h) * Nq, sqn, son, Nq, qk_scale, q_offset, window, QSEG + b * Nq, KSEG + b * Nk, KVALID + b * Nk, QP + b * Nq, q_start, CQ + b * s_cqb + h * s_cqh, SLOPES, TABLE, DTABLE, RMAX, s_th, DENSE + b * s_db + h * s_dh, DDENSE + b * s_ddb + h * s_dh, s_dm, TILE, TILE_W, H, tile_eps, 1,
            CAUSAL, WINDOW, HAS_SEG, HAS_KVALID, HAS_LIN, HAS_REL, HAS_DEC, HAS_DENSE, HAS_TILE, TILE_VALUE, TILE_GRADS,
            TILE_GB, POS_RANGE, DOT_T, PREC, BM, BN, ACC, mod_a, mod_floor, HAS_MOD)
        dk, dv, dck, dslope, dtile, dhi, dlo = _dkdv_tiles(
            dk, dv, dck, dslope, dtile, dhi, dlo, k, v, mid, inner, mid, gap, h, offs_n, n_mask, offs_d, d_mask, kp, ck2, Q + b * sqb + h * sqh, DO + b * sob + h * soh, LSE + (b * H + h) * Nq, DELTA + (b * H + h) * Nq, sqn, son, Nq, qk_scale, q_offset, window, QSEG + b * Nq, KSEG + b * Nk, KVALID + b * Nk, QP + b * Nq, q_start, CQ + b * s_cqb + h * s_cqh, SLOPES, TABLE, DTABLE, RMAX, s_th, DENSE + b * s_db + h * s_dh, DDENSE + b * s_ddb + h * s_dh, s_dm, TILE, TILE_W, H, tile_eps,
            2 - 2 * EVEN_N, CAUSAL, WINDOW, HAS_SEG, HAS_KVALID, HAS_LIN, HAS_REL, HAS_DEC, HAS_DENSE, HAS_TILE,
            TILE_VALUE, TILE_GRADS, TILE_GB, POS_RANGE, DOT_T, PREC, BM, BN, ACC, mod_a, mod_floor, HAS_MOD)
        if HAS_DEC:
            tl.store(DCK + (b * H + h) * Nk + offs_n, dck, mask=n_mask)
        if HAS_LIN:
            tl.store(DSLOPE + (b * H + h) * n_kblocks + pid_n, dslope)
        if HAS_REL:  # one add per program and edge, for the tiles wholly past the clamp
            tl.atomic_add(DTABLE + h * s_th + 2 * RMAX, dhi)
            tl.atomic_add(DTABLE + h * s_th, dlo)
        if HAS_TILE:  # this program's partial sums, reduced after the launch
            tl.store(DTILE + ((b * H + h) * n_kblocks + pid_n) * TILE_GB + tl.arange(0, TILE_GB), dtile)
    out = b * sgb + hk * sgh + offs_n[:, None] * sgn + offs_d[None, :]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_tiles(dq, dcq, q, do, lse, delta, lo, hi, gap_at, gap, h, offs_m, m_mask, offs_d, d_mask, qp, cq2, Kh, Vh, skn, svn,
              Nk, qk_scale, q_offset, window, QSEG, KSEG, KVALID, KP, k_start, CK, SLOPES, TABLE, RMAX, s_th, DENSE, s_dm,
              TILE, TILE_W, H, tile_eps,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, HAS_KVALID: tl.constexpr,
              HAS_LIN: tl.constexpr, HAS_REL: tl.constexpr, HAS_DEC: tl.constexpr, HAS_DENSE: tl.constexpr,
              HAS_TILE: tl.constexpr, TILE_VALUE: tl.constexpr, POS_RANGE: tl.constexpr, DOT_T: tl.constexpr,
              PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, ACC: tl.constexpr,
              mod_a, mod_floor, HAS_MOD: tl.constexpr):
    """dQ of one query block over key tiles ``[lo, hi)``. With ``WINDOW``, the masked loop (``MASKED`` 1)
    jumps ``gap`` at ``gap_at``: its tiles are ``[lo, gap_at)`` and ``[gap_at + gap, hi + gap)``, the
    edge tiles on both sides of the unmasked ones."""
    for start_n in range(lo, hi, BN):
        if WINDOW and MASKED == 1:
            start_n = start_n + tl.where(start_n >= gap_at, gap, 0)
        offs_n = start_n + tl.arange(0, BN)
        n_mask = offs_n < Nk
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(Kh + offs_n[:, None] * skn + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT_T)
        v = tl.load(Vh + offs_n[:, None] * svn + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT_T)
        kp = positions(KP, offs_n, n_mask, k_start, POS_RANGE, ACC)
        ck2 = cq2  # unused without decays
        if HAS_DEC:
            ck2 = tl.load(CK + offs_n, mask=n_mask, other=0.0).to(ACC) * log2e(ACC)
        s = tl.dot(q, tl.trans(k), input_precision=PREC, out_dtype=ACC) * qk_scale
        mod = qk_scale  # no modulation: unused
        if HAS_MOD:  # the normalizer's modulation of this tile, for the logits (and dS)
            mod = distance_decay(qp, kp, mod_a, mod_floor, ACC)
        s = logits2(s, h, offs_m, offs_n, m_mask, n_mask, qp, kp, cq2, ck2, q_offset, QSEG, KSEG, KVALID,
                    SLOPES, TABLE, RMAX, s_th, DENSE, s_dm, TILE, TILE_W, H, tile_eps, MASKED, CAUSAL, HAS_SEG,
                    HAS_KVALID, HAS_LIN, HAS_REL, HAS_DEC, HAS_DENSE, HAS_TILE, TILE_VALUE, BM, BN, ACC,
                    mod, HAS_MOD)
        if WINDOW and MASKED == 1:  # a tile that the window's lower edge may cut (the others lie inside it)
            s = tl.where(in_window(offs_m, offs_n, q_offset, window), s, float("-inf"))
        p = tl.math.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PREC, out_dtype=ACC)
        ds = p * (dp - delta[:, None])
        if HAS_MOD:  # dS of the logits before the normalizer's modulation
            ds = ds * mod
        dq += tl.dot(ds.to(DOT_T), k, input_precision=PREC, out_dtype=ACC)
        if HAS_DEC:
            dcq += tl.sum(ds, 1)
    return dq, dcq


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, DCQ,
                   sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sgb, sgh, sgn,
                   H, GROUP, Nq, Nk, D, scale, qk_scale, q_offset, window, q_start, k_start,
                   QSEG, KSEG, KVALID,
                   QP, KP, SLOPES, TABLE, RMAX, s_th, CQ, CK, s_cqb, s_cqh, s_ckb, s_ckh, DENSE, s_db, s_dh, s_dm,
                   TILE, TILE_W, tile_eps,
                   CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_SEG: tl.constexpr, HAS_KVALID: tl.constexpr,
                   HAS_LIN: tl.constexpr, HAS_REL: tl.constexpr, HAS_DEC: tl.constexpr, HAS_DENSE: tl.constexpr,
                   HAS_TILE: tl.constexpr, TILE_VALUE: tl.constexpr, POS_RANGE: tl.constexpr,
                   DOT_T: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                   ACC: tl.constexpr, mod_a, mod_floor, HAS_MOD: tl.constexpr):
    """dQ (of the rotated q; the operand dtype, strides ``sg*``) and dc_q of one query block."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    m0 = pid_m * BM
    offs_m = m0 + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    m_mask = offs_m < Nq
    d_mask = offs_d < D
    qd_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :], mask=qd_mask, other=0.0).to(DOT_T)
    do = tl.load(DO + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], mask=qd_mask,
                 other=0.0).to(DOT_T)
    lse = tl.load(LSE + pid_bh * Nq + offs_m, mask=m_mask, other=float("inf"))
    delta = tl.load(DELTA + pid_bh * Nq + offs_m, mask=m_mask, other=0.0)
    qp = positions(QP + b * Nq, offs_m, m_mask, q_start, POS_RANGE, ACC)
    cq2 = tl.zeros((BM,), ACC)
    if HAS_DEC:
        cq2 = tl.load(CQ + b * s_cqb + h * s_cqh + offs_m, mask=m_mask, other=0.0).to(ACC) * log2e(ACC)
    dq = tl.zeros((BM, BD), ACC)
    dcq = tl.zeros((BM,), ACC)
    lo, full, edge, end, gap = _query_block_tiles(m0, Nk, q_offset, window, CAUSAL, WINDOW, BM, BN)
    Kh = K + b * skb + hk * skh
    Vh = V + b * svb + hk * svh
    dq, dcq = _dq_tiles(dq, dcq, q, do, lse, delta, lo, full, lo, gap, h, offs_m, m_mask, offs_d, d_mask, qp, cq2, Kh, Vh,
                        skn, svn, Nk, qk_scale, q_offset, window, QSEG + b * Nq, KSEG + b * Nk, KVALID + b * Nk, KP + b * Nk, k_start, CK + b * s_ckb + h * s_ckh, SLOPES, TABLE, RMAX, s_th, DENSE + b * s_db + h * s_dh, s_dm, TILE, TILE_W, H, tile_eps, 0, CAUSAL, WINDOW, HAS_SEG, HAS_KVALID, HAS_LIN, HAS_REL,
                        HAS_DEC, HAS_DENSE, HAS_TILE, TILE_VALUE, POS_RANGE, DOT_T, PREC, BM, BN, ACC, mod_a, mod_floor, HAS_MOD)
    dq, dcq = _dq_tiles(dq, dcq, q, do, lse, delta, edge, end, lo, gap, h, offs_m, m_mask, offs_d, d_mask, qp, cq2, Kh, Vh,
                        skn, svn, Nk, qk_scale, q_offset, window, QSEG + b * Nq, KSEG + b * Nk, KVALID + b * Nk, KP + b * Nk, k_start, CK + b * s_ckb + h * s_ckh, SLOPES, TABLE, RMAX, s_th, DENSE + b * s_db + h * s_dh, s_dm, TILE, TILE_W, H, tile_eps, 1, CAUSAL, WINDOW, HAS_SEG, HAS_KVALID, HAS_LIN, HAS_REL,
                        HAS_DEC, HAS_DENSE, HAS_TILE, TILE_VALUE, POS_RANGE, DOT_T, PREC, BM, BN, ACC, mod_a, mod_floor, HAS_MOD)
    tl.store(DQ + b * sgb + h * sgh + offs_m[:, None] * sgn + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=qd_mask)
    if HAS_DEC:
        tl.store(DCQ + pid_bh * Nq + offs_m, dcq, mask=m_mask)
