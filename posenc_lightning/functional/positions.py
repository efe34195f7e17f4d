"""Recognizing the common case of positions: ``a + arange(N)`` in every row."""

from __future__ import annotations

import torch
from torch import Tensor


def arange_offset(pos: Tensor) -> int | None:
    """``a`` if every row of ``pos`` (``[B, N]`` integers) is ``a + arange(N)``, else None.

    Then a table lookup ``T[pos]`` is the zero-copy slice ``T[a:a + N]`` (one host sync to know).
    """
    if pos.dim() != 2 or pos.dtype.is_floating_point or pos.dtype == torch.bool or not pos.numel():
        return None
    a = pos[:1, :1]
    ok = torch.equal(pos, (a + torch.arange(pos.shape[1], device=pos.device)).expand_as(pos))
    return int(a.item()) if ok else None
