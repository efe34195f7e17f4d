"""PaTH (Yang et al., 2025, "PaTH Attention: Position Encoding via Accumulating Householder
Transformations", arXiv 2505.16381): a data-dependent product of Householder reflections between
every key and query.

``H_t = I - beta_t w_t w_t^T`` (``w_t`` unit length, ``beta_t = 2 sigmoid(.)`` in (0, 2)) and,
causally (``j <= i``), the logit ``s_ij = q_i^T M_ij k_j`` with ``M_ij = H_i H_{i-1} ... H_{j+1}``
(``M_ii = I``). Everything here is per (batch, head); tokens are ordered by *index* (positions play
no part), so a product never crosses a document boundary when attention is kept inside documents.

Two forms:

- `path_logits_naive` multiplies the ``d x d`` factors out for every pair: ``O(N^2 d^3)``, float64,
  the reference for tests only.
- `path_logit_rows`, the blockwise algorithm (the paper's section 3): tokens in chunks of ``C``; a
  chunk's product in the UT form ``H_{e-1} ... H_b = I - W^T T W`` with ``T = (I +
  strictly_lower(diag(beta) W W^T))^{-1} diag(beta)`` (`path_ut_transform`). A contiguous sub-range
  of a chunk takes the principal sub-block of ``T`` (the inverse of a triangular matrix restricted
  to a diagonal block), so within a chunk the logits are a masked product of ``C x C`` matrices; a
  query is carried to its chunk's start and the keys of earlier chunks to the same point by one
  ``d x d`` product accumulated chunk by chunk, nearest first. No ``N x N`` array of ``d x d``
  matrices; for ``m`` query rows the memory is ``O(m N + N d)``.

The whole attention's parts (`encodings.path_attention` walks them): `path_chunk_parts` (the keys
carried to their chunk's end), `path_carries` (each chunk's product as a ``d x d`` matrix) and
`path_query_chunks` (the queries carried to their chunk's start, and the logits within it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["path_attention_naive", "path_carries", "path_chunk_parts", "path_chunks", "path_householder",
           "path_logit_rows", "path_logits_naive", "path_query_chunks", "path_ut_transform", "path_walk_rows"]


def path_householder(w_raw: Tensor, beta_logits: Tensor) -> tuple[Tensor, Tensor]:
    """The reflections' parameters from their projections (eq. 3 of the paper).

    Args:
        w_raw: un-normalized directions ``[..., N, D]``.
        beta_logits: ``[..., N]``.

    Returns:
        ``(w, beta)``: ``w`` L2-normalized along the last dim, ``beta = 2 sigmoid(beta_logits)``
        in (0, 2); float32 at least (float64 for float64 inputs).
    """
    dt = torch.promote_types(w_raw.dtype, torch.float32)
    w = F.normalize(w_raw.to(dt), dim=-1, eps=1e-6)
    return w, 2.0 * torch.sigmoid(beta_logits.to(torch.promote_types(beta_logits.dtype, torch.float32)))


def path_ut_transform(w: Tensor, beta: Tensor) -> Tensor:
    """``T`` of the UT transform: ``H_{C-1} ... H_1 H_0 = I - W^T T W`` for the rows ``w_0..w_{C-1}``.

    Args:
        w: ``[..., C, D]`` unit directions; beta: ``[..., C]``.

    Returns:
        ``T = (I + strictly_lower(diag(beta) W W^T))^{-1} diag(beta)``, ``[..., C, C]`` lower
        triangular (``T_st != 0`` only for ``s >= t``).
    """
    c = w.shape[-2]
    strict = torch.tril(beta[..., :, None] * (w @ w.transpose(-1, -2)), -1)
    eye = torch.eye(c, dtype=w.dtype, device=w.device)
    return torch.linalg.solve_triangular(eye + strict, torch.diag_embed(beta), upper=False)


def path_logits_naive(q: Tensor, k: Tensor, w: Tensor, beta: Tensor, q_offset: int = 0) -> Tensor:
    """``q_i^T (H_i ... H_{j+1}) k_j`` for ``j <= i``, each product multiplied out (reference only).

    Args:
        q: ``[B, H, Nq, D]`` queries at key indices ``q_offset .. q_offset + Nq - 1``.
        k: ``[B, H, Nk, D]`` keys; w: ``[B, H, Nk, D]`` unit directions; beta: ``[B, H, Nk]``.
        q_offset: the key index of the first query.

    Returns:
        ``[B, H, Nq, Nk]`` float64 logits (unscaled); 0 where ``j > i``.
    """
    q, k, w, beta = (t.double() for t in (q, k, w, beta))
    b, h, nq, d = q.shape
    eye = torch.eye(d, dtype=torch.float64)
    out = torch.zeros(b, h, nq, k.shape[-2], dtype=torch.float64)
    for r in range(nq):
        i = q_offset + r
        m = eye.expand(b, h, d, d)
        for j in range(i, -1, -1):
            out[:, :, r, j] = torch.einsum("bhd,bhde,bhe->bh", q[:, :, r], m, k[:, :, j])
            hj = eye - beta[:, :, j, None, None] * w[:, :, j, :, None] * w[:, :, j, None, :]
            m = m @ hj  # M_{i, j-1} = M_ij H_j
    return out


def path_attention_naive(q: Tensor, k: Tensor, v: Tensor, w: Tensor, beta: Tensor, scale: float,
                         segment_ids: Tensor | None = None) -> Tensor:
    """Causal PaTH attention, float64, each document computed on its own (reference only).

    Args:
        q, k, v: ``[B, H, N, D]``; w: ``[B, H, N, D]``; beta: ``[B, H, N]``; scale: the logit scale.
        segment_ids: ``[B, N]`` contiguous document ids of a packed batch, or None.

    Returns:
        ``softmax(scale * s + causal mask) v`` ``[B, H, N, D]`` float64, where a document's tokens see
        only its own keys and reflections (it is cut out and run alone).
    """
    n = q.shape[-2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for bi in range(q.shape[0]):
        ids = torch.zeros(n, dtype=torch.long) if segment_ids is None else segment_ids[bi]
        for doc in ids.unique():
            idx = (ids == doc).nonzero().flatten()
            sl = (slice(bi, bi + 1), slice(None), idx)
            s = path_logits_naive(q[sl], k[sl], w[sl], beta[bi:bi + 1, :, idx]) * scale
            s = s.masked_fill(torch.ones(len(idx), len(idx), dtype=torch.bool).triu(1), float("-inf"))
            out[bi, :, idx] = (torch.softmax(s, -1) @ v[sl].double())[0]
    return out


def path_logit_rows(q: Tensor, k: Tensor, w: Tensor, beta: Tensor, q_offset: int, chunk: int = 64) -> Tensor:
    """The change PaTH makes to the logits of a block of query rows: ``q_i^T (M_ij - I) k_j``.

    The blockwise algorithm (module docstring): chunks of ``chunk`` tokens aligned to index 0
    (`path_chunks`), the queries walked down the key chunks (`path_walk_rows`). For a query ``i``
    in chunk ``c`` carried to the end of an earlier key chunk: ``r_i^T = q_i^T H_i ... H_e``; for a
    key ``j`` of that chunk ``k~_j = H_{e-1} ... H_{j+1} k_j``. Differences are carried (``r - q``,
    ``k~ - k``), so the result is the change itself, not a difference of two logits.

    Args:
        q: ``[B, H, m, D]`` query rows at key indices ``q_offset .. q_offset + m - 1``.
        k: ``[B, Hkv, K, D]`` keys ``0 .. K - 1`` (grouped heads are repeated).
        w: ``[B, H, L, D]`` unit directions and beta ``[B, H, L]``, ``L >= max(K, q_offset + m)``.
        q_offset: the key index of the first query row.
        chunk: the chunk length ``C``.

    Returns:
        ``[B, H, m, K]`` in float32 at least (float64 for float64 inputs); 0 where ``j >= i``.

    Raises:
        ValueError: ``chunk`` below 1, or ``w`` / ``beta`` shorter than the indices read.
    """
    if chunk < 1:
        raise ValueError(f"path_logit_rows: chunk must be >= 1, got {chunk}")
    h, m = q.shape[1], q.shape[2]
    n_k = k.shape[-2]
    end = max(n_k, q_offset + m)
    if w.shape[-2] < end or beta.shape[-1] < end:
        raise ValueError(f"path_logit_rows: w and beta must cover indices 0..{end - 1} "
                         f"(got {w.shape[-2]} and {beta.shape[-1]}); pass every token's reflection")
    if k.shape[1] != h:
        k = k.repeat_interleave(h // k.shape[1], dim=1)
    k = F.pad(k, (0, 0, 0, end - n_k))  # zero keys up to the last query: their logits are cut off
    return path_walk_rows(q, *path_chunks(k, w[..., :end, :], beta[..., :end], chunk), q_offset, n_k)


def path_chunks(k: Tensor, w: Tensor, beta: Tensor, chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What every block of rows reads of the keys' chunks, computed once per attention call.

    Args:
        k: ``[B, H, N, D]`` keys (heads repeated); w: ``[B, H, N, D]``; beta: ``[B, H, N]``.
        chunk: the chunk length ``C``; the last chunk is padded with identities and zero keys.

    Returns:
        ``(w_c [B, H, n, C, D], t [B, H, n, C, C], wk [B, H, n, C, C], kd [B, H, n, C, 2D])``: the
        directions, the UT transforms (`path_ut_transform`), ``(w_t . k_j)`` for ``t > j`` and
        ``[k~ | k~ - k]`` with ``k~_j = H_{e-1} ... H_{j+1} k_j`` the key carried to its chunk's end.
    """
    wc, t, wk, kc, kt = path_chunk_parts(k, w, beta, chunk)
    return wc, t, wk, torch.cat((kt, kt - kc), dim=-1)


