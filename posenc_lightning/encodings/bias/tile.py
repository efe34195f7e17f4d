"""`TileBias`: what a parametric per-pair bias hands the Triton kernels to be evaluated tile by
tile (`KernelBias.tile`; docs/architecture.md, "The Triton kernels")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = ["TileBias"]


@dataclass(frozen=True, eq=False)
class TileBias:
    """A parametric per-pair bias the Triton kernels evaluate tile by tile from the positions, with
    the gradient of its parameters reduced per program (`KernelBias.tile`): the kernels call
    ``value`` and ``grads``, two ``@triton.jit`` functions they receive as compile-time constants,
    and know nothing else about the bias (docs/architecture.md, "The Triton kernels").

    ``value(h, qp, kp, P, W, H, eps, BM, BN, ACC)`` returns the bias ``[BM, BN]`` of head ``h``
    at query / key positions ``qp [BM]``, ``kp [BN]`` (float, ``ACC``) from the packed
    parameters ``P``; ``grads(ds, h, qp, kp, ok, P, W, H, eps, GB, ACC)`` returns this tile's
    packed parameter gradient ``[GB]`` from ``ds = dL/dbias [BM, BN]`` (``ok``: the visible
    pairs). The kernels sum the ``[GB]`` rows per head and ``unpack`` turns ``[H, GB]`` into the
    gradient of ``params``.

    Attributes:
        name: what the bias is called in the compile report (``<kernel>_<name>`` rows).
        params: the packed parameters ``[P]`` (differentiable: their gradient is ``unpack``'s).
        heads: the number of heads ``params`` hold.
        width: the tile's static int (a runtime loop bound, e.g. a hidden width).
        eps: the tile's static float.
        grad_block: ``GB``, the length of a packed gradient row (a power of two).
        value: the ``@triton.jit`` bias of a tile.
        grads: the ``@triton.jit`` parameter gradient of a tile.
        unpack: ``[H, GB]`` per-head gradient rows -> the gradient of ``params``.
    """

    name: str
    params: Tensor
    heads: int
    width: int
    eps: float
    grad_block: int
    value: Any
    grads: Any
    unpack: Callable[[Tensor], Tensor]
