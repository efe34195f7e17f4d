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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["path_attention_naive", "path_householder", "path_logit_rows", "path_logits_naive",
           "path_ut_transform"]


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

    The blockwise algorithm (module docstring): chunks of ``chunk`` tokens aligned to index 0.
    For a query ``i`` in chunk ``c`` (from index ``a``): ``r_i^T = q_i^T H_i ... H_a``; for a key
    ``j`` of an earlier chunk ``k^_j = H_{a-1} ... H_{j+1} k_j``, built as the key carried to its
    own chunk's end then through the whole chunks between (``F``, accumulated nearest first).
    Differences are carried, not full vectors (``r - q``, ``k^ - k``, ``F - I``), so the result
    is the change itself, not a difference of two logits.

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
    b, h, m, d = q.shape
    n_k = k.shape[-2]
    end = max(n_k, q_offset + m)
    if w.shape[-2] < end or beta.shape[-1] < end:
        raise ValueError(f"path_logit_rows: w and beta must cover indices 0..{end - 1} "
                         f"(got {w.shape[-2]} and {beta.shape[-1]}); pass every token's reflection")
    dt = torch.promote_types(q.dtype, torch.float32)
    if k.shape[1] != h:
        k = k.repeat_interleave(h // k.shape[1], dim=1)
    n_ch = -(-end // chunk)
    pad = n_ch * chunk - end  # identity reflections (w = 0, beta = 0) and zero keys after the end
    wc = F.pad(w[..., :end, :].to(dt), (0, 0, 0, pad)).view(b, h, n_ch, chunk, d)
    bc = F.pad(beta[..., :end].to(dt), (0, pad)).view(b, h, n_ch, chunk)
    kc = F.pad(k.to(dt), (0, 0, 0, n_ch * chunk - n_k)).view(b, h, n_ch, chunk, d)
    t = path_ut_transform(wc, bc)  # [B, H, n, C, C]
    # (w_t . k_j) for t > j in the same chunk: the reflections after key j up to its chunk's end
    wk = torch.tril(wc @ kc.transpose(-1, -2), -1)  # [B, H, n, C(t), C(j)]
    dkt = -(wk.transpose(-1, -2) @ t.transpose(-1, -2)) @ wc  # k~ - k: key carried to its chunk's end
    kt = kc + dkt
    qi = torch.arange(q_offset, q_offset + m, device=q.device)
    rows = []
    for cq in range(q_offset // chunk, -(-(q_offset + m) // chunk)):
        r0, r1 = max(cq * chunk, q_offset), min((cq + 1) * chunk, q_offset + m)
        qs = q[:, :, r0 - q_offset:r1 - q_offset].to(dt)
        # (q_i . w_s) for s <= i in the query's chunk, times T: r - q = -x W, and the chunk's keys
        seen = (cq * chunk + torch.arange(chunk, device=q.device))[None, :] <= qi[r0 - q_offset:r1 - q_offset, None]
        x = ((qs @ wc[:, :, cq].transpose(-1, -2)) * seen) @ t[:, :, cq]
        intra = -(x @ wk[:, :, cq])  # keys of the query's chunk
        inter = None
        if cq > 0:
            dr = -(x @ wc[:, :, cq])
            e: Tensor | None = None  # F - I: carries a key from its chunk's end to chunk cq's start
            dkh = []
            for c in range(cq - 1, -1, -1):
                wcc = wc[:, :, c]
                dkh.append(dkt[:, :, c] if e is None else dkt[:, :, c] + kt[:, :, c] @ e)
                wf = wcc if e is None else wcc + wcc @ e  # W (I + E)
                step = -(wcc.transpose(-1, -2) @ (t[:, :, c].transpose(-1, -2) @ wf))
                e = step if e is None else e + step  # F <- P_c^T F
            dk_hat = torch.cat(dkh[::-1], dim=-2)  # [B, H, cq * C, D]: k^ - k
            k_hat = kc[:, :, :cq].reshape(b, h, cq * chunk, d) + dk_hat
            # r . k^ - q . k = (r - q) . k^ + q . (k^ - k)
            inter = dr @ k_hat.transpose(-1, -2) + qs @ dk_hat.transpose(-1, -2)
        row = intra if inter is None else torch.cat((inter, intra), dim=-1)
        width = (cq + 1) * chunk
        rows.append(row[..., :n_k] if width >= n_k else F.pad(row, (0, n_k - width)))
    return torch.cat(rows, dim=-2)