def path_chunk_parts(k: Tensor, w: Tensor, beta: Tensor, chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`path_chunks`' parts: ``(w_c, t, wk, k_c, k~)``, the keys ``k_c [B, H, n, C, D]`` as chunks and
    ``k~ [B, H, n, C, D]`` each carried to its chunk's end.

    Raises:
        ValueError: ``chunk`` below 1.
    """
    if chunk < 1:
        raise ValueError(f"path_chunks: chunk must be >= 1, got {chunk}")
    b, h, n, d = k.shape
    dt = torch.promote_types(k.dtype, torch.float32)
    n_ch = -(-n // chunk)
    pad = n_ch * chunk - n
    # contiguous first (heads are often a transposed view of the projections): every product
    # below then runs on contiguous batches, with no copy per product
    wc = F.pad(w[..., :n, :].to(dt).contiguous(), (0, 0, 0, pad)).view(b, h, n_ch, chunk, d)
    bc = F.pad(beta[..., :n].to(dt).contiguous(), (0, pad)).view(b, h, n_ch, chunk)
    kc = F.pad(k.to(dt).contiguous(), (0, 0, 0, pad)).view(b, h, n_ch, chunk, d)
    t = path_ut_transform(wc, bc)
    wk = torch.tril(wc @ kc.transpose(-1, -2), -1)
    return wc, t, wk, kc, kc - (wk.transpose(-1, -2) @ t.transpose(-1, -2)) @ wc


def path_carries(wc: Tensor, t: Tensor) -> Tensor:
    """Each chunk's whole product ``H_{e-1} ... H_b = I - W^T T W`` as a ``D x D`` matrix: a row
    vector is carried through the chunk by one product with it (cheaper than the three of the
    low-rank form when ``D`` is below about ``3 C``).

    Args:
        wc: ``[..., C, D]`` directions; t: ``[..., C, C]`` their UT transforms.

    Returns:
        ``[..., D, D]``.
    """
    eye = torch.eye(wc.shape[-1], dtype=wc.dtype, device=wc.device)
    return eye - wc.transpose(-1, -2) @ (t @ wc)


def path_query_chunks(q: Tensor, wc: Tensor, t: Tensor, wk: Tensor, kc: Tensor,
                      q_offset: int) -> tuple[Tensor, Tensor, int]:
    """The query side of PaTH attention within each query's own chunk.

    Args:
        q: ``[B, H, m, D]`` query rows at key indices ``q_offset ..``; wc, t, wk, kc: `path_chunk_parts`
            (covering the queries' chunks).
        q_offset: the key index of the first query row.

    Returns:
        ``(q~ [B, H, nq, C, D], s0 [B, H, nq, C, C], front)`` for the query chunks ``c0 .. c1``
        (``c0 = q_offset // C``, rows padded with zeros: ``front`` rows before the first query):
        ``q~_i = q_i^T H_i ... H_b`` (the query carried to its chunk's start ``b``) and the logits
        in the chunk, ``s0_ij = q_i^T H_i ... H_{j+1} k_j`` (every ``j``; only ``j <= i`` means one).
    """
    b, h, m, d = q.shape
    c = wc.shape[-2]
    c0, c1 = q_offset // c, (q_offset + m - 1) // c
    nq = c1 - c0 + 1
    front = q_offset - c0 * c
    qq = F.pad(q.to(wc.dtype).contiguous(), (0, 0, front, nq * c - m - front)).view(b, h, nq, c, d)
    w_q, t_q = wc[:, :, c0:c1 + 1], t[:, :, c0:c1 + 1]
    x = torch.tril(qq @ w_q.transpose(-1, -2)) @ t_q  # (q_i . w_s) for s <= i, times T
    s0 = qq @ kc[:, :, c0:c1 + 1].transpose(-1, -2) - x @ wk[:, :, c0:c1 + 1]
    return qq - x @ w_q, s0, front


def path_walk_rows(q: Tensor, wc: Tensor, t: Tensor, wk: Tensor, kd: Tensor, q_offset: int, n_k: int) -> Tensor:
    """`path_logit_rows` from `path_chunks`, the queries walked down the key chunks (the paper's
    query-side form): every query chunk of the block is carried to its chunk's start, then meets
    the key chunk ``delta`` before it and is carried through it (``r <- r P_c``, one low-rank update),
    for ``delta = 1, 2, ...``, all query chunks of the block at once.

    Args:
        q: ``[B, H, m, D]`` query rows at key indices ``q_offset ..``; the chunk tensors cover them.
        wc, t, wk, kd: `path_chunks` (at least the chunks up to the last query's and key's).
        q_offset: the key index of the first query row; n_k: keys ``0 .. n_k - 1`` in the result.

    Returns:
        ``[B, H, m, n_k]``: ``q_i^T (M_ij - I) k_j``, 0 where ``j >= i``.
    """
    b, h, m, d = q.shape
    c = wc.shape[-2]
    c0, c1 = q_offset // c, (q_offset + m - 1) // c  # the block's query chunks
    nq = c1 - c0 + 1
    front = q_offset - c0 * c
    qq = F.pad(q.to(wc.dtype), (0, 0, front, nq * c - m - front)).view(b, h, nq, c, d)
    # chunks as a tuple of views, stacked per step: a slice's backward would write zeros over the
    # whole tensor at every step (quadratic), unbind's backward is one stack of every chunk's gradient
    wl, tl, kl = wc.unbind(2), t.unbind(2), kd.unbind(2)

    def chunks(parts: tuple[Tensor, ...], a: int, e: int) -> Tensor:
        return torch.stack(parts[a:e], dim=2)

    w_q, t_q = chunks(wl, c0, c1 + 1), chunks(tl, c0, c1 + 1)
    x = torch.tril(qq @ w_q.transpose(-1, -2)) @ t_q  # (q_i . w_s) for s <= i, times T
    blocks = [-(x @ chunks(wk.unbind(2), c0, c1 + 1))]  # delta 0: the query's own chunk
    dr = -(x @ w_q)  # r - q: the query carried to its chunk's start
    for delta in range(1, c1 + 1):
        j0 = max(0, delta - c0)  # query chunks c0 + j0 .. c1 meet key chunks c0 + j0 - delta ..
        dr, qv = dr[:, :, j0 - (nq - dr.shape[2]):], qq[:, :, j0:]
        a, e = c0 + j0 - delta, c1 - delta + 1
        blk = torch.cat((dr, qv), dim=-1) @ chunks(kl, a, e).transpose(-1, -2)  # r . k~ - q . k
        blocks.append(F.pad(blk, (0, 0, 0, 0, j0, 0)))
        if delta < c1:
            w_a = chunks(wl, a, e)
            dr = dr - (((qv + dr) @ w_a.transpose(-1, -2)) @ chunks(tl, a, e)) @ w_a  # r <- r P_c
    skew = torch.stack(blocks, dim=3)  # [B, H, nq, delta, C, C]
    n_kc = min(-(-n_k // c), c1 + 1)
    cq = torch.arange(c0, c1 + 1, device=q.device)[:, None]
    dist = cq - torch.arange(n_kc, device=q.device)[None, :]  # delta of (query chunk, key chunk)
    rows = skew[:, :, torch.arange(nq, device=q.device)[:, None], dist.clamp(0, c1)]  # [B, H, nq, n_kc, C, C]
    rows = torch.where((dist >= 0)[:, :, None, None], rows, 0.0)
    out = rows.permute(0, 1, 2, 4, 3, 5).reshape(b, h, nq * c, n_kc * c)[:, :, front:front + m]
    return out[..., :n_k] if n_kc * c >= n_k else F.pad(out, (0, n_k - n_kc * c))
