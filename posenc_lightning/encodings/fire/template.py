"""Where FIRE is a function of ``i - j`` alone: while every query position is below the learned
threshold ``L``, ``psi(max(L, i)) = psi(L)`` (FIRE eq. 3), so the bias is
``f_theta(psi(i - j) / (psi(L) + eps))``, one MLP call per distance instead of per pair.

`below_threshold` decides it, `distance_table` evaluates it: the eager `FIRE` returns it as a
`RelativeBias` table, `FireBias.distance_table` gives it to the compiled graph's opaque operator
(the Toeplitz template, `Bias.distance_shift`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc_lightning.functional.fire import fire_psi


def below_threshold(top_query: float, threshold: Tensor) -> bool:
    """Every query is below ``L`` (the largest query position ``top_query``): the bias is then
    ``f(i - j)``. Reads ``threshold`` on the host.

    Args:
        top_query: the largest query position.
        threshold: ``L`` (its absolute value is taken).

    Returns:
        Whether ``top_query < L``.
    """
    return top_query < float(threshold.detach().abs())


def distance_table(distances: Tensor, c: Tensor, threshold: Tensor, eps: float, w1: Tensor, b1: Tensor,
                   w2: Tensor, b2: Tensor) -> Tensor:
    """FIRE below ``L`` at query-key distances ``i - j``: ``f_theta(psi(i - j) / (psi(L) + eps))``.

    Args:
        distances: ``i - j`` ``[T]`` (any dtype; computed in float32, or float64 for float64 ``c``).
        c: ``psi``'s ``c`` ``[1]``.
        threshold: ``L`` ``[1]`` (its absolute value is taken).
        eps: added to the normalizer.
        w1: ``Linear(1, W).weight`` ``[W, 1]``.
        b1: ``[W]``.
        w2: ``[H, W]``.
        b2: ``[H]``.

    Returns:
        ``[H, T]`` float32, differentiable in every parameter.
    """
    dt = torch.promote_types(c.dtype, torch.float32)  # the log-ratio in float32 (or 64)
    cd = c.to(dt)
    x = fire_psi(distances.to(dt), cd) / (fire_psi(threshold.abs().to(dt), cd) + eps)
    return F.linear(F.relu(F.linear(x[:, None].to(w1.dtype), w1, b1)), w2, b2).float().t()
