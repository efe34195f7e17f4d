"""Learned rotations' autograd Functions with hand-written backwards: the Hermitian eigen-decomposition
of a skew-symmetric generator (`HermitianEigh`, the diagnostic one; `LiePlanes`, the generators' basis
and frequencies through one operator each way, ``posenc::lie_planes`` and
``posenc::lie_planes_backward``) and the rotation ``Q R(theta) Q^T x`` of q and k per
token (`LieRotationPair`: one operator each way, ``posenc::lie_rotate_pair`` and
``posenc::lie_rotate_pair_backward``, one Triton launch each on CUDA from `autograd.lie_triton`);
`functional.lie_rotary` is the math that uses them (LieRE, ComRoPE)."""

from __future__ import annotations

import math
from collections.abc import Callable

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
    """``x + Q (R - I) Q^T x`` and whether ``x`` was token-major (the torch math of `lie_rotate_pair_op`)."""
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



def _top_planes(u: Tensor, m: int) -> Tensor:
    """``u [K, b, b]`` complex: the real view ``[b, 2, m, K]`` of its last ``m`` columns
    (``[i, c, j, k] = (Re, Im)[c] u[k, i, m + j]``), in two view operators."""
    r = torch.view_as_real(u)
    s = r.stride()
    return r.as_strided((r.shape[1], 2, m, r.shape[0]), (s[1], s[3], s[2], s[0]), r.storage_offset() + m * s[2])


