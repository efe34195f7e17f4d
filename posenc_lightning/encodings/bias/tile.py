"""`TileBias`: what a parametric per-pair bias hands the Triton kernels to be evaluated tile by
tile (`KernelBias.tile`; docs/architecture.md, "The Triton kernels"), and the tile kinds' registry
(`register_tile_kind`): an example tile per kind, which `kernels/resource_report.py` compiles the
kernels with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import Tensor

__all__ = ["TileBias", "register_tile_kind", "tile_kinds"]


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


#: ``example(n_heads) -> TileBias``: a tile of a kind with placeholder parameters
Example = Callable[[int], TileBias]
E = TypeVar("E", bound=Example)
_TILE_KINDS: dict[str, Example] = {}


def register_tile_kind(name: str) -> Callable[[E], E]:
    """Decorator of a tile kind's example function, in the kind's own file: ``example(n_heads)``
    gives a tile named ``name`` (`TileBias.name`) with placeholder parameters, with which
    `posenc_lightning.kernels.resource_report` compiles every attention kernel once more
    (``<kernel>_<name>``). The function imports triton only when called.

    Args:
        name: the tiles' `TileBias.name`.

    Returns:
        The decorator (it returns the function unchanged).

    Raises:
        ValueError: ``name`` is registered to another function.
    """

    def deco(example: E) -> E:
        old = _TILE_KINDS.get(name)
        if old is not None and old.__qualname__ != example.__qualname__:
            raise ValueError(f"tile bias kind {name!r} is registered twice ({old.__qualname__} and "
                             f"{example.__qualname__})")
        _TILE_KINDS[name] = example
        return example

    return deco


def tile_kinds() -> dict[str, Example]:
    """The registered tile kinds' example functions by name (`register_tile_kind`). Importing any
    module of ``posenc_lightning.encodings`` imports the package first, which imports every family
    module: their registrations have run.

    Returns:
        ``{name: example}``, in registration order.
    """
    return dict(_TILE_KINDS)
