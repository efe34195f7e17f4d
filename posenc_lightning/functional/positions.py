"""Recognizing the common case of positions, ``a + arange(N)`` in every row, without a host read
where one would cost a device sync or break a traced graph."""

from __future__ import annotations

import torch
from torch import Tensor

from posenc_lightning.functional.mode import Mode


def host_reads_ok(t: Tensor) -> bool:
    """Reading ``t``'s values on the host is free: a CPU tensor outside a traced (compiled)
    region. Elsewhere a read is a device sync (GPU) or a graph break (``torch.compile``), so code
    that would look at values to pick a faster path takes the general one instead."""
    return Mode.of(t).host_reads


def arange_offset(pos: Tensor, known: int | None = None) -> int | None:
    """``a`` if every row of ``pos`` (``[B, N]`` integers) is ``a + arange(N)``, else None.

    ``known``: the caller knows it statically (positions it made itself); returned as is. Otherwise
    the values are checked only where `host_reads_ok` (None elsewhere: "not known").
    Then a table lookup ``T[pos]`` is the zero-copy slice ``T[a:a + N]``.
    """
    if known is not None:
        return known
    if pos.dim() != 2 or pos.dtype.is_floating_point or pos.dtype == torch.bool or not pos.numel():
        return None
    if not host_reads_ok(pos):
        return None
    a = pos[:1, :1]
    ok = torch.equal(pos, (a + torch.arange(pos.shape[1], device=pos.device)).expand_as(pos))
    return int(a.item()) if ok else None


def max_position(pos: Tensor, start: int | None = None) -> int | None:
    """The largest position + 1 (a table size, a context length): ``start + N`` when the positions
    are known to be ``start + arange(N)``, read from the values where `host_reads_ok`, else None."""
    if start is not None:
        return start + pos.shape[-1]
    if not pos.numel():
        return 0
    if not host_reads_ok(pos):
        return None
    return int(pos.max()) + 1
