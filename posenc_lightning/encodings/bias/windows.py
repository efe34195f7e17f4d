"""Windows of tensors and of positions, shared by the bias kinds: `span` / `cut` name the part of an
input a block of rows reads, `pair_distance` and `same_positions` compare query and key positions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from posenc_lightning.functional.positions import host_reads_ok

__all__ = ["Index", "cut", "pair_distance", "same_positions", "span"]

#: a part of a tensor (``t[index]``); None = the whole tensor
Index = Any


def span(start: int, stop: int, dim: int = -1) -> Index:
    """The index of ``[start, stop)`` along ``dim`` (negative: counted from the end), e.g.
    ``span(s, e, -2)`` = the query rows ``s:e`` of ``q [B, H, N, D]``."""
    return (Ellipsis, slice(start, stop)) + (slice(None),) * (-dim - 1)


def cut(tensors: Sequence[Tensor], windows: Sequence[Index]) -> list[Tensor]:
    """``[t[w] for t, w in ...]``, None windows taking the whole tensor."""
    return [t if w is None else t[w] for t, w in zip(tensors, windows)]


def pair_distance(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``i - j`` for every (query, key) pair: ``[B, Nq, Nk]`` from ``[B, Nq]`` and ``[B, Nk]``."""
    return q_pos[:, :, None] - k_pos[:, None, :]


def same_positions(a: Tensor, b: Tensor) -> bool:
    """The same positions: the same tensor, or equal values where reading them is free."""
    return a is b or (a.shape == b.shape and host_reads_ok(a) and bool(torch.equal(a, b)))
