"""A plain name -> class table. It imports no encoding; families register themselves."""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from posenc_lightning.encodings.base import Encoding

_REGISTRY: dict[str, type] = {}
T = TypeVar("T", bound=type)


def register(name: str, family: str, description: str) -> Callable[[T], T]:
    """Class decorator that registers an `Encoding` subclass under a name.

    Args:
        name: the name users give (`PosEncCallback`, ``posenc list``, checkpoints).
        family: the stage family shown in listings (``embed``, ``rotate``, ``bias``, ``normalize``,
            ``hybrid``, ``none``).
        description: one line naming the method and its paper.

    Returns:
        The decorator; it sets ``name``, ``family`` and ``description`` on the class.

    Raises:
        ValueError: ``name`` is already registered to another class.

    Examples:
        ```python
        @register("rope", "rotate", "Rotary position embedding (Su et al., 2021)")
        class RoPE(RotaryEncoding): ...
        ```
    """

    def deco(cls: T) -> T:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"encoding name {name!r} is registered twice "
                             f"({_REGISTRY[name].__qualname__} and {cls.__qualname__})")
        cls.name = name  # type: ignore[attr-defined]
        cls.family = family  # type: ignore[attr-defined]
        cls.description = description  # type: ignore[attr-defined]
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_families() -> None:
    importlib.import_module("posenc_lightning.encodings")


def available_encodings() -> list[str]:
    """The names of every registered encoding.

    Returns:
        The names, sorted.
    """
    _load_families()
    return sorted(_REGISTRY)


def encoding_class(name: str) -> type:
    _load_families()
    key = name.lower().replace("-", "_")
    if key not in _REGISTRY:
        close = difflib.get_close_matches(key, list(_REGISTRY), n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"Unknown encoding {name!r}.{hint} Known encodings: "
                         f"{', '.join(sorted(_REGISTRY))}.")
    return _REGISTRY[key]


def build_encoding(name: str, **cfg: Any) -> Encoding:
    """Build a registered encoding by name.

    Args:
        name: a registered name (case and ``-`` / ``_`` are forgiven).
        **cfg: the encoding's ``__init__`` arguments.

    Returns:
        The encoding, not yet bound to attention sizes (`inject` binds it).

    Raises:
        ValueError: an unknown name (the message suggests close ones).
        TypeError: an argument the encoding does not take.
    """
    cls = encoding_class(name)
    sig = inspect.signature(cls.__init__)
    params = sig.parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(cfg) - set(params) - {"self"})
        if unknown:
            valid = [p for p in params if p != "self"]
            raise TypeError(f"{name}: unknown argument(s) {unknown}; it takes {valid}")
    return cls(**cfg)


def describe() -> list[tuple[str, str, str]]:
    """``(name, family, description)`` for every encoding (``posenc list``)."""
    _load_families()
    return [(n, c.family, c.description) for n, c in sorted(_REGISTRY.items())]
