"""Rotations ``exp(t A)`` by learned skew-symmetric generators without per-token matrices.

LieRE (Ostmeier et al., 2024, eq. 3) and ComRoPE (Yu et al., 2025, eq. 6) rotate a token at
position ``t`` by ``R(t) = exp(t A)``. A real skew-symmetric ``A`` (``b x b``, ``b`` even) is
orthogonally similar to ``b/2`` plane rotations (its real Schur form):

    A = Q S Q^T,   S = diag([[0, -mu_k], [mu_k, 0]]),   exp(t A) = Q exp(t S) Q^T,

so ``R(t) x`` is RoPE (Su et al., 2021, eq. 34) with learned frequencies ``mu_k`` applied in a
learned orthonormal basis ``Q``: two small matmuls and a rotation per token. ``Q`` and ``mu`` come
from one eigen-decomposition of the Hermitian ``i A`` per generator, shared by every position:
``i A u_k = mu_k u_k`` gives ``A Re(u_k) = mu_k Im(u_k)``, ``A Im(u_k) = -mu_k Re(u_k)``.

`lie_rotate` applies ``Q R(angles) Q^T x`` (as ``x + Q (R - I) Q^T x``) with a backward that
keeps only ``x`` (which attention keeps anyway), ``Q`` and the ``[B, N, b/2]`` cos/sin: nothing
``[N, b, b]`` and no rotated copy. Cost per token and head: two ``D x D`` matmuls forward, four
backward (``Q`` is block diagonal up to a column order, applied as one dense ``D x D`` matmul).
`matrix_exp_rotate` is the exact ``torch.linalg.matrix_exp`` path (for non-commuting generators,
LieRE with several axes), recomputed chunk by chunk in backward.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["canonical_basis", "lie_rotate", "matrix_exp_rotate", "relative_spectral_gap", "skew"]

#: dtype of the eigen-decomposition (the generators are tiny): its gradient has
#: ``1 / (mu_i - mu_j)`` terms, whose rounding float64 keeps at ~1e-16 / relative gap
DECOMPOSITION_DTYPE = torch.float64


def skew(m: Tensor) -> Tensor:
    """The skew-symmetric part ``(M - M^T) / 2`` (over the last two dims)."""
    return 0.5 * (m - m.transpose(-1, -2))


class _HermitianEigh(torch.autograd.Function):
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


def canonical_basis(a: Tensor) -> tuple[Tensor, Tensor]:
    """Real Schur form of skew-symmetric blocks ``a`` ``[..., b, b]``: ``(Q, mu)`` with
    ``a = Q S Q^T``; ``Q`` ``[..., b, b]`` orthogonal, columns ordered ``(x_1..x_m, y_1..y_m)``
    (``m = b/2``) so that plane ``k`` is the pair ``(k, k + m)`` of RoPE's half layout, and
    ``mu`` ``[..., m]`` >= 0. Computed in `DECOMPOSITION_DTYPE`."""
    b = a.shape[-1]
    h = 1j * a.to(DECOMPOSITION_DTYPE).to(torch.complex128)
    lam, u = _HermitianEigh.apply(h)
    # eigenvalues come in pairs +-mu_k, sorted ascending: the top half are the mu_k >= 0
    u_top = u[..., b // 2:]
    q = math.sqrt(2.0) * torch.cat((u_top.real, u_top.imag), dim=-1)
    return q, lam[..., b // 2:]


def relative_spectral_gap(mu: Tensor) -> Tensor:
    """Per generator block ``mu`` ``[..., m]``: the smallest distance between the eigenvalues
    ``+-mu_k`` over the largest ``|mu|``; 0 for a zero block. The eigen-gradient's error grows as
    eps / gap (eps of the per-token work's dtype): near 0 use `matrix_exp_rotate` instead."""
    lam = torch.cat((mu, -mu), dim=-1)
    d = (lam[..., :, None] - lam[..., None, :]).abs()
    d = d.masked_fill(torch.eye(lam.shape[-1], dtype=torch.bool, device=d.device), float("inf"))
    scale = mu.abs().amax(-1)
    return torch.where(scale > 0, d.amin((-1, -2)) / scale.clamp_min(torch.finfo(mu.dtype).tiny), 0.0)


def _rotate_planes_(h: Tensor, cosm1: Tensor, sin: Tensor) -> Tensor:
    """``(R - I) h`` in place, RoPE's half layout: ``h1 <- h1 (cos - 1) - h2 sin``,
    ``h2 <- h2 (cos - 1) + h1 sin`` (``cos - 1`` given: exact for small angles)."""
    m = cosm1.shape[-1]
    h1, h2 = h[..., :m], h[..., m:]
    t1 = h1.clone()
    h1.mul_(cosm1).addcmul_(h2, sin, value=-1.0)
    h2.mul_(cosm1).addcmul_(t1, sin)
    return h


def _token_major(x: Tensor) -> bool:
    """``x`` ``[B, H, N, D]`` is a transposed contiguous ``[B, N, H, D]`` (a projection's output):
    work in that layout, where every token's heads are one contiguous ``[N * H, D]`` matrix."""
    return not x.is_contiguous() and x.transpose(1, 2).is_contiguous()


class _LieRotation(torch.autograd.Function):
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
        ctx.token_major = t = _token_major(x)
        c, s = (cosm1[:, :, None], sin[:, :, None]) if t else (cosm1[:, None], sin[:, None])
        xl = (x.transpose(1, 2) if t else x).to(q.dtype)
        y = (_rotate_planes_(xl @ q, c, s) @ q.mT).add_(xl).to(x.dtype)
        return y.transpose(1, 2) if t else y

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        x, q, cosm1, sin = ctx.saved_tensors
        need_x, need_q, need_c, need_s = ctx.needs_input_grad
        t = ctx.token_major
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
                gq = gl.reshape(-1, gl.shape[-1]).mT @ _rotate_planes_(xh, c, s).reshape(-1, xh.shape[-1])
            del xh, x1, x2
        grad_in = _rotate_planes_(gh, c, -s)  # (R - I)^T Q^T g: the gradient of Q^T x
        if need_q:  # ... and the inner one
            gq = gq + xl.reshape(-1, xl.shape[-1]).mT @ grad_in.reshape(-1, grad_in.shape[-1])
        gx = None
        if need_x:
            gx = (grad_in @ q.mT).add_(gl).to(x.dtype)
            gx = gx.transpose(1, 2) if t else gx
        return gx, gq, gc, gs


def lie_rotate(x: Tensor, basis: Tensor, angles: Tensor) -> Tensor:
    """``Q R(angles) Q^T x``: x ``[B, H, N, D]``, basis ``Q`` ``[D, D]`` (half-layout columns,
    see `canonical_basis`), angles ``[B, N, D/2]`` (any float dtype); computed in ``basis.dtype``,
    returned in ``x.dtype``."""
    # cos - 1 = -2 sin^2(theta / 2) and sin in the angles' dtype (float64 from `planes`), then cast
    cosm1 = -2.0 * (0.5 * angles).sin().square()
    return _LieRotation.apply(x, basis, cosm1.to(basis.dtype), angles.sin().to(basis.dtype))


def matrix_exp_rotate(xs: tuple[Tensor, ...], positions: Tensor, generators: Tensor,
                      chunk_elems: int = 1 << 18) -> tuple[Tensor, ...]:
    """Exact ``exp(sum_a x_a A_a)`` applied per token and block to each of ``xs`` (``[B, H, N, D]``,
    one set of ``positions`` ``[B, N, n_axes]``; ``generators`` ``[n_axes, K, b, b]``). Tokens go
    in static chunks of ~``chunk_elems`` matrix entries, each recomputed in backward
    (checkpointing), so neither pass keeps ``[B, N, K, b, b]`` (matrix_exp's own workspace is
    ~20x a chunk); cost: one ``b x b`` ``matrix_exp``
    per token and block forward, and that again plus its adjoint in backward."""
    k, b = generators.shape[1], generators.shape[-1]
    if positions.shape[0] > 1 and positions.stride(0) == 0:  # one row expanded over the batch
        positions = positions[:1]  # (static metadata, as the mixin's default positions): once
    bsz, n = positions.shape[:2]
    step = max(1, chunk_elems // max(1, bsz * k * b * b))
    if n <= step:
        return _exp_apply(positions, generators, *xs)
    outs = [checkpoint(_exp_apply, positions[:, lo:lo + step], generators, *(x[:, :, lo:lo + step] for x in xs),
                       use_reentrant=False) for lo in range(0, n, step)]
    return tuple(torch.cat([o[i] for o in outs], dim=2) for i in range(len(xs)))


def _exp_apply(positions: Tensor, generators: Tensor, *xs: Tensor) -> tuple[Tensor, ...]:
    rot = torch.linalg.matrix_exp(torch.einsum("bna,akij->bnkij", positions.to(generators.dtype), generators))
    k, b = generators.shape[1], generators.shape[-1]
    out = []
    for x in xs:
        xb = x.to(rot.dtype).unflatten(-1, (k, b))
        r = rot.expand(x.shape[0], *rot.shape[1:])
        out.append(torch.einsum("bnkij,bhnkj->bhnki", r, xb).flatten(-2).to(x.dtype))
    return tuple(out)
