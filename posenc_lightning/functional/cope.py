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
    g_before = gates.masked_fill(after, 0.0)
    # reverse cumulative sum: sum_{t >= j, t <= i} g_it
    p_before = g_before.flip(-1).cumsum(-1).flip(-1)
    if causal:
        return p_before.masked_fill(after, 0.0)
    g_after = gates.masked_fill(kj < qi, 0.0)
    p_after = g_after.cumsum(-1)  # sum_{i <= t <= j} g_it
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
