"""CoPE attention kernels (Golovneva et al., 2024, eqs. 3-5): contextual positions counted by
content gates inside the attention tile, no N x N tensor.

For query ``i`` (at key index ``i + q_offset``) and keys ``j <= i + q_offset``:
``g_ij = sigmoid(gate_scale q_i.k_j)``, ``p_ij = sum_{t=j..i+q_offset} g_it`` clamped to ``P - 1``,
the bias ``z_i[p_ij]`` linearly interpolated between ``floor(p)`` and ``ceil(p)`` of the table
``Z = q E`` (``[B, H, Nq, P]``, computed before the launch: N x P, not N x N), logits
``scale q_i.k_j + z_i[p_ij]``, softmax. The gates count every key the causal rule allows (packed
documents and padding mask the softmax, not the count), as the eager reference does.

- Forward (`_cope_fwd_kernel`): one program per query block, key blocks from the diagonal down to
  0, so each row's sum of gates after the block (``carry``) plus the in-tile reverse cumulative sum
  is the position; online softmax in base 2 (``qk_scale = scale log2(e)``, the bias times
  log2(e)), O and the base-2 LSE. Each row's carry before every key block is stored (``GTAIL
  [B * H, n_kblocks, Nq]``) so the backward recomputes exactly the forward's positions.
- Backward, with ``dS = P (dP - delta)`` (the bias gradient per score):
  ``dZ[i, floor] += dS (1 - w)``, ``dZ[i, ceil] += dS w``, ``dp_ij = dS_ij (Z[i, ceil] - Z[i, floor])``
  (0 where clamped), ``dg_it = sum_{j <= t} dp_ij`` (a prefix over keys) and through the sigmoid,
  ``ds_gate = dg g (1 - g)``, to q and k with ``gate_scale``. `_cope_bwd_dq_kernel` (one program per
  query block, key blocks ascending: it carries the prefix of ``dp`` and stores it per key block,
  ``DPTAIL``) gives dQ (without the ``dZ E^T`` part, added by torch) and dZ, summed per row in a
  ``[BM, BP]`` register tile (one masked row sum per integer position the tile reaches: no atomics);
  `_cope_bwd_dkdv_kernel` (one program per key block, over the query blocks of every head of its
  kv group) reads ``GTAIL``/``DPTAIL`` for dK and dV. No program adds into another's outputs.
- Matrix products take operands in the input dtype and accumulate in ``ACC`` (float32; float64 for
  float64 inputs), as the softmax kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from posenc_lightning.kernels._common import log2e, visible


@triton.jit
def _cope_tile(q, kd, Zr, P, carry, offs_m, offs_n, m_mask, n_mask, q_offset, gate_scale,
               PREC: tl.constexpr, ACC: tl.constexpr):
    """One tile's ``q.k`` (unscaled), gates (0 past the causal rule and the bounds), unclamped
    positions ``carry + suffix sum``, the interpolation weight and slots (``lo``, ``hi``: floor and
    ceil of the clamped position), ``Z`` at them and the bias."""
    s = tl.dot(q, tl.trans(kd), input_precision=PREC, out_dtype=ACC)
    ld = m_mask[:, None] & n_mask[None, :]
    gok = ld & (offs_n[None, :] <= offs_m[:, None] + q_offset)
    g = tl.where(gok, 1.0 / (1.0 + tl.math.exp2(-(s * gate_scale) * log2e(ACC))), 0.0)
    p = carry[:, None] + tl.cumsum(g, axis=1, reverse=True)
    pc = tl.minimum(p, P - 1.0)
    fl = tl.floor(pc)
    w = pc - fl
    lo = fl.to(tl.int32)
    hi = tl.where(w > 0.0, lo + 1, lo)
    row = Zr + offs_m[:, None] * P
    zlo = tl.load(row + lo, mask=ld, other=0.0).to(ACC)
    zhi = tl.load(row + hi, mask=ld, other=0.0).to(ACC)
    return s, g, gok, p, w, lo, hi, zlo, zhi, zlo + w * (zhi - zlo)


@triton.jit
def _cope_grad_tile(q, kd, vd, dod, Zr, P, carry, dpc, lse, delta, offs_m, offs_n, m_mask, n_mask, q_offset,
                    QSEG, KSEG, KVALID, scale, qk_scale, gate_scale, HAS_SEG: tl.constexpr,
                    HAS_KVALID: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr):
    """One tile of the backward: the weights ``pr``, ``dS`` (natural units), the gradient of the
    unscaled ``q.k`` (softmax and gate parts), the position gradients ``dp`` (for the carry) and
    what dZ needs (``lo``, ``hi``, ``w``)."""
    s, g, gok, p, w, lo, hi, zlo, zhi, bias = _cope_tile(q, kd, Zr, P, carry, offs_m, offs_n, m_mask, n_mask,
                                                         q_offset, gate_scale, PREC, ACC)
    ok = visible(offs_m, offs_n, m_mask, n_mask, q_offset, QSEG, KSEG, KVALID, 1, HAS_SEG, HAS_KVALID)
    s2 = tl.where(ok, s * qk_scale + bias * log2e(ACC), float("-inf"))
    pr = tl.math.exp2(s2 - lse[:, None])  # 0 where hidden, and in rows that see nothing (lse = +inf)
    dpv = tl.dot(dod, tl.trans(vd), input_precision=PREC, out_dtype=ACC)
    ds = tl.where(ok, pr * (dpv - delta[:, None]), 0.0)
    dp = tl.where(p < P - 1.0, ds * (zhi - zlo), 0.0)  # the clamp passes no gradient
    dg = dpc[:, None] + tl.cumsum(dp, axis=1)  # sum over keys j <= t of dp_ij
    dsg = tl.where(gok, dg * g * (1.0 - g), 0.0)
    return pr, ds, ds * scale + dsg * gate_scale, dp, lo, hi, w, ok


@triton.jit
def _cope_fwd_kernel(Q, K, V, Z, O, LSE, GTAIL, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                     H, GROUP, Nq, Nk, D, P, n_kblocks, qk_scale, gate_scale, q_offset, QSEG, KSEG, KVALID,
                     HAS_SEG: tl.constexpr, HAS_KVALID: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    m_mask = offs_m < Nq
    d_mask = offs_d < D
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_T)
    Zr = Z + pid_bh * Nq * P
    m_i = tl.full((BM,), float("-inf"), ACC)
    l_i = tl.zeros((BM,), ACC)
    acc = tl.zeros((BM, BD), ACC)
    carry = tl.zeros((BM,), ACC)  # each row's sum of gates over the keys after this block
    n_blocks = tl.cdiv(tl.minimum(Nk, q_offset + (pid_m + 1) * BM), BN)
    for it in range(n_blocks):
        jb = n_blocks - 1 - it
        offs_n = jb * BN + tl.arange(0, BN)
        n_mask = offs_n < Nk
        tl.store(GTAIL + (pid_bh * n_kblocks + jb) * Nq + offs_m, carry, mask=m_mask)
        kd = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :],
                     mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_T)
        s, g, _, _, _, _, _, _, _, bias = _cope_tile(q, kd, Zr, P, carry, offs_m, offs_n, m_mask, n_mask,
                                                     q_offset, gate_scale, PREC, ACC)
        ok = visible(offs_m, offs_n, m_mask, n_mask, q_offset, QSEG + b * Nq, KSEG + b * Nk, KVALID + b * Nk,
                     1, HAS_SEG, HAS_KVALID)
        s2 = tl.where(ok, s * qk_scale + bias * log2e(ACC), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.math.exp2(m_i - m_safe)
        pr = tl.math.exp2(s2 - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        vd = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :],
                     mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_T)
        acc = acc * alpha[:, None] + tl.dot(pr.to(DOT_T), vd, input_precision=PREC, out_dtype=ACC)
        m_i = m_new
        carry += tl.sum(g, 1)
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])
    # base 2; +inf for a row that sees no key, so that its weights recompute to 0 in the backward
    lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("inf"))
    tl.store(LSE + pid_bh * Nq + offs_m, lse, mask=m_mask)


@triton.jit
def _cope_bwd_dq_kernel(Q, K, V, Z, DO, LSE, DELTA, GTAIL, DPTAIL, DQ, DZ,
                        sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                        H, GROUP, Nq, Nk, D, P, n_kblocks, scale, qk_scale, gate_scale, q_offset, QSEG, KSEG, KVALID,
                        HAS_SEG: tl.constexpr, HAS_KVALID: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BP: tl.constexpr, ACC: tl.constexpr):
    """dQ (softmax and gate parts, ``[B, H, Nq, D]``) and dZ (``[B, H, Nq, P]``) of one query block,
    key blocks ascending; stores each row's prefix sum of ``dp`` before every key block (``DPTAIL``)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    offs_p = tl.arange(0, BP)
    m_mask = offs_m < Nq
    d_mask = offs_d < D
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_T)
    dod = tl.load(DO + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :],
                  mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_T)
    lse = tl.load(LSE + pid_bh * Nq + offs_m, mask=m_mask, other=float("inf"))
    delta = tl.load(DELTA + pid_bh * Nq + offs_m, mask=m_mask, other=0.0)
    Zr = Z + pid_bh * Nq * P
    dq = tl.zeros((BM, BD), ACC)
    dz = tl.zeros((BM, BP), ACC)
    dpc = tl.zeros((BM,), ACC)  # each row's sum of dp over the keys before this block
    n_blocks = tl.cdiv(tl.minimum(Nk, q_offset + (pid_m + 1) * BM), BN)
    for jb in range(n_blocks):
        offs_n = jb * BN + tl.arange(0, BN)
        n_mask = offs_n < Nk
        tl.store(DPTAIL + (pid_bh * n_kblocks + jb) * Nq + offs_m, dpc, mask=m_mask)
        carry = tl.load(GTAIL + (pid_bh * n_kblocks + jb) * Nq + offs_m, mask=m_mask, other=0.0)
        kd = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :],
                     mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_T)
        vd = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :],
                     mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_T)
        _, ds, dst, dp, lo, hi, w, ok = _cope_grad_tile(
            q, kd, vd, dod, Zr, P, carry, dpc, lse, delta, offs_m, offs_n, m_mask, n_mask, q_offset,
            QSEG + b * Nq, KSEG + b * Nk, KVALID + b * Nk, scale, qk_scale, gate_scale, HAS_SEG, HAS_KVALID, PREC,
            ACC)
        dq += tl.dot(dst.to(DOT_T), kd, input_precision=PREC, out_dtype=ACC)
        # dZ: the row sums of dS (1 - w) at floor and dS w at ceil, one integer slot at a time over
        # the slots this tile reaches (positions fall along a row: a few slots; one past the clamp)
        c_lo = ds * (1.0 - w)
        c_hi = ds * w
        n_lo = tl.min(tl.min(tl.where(ok, lo, BP), 1), 0)
        n_hi = tl.max(tl.max(tl.where(ok, hi, -1), 1), 0)
        for n in range(n_lo, n_hi + 1):
            col = tl.sum(tl.where(lo == n, c_lo, 0.0) + tl.where(hi == n, c_hi, 0.0), 1)
            dz += tl.where(offs_p[None, :] == n, col[:, None], 0.0)
        dpc += tl.sum(dp, 1)
    tl.store(DQ + pid_bh * Nq * D + offs_m[:, None] * D + offs_d[None, :], dq,
             mask=m_mask[:, None] & d_mask[None, :])
    tl.store(DZ + pid_bh * Nq * P + offs_m[:, None] * P + offs_p[None, :], dz,
             mask=m_mask[:, None] & (offs_p < P)[None, :])


