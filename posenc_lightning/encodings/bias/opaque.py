"""The kinds an opaque operator can rebuild from their operands (`ValueDependentForm.operands`), by
name: the operator in `posenc_lightning.attention.backends` takes tensors and constants only and never
imports a kind's class."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from torch import Tensor

from posenc_lightning.encodings.bias.kinds import Bias

__all__ = ["Rebuild", "rebuild_bias", "register_opaque_kind"]

#: ``(tensors, ints, floats) -> Bias``: a bias again from its `OpaqueOperands` (inside the operator,
#: or from stand-ins for its tensors to differentiate `ValueDependentForm.distance_table`)
Rebuild = Callable[[Sequence[Tensor], Sequence[int], Sequence[float]], Bias]
R = TypeVar("R", bound=Rebuild)
_KINDS: dict[str, Rebuild] = {}


def register_opaque_kind(name: str) -> Callable[[R], R]:
    """Decorator of a kind's rebuild function (`Rebuild`), in the kind's own file: ``name`` (its
    operands' `OpaqueOperands.kind`) rebuilds the bias with it (`rebuild_bias`).

    Args:
        name: the kind's name in `OpaqueOperands.kind`.

    Returns:
        The decorator (it returns the function unchanged).

    Raises:
        ValueError: ``name`` is registered to another function.
    """

    def deco(rebuild: R) -> R:
        old = _KINDS.get(name)
        if old is not None and old.__qualname__ != rebuild.__qualname__:
            raise ValueError(f"opaque bias kind {name!r} is registered twice ({old.__qualname__} and "
                             f"{rebuild.__qualname__})")
        _KINDS[name] = rebuild
        return rebuild

    return deco


def rebuild_bias(kind: str, tensors: Sequence[Tensor], ints: Sequence[int], floats: Sequence[float]) -> Bias:
    """The bias of kind ``kind`` from its operands (its registered `Rebuild`).

    Args:
        kind: a registered name.
        tensors: `OpaqueOperands.tensors`, or stand-ins for them.
        ints: `OpaqueOperands.ints`.
        floats: `OpaqueOperands.floats`.

    Returns:
        The bias.

    Raises:
        KeyError: no kind is registered under ``kind``.
    """
    if kind not in _KINDS:
        raise KeyError(f"no opaque bias kind {kind!r}; registered: {sorted(_KINDS)}")
    return _KINDS[kind](tensors, ints, floats)
