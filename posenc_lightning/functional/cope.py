"""CoPE (Golovneva et al., 2024, "Contextual Position Encoding: Learning to Count What's
Important"), eqs. 3-5.

gates ``g_ij = sigmoid(q_i . k_j)``; positions ``p_ij = sum_{t=j..i} g_it``; the position term
``z_i[p_ij]`` linearly interpolated between the integer positions ``floor(p)`` and ``ceil(p)`` of
``z_i[p] = q_i . e[p]`` (the paper's optimized form: interpolate scalars, not vectors).

The formulas and the gates and counts of blocks of rows (whole or on each row's band of keys); the
rows' autograd Functions with hand-written backwards are the encoding's (`encodings.cope.rows`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from posenc_lightning.functional.positions import host_reads_ok


def cope_positions(gates: Tensor, causal: bool = True, q_offset: int = 0) -> Tensor:
    """Contextual positions ``p_ij = sum over t between j and i (inclusive) of g_it``.

    ``gates``: ``[..., Nq, Nk]``; query ``i`` sits at key index ``i + q_offset`` (cached keys come
    first). Causal: keys after the query get position 0 (they are masked anyway) and
    ``p_ij = sum_{t=j}^{i} g_it`` (eq. 4). Non-causal: the sum runs over ``t`` from ``j`` to ``i``
    in whichever direction, so positions count outward from the query on both sides.
    """
    nq, nk = gates.shape[-2:]
    qi = torch.arange(nq, device=gates.device)[:, None] + q_offset
    kj = torch.arange(nk, device=gates.device)[None, :]
    after = kj > qi  # keys after the query
    # reverse cumulative sum: sum_{t >= j, t <= i} g_it, on the flipped copy in place; a product
    # with the 0/1 mask (faster than a broadcast masked_fill on CPU); it is exactly 0 after the query
    keep = (~after).to(gates.dtype).flip(-1)
    p_before = gates.flip(-1).mul_(keep).cumsum_(-1).flip(-1)
    if causal:
        return p_before
    p_after = gates.mul((kj >= qi).to(gates.dtype)).cumsum_(-1)  # sum_{i <= t <= j} g_it
    return torch.where(after, p_after, p_before)


def cope_interpolate(z: Tensor, positions: Tensor) -> Tensor:
    """``z[p]`` at fractional ``p`` (eq. 5, optimized form).

    ``z``: ``[..., Nq, P]`` the logits ``q_i . e[p]`` at integer positions; ``positions``:
    ``[..., Nq, Nk]`` already clamped to ``[0, P - 1]``. Returns ``[..., Nq, Nk]``.
    """
    floor = positions.floor()
    w = positions - floor
    lo = floor.long()
    hi = positions.ceil().long()
    z_lo = z.gather(-1, lo)
    z_hi = z.gather(-1, hi)
    return w * z_hi + (1 - w) * z_lo


def query_groups(t: Tensor, h_kv: int) -> Tensor:
    """``[B, H, r, X] -> [B, H_kv, g r, X]``: the rows of a query group against its kv head."""
    return t.reshape(t.shape[0], h_kv, -1, t.shape[-1])


def zero_after_query(t: Tensor, q_offset: int) -> None:
    """Zero ``t [..., r, K]`` (finite) at the keys after each query (the block's diagonal corner
    only): a product with a 0/1 lower triangle, one pass where a broadcast masked_fill is several."""
    r, n_k = t.shape[-2:]
    if q_offset + 1 < n_k:  # column c is key q_offset + 1 + c, seen by rows i > c
        t[..., q_offset + 1:].mul_(torch.ones(r, n_k - q_offset - 1, dtype=t.dtype, device=t.device).tril_(-1))


def packed_rows(t: Tensor) -> Tensor:
    """``t [..., r, X]``, copied only where its rows are not dense (a view of a fused qkv, heads
    interleaved: 3x slower matmuls); a block of rows of a dense tensor is taken as it is."""
    return t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()


def scaled_logits(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """``scale q_i.k_j`` ``[B, H, r, K]`` (GQA: a query group against its kv head), the scale
    applied by the matrix product itself (no pass over q or the logits)."""
    b, h, r, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[-2]
    q3 = query_groups(q, h_kv).reshape(b * h_kv, -1, d)
    k3 = packed_rows(k).reshape(b * h_kv, n_k, d)
    return torch.baddbmm(q3.new_zeros(()), q3, k3.mT, beta=0.0, alpha=scale).view(b, h, r, n_k)


def cope_causal_gates(q: Tensor, k: Tensor, scale: float, q_offset: int) -> Tensor:
    """``sigmoid(scale q_i.k_j)`` ``[B, H, r, K]``, 0 at the keys after each query (eq. 3)."""
    g = scaled_logits(q, k, scale).sigmoid_()
    zero_after_query(g, q_offset)
    return g


def cope_counts(q: Tensor, k: Tensor, scale: float, q_offset: int) -> tuple[Tensor, Tensor]:
    """``(gates, suffix)``: the causal gates ``[B, H, r, K]`` (`cope_causal_gates`) and their sums
    over the keys from the last one back, ``suffix[..., u] = sum_{j >= K - 1 - u} g_ij`` (keys in
    reverse order: ``p_ij = suffix[..., K - 1 - j]``, eq. 4). The suffix of the last ``K'`` keys
    is ``suffix[..., :K']`` (the same sums in the same order as over those keys alone), and it
    does not decrease along its last dim (gates >= 0), as ``torch.searchsorted`` reads it."""
    g = cope_causal_gates(q, k, scale, q_offset)
    return g, g.flip(-1).cumsum_(-1)


def cope_clamped_count(suffix: Tensor, top: float) -> int:
    """How many leading keys have ``p_ij >= top`` in every row, from `cope_counts`'s ``suffix``
    (non-decreasing along its last dim: a binary search per row); 0 where values cannot be read
    on the host (traced)."""
    if not host_reads_ok(suffix):
        return 0
    first = torch.searchsorted(suffix, suffix.new_full((*suffix.shape[:-1], 1), top))  # first >= top
    return suffix.shape[-1] - int(first.max())


def cope_band_counts(q: Tensor, k: Tensor, scale: float, width: int) -> tuple[Tensor, Tensor]:
    """Causal gates and counts on each query row's band of its last ``width + 1`` keys.

    ``q [B, H, r, D]`` (query ``i`` at key ``o + i``), ``k [B, H_kv, width + r, D]`` the keys
    ``o - width .. o + r - 1`` (GQA: a query group shares its kv head), float32. Row ``i``'s band is
    its keys ``o - width + i + u`` for ``u = 0..width``: ``u = width`` is the query's own key, so the
    band holds no key after the query and needs no mask. Returns ``(gates, suffix)``, both
    ``[B, H, r, width + 1]``: ``gates[..., u] = sigmoid(scale q_i.k_j)`` at band column ``u``
    (eq. 3), and ``suffix[..., v] = sum_{u >= width - v} gates[..., u]``, the count ``p_ij`` of band
    column ``u = width - v`` (eq. 4; the same sums in the same order as `cope_counts`' over the
    same keys). ``suffix[..., v]`` for ``v < width' + 1`` are the counts of the band of the last
    ``width' + 1`` keys."""
    g = band_view(scaled_logits(q, k, scale), width).sigmoid()
    return g, g.flip(-1).cumsum_(-1)


def band_view(t: Tensor, width: int, lead: int = 0) -> Tensor:
    """The view of ``t [B, H, r, lead + width + r]`` (contiguous) whose row ``i`` is its columns
    ``lead + i .. lead + i + width``: each row's band, one column further right per row."""
    b, h, r, n = t.shape
    return t.as_strided((b, h, r, width + 1), (h * r * n, r * n, n + 1, 1), t.storage_offset() + lead)
