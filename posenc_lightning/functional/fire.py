"""FIRE (Li et al., 2024, "Functional Interpolation for Relative Positions Improves Long Context
Transformers"), eq. 3: ``b(i, j) = f_theta( psi(i - j) / psi(max(L, i)) )`` with
``psi(x) = log(c * x + 1)``.

Dividing by ``psi(max(L, i))`` ("progressive interpolation") maps every causal distance into
``[0, 1]`` at any length, so the MLP ``f_theta`` only ever sees inputs from the training range.
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
