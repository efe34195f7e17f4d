"""The kinds an opaque operator can rebuild from their operands (`Bias.opaque_operands`), by name:
the operator in `posenc_lightning.attention.backends` takes tensors and constants only and never
imports a kind's class."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from torch import Tensor

from posenc_lightning.encodings.bias.kinds import Bias

__all__ = ["rebuild_bias", "register_opaque_kind"]

_KINDS: dict[str, type[Bias]] = {}
B = TypeVar("B", bound=type[Bias])


def register_opaque_kind(name: str) -> Callable[[B], B]:
    """Class decorator: ``name`` rebuilds the kind (`Bias.from_operands`); sets `Bias.opaque_kind`.

    Args:
        name: the kind's name in `OpaqueOperands.kind`.

    Returns:
        The decorator.

    Raises:
        ValueError: ``name`` is registered to another class.
    """

    def deco(cls: B) -> B:
        old = _KINDS.get(name)
        if old is not None and old.__qualname__ != cls.__qualname__:
            raise ValueError(f"opaque bias kind {name!r} is registered twice ({old.__qualname__} and "
                             f"{cls.__qualname__})")
        _KINDS[name] = cls
        cls.opaque_kind = name
        return cls

    return deco


def rebuild_bias(kind: str, tensors: Sequence[Tensor], ints: Sequence[int], floats: Sequence[float]) -> Bias:
    """The bias of kind ``kind`` from its operands (`Bias.from_operands`).

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
    return _KINDS[kind].from_operands(tensors, ints, floats)
