"""ALiBi slopes (Press et al., 2022, "Train Short, Test Long", section 3).

For n heads, n a power of two, the slopes are the geometric sequence starting at
``2^(-8/n)`` with ratio ``2^(-8/n)``. For other n, the paper's code takes the slopes of the
closest power of two below n and fills up with every other slope of twice that power.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["alibi_slopes"]


def _power_of_two_slopes(n: int) -> list[float]:
    start = 2 ** (-(2 ** -(math.log2(n) - 3)))  # = 2^(-8/n)
    return [start * start ** i for i in range(n)]


def alibi_slopes(n_heads: int) -> Tensor:
    """The per-head slopes ``m_h`` (float32 ``[n_heads]``), as in the paper's reference code."""
    if n_heads < 1:
        raise ValueError(f"alibi needs at least one head, got n_heads={n_heads}")
    if math.log2(n_heads).is_integer():
        slopes = _power_of_two_slopes(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = _power_of_two_slopes(closest)
        slopes += _power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)