def _basis_blocks(basis: Tensor, k: int, b: int) -> Tensor:
    """The ``[b, 2, m, K]`` view of ``basis`` ``[D, D]`` that `_top_planes` maps onto: block ``k``'s
    row ``i`` and its plane ``j``'s component ``c`` at ``(k b + i, c D/2 + k m + j)`` (a gradient
    laid out otherwise is copied first)."""
    return basis.reshape(k, b, 2, k, b // 2).diagonal(dim1=0, dim2=3)


def _plane_speeds(lam: Tensor, m: int) -> Tensor:
    """The ``mu_k >= 0`` of ``lam [K, b]`` (eigenvalues ``+-mu`` ascending: the top half) as a
    ``[1, K, m]`` view."""
    s = lam.stride()
    return lam.as_strided((1, lam.shape[0], m), (0, s[0], s[1]), lam.storage_offset() + m * s[1])


def _plane_speeds_diag(inner: Tensor, m: int) -> Tensor:
    """The ``[1, K, m]`` view of the diagonal entries ``(m + j, m + j)`` of ``inner [K, b, b]``
    (where the speeds' gradient enters)."""
    s = inner.stride()
    return inner.as_strided((1, inner.shape[0], m), (0, s[0], s[1] + s[2]), inner.storage_offset() + m * (s[1] + s[2]))


def _lie_planes_math(w: Tensor, c: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`lie_planes_op`'s torch math: ``(basis, freq, lam, u)``, each a new tensor."""
    k, b = w.shape[-3], w.shape[-1]
    m = b // 2
    w3 = w if w.dim() == 3 else w.view(k, b, b)
    # W - W^T in W's dtype (as `skew`), the rest in float64
    lam, u = torch.linalg.eigh((w3 - w3.mT).to(torch.float64) * 0.5j)  # [K, b], [K, b, b]
    basis = torch.zeros((k * b, k * b), dtype=dtype, device=w.device)
    _basis_blocks(basis, k, b).add_(_top_planes(u, m), alpha=math.sqrt(2.0))
    mu = _plane_speeds(lam, m)
    # a copy without c: an operator's outputs alias neither its inputs nor each other
    freq = mu.clone(memory_format=torch.contiguous_format) if c is None else c.view(c.shape[0], -1, 1) * mu
    return basis, freq, lam, u


@torch.library.custom_op("posenc::lie_planes", mutates_args=())
def lie_planes_op(w: Tensor, c: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Generators to RoPE planes in one operator: ``(W [(1,) K, b, b], c) -> (Q [D, D] in dtype,
    F [A, K, b/2] float64, lam [K, b] float64, U [K, b, b] complex128)``, ``lam`` and ``U`` the
    eigen-decomposition that `lie_planes_backward_op` takes (the math: `LiePlanes`). On CUDA one
    dispatch still launches the batched complex eigh's cuSOLVER calls and a few small element-wise
    kernels (complex eigh has no fused form), once per step and independent of N."""
    return _lie_planes_math(w, c, dtype)


@lie_planes_op.register_fake
def _(w, c, dtype):
    k, b = w.shape[-3], w.shape[-1]
    lam, u = torch.linalg.eigh(w.new_empty((k, b, b), dtype=torch.complex128))  # eigh's strides
    freq = w.new_empty((1 if c is None else c.shape[0], k, b // 2), dtype=torch.float64)
    return w.new_empty((k * b, k * b), dtype=dtype), freq, lam, u


def _lie_planes_grad(c: Tensor | None, lam: Tensor, u: Tensor, g_basis: Tensor, g_freq: Tensor,
                     w_dtype: torch.dtype, lead: bool, need_c: bool) -> tuple[Tensor, Tensor]:
    """`lie_planes_backward_op`'s torch math: ``(gW, gc)`` (``gc`` empty unless ``need_c``)."""
    k, b = u.shape[-3], u.shape[-1]
    m = b // 2
    # the gradient of u (its top columns) at half weight: the 1/2 of skew(W) folded in
    gu = torch.zeros_like(u)
    _top_planes(gu, m).add_(_basis_blocks(g_basis, k, b), alpha=math.sqrt(0.5))
    uh = u.mH
    gap = (lam[..., None, :] - lam[..., :, None]).reciprocal_()  # 1 / (lambda_j - lambda_i)
    inner = torch.bmm(uh, gu) * gap.nan_to_num_(posinf=0.0, neginf=0.0)
    gl = g_freq if c is None else (c.view(c.shape[0], -1, 1) * g_freq).sum(0, keepdim=True)
    _plane_speeds_diag(inner, m).add_(gl, alpha=0.5)
    z = torch.bmm(torch.bmm(u, inner), uh).imag
    gw = torch.sub(z, z.mT).to(w_dtype)
    gw = gw[None] if lead else gw
    if not need_c or c is None:
        return gw, g_freq.new_empty(0, dtype=w_dtype)
    mu = _plane_speeds(lam, m)
    gc = (g_freq * mu).sum(-1) if c.dim() == 2 else (g_freq * mu).sum((1, 2))
    return gw, gc.to(c.dtype)


@torch.library.custom_op("posenc::lie_planes_backward", mutates_args=())
def lie_planes_backward_op(c: Tensor | None, lam: Tensor, u: Tensor, g_basis: Tensor, g_freq: Tensor,
                           w_dtype: torch.dtype, lead: bool, need_c: bool) -> tuple[Tensor, Tensor]:
    """The gradients of `lie_planes_op`'s ``(Q, F)`` given theirs, in one operator: ``(gW, gc)``,
    ``gW`` ``[(1,) K, b, b]`` (the leading 1 when ``lead``) in ``w_dtype``, ``gc`` in ``c``'s shape and
    dtype (empty unless ``need_c``); the math: `LiePlanes`. On CUDA it launches the small products and
    couplings of ``[K, b, b]`` tensors, once per step and independent of N."""
    return _lie_planes_grad(c, lam, u, g_basis, g_freq, w_dtype, lead, need_c)


@lie_planes_backward_op.register_fake
def _(c, lam, u, g_basis, g_freq, w_dtype, lead, need_c):
    k, b = u.shape[-3], u.shape[-1]
    gw = u.new_empty((1, k, b, b) if lead else (k, b, b), dtype=w_dtype)
    return gw, (c.new_empty(c.shape) if need_c and c is not None else g_freq.new_empty(0, dtype=w_dtype))


class LiePlanes(torch.autograd.Function):
    """Learned generators to RoPE planes: ``(W [(1,) K, b, b], c) -> (Q [D, D], F [A, K, b/2])``,
    one operator each way (``posenc::lie_planes`` and ``posenc::lie_planes_backward``).

    ``A_k = (W_k - W_k^T) / 2`` (the skew part is taken here) is ``Q_k S_k Q_k^T`` with plane speeds
    ``mu_k`` from one batched eigh of the Hermitian ``i A`` in complex128 (see
    `functional.lie_rotary.canonical_basis`, the same basis); ``Q`` is block diagonal with columns in
    RoPE's half layout (plane ``k b/2 + j`` is block k's j-th plane, x parts first, then y parts) in
    ``dtype``, ``F[a, k, j] = c[a, k] mu_kj`` in float64 (``c`` ``[A, K]`` or ``[A]``; None: one axis
    with ``c = 1``). Backward is the eigen-decomposition's (Giles, 2008) written for these outputs:
    ``gW = Im Z - Im Z^T``, ``Z = U (diag(g_mu) / 2 + (U^H gU / 2) / (l_j - l_i)) U^H`` (0 where
    ``l_i = l_j``: see `HermitianEigh`), from the forward's ``lam`` and ``U`` (saved: eigh runs once).
    Only gauge-invariant uses of ``Q`` (``Q R Q^T``) get the right gradient, as with `HermitianEigh`;
    differentiable once (the backward operator has no derivative of its own).
    ``on_backward`` (optional) is called when backward runs (the outputs' graph is then spent)."""

    @staticmethod
    def forward(ctx, w: Tensor, c: Tensor | None, dtype: torch.dtype,  # type: ignore[override]
                on_backward: Callable[[], None] | None) -> tuple[Tensor, Tensor]:
        basis, freq, lam, u = lie_planes_op(w, c, dtype)
        ctx.save_for_backward(c, lam, u)
        ctx.w_dtype, ctx.lead, ctx.on_backward = w.dtype, w.dim() == 4, on_backward
        return basis, freq

    @staticmethod
    def backward(ctx, g_basis: Tensor, g_freq: Tensor):  # type: ignore[override]
        c, lam, u = ctx.saved_tensors
        if ctx.on_backward is not None:
            ctx.on_backward()
        need_c = c is not None and ctx.needs_input_grad[1]
        gw, gc = lie_planes_backward_op(c, lam, u, g_basis, g_freq, ctx.w_dtype, ctx.lead, need_c)
        return gw, gc if need_c else None, None, None


# ----------------------------------------------------------------------------- q and k per token
def _lie_out(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A new tensor shaped like ``x`` ``[B, H, N, D]``, laid out as `_lie_forward` returns it:
    token-major when ``x`` is, else contiguous."""
    dt = x.dtype if dtype is None else dtype
    if token_major(x):
        return x.new_empty((x.shape[0], x.shape[2], x.shape[1], x.shape[3]), dtype=dt).transpose(1, 2)
    return x.new_empty(x.shape, dtype=dt)


def lie_angles(pos: Tensor, freq: Tensor) -> Tensor:
    """``[B, N, D/2]`` float64 angles ``sum_a pos_a F[a]``: positions ``[B, N]`` (one axis) or
    ``[B, N, A]``, ``F`` ``[A, K, b/2]`` (plane ``k b/2 + j``)."""
    p = (pos if pos.dim() == 3 else pos[..., None]).to(torch.float64)
    return p @ freq.reshape(freq.shape[0], -1).to(torch.float64)


def lie_tables(angles: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(cos - 1, sin)`` of ``angles`` in ``dtype``: ``cos - 1 = -2 sin^2(theta / 2)`` (exact for
    small angles) and sin, computed in the angles' dtype (float64), then cast."""
    return (-2.0 * (0.5 * angles).sin().square()).to(dtype), angles.sin().to(dtype)


def _triton_ready(x: Tensor, basis: Tensor) -> bool:
    """The Triton launch applies: CUDA, triton installed, a head of at most 128 channels (a
    token's ``D x D`` product in one program), float32 math (float64, for checks, takes the torch
    math: the kernel's float64 products are sums of ``[rows, D, D/2]`` products, correct but slow)."""
    if x.device.type != "cuda" or x.shape[-1] > 128 or basis.dtype != torch.float32:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@torch.library.custom_op("posenc::lie_rotate_pair", mutates_args=())
def lie_rotate_pair_op(q: Tensor, k: Tensor, basis: Tensor, freq: Tensor, pos_q: Tensor,
                       pos_k: Tensor | None) -> tuple[Tensor, Tensor]:
    """``x + Q (R - I) Q^T x`` for q ``[B, H, Nq, D]`` and k ``[B, Hkv, Nk, D]``, ``R`` the planes'
    rotation by the angles `lie_angles` (``pos_q``, ``pos_k`` with ``freq``; ``pos_k`` None: k at
    q's positions, one tensor not passed twice, which would not trace), computed in
    ``basis.dtype``, returned in the inputs' dtypes (laid out as `_lie_out`): one Triton launch on
    CUDA (`autograd.lie_triton`), the torch math elsewhere."""
    pos_k = pos_q if pos_k is None else pos_k
    if _triton_ready(q, basis):
        from posenc_lightning.autograd.lie_triton import lie_pair_forward

        return lie_pair_forward(q, k, _lie_out(q), _lie_out(k), basis, freq, pos_q, pos_k)
    outs = []
    for x, pos in ((q, pos_q), (k, pos_k)):
        cm1, sin = lie_tables(lie_angles(pos, freq), basis.dtype)
        outs.append(_lie_forward(x, basis, cm1, sin)[0])
    return outs[0], outs[1]


@lie_rotate_pair_op.register_fake
def _(q, k, basis, freq, pos_q, pos_k):
    return _lie_out(q), _lie_out(k)


@torch.library.custom_op("posenc::lie_rotate_pair_backward", mutates_args=())
def lie_rotate_pair_backward_op(q: Tensor, k: Tensor, basis: Tensor, freq: Tensor, pos_q: Tensor,
                                pos_k: Tensor | None, gq: Tensor, gk: Tensor, need_params: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of `lie_rotate_pair_op` given ``gq``, ``gk``: ``(dq, dk, dQ, dF)`` (``dQ``
    in ``basis.dtype``, ``dF`` float64 ``[A, K, b/2]``; both empty unless ``need_params``): one
    Triton launch on CUDA (``dQ``, ``dF`` summed over tokens in place), the torch math elsewhere."""
    pos_k = pos_q if pos_k is None else pos_k
    if _triton_ready(q, basis):
        from posenc_lightning.autograd.lie_triton import lie_pair_backward

        dq, dk = _lie_out(q), _lie_out(k)
        db, df = lie_pair_backward(q, k, gq, gk, dq, dk, basis, freq, pos_q, pos_k, need_params)
        return dq, dk, db, df
    grads, db, df = [], None, None
    for x, pos, g in ((q, pos_q, gq), (k, pos_k, gk)):
        angles = lie_angles(pos, freq)
        cm1, sin = lie_tables(angles, basis.dtype)
        gx, gb, gc, gs = _lie_backward(x, basis, cm1, sin, g, token_major(x), (True, need_params, need_params,
                                                                               need_params))
        grads.append(gx)
        if need_params:
            # d(cos - 1)/d theta = -sin, d sin/d theta = cos; theta = sum_a pos_a F[a]
            g_theta = gs.to(torch.float64) * angles.cos() - gc.to(torch.float64) * angles.sin()
            p = (pos if pos.dim() == 3 else pos[..., None]).to(torch.float64).expand(g_theta.shape[0], -1, -1)
            gf = torch.einsum("bna,bnj->aj", p, g_theta)
            db, df = (gb, gf) if db is None else (db + gb, df + gf)
    if not need_params:
        return grads[0], grads[1], basis.new_empty(0), freq.new_empty(0, dtype=torch.float64)
    return grads[0], grads[1], db.to(basis.dtype), df.reshape(freq.shape).contiguous()


@lie_rotate_pair_backward_op.register_fake
def _(q, k, basis, freq, pos_q, pos_k, gq, gk, need_params):
    if not need_params:
        return _lie_out(q), _lie_out(k), basis.new_empty(0), freq.new_empty(0, dtype=torch.float64)
    return (_lie_out(q), _lie_out(k), basis.new_empty(basis.shape),
            freq.new_empty(freq.shape, dtype=torch.float64))


class LieRotationPair(torch.autograd.Function):
    """q and k rotated by ``Q R(theta) Q^T`` per token through one operator each way
    (``posenc::lie_rotate_pair`` and its backward): ``(q, k, Q, F, pos_q, pos_k) -> (q', k')``,
    the angles ``theta = pos @ F`` (and their cos/sin) computed inside from the positions. Written
    around ``R - I`` so that the generator's gradient has no cancellation: with ``R`` the two outer
    products of ``Q``'s gradient are O(|x| |g|) each and cancel to O(theta) in the eigen-coupling
    that `LiePlanes`' backward divides by ``mu_i - mu_j``. Saves the un-rotated q and k (kept by
    attention anyway), ``Q``, ``F`` and the positions (``pos_k`` None: q's); the gradients of ``Q`` and ``F`` are summed
    over tokens and heads by the backward operator."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, basis: Tensor, freq: Tensor, pos_q: Tensor,  # type: ignore[override]
                pos_k: Tensor | None) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(q, k, basis, freq, pos_q, pos_k)
        return lie_rotate_pair_op(q, k, basis, freq, pos_q, pos_k)

    @staticmethod
    def backward(ctx, gq: Tensor, gk: Tensor):  # type: ignore[override]
        q, k, basis, freq, pos_q, pos_k = ctx.saved_tensors
        n = ctx.needs_input_grad
        dq, dk, db, df = lie_rotate_pair_backward_op(q, k, basis, freq, pos_q, pos_k, gq, gk, n[2] or n[3])
        return dq, dk, db if n[2] else None, df if n[3] else None, None, None
