"""Triton building blocks shared by the fused attention kernels.

* `load_rotated`: load a ``[BLOCK, D]`` tile of q or k and rotate it in registers (RoFormer
  eq. 34: ``x * cos + rotate(x) * sin``) with cos/sin gathered per token from a table at
  arbitrary per-token indices; ``SIGN=-1`` applies the transpose (used to rotate gradients back).
* `visible`: which (query, key) pairs may attend (causal by index, packed documents, padding);
  `in_window`: a sliding window's lower edge, for the kernels that take one (``WINDOW``).
* `distance_decay`: a softmax normalizer's multiplicative modulation of the logits from the
  tile's positions (`Normalizer.kernel_modulation`: a distance decay).
* `bias_tile` / `bias_grads2`: the structured biases of ``encodings/bias`` read in-kernel
  (``LinearBias``, ``RelativeBias``, ``DecayBias``, ``DenseBias``, and one `TileBias`: a
  parametric bias whose ``@triton.jit`` tile and gradient functions come in as compile-time
  constants ``TILE_VALUE`` / ``TILE_GRADS``) and their gradients.

Everything is loaded and accumulated in float32 (the interpreter mishandles bf16); q, k and the
probabilities are cast to the input dtype (``DOT_T``) only for the matrix products, which
accumulate in ``ACC`` (float32; float64 for float64 inputs, the gradcheck) with ``PREC`` "ieee"
(true fp32 products for fp32 inputs, not tf32).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_rotated(base, stride_n, offs_n, n_mask, offs_d, D,
                 COS, SIN, stride_cp, IDX, R,
                 ROT: tl.constexpr, SIGN: tl.constexpr, ACC: tl.constexpr):
    """A ``[BLOCK_N, BLOCK_D]`` float32 tile rows ``offs_n`` of ``base`` (row stride ``stride_n``),
    rotated by the angles of table row ``IDX[n]`` when ``ROT`` is 1 (half) or 2 (interleaved).

    ``COS``/``SIN`` point at this (batch, head)'s table ``[L, R/2]`` (row stride ``stride_cp``),
    ``IDX`` at this batch's ``[N]`` int32 table rows; channels ``>= R`` are left as they are.
    """
    d_mask = offs_d < D
    x = tl.load(base + offs_n[:, None] * stride_n + offs_d[None, :],
                mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(ACC)
    if ROT != 0:
        half = R // 2
        if ROT == 1:  # (x_i, x_{i + R/2}) pairs, HF rotate_half
            lo = offs_d < half
            partner = tl.where(lo, offs_d + half, offs_d - half)
            sgn = tl.where(lo, -1.0, 1.0)
            fidx = tl.where(lo, offs_d, offs_d - half)
        else:  # (x_{2i}, x_{2i+1}) pairs, RoFormer
            partner = offs_d ^ 1
            sgn = tl.where((offs_d % 2) == 0, -1.0, 1.0)
            fidx = offs_d // 2
        rmask = n_mask[:, None] & (offs_d < R)[None, :]
        xp = tl.load(base + offs_n[:, None] * stride_n + partner[None, :], mask=rmask, other=0.0).to(ACC)
        row = tl.load(IDX + offs_n, mask=n_mask, other=0).to(tl.int64)
        c = tl.load(COS + row[:, None] * stride_cp + fidx[None, :], mask=rmask, other=1.0).to(ACC)
        s = tl.load(SIN + row[:, None] * stride_cp + fidx[None, :], mask=rmask, other=0.0).to(ACC)
        x = x * c + (SIGN * sgn)[None, :] * xp * s
    return x


@triton.jit
def visible(offs_m, offs_n, m_mask, n_mask, q_offset, QSEG, KSEG, KVALID,
            CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, HAS_KVALID: tl.constexpr):
    """bool ``[BM, BN]``: CAUSAL 1 = key index <= query index + q_offset, 2 = strictly before."""
    ok = m_mask[:, None] & n_mask[None, :]
    if CAUSAL == 1:
        ok = ok & (offs_n[None, :] <= offs_m[:, None] + q_offset)
    elif CAUSAL == 2:
        ok = ok & (offs_n[None, :] < offs_m[:, None] + q_offset)
    if HAS_SEG:
        qs = tl.load(QSEG + offs_m, mask=m_mask, other=-1)
        ks = tl.load(KSEG + offs_n, mask=n_mask, other=-2)
        ok = ok & (qs[:, None] == ks[None, :])
    if HAS_KVALID:
        kv = tl.load(KVALID + offs_n, mask=n_mask, other=0)
        ok = ok & (kv != 0)[None, :]
    return ok


@triton.jit
def in_window(offs_m, offs_n, q_offset, window):
    """bool ``[BM, BN]``: key index > query index + q_offset - window, the sliding window's lower
    edge (`attention.mask.AttentionMask.window`: ``0 <= i - j < W``; the upper edge is causal,
    `visible`'s)."""
    return offs_n[None, :] > offs_m[:, None] + q_offset - window


@triton.jit
def bias_tile(h, offs_m, offs_n, m_mask, n_mask, QP, KP, SLOPES, TABLE, RMAX, stride_th,
              CQ, CK, DENSE, stride_dm, TILE, TILE_W, H, tile_eps,
              HAS_LIN: tl.constexpr, HAS_REL: tl.constexpr, HAS_DEC: tl.constexpr,
              HAS_DENSE: tl.constexpr, HAS_TILE: tl.constexpr, TILE_VALUE: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, ACC: tl.constexpr):
    """The additive bias ``[BM, BN]`` in float32. ``QP``/``KP`` (float32 positions), ``CQ``/``CK``
    and ``DENSE`` already point at this (batch, head); ``TILE``: the tile bias's packed
    parameters, read by ``TILE_VALUE`` (`TileBias.value`)."""
    bias = tl.zeros((BM, BN), dtype=ACC)
    if HAS_LIN or HAS_REL or HAS_TILE:
        qp = tl.load(QP + offs_m, mask=m_mask, other=0.0)
        kp = tl.load(KP + offs_n, mask=n_mask, other=0.0)
        dist = qp[:, None] - kp[None, :]
        if HAS_LIN:  # -slope |i - j|, Press et al. 2022 eq. 1
            bias += -tl.load(SLOPES + h).to(ACC) * tl.abs(dist)
        if HAS_REL:  # table[h, clamp(i - j, -R, R) + R]
            idx = tl.minimum(tl.maximum(dist.to(tl.int32), -RMAX), RMAX) + RMAX
            ok = m_mask[:, None] & n_mask[None, :]
            bias += tl.load(TABLE + h * stride_th + idx, mask=ok, other=0.0).to(ACC)
        if HAS_TILE:
            bias += TILE_VALUE(h, qp.to(ACC), kp.to(ACC), TILE, TILE_W, H, tile_eps, BM, BN, ACC)
    if HAS_DEC:  # cumulative decays: c_i - c_j
        cq = tl.load(CQ + offs_m, mask=m_mask, other=0.0).to(ACC)
        ck = tl.load(CK + offs_n, mask=n_mask, other=0.0).to(ACC)
        bias += cq[:, None] - ck[None, :]
    if HAS_DENSE:
        ok = m_mask[:, None] & n_mask[None, :]
        bias += tl.load(DENSE + offs_m[:, None] * stride_dm + offs_n[None, :], mask=ok, other=0.0).to(ACC)
    return bias


@triton.jit
def _rotate_kernel(X, Y, sxb, sxh, sxn, syb, syh, syn, H, N, D,
                   COS, SIN, s_cb, s_ch, s_cp, IDX, R,
                   ROT: tl.constexpr, SIGN: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                   ACC: tl.constexpr):
    """Elementwise rotation of ``X [B, H, N, D]`` into ``Y`` (``SIGN=-1``: the transpose, which
    takes a gradient w.r.t. rotated q/k back to the un-rotated input)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    m_mask = offs_m < N
    x = load_rotated(X + b * sxb + h * sxh, sxn, offs_m, m_mask, offs_d, D,
                     COS + b * s_cb + h * s_ch, SIN + b * s_cb + h * s_ch, s_cp, IDX + b * N, R, ROT, SIGN, ACC)
    tl.store(Y + b * syb + h * syh + offs_m[:, None] * syn + offs_d[None, :], x.to(Y.dtype.element_ty),
             mask=m_mask[:, None] & (offs_d < D)[None, :])


# ----------------------------------------------------------------------------- the softmax kernels'
# helpers (FlashAttention-2 structure): logits in base-2 units, bias terms scaled by log2(e) where
# they are smallest (a slope, a decay vector) or fused into the add (table, dense, tile values).

#: log2(e): ``exp(x) = exp2(x * LOG2E)``, folded into the logit scale and every bias term
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def log2e(ACC: tl.constexpr):
    """`LOG2E` as a ``[1]`` tensor of ``ACC`` (a bare float literal would be float32, short of
    float64's precision for the float64 checks)."""
    return tl.full([1], LOG2E, ACC)


@triton.jit
def positions(P, offs, mask, start, POS_RANGE: tl.constexpr, ACC: tl.constexpr):
    """The bias positions of tokens ``offs``: ``start + offs`` when the positions are a plain range
    (``POS_RANGE``: nothing loaded), else read from ``P``."""
    if POS_RANGE:
        return (start + offs).to(ACC)
    else:
        return tl.load(P + offs, mask=mask, other=0.0).to(ACC)


@triton.jit
def table_side(qp, kp, m_mask, n_mask, RMAX):
    """Where a tile lies against a relative table's clamp (T5: distances past ``max_distance``
    share the last bucket): 1 every pair of the tile at ``i - j >= RMAX`` (the table's last entry),
    -1 every pair at ``i - j <= -RMAX`` (its first), 0 a tile that straddles the clamped range
    (a gather per score). Rows and columns outside the tensors do not count."""
    inf = float("inf")
    dmin = tl.min(tl.where(m_mask, qp, inf), 0) - tl.max(tl.where(n_mask, kp, -inf), 0)
    dmax = tl.max(tl.where(m_mask, qp, -inf), 0) - tl.min(tl.where(n_mask, kp, inf), 0)
    return tl.where(dmin >= RMAX, 1, tl.where(dmax <= -RMAX, -1, 0))


@triton.jit
def distance_decay(qp, kp, mod_a, mod_floor, ACC: tl.constexpr):
    """A softmax normalizer's multiplicative modulation ``[BM, BN]`` at the tile's positions:
    ``floor + (1 - floor) exp(-decay |i - j|)`` with ``mod_a = decay * log2(e)`` (one ``ex2`` per
    score, computed once per tile and shared by the logits and dS)."""
    dist = tl.abs(qp[:, None] - kp[None, :]).to(ACC)
    return mod_floor + (1.0 - mod_floor) * tl.math.exp2(-mod_a * dist)


@triton.jit
def logits2(s, h, offs_m, offs_n, m_mask, n_mask, qp, kp, cq2, ck2, q_offset, QSEG, KSEG, KVALID,
            SLOPES, TABLE, RMAX, stride_th, DENSE, stride_dm, TILE, TILE_W, H, tile_eps,
            MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr, HAS_KVALID: tl.constexpr,
            HAS_LIN: tl.constexpr, HAS_REL: tl.constexpr, HAS_DEC: tl.constexpr, HAS_DENSE: tl.constexpr,
            HAS_TILE: tl.constexpr, TILE_VALUE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            ACC: tl.constexpr, mod, HAS_MOD: tl.constexpr):
    """``s`` (``q k^T`` times scale * log2(e)) plus every bias term times log2(e), times the
    normalizer's modulation ``mod`` (the tile's `distance_decay`, read only with ``HAS_MOD``: the
    backward multiplies dS by the same tile), ``-inf`` where
    hidden. ``qp``/``kp``: positions, ``cq2``/``ck2``: cumulative decays times log2(e), ``DENSE``
    pointing at this (batch, head). ``MASKED``: 1 a tile that the causal mask or the bounds may
    hide in part (every mask), 0 a tile inside both (only segments and padding, which may hide any
    pair), 2 a tile past the causal diagonal whose keys may run past ``Nk`` (bounds on keys only)."""
    ld = m_mask[:, None] & n_mask[None, :]  # a load inside the tensors
    l2e = log2e(ACC)
    if HAS_LIN or HAS_REL or HAS_TILE:
        dist = qp[:, None] - kp[None, :]
        if HAS_LIN:  # -slope |i - j|, Press et al. 2022 eq. 1
            s += (-l2e * tl.load(SLOPES + h).to(ACC)) * tl.abs(dist)
        if HAS_REL:  # table[h, clamp(i - j, -R, R) + R]
            # a tile wholly past the clamp adds one entry (`table_side`): its gather is masked off, no
            # load issued (a select, not a branch: a branch here duplicated the loop body in the PTX)
            side = table_side(qp, kp, m_mask, n_mask, RMAX)
            idx = tl.minimum(tl.maximum(dist.to(tl.int32), -RMAX), RMAX) + RMAX
            edge = tl.load(TABLE + h * stride_th + RMAX + side * RMAX).to(ACC)
            s += tl.load(TABLE + h * stride_th + idx, mask=ld & (side == 0), other=edge).to(ACC) * l2e
        if HAS_TILE:
            s += TILE_VALUE(h, qp, kp, TILE, TILE_W, H, tile_eps, BM, BN, ACC) * l2e
    if HAS_DEC:  # cumulative decays: c_i - c_j
        s += cq2[:, None] - ck2[None, :]
    if HAS_DENSE:
        s += tl.load(DENSE + offs_m[:, None] * stride_dm + offs_n[None, :], mask=ld, other=0.0).to(ACC) * l2e
    if HAS_MOD:  # the whole logit (scaled scores plus bias) times the modulation, as `Normalizer.weights`
        s = s * mod
    if MASKED == 1:
        ok = visible(offs_m, offs_n, m_mask, n_mask, q_offset, QSEG, KSEG, KVALID, CAUSAL, HAS_SEG, HAS_KVALID)
        s = tl.where(ok, s, float("-inf"))
    elif HAS_SEG or HAS_KVALID:
        ok = visible(offs_m, offs_n, m_mask, n_mask, q_offset, QSEG, KSEG, KVALID, 0, HAS_SEG, HAS_KVALID)
        s = tl.where(ok, s, float("-inf"))
    elif MASKED == 2:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    return s


@triton.jit
def bias_grads2(ds, h, offs_m, offs_n, m_mask, n_mask, qp, kp, DTABLE, RMAX, stride_th, DDENSE, stride_ddm,
                TILE, TILE_W, H, tile_eps, HAS_LIN: tl.constexpr, HAS_REL: tl.constexpr,
                HAS_DENSE: tl.constexpr, HAS_TILE: tl.constexpr, TILE_GRADS: tl.constexpr,
                TILE_GB: tl.constexpr, ACC: tl.constexpr):
    """The bias gradients of one tile (softmax dK/dV, stick-breaking dQ): ``dL/dlogits`` (zero where
    hidden) stored into this (batch, head)'s dense-bias gradient (plain stores: one program owns each element), and
    this tile's slope, relative-table edge and tile-bias parameter contributions returned for the
    program's sums. The relative table's gradient: a tile wholly past the clamp (`table_side`)
    returns its sum of ``ds`` as ``dhi`` (last entry) or ``dlo`` (first entry), added once per
    program; only a tile that straddles the clamped range scatters with atomic adds per score."""
    dslope = 0.0
    dtile = tl.zeros((TILE_GB,), ACC)
    dhi = tl.zeros((1,), ACC).sum(0)
    dlo = tl.zeros((1,), ACC).sum(0)
    ok = m_mask[:, None] & n_mask[None, :]
    if HAS_LIN or HAS_REL or HAS_TILE:
        dist = qp[:, None] - kp[None, :]
        if HAS_LIN:
            dslope = tl.sum(tl.sum(-ds * tl.abs(dist), axis=1), axis=0)
        if HAS_REL:
            side = table_side(qp, kp, m_mask, n_mask, RMAX)
            idx = tl.minimum(tl.maximum(dist.to(tl.int32), -RMAX), RMAX) + RMAX
            tl.atomic_add(DTABLE + h * stride_th + idx, ds, mask=ok & (side == 0))  # none issued past the clamp
            tot = tl.sum(tl.sum(tl.where(ok & (side != 0), ds, 0.0), axis=1), axis=0)
            dhi = tl.where(side > 0, tot, 0.0)
            dlo = tl.where(side < 0, tot, 0.0)
        if HAS_TILE:
            dtile = TILE_GRADS(ds, h, qp, kp, ok, TILE, TILE_W, H, tile_eps, TILE_GB, ACC)
    if HAS_DENSE:
        tl.store(DDENSE + offs_m[:, None] * stride_ddm + offs_n[None, :], ds, mask=ok)
    return dslope, dtile, dhi, dlo


@triton.jit
def _rowdot_kernel(O, DO, DELTA, sob, soh, son, sdb, sdh, sdn, H, N, D, BM: tl.constexpr, BD: tl.constexpr,
                   ACC: tl.constexpr):
    """``DELTA[b, h, i] = sum_d dO[b, h, i, d] O[b, h, i, d]`` in float32 (FlashAttention-2's
    backward preprocess; the stick-breaking backward's ``dO . o`` too)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    mask = (offs_m < N)[:, None] & (offs_d < D)[None, :]
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * son + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdn + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(ACC) * do.to(ACC), axis=1)
    tl.store(DELTA + pid_bh * N + offs_m, delta, mask=offs_m < N)
