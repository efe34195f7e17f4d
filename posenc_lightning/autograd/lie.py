"""Learned rotations' autograd Functions with hand-written backwards: the Hermitian eigen-decomposition
of a skew-symmetric generator (`HermitianEigh`) and the rotation ``Q R(theta) Q^T x`` per token
(`LieRotation`); `functional.lie_rotary` is the math that uses them (LieRE, ComRoPE)."""

from __future__ import annotations

import torch
from torch import Tensor


class HermitianEigh(torch.autograd.Function):
    """``torch.linalg.eigh`` with the textbook backward (Giles, 2008, sec. 3.1):
    ``gH = U (diag(g_lambda) + skewH(U^H gU) / (lambda_j - lambda_i)) U^H``. Unlike torch's
    it does not read the device to check gauge invariance (``exp(tA)`` is invariant under
    ``u_k -> e^{i phi} u_k``), so it traces without host reads; an exactly repeated eigenvalue
    gives a zero (not infinite) coupling: see `relative_spectral_gap`."""

    @staticmethod
    def forward(ctx, h: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        lam, u = torch.linalg.eigh(h)
        ctx.save_for_backward(lam, u)
        return lam, u

    @staticmethod
    def backward(ctx, g_lam: Tensor, g_u: Tensor) -> Tensor:  # type: ignore[override]
        lam, u = ctx.saved_tensors
        inner = u.mH @ g_u
        inner = 0.5 * (inner - inner.mH)
        gap = lam[..., None, :] - lam[..., :, None]  # lambda_j - lambda_i
        safe = torch.where(gap == 0, torch.ones_like(gap), gap)
        coupling = torch.where(gap == 0, torch.zeros_like(inner), inner / safe)
        coupling = coupling + torch.diag_embed(g_lam.to(coupling.dtype))
        return u @ coupling @ u.mH


def rotate_planes_(h: Tensor, cosm1: Tensor, sin: Tensor) -> Tensor:
    """``(R - I) h`` in place, RoPE's half layout: ``h1 <- h1 (cos - 1) - h2 sin``,
    ``h2 <- h2 (cos - 1) + h1 sin`` (``cos - 1`` given: exact for small angles)."""
    m = cosm1.shape[-1]
    h1, h2 = h[..., :m], h[..., m:]
    t1 = h1.clone()
    h1.mul_(cosm1).addcmul_(h2, sin, value=-1.0)
    h2.mul_(cosm1).addcmul_(t1, sin)
    return h


def token_major(x: Tensor) -> bool:
    """``x`` ``[B, H, N, D]`` is a transposed contiguous ``[B, N, H, D]`` (a projection's output):
    work in that layout, where every token's heads are one contiguous ``[N * H, D]`` matrix."""
    return not x.is_contiguous() and x.transpose(1, 2).is_contiguous()


def _lie_forward(x: Tensor, q: Tensor, cosm1: Tensor, sin: Tensor) -> tuple[Tensor, bool]:
    """``x + Q (R - I) Q^T x`` and whether ``x`` was token-major (`LieRotation`)."""
    t = token_major(x)
    c, s = (cosm1[:, :, None], sin[:, :, None]) if t else (cosm1[:, None], sin[:, None])
    xl = (x.transpose(1, 2) if t else x).to(q.dtype)
    y = (rotate_planes_(xl @ q, c, s) @ q.mT).add_(xl).to(x.dtype)
    return (y.transpose(1, 2) if t else y), t


def _lie_backward(x: Tensor, q: Tensor, cosm1: Tensor, sin: Tensor, g: Tensor, t: bool,
                  needs: tuple[bool, bool, bool, bool]) -> tuple[Tensor | None, ...]:
    """The gradients of `_lie_forward` with respect to ``(x, Q, cos - 1, sin)`` (None where not needed)."""
    need_x, need_q, need_c, need_s = needs
    c, s = (cosm1[:, :, None], sin[:, :, None]) if t else (cosm1[:, None], sin[:, None])
    heads = 2 if t else 1
    xl, gl = (x.transpose(1, 2), g.transpose(1, 2)) if t else (x, g)
    xl, gl = xl.to(q.dtype), gl.to(q.dtype)
    gh = gl @ q  # the gradient of v = (R - I) Q^T x
    gq = gc = gs = None
    if need_q or need_c or need_s:
        xh = xl @ q  # Q^T x
        m = cosm1.shape[-1]
        g1, g2, x1, x2 = gh[..., :m], gh[..., m:], xh[..., :m], xh[..., m:]
        if need_c:
            gc = (g1 * x1).sum(heads) + (g2 * x2).sum(heads)
        if need_s:
            gs = (g2 * x1).sum(heads) - (g1 * x2).sum(heads)
        if need_q:  # y = x + v Q^T: the outer Q
            gq = gl.reshape(-1, gl.shape[-1]).mT @ rotate_planes_(xh, c, s).reshape(-1, xh.shape[-1])
        del xh, x1, x2
    grad_in = rotate_planes_(gh, c, -s)  # (R - I)^T Q^T g: the gradient of Q^T x
    if need_q:  # ... and the inner one
        gq = gq + xl.reshape(-1, xl.shape[-1]).mT @ grad_in.reshape(-1, grad_in.shape[-1])
    gx = None
    if need_x:
        gx = (grad_in @ q.mT).add_(gl).to(x.dtype)
        gx = gx.transpose(1, 2) if t else gx
    return gx, gq, gc, gs


class LieRotation(torch.autograd.Function):
    """``y = x + Q (R(theta) - I) Q^T x`` (``= Q R Q^T x``: ``Q`` orthogonal) per token and head.

    Written around ``R - I`` so that the generator's gradient has no cancellation: with ``R`` the
    two outer products of ``Q``'s gradient are O(|x| |g|) each and cancel to O(theta) in the
    eigen-coupling that `canonical_basis`'s backward divides by ``mu_i - mu_j`` (float32 rounding
    of the cancelled parts would be amplified by 1 / gap). Saved: ``x`` (the un-rotated q or k,
    kept by attention anyway), ``Q`` and ``[B, N, D/2]`` cos - 1 and sin; backward recomputes
    ``Q^T x``. Transients: ~2.5 copies of ``x``."""

    @staticmethod
    def forward(ctx, x: Tensor, q: Tensor, cosm1: Tensor, sin: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, q, cosm1, sin)
        y, ctx.token_major = _lie_forward(x, q, cosm1, sin)
        return y

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        x, q, cosm1, sin = ctx.saved_tensors
        return _lie_backward(x, q, cosm1, sin, g, ctx.token_major, ctx.needs_input_grad)


class LieRotationPair(torch.autograd.Function):
    """`LieRotation` of q and k in one Function, one basis ``Q`` (its gradient summed over both):
    ``(q, k, Q, cos_q - 1, sin_q, cos_k - 1, sin_k) -> (q', k')``, k's tables None when they are
    q's (no tensor passed twice: that would not trace); saves the un-rotated q and k (kept by
    attention anyway), ``Q`` and the tables."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, basis: Tensor, cq: Tensor, sq: Tensor, ck: Tensor | None,  # type: ignore[override]
                sk: Tensor | None) -> tuple[Tensor, Tensor]:
        ctx.shared = ck is None
        ck, sk = (cq, sq) if ctx.shared else (ck, sk)
        ctx.save_for_backward(q, k, basis, cq, sq, ck, sk)
        yq, tq = _lie_forward(q, basis, cq, sq)
        yk, tk = _lie_forward(k, basis, ck, sk)
        ctx.token_major = (tq, tk)
        return yq, yk

    @staticmethod
    def backward(ctx, gq: Tensor, gk: Tensor):  # type: ignore[override]
        q, k, basis, cq, sq, ck, sk = ctx.saved_tensors
        n = ctx.needs_input_grad
        tables_k = (n[3], n[4]) if ctx.shared else (n[5], n[6])
        dq, dbq, dcq, dsq = _lie_backward(q, basis, cq, sq, gq, ctx.token_major[0], (n[0], n[2], n[3], n[4]))
        dk, dbk, dck, dsk = _lie_backward(k, basis, ck, sk, gk, ctx.token_major[1], (n[1], n[2], *tables_k))
        db = dbq + dbk if dbq is not None else None
        if ctx.shared:
            dcq = dcq + dck if dcq is not None else None
            dsq = dsq + dsk if dsq is not None else None
            dck = dsk = None
        return dq, dk, db, dcq, dsq, dck, dsk
