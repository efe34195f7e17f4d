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


def fire_mlp_segments(w1: Tensor, b1: Tensor) -> tuple[Tensor, Tensor]:
    """The segments of ``f_theta``'s input line (no gradient): ``(tau, active)``, the ``W``
    breakpoints ``-b1 / w1`` sorted (``+inf`` for a unit with ``w1 = 0``, constant: active
    everywhere iff ``b1 > 0``), and ``active`` ``[W, W + 1]`` (0/1 in ``w1``'s dtype) the units on
    over segment ``s`` = ``(tau[s-1], tau[s]]``, decided at a point inside it. Static shapes (no
    host read): the traced form `fire_mlp_piecewise` takes it as the compiled rows do."""
    w1, b1 = w1.detach(), b1.detach()
    t = torch.where(w1 != 0, -b1 / torch.where(w1 != 0, w1, torch.ones_like(w1)), torch.full_like(w1, float("inf")))
    t_sorted = torch.sort(t).values
    finite = torch.where(torch.isfinite(t_sorted), t_sorted, torch.zeros_like(t_sorted))
    lo, hi = finite.min() - 1, finite.max() + 1
    edges = torch.cat((lo[None], torch.where(torch.isfinite(t_sorted), t_sorted, hi)))  # [W + 1]
    nxt = torch.cat((edges[1:], (hi + 1)[None]))
    mid = (edges + nxt) / 2  # a point inside each segment (segment s: (t_s, t_{s+1}]]
    return t_sorted, ((w1[:, None] * mid[None, :] + b1[:, None]) > 0).to(w1.dtype)  # [W], [W, W + 1]


def fire_mlp_piecewise(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """`fire_mlp_reference` as the piecewise-linear function it is: the ``W`` breakpoints ``-b1/w1`` cut the
    line into ``W + 1`` segments on each of which the set of active units is fixed, so
    ``f(x) = A[:, s] x + B[:, s]`` with ``s`` the segment of ``x`` (``A = W2 (active * w1)``,
    ``B = b2 + W2 (active * b1)``, ``[H, W + 1]``, differentiable in every weight). Per element:
    one binary search and one multiply-add per head, instead of ``W`` hidden units."""
    t_sorted, active = fire_mlp_segments(w1, b1)
    active = active.to(x.dtype)
    a = w2 @ (active * w1[:, None])  # [H, W + 1]
    b = b2[:, None] + w2 @ (active * b1[:, None])
    seg = torch.searchsorted(t_sorted.contiguous(), x.detach().contiguous())  # [B, M]: #breakpoints < x
    return a[:, seg].permute(1, 0, 2) * x[:, None, :] + b[:, seg].permute(1, 0, 2)


def fire_unit_states(x_lo: Tensor, x_hi: Tensor, w1: Tensor, b1: Tensor) -> tuple[Tensor, Tensor]:
    """Each hidden unit of ``f_theta`` over input ranges ``[x_lo, x_hi]`` (any shape ``S``):
    ``(on, straddling)``, boolean ``[*S, W]``.

    The pre-activation ``u = w1 x + b1`` is affine in ``x``, so its sign on a range is decided at
    the range's two ends: a unit with ``u <= 0`` at both is off on the whole range (``relu(u) = 0``
    and ``relu'(u) = 0``, as torch's at ``u = 0``): skipped; one with ``u > 0`` at both is on
    (``relu(u) = u``): folded into one affine term (`fire_mlp_fold`); the others straddle their kink
    ``-b1 / w1`` (or touch it at an end) and are evaluated per element.

    Args:
        x_lo: the ranges' smallest inputs.
        w1, b1: the first layer's weight and bias ``[W]``.
        x_hi: the ranges' largest inputs, the shape of ``x_lo``.
    """
    pos_lo = w1 * x_lo[..., None] + b1 > 0
    pos_hi = w1 * x_hi[..., None] + b1 > 0
    return pos_lo & pos_hi, pos_lo ^ pos_hi


def fire_mlp_fold(on: Tensor, w1: Tensor, b1: Tensor, w2: Tensor) -> Tensor:
    """The units on throughout a range as one affine term per head: ``[2H]`` for ``on`` ``[W]``, or
    ``[2H, G]`` for ``on`` ``[G, W]`` (one range per row): the slopes ``a = W2 (on * w1)`` then the
    intercepts ``b = W2 (on * b1)`` (``b2`` not included). On such a range
    ``sum_{w on} W2[h, w] relu(w1_w x + b1_w) = a_h x + b_h`` exactly.

    Args:
        on: 0/1 (in ``w2``'s dtype) per unit, per range (`fire_unit_states`).
        w1, b1: the first layer's weight and bias ``[W]``.
        w2: the second layer's weight ``[H, W]``.
    """
    return torch.cat((w2 * w1, w2 * b1)) @ (on.t() if on.dim() == 2 else on)


def fire_mlp_blocks(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, block: int) -> Tensor:
    """`fire_mlp_reference` evaluated piecewise: ``[B, H, M]`` for ``x`` ``[B, M]``, the units
    classified per block of ``block`` columns of ``x`` over its range there (all rows of the batch,
    `fire_unit_states`): per block the on units' ``a x + b`` (`fire_mlp_fold`), the straddling
    units' ``W2 relu(w1 x + b1)`` per element, the off units not at all. The same function as the
    MLP, forward and (by autograd here) backward: the formula FIRE's fast rows
    (`posenc_lightning.encodings.fire`) compute and differentiate by hand, per block of keys or of
    distances. The straddling units are written as a masked hidden tensor: this is the math, not
    a fast path.

    Args:
        x: the MLP's scalar inputs ``[B, M]`` (FIRE's ``psi(i - j) / psi(max(L, i))``).
        w1, b1: the first layer's weight and bias ``[W]``.
        w2, b2: the second layer's weight ``[H, W]`` and bias ``[H]``.
        block: columns per classification, at least 1.

    Raises:
        ValueError: ``block`` below 1.
    """
    if block < 1:
        raise ValueError(f"fire_mlp_blocks: block must be >= 1 (got {block}); pass the columns per unit selection")
    m = x.shape[1]
    h = w2.shape[0]
    groups = -(-m // block)
    pad = groups * block - m  # a ragged last block: padded with values that move neither min nor max
    xd = x.detach()
    lo = torch.nn.functional.pad(xd.amin(0), (0, pad), value=float("inf")).view(groups, block).amin(1)
    hi = torch.nn.functional.pad(xd.amax(0), (0, pad), value=float("-inf")).view(groups, block).amax(1)
    on, straddling = fire_unit_states(lo, hi, w1.detach(), b1.detach())  # [G, W]
    ab = fire_mlp_fold(on.to(w2.dtype), w1, b1, w2).repeat_interleave(block, 1)[:, :m]  # [2H, M]
    mask = straddling.to(x.dtype).repeat_interleave(block, 0)[:m].t()  # [W, M]
    hidden = torch.relu(w1[None, :, None] * x[:, None, :] + b1[None, :, None]) * mask  # [B, W, M]
    return ab[:h] * x[:, None, :] + (ab[h:] + b2[:, None]) + torch.einsum("hw,bwm->bhm", w2, hidden)