@triton.jit
def _cope_bwd_dkdv_kernel(Q, K, V, Z, DO, LSE, DELTA, GTAIL, DPTAIL, DK, DV,
                          sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                          H, GROUP, Nq, Nk, D, P, n_kblocks, scale, qk_scale, gate_scale, q_offset,
                          QSEG, KSEG, KVALID, HAS_SEG: tl.constexpr, HAS_KVALID: tl.constexpr, DOT_T: tl.constexpr,
                          PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                          ACC: tl.constexpr):
    """dK, dV (``[B, Hkv, Nk, D]``) of one key block of one kv head, over the query blocks of its
    query heads that see it; each row's carries at the block come from ``GTAIL``/``DPTAIL``."""
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
    kd = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :], mask=kv_mask,
                 other=0.0).to(DOT_T)
    vd = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :], mask=kv_mask,
                 other=0.0).to(DOT_T)
    dk = tl.zeros((BN, BD), ACC)
    dv = tl.zeros((BN, BD), ACC)
    lo_m = tl.maximum(n0 - q_offset, 0) // BM * BM  # earlier queries see none of these keys
    for gi in range(GROUP):
        h = hk * GROUP + gi
        bh = b * H + h
        Zr = Z + bh * Nq * P
        for start_m in range(lo_m, Nq, BM):
            offs_m = start_m + tl.arange(0, BM)
            m_mask = offs_m < Nq
            q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqn + offs_d[None, :],
                        mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_T)
            dod = tl.load(DO + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :],
                          mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_T)
            lse = tl.load(LSE + bh * Nq + offs_m, mask=m_mask, other=float("inf"))
            delta = tl.load(DELTA + bh * Nq + offs_m, mask=m_mask, other=0.0)
            carry = tl.load(GTAIL + (bh * n_kblocks + pid_n) * Nq + offs_m, mask=m_mask, other=0.0)
            dpc = tl.load(DPTAIL + (bh * n_kblocks + pid_n) * Nq + offs_m, mask=m_mask, other=0.0)
            pr, _, dst, _, _, _, _, _ = _cope_grad_tile(
                q, kd, vd, dod, Zr, P, carry, dpc, lse, delta, offs_m, offs_n, m_mask, n_mask, q_offset,
                QSEG + b * Nq, KSEG + b * Nk, KVALID + b * Nk, scale, qk_scale, gate_scale, HAS_SEG, HAS_KVALID,
                PREC, ACC)
            dv += tl.dot(tl.trans(pr.to(DOT_T)), dod, input_precision=PREC, out_dtype=ACC)
            dk += tl.dot(tl.trans(dst.to(DOT_T)), q, input_precision=PREC, out_dtype=ACC)
    out = (b * hkv + hk) * Nk * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(DK + out, dk, mask=kv_mask)
    tl.store(DV + out, dv, mask=kv_mask)
