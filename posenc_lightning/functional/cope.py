"""CoPE (Golovneva et al., 2024, "Contextual Position Encoding: Learning to Count What's
Important"), eqs. 3-5.

gates ``g_ij = sigmoid(q_i . k_j)``; positions ``p_ij = sum_{t=j..i} g_it``; the position term
``z_i[p_ij]`` linearly interpolated between the integer positions ``floor(p)`` and ``ceil(p)`` of
``z_i[p] = q_i . e[p]`` (the paper's optimized form: interpolate scalars, not vectors).
"""

from __future__ import annotations

import torch
from torch import Tensor


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


def cope_lookup(z: Tensor, positions: Tensor, max_position: int | None = None) -> Tensor:
    """``cope_interpolate(z, positions.clamp(max=max_position - 1))`` (positions ``>= 0``;
    ``max_position`` at most ``P``, default ``P``), forward and
    backward, in fewer passes: one gather of ``(z[p], z[p + 1] - z[p])`` pairs at ``floor(p)``, and
    only ``positions`` and ``z`` kept for backward (not the indices, weights and clamp input)."""
    top = z.shape[-1] - 1 if max_position is None else int(max_position) - 1
    if not 0 <= top < z.shape[-1]:
        raise ValueError(f"cope_lookup: max_position must be in [1, {z.shape[-1]}], got {max_position}")
    return _CoPELookup.apply(z, positions, top)


class _CoPELookup(torch.autograd.Function):
    @staticmethod
    def forward(z: Tensor, positions: Tensor, top: int) -> Tensor:  # type: ignore[override]
        p = positions.clamp(max=top)
        lo = p.long()  # floor: p >= 0
        w = p.frac_()
        dz = torch.diff(z, dim=-1, append=z[..., -1:])  # z[m + 1] - z[m]; 0 at the top
        pairs = torch.complex(z.contiguous(), dz) if z.dtype in (torch.float32, torch.float64) else None
        if pairs is not None:
            g = pairs.gather(-1, lo)
            out = torch.addcmul(g.real, g.imag, w)
        else:
            out = torch.addcmul(z.gather(-1, lo), dz.gather(-1, lo), w)
        return out

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Tensor) -> None:  # functorch-compatible (vjp)
        z, positions, top = inputs
        ctx.save_for_backward(z, positions)
        ctx.top = top

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        z, positions = ctx.saved_tensors
        top = ctx.top
        p = positions.clamp(max=top)
        lo = p.long()
        w = p.frac_()
        gz = gp = None
        if ctx.needs_input_grad[0]:
            gw = grad * w
            gz = torch.zeros_like(z).scatter_add_(-1, lo, grad - gw)
            gz.scatter_add_(-1, (lo + 1).clamp_(max=top), gw)  # hi = ceil(p): weight w (0 if p is whole)
        if ctx.needs_input_grad[1]:
            dz = torch.diff(z, dim=-1, append=z[..., -1:])
            # d/dp (z[ceil p] - z[floor p]) weight: 0 where p is whole (ceil = floor) or clamped
            gp = grad * dz.gather(-1, lo)
            gp.masked_fill_((w == 0) | (positions > top), 0.0)
        return gz, gp, None
