"""Rotations ``exp(t A)`` by learned skew-symmetric generators without per-token matrices.

LieRE (Ostmeier et al., 2024, eq. 3) and ComRoPE (Yu et al., 2025, eq. 6) rotate a token at
position ``t`` by ``R(t) = exp(t A)``. A real skew-symmetric ``A`` (``b x b``, ``b`` even) is
orthogonally similar to ``b/2`` plane rotations (its real Schur form):

    A = Q S Q^T,   S = diag([[0, -mu_k], [mu_k, 0]]),   exp(t A) = Q exp(t S) Q^T,

so ``R(t) x`` is RoPE (Su et al., 2021, eq. 34) with learned frequencies ``mu_k`` applied in a
learned orthonormal basis ``Q``: two small matmuls and a rotation per token. ``Q`` and ``mu`` come
from one eigen-decomposition of the Hermitian ``i A`` per generator, shared by every position:
``i A u_k = mu_k u_k`` gives ``A Re(u_k) = mu_k Im(u_k)``, ``A Im(u_k) = -mu_k Re(u_k)``.

`lie_planes` gives ``Q`` and the frequencies ``F`` (``mu`` times each axis' weight) from the raw
generator weights through one operator each way (`autograd.lie.LiePlanes`: ``posenc::lie_planes``,
one batched eigh, and ``posenc::lie_planes_backward``), eager or traced. `lie_rotate_pair` applies
``Q R(pos @ F) Q^T x`` (as ``x + Q (R - I) Q^T x``) to q and k through one operator forward
(``posenc::lie_rotate_pair``) and one backward, each one Triton launch on CUDA; the cos/sin of the
angles are computed inside from the positions and ``F``. Its backward keeps only q and k (which
attention keeps anyway), ``Q``, ``F`` and the positions: nothing ``[N, b, b]`` and no rotated copy.
Cost per token and head: two ``D x D`` products forward, four backward (``Q`` is block diagonal up
to a column order, applied as one dense ``D x D`` product).
`matrix_exp_rotate` is the exact ``torch.linalg.matrix_exp`` path (for non-commuting generators,
LieRE with several axes), recomputed chunk by chunk in backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from posenc_lightning.autograd.lie import HermitianEigh, LiePlanes, LieRotationPair, lie_angles, lie_tables

__all__ = ["canonical_basis", "lie_angles", "lie_planes", "lie_planes_traceable", "lie_rotate_pair", "lie_tables", "matrix_exp_rotate",
           "relative_spectral_gap", "skew"]

#: dtype of the eigen-decomposition (the generators are tiny): its gradient has
#: ``1 / (mu_i - mu_j)`` terms, whose rounding float64 keeps at ~1e-16 / relative gap
DECOMPOSITION_DTYPE = torch.float64


def skew(m: Tensor) -> Tensor:
    """The skew-symmetric part ``(M - M^T) / 2`` (over the last two dims)."""
    return 0.5 * (m - m.transpose(-1, -2))


def canonical_basis(a: Tensor) -> tuple[Tensor, Tensor]:
    """Real Schur form of skew-symmetric blocks ``a`` ``[..., b, b]``: ``(Q, mu)`` with
    ``a = Q S Q^T``; ``Q`` ``[..., b, b]`` orthogonal, columns ordered ``(x_1..x_m, y_1..y_m)``
    (``m = b/2``) so that plane ``k`` is the pair ``(k, k + m)`` of RoPE's half layout, and
    ``mu`` ``[..., m]`` >= 0. Computed in `DECOMPOSITION_DTYPE`."""
    b = a.shape[-1]
    h = 1j * a.to(DECOMPOSITION_DTYPE).to(torch.complex128)
    lam, u = HermitianEigh.apply(h)
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


def lie_planes(w: Tensor, c: Tensor | None, dtype: torch.dtype,
               on_backward: Callable[[], None] | None = None) -> tuple[Tensor, Tensor]:
    """``(Q [D, D] in dtype, F [A, K, b/2] float64)`` of generator weights ``w`` ``[(1,) K, b, b]``
    (their skew parts ``P_k`` are taken inside) and axis weights ``c`` (``[A, K]``, ``[A]``, or None
    for one axis): the rotation of a token at ``x`` is RoPE with angles ``sum_a x_a F[a]`` (plane
    ``k b/2 + j``, half layout) in the orthonormal basis ``Q`` (`autograd.lie.LiePlanes`; the basis
    is `canonical_basis`'s blocks in that column order), one operator each way. ``on_backward`` is
    called when the outputs' backward runs."""
    return LiePlanes.apply(w, c, dtype, on_backward)


def lie_planes_traceable(w: Tensor, c: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`lie_planes` as differentiable torch operators around `canonical_basis`, autograd's backward
    through them: the same values and gradients (the reference `lie_planes` is tested against)."""
    b = w.shape[-1]
    q, mu = canonical_basis(skew(w.reshape(-1, b, b)))  # [K, b, b], [K, b/2]
    k = q.shape[0]
    order = torch.arange(k * b, device=q.device).view(k, 2, b // 2).transpose(0, 1).reshape(-1)
    basis = torch.block_diag(*q.unbind(0))[:, order].to(dtype)
    return basis, mu[None] if c is None else c.reshape(c.shape[0], -1, 1) * mu[None]


def lie_rotate_pair(q: Tensor, k: Tensor, basis: Tensor, freq: Tensor, pos_q: Tensor,
                    pos_k: Tensor) -> tuple[Tensor, Tensor]:
    """``Q R(angles) Q^T x`` for q ``[B, H, Nq, D]`` and k ``[B, Hkv, Nk, D]`` in one operator each
    way (`autograd.lie.LieRotationPair`): ``Q`` and ``F`` from `lie_planes`, positions ``[B, N]`` or
    ``[B, N, A]`` (angles `lie_angles`); computed in ``basis.dtype``, returned in q's and k's."""
    return LieRotationPair.apply(q, k, basis, freq, pos_q, None if pos_k is pos_q else pos_k)


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
