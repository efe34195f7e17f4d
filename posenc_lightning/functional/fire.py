"""FIRE (Li et al., 2024, "Functional Interpolation for Relative Positions Improves Long Context
Transformers"), eq. 3: ``b(i, j) = f_theta( psi(i - j) / psi(max(L, i)) )`` with
``psi(x) = log(c * x + 1)``.

Dividing by ``psi(max(L, i))`` ("progressive interpolation") maps every causal distance into
``[0, 1]`` at any length, so the MLP ``f_theta`` only ever sees inputs from the training range.

The formulas only; the autograd Functions that compute them without their ``N x N``
intermediates are FIRE's own (`posenc_lightning.encodings.fire.functions`, `by_distance`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def fire_psi(x: Tensor, c: Tensor | float) -> Tensor:
    """``psi(x) = log(|c * x| + 1)`` (FIRE eq. 3; the absolute value as in the paper's code)."""
    return torch.log1p((c * x).abs())


def fire_normalized_distance(q_pos: Tensor, k_pos: Tensor, c: Tensor | float, threshold: Tensor | float,
                             eps: float = 1e-6) -> Tensor:
    """The MLP input ``psi(i - j) / psi(max(L, i))``: ``[B, Nq, Nk]`` from ``[B, Nq]``, ``[B, Nk]``.

    For causal pairs (``0 <= j <= i``) it lies in ``[0, 1]`` whatever the length.
    """
    qp = q_pos.to(torch.float32)
    kp = k_pos.to(torch.float32)
    rel = qp[:, :, None] - kp[:, None, :]
    thr = torch.as_tensor(threshold, dtype=torch.float32, device=qp.device).abs()
    norm = torch.maximum(qp, thr)[:, :, None]
    return fire_psi(rel, c) / (fire_psi(norm, c) + eps)


def fire_mlp_reference(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """The MLP ``f_theta(x) = W2 relu(w1 x + b1) + b2`` for scalar inputs ``x`` ``[B, M]``, as written
    (its ``[B, W, M]`` hidden tensor): ``[B, H, M]``."""
    hidden = torch.relu(w1[None, :, None] * x[:, None, :] + b1[None, :, None])  # [B, W, M]
    return torch.einsum("hw,bwm->bhm", w2, hidden) + b2[None, :, None]


def fire_mlp_piecewise(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """`fire_mlp_reference` as the piecewise-linear function it is: the ``W`` breakpoints ``-b1/w1`` cut the
    line into ``W + 1`` segments on each of which the set of active units is fixed, so
    ``f(x) = A[:, s] x + B[:, s]`` with ``s`` the segment of ``x`` (``A = W2 (active * w1)``,
    ``B = b2 + W2 (active * b1)``, ``[H, W + 1]``, differentiable in every weight). Per element:
    one binary search and one multiply-add per head, instead of ``W`` hidden units."""
    # a unit with w1 = 0 is constant: no breakpoint (+inf), active everywhere iff b1 > 0
    t = torch.where(w1 != 0, -b1 / torch.where(w1 != 0, w1, torch.ones_like(w1)), torch.full_like(w1, float("inf")))
    t_sorted = torch.sort(t.detach()).values
    finite = torch.where(torch.isfinite(t_sorted), t_sorted, torch.zeros_like(t_sorted))
    lo, hi = finite.min() - 1, finite.max() + 1
    edges = torch.cat((lo[None], torch.where(torch.isfinite(t_sorted), t_sorted, hi)))  # [W + 1]
    nxt = torch.cat((edges[1:], (hi + 1)[None]))
    mid = (edges + nxt) / 2  # a point inside each segment (segment s: (t_s, t_{s+1}]]
    active = ((w1.detach()[:, None] * mid[None, :] + b1.detach()[:, None]) > 0).to(x.dtype)  # [W, W + 1]
    a = w2 @ (active * w1[:, None])  # [H, W + 1]
    b = b2[:, None] + w2 @ (active * b1[:, None])
    seg = torch.searchsorted(t_sorted.contiguous(), x.detach().contiguous())  # [B, M]: #breakpoints < x
    return a[:, seg].permute(1, 0, 2) * x[:, None, :] + b[:, seg].permute(1, 0, 2)
