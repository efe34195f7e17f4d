"""Stick-breaking attention (Tan et al., 2024, "Scaling Stick-Breaking Attention: An Efficient
Implementation and In-depth Study", eqs. 1-3), in log space.

For query ``i`` the visible keys are broken off in order, nearest first:
``A_ij = beta_ij prod_{j<k<i} (1 - beta_ik)``, ``beta = sigmoid(z)``, so that
``log A_ij = z_ij - sum_{k=j}^{i-1} softplus(z_ik)`` (``log sigmoid(z) = z - softplus(z)``,
``log(1 - sigmoid(z)) = -softplus(z)``). The weights of a query sum to at most 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

#: above it softplus(x) == x (the seed's stabilized softplus)
SOFTPLUS_THRESHOLD = 15.0


def stable_softplus(x: Tensor) -> Tensor:
    """``log(1 + exp(x))`` for ``x <= 15`` and ``x`` above (no overflow)."""
    return F.softplus(x, beta=1.0, threshold=SOFTPLUS_THRESHOLD)


def stick_breaking_mask(nq: int, nk: int, q_offset: int = 0, attend_current: bool = False,
                        device: torch.device | None = None) -> Tensor:
    """bool ``[Nq, Nk]``: key ``j`` is before query ``i`` (at index ``i + q_offset``); the
    diagonal only when ``attend_current``."""
    qi = torch.arange(nq, device=device)[:, None] + q_offset
    kj = torch.arange(nk, device=device)[None, :]
    return kj <= qi if attend_current else kj < qi


def stick_breaking_weights(logits: Tensor, mask: Tensor) -> Tensor:
    """Stick-breaking weights ``[..., Nq, Nk]`` from logits and a bool mask (True = visible).

    The mask must already exclude keys after the query (and the query itself unless it may
    attend to itself); keys are ordered by index and broken off from the last visible one.
    Computed as ``exp(log beta_ij - sum_{k > j, visible} softplus(z_ik))`` in float32, the sum an
    exclusive reverse cumulative sum (so a key's own term never cancels against itself).
    """
    z = logits.float()
    zero = torch.zeros((), device=z.device)
    sp = torch.where(mask, stable_softplus(z), zero)  # -log(1 - beta)
    tail = sp.flip(-1).cumsum(-1).flip(-1)  # sum over visible k >= j
    excl = torch.cat((tail[..., 1:], torch.zeros_like(tail[..., :1])), dim=-1)  # k > j
    log_beta = z - sp  # log sigmoid(z) with the seed's stabilized softplus
    log_a = torch.where(mask, log_beta - excl, torch.full((), -torch.inf, device=z.device))
    return log_a.exp()
