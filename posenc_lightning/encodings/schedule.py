"""Per-layer schedules: which encoding, and which attention window, each layer gets.

A schedule is data: a list of rules, each naming some layers and what they get (an encoding spec and
an optional sliding ``window`` or ``chunk``). `LayerSchedule.resolve` turns it into one `LayerSpec`
per layer for a model of ``n_layers`` layers; `posenc_lightning.inject` hands each attention module
its layer's encoding (its own instance) and window. Layers are named by:

* an index (``3``, ``-1`` for the last) or a list of indices (``[0, 5]``);
* a range ``"a:b"`` (Python's slice: layers ``a .. b-1``; either end may be left out or negative);
* ``"every k"``: the k-th, 2k-th, ... layer (indices ``k-1, 2k-1, ...``), the convention of Llama 4's
  ``no_rope_layers``, SmolLM3's ``no_rope_layer_interval`` and Gemma 3's ``sliding_window_pattern``;
* ``"last n"``: the last n layers;
* ``"type:NAME"``: the layers whose type in the model's own ``layer_types`` is NAME
  (transformers' ``config.layer_types``: ``"sliding_attention"``, ``"full_attention"``, ...);
* ``"rest"``: every layer no other rule names.

Rules must not overlap and must cover every layer (``"rest"`` covers what is left); a violation
raises a ``ValueError`` naming the layers and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LayerRule", "LayerSchedule", "LayerSpec"]

Selector = int | str | Sequence[int]


@dataclass(frozen=True)
class LayerSpec:
    """What one layer gets: an encoding (a registered name and its arguments) and its window.

    Args:
        encoding: a registered encoding name (``posenc list``).
        config: the encoding's ``__init__`` arguments.
        window: a sliding window W: key j is visible to query i iff ``0 <= i - j < W``; None: global.
        chunk: a chunk C: key j is visible to query i iff ``i // C == j // C`` and ``j <= i``; None: global.
    """

    encoding: str
    config: dict[str, Any] = field(default_factory=dict)
    window: int | None = None
    chunk: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.encoding, str) or not self.encoding:
            raise TypeError(f"LayerSpec.encoding must be a registered encoding name, got {self.encoding!r}")
        for name in ("window", "chunk"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"LayerSpec.{name} must be a positive int (tokens) or None, got {v!r}")

    def key(self) -> tuple[str, str]:
        """The encoding part as a hashable key: layers with equal keys may share one instance.

        Returns:
            ``(encoding, repr of the sorted config)``.
        """
        return self.encoding, repr(sorted(self.config.items()))


@dataclass(frozen=True)
class LayerRule:
    """One rule of a schedule: the layers it names (``layers``, see the module docstring) and the
    `LayerSpec` they get."""

    layers: Selector
    spec: LayerSpec

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layers": list(self.layers) if isinstance(self.layers, (list, tuple)) else self.layers,
                               "encoding": self.spec.encoding}
        if self.spec.config:
            out["config"] = dict(self.spec.config)
        for name in ("window", "chunk"):
            if getattr(self.spec, name) is not None:
                out[name] = getattr(self.spec, name)
        return out


_EVERY = re.compile(r"^every\s+(\d+)$")
_LAST = re.compile(r"^last\s+(\d+)$")
_RANGE = re.compile(r"^(-?\d*)\s*:\s*(-?\d*)$")


def _select(sel: Selector, n_layers: int, layer_types: Sequence[str] | None, where: str) -> list[int]:
    """The layer indices ``sel`` names in a model of ``n_layers`` layers (``"rest"`` excluded)."""
    if isinstance(sel, bool):
        raise TypeError(f"{where}: layers={sel!r} is not a layer selector")
    if isinstance(sel, int):
        sel = [sel]
    if isinstance(sel, (list, tuple)):
        out = []
        for i in sel:
            if isinstance(i, bool) or not isinstance(i, int):
                raise TypeError(f"{where}: layer indices must be ints, got {i!r}")
            if not -n_layers <= i < n_layers:
                raise ValueError(f"{where}: layer {i} is out of range for a model of {n_layers} layers "
                                 f"(indices 0..{n_layers - 1}, or -1..-{n_layers} from the end)")
            out.append(i % n_layers)
        return out
    if not isinstance(sel, str):
        raise TypeError(f"{where}: layers={sel!r}: give an index, a list of indices, 'a:b', 'every k', "
                        f"'last n', 'type:NAME' or 'rest'")
    s = sel.strip()
    if m := _EVERY.match(s):
        k = int(m.group(1))
        if k < 1:
            raise ValueError(f"{where}: 'every {k}' needs k >= 1")
        return [i for i in range(n_layers) if (i + 1) % k == 0]
    if m := _LAST.match(s):
        n = int(m.group(1))
        if n > n_layers:
            raise ValueError(f"{where}: 'last {n}' asks for more layers than the model's {n_layers}")
        return list(range(n_layers - n, n_layers))
    if m := _RANGE.match(s):
        a, b = (int(x) if x not in ("", "-") else None for x in m.groups())
        for end in (a, b):
            if end is not None and not -n_layers <= end <= n_layers:
                raise ValueError(f"{where}: range {s!r} is out of range for a model of {n_layers} layers")
        out = list(range(n_layers))[slice(a, b)]
        if not out:
            raise ValueError(f"{where}: range {s!r} names no layer of a model of {n_layers} layers")
        return out
    if s.startswith("type:"):
        want = s[len("type:"):].strip()
        if layer_types is None:
            raise ValueError(f"{where}: layers={s!r} needs the model's layer_types; pass "
                             f"resolve(n_layers, layer_types=[...]) or name the layers by index")
        if len(layer_types) != n_layers:
            raise ValueError(f"{where}: layer_types has {len(layer_types)} entries for {n_layers} layers")
        out = [i for i, t in enumerate(layer_types) if t == want]
        if not out:
            raise ValueError(f"{where}: no layer has type {want!r}; the model's types are {sorted(set(layer_types))}")
        return out
    raise ValueError(f"{where}: cannot read layers={sel!r}: give an index, a list of indices, 'a:b', "
                     f"'every k', 'last n', 'type:NAME' or 'rest'")


class LayerSchedule:
    """A per-layer schedule of encodings and attention windows.

    Args:
        rules: the rules, each a `LayerRule` or a dict ``{"layers": ..., "encoding": name,
            "config": {...}, "window": W, "chunk": C}`` (the YAML form).
        name: what the schedule is called in checkpoints and logs (a preset's name; default
            ``"schedule"``).

    Examples:
        >>> s = LayerSchedule([{"layers": "every 4", "encoding": "nope"},
        ...                    {"layers": "rest", "encoding": "rope", "window": 128}])
        >>> [(l.encoding, l.window) for l in s.resolve(4)]
        [('rope', 128), ('rope', 128), ('rope', 128), ('nope', None)]
    """

    def __init__(self, rules: Sequence[LayerRule | dict[str, Any]], name: str = "schedule") -> None:
        if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence) or not rules:
            raise ValueError(f"LayerSchedule needs a non-empty list of rules, got {rules!r}")
        self.rules: list[LayerRule] = [r if isinstance(r, LayerRule) else self._rule(r, i) for i, r in enumerate(rules)]
        self.name = name
        if sum(r.layers == "rest" for r in self.rules) > 1:
            raise ValueError("LayerSchedule: more than one rule names layers='rest'; keep one")

    @staticmethod
    def _rule(d: dict[str, Any], i: int) -> LayerRule:
        if not isinstance(d, dict):
            raise TypeError(f"LayerSchedule rule {i}: expected a dict or LayerRule, got {type(d).__name__}")
        unknown = sorted(set(d) - {"layers", "encoding", "config", "window", "chunk"})
        if unknown or "layers" not in d or "encoding" not in d:
            raise ValueError(f"LayerSchedule rule {i} ({d!r}): needs 'layers' and 'encoding', may have "
                             f"'config', 'window', 'chunk'" + (f"; unknown keys {unknown}" if unknown else ""))
        layers = d["layers"]
        return LayerRule(tuple(layers) if isinstance(layers, list) else layers,
                         LayerSpec(d["encoding"], dict(d.get("config") or {}), d.get("window"), d.get("chunk")))

    @classmethod
    def uniform(cls, encoding: str, name: str | None = None, window: int | None = None, chunk: int | None = None,
                **config: Any) -> LayerSchedule:
        """One encoding (and window) in every layer.

        Args:
            encoding: a registered encoding name; name: the schedule's name (default: ``encoding``).
            window, chunk: every layer's window or chunk; **config: the encoding's arguments.

        Returns:
            The schedule.
        """
        return cls([LayerRule("rest", LayerSpec(encoding, config, window, chunk))], name or encoding)

    def resolve(self, n_layers: int, layer_types: Sequence[str] | None = None) -> list[LayerSpec]:
        """One `LayerSpec` per layer.

        Args:
            n_layers: the model's attention layers, in order.
            layer_types: the model's own type of each layer (for ``"type:NAME"`` rules), or None.

        Returns:
            ``n_layers`` specs, layer 0 first.

        Raises:
            ValueError: a rule names a layer out of range, two rules name the same layer, or a layer
                is named by no rule and there is no ``"rest"`` rule.
        """
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
            raise ValueError(f"LayerSchedule.resolve: n_layers must be a positive int, got {n_layers!r}")
        owner: dict[int, int] = {}
        for r, rule in enumerate(self.rules):
            if rule.layers == "rest":
                continue
            for i in _select(rule.layers, n_layers, layer_types, f"LayerSchedule rule {r}"):
                if i in owner:
                    raise ValueError(f"LayerSchedule: layer {i} is named by rule {owner[i]} "
                                     f"({self.rules[owner[i]].layers!r}) and rule {r} ({rule.layers!r}); "
                                     f"each layer must be named once: narrow one of the rules")
                owner[i] = r
        rest = next((r for r, rule in enumerate(self.rules) if rule.layers == "rest"), None)
        missing = [i for i in range(n_layers) if i not in owner]
        if missing and rest is None:
            raise ValueError(f"LayerSchedule: layers {missing} of {n_layers} are named by no rule; add a rule "
                             f"for them, or one with layers='rest'")
        return [self.rules[owner.get(i, rest)].spec for i in range(n_layers)]

    def to_dict(self) -> dict[str, Any]:
        """The YAML / checkpoint form (`from_dict` reads it back).

        Returns:
            ``{"name": ..., "rules": [rule dicts]}``.
        """
        return {"name": self.name, "rules": [r.to_dict() for r in self.rules]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerSchedule:
        """The schedule of a `to_dict` form (or of a plain list of rule dicts).

        Args:
            d: ``{"name": ..., "rules": [...]}`` or a list of rule dicts.

        Returns:
            The schedule.
        """
        if isinstance(d, list):
            return cls(d)
        return cls(d["rules"], d.get("name", "schedule"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LayerSchedule) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(repr(self.to_dict()))

    def __repr__(self) -> str:
        return f"LayerSchedule({[r.to_dict() for r in self.rules]!r}, name={self.name!r})"
