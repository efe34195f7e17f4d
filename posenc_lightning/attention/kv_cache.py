"""A key/value cache for incremental decoding.

Static encodings cache *rotated* keys. Dynamic encodings (``Encoding.dynamic``: dynamic_ntk,
long_rope's switching factor sets, clex) cache keys *before* rotation and the mixin rotates all
of them at attend time, so growing past a switch point never leaves keys rotated with stale
frequencies. Encodings with per-token state (FoX's cumulative gates) keep it in ``extra``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class LayerKVCache:
    """One attention layer's cache: keys/values ``[B, Hkv, L, D]`` and their positions ``[B, L]``."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.positions: Tensor | None = None
        self.segments: Tensor | None = None
        self.rotated: bool | None = None
        self.extra: dict[str, Any] = {}
        #: the cached positions are ``start + arange(length)`` in every row, known without reading
        #: them (every update said so), else None
        self.start: int | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def update(self, k: Tensor, v: Tensor, positions: Tensor, rotated: bool,
               segments: Tensor | None = None, start: int | None = None
               ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Append one step's keys and values (the mixin calls this inside ``attend``).

        Args:
            k: new keys ``[B, Hkv, N, D]``, rotated or not as ``rotated`` says.
            v: new values ``[B, Hkv, N, D]``.
            positions: their positions ``[B, N]``.
            rotated: whether ``k`` is already rotated (False for dynamic encodings).
            segments: packed-document ids ``[B, N]``, or None.
            start: the new positions are known to be ``start + arange(N)`` in every row; None: not known.

        Returns:
            Everything cached so far: ``(keys, values, positions, segments)``.

        Raises:
            RuntimeError: the cache was filled by an encoding that caches keys the other way.
        """
        if self.rotated is not None and self.rotated != rotated:
            raise RuntimeError("the KV cache was filled by a different encoding; call reset() "
                               "after injecting a new encoding")
        self.rotated = rotated
        if self.k is None:
            self.start = start
            self.k, self.v, self.positions, self.segments = k, v, positions, segments
        else:
            if self.start is None or start != self.start + self.length:
                self.start = None
            self.k = torch.cat((self.k, k), dim=-2)
            self.v = torch.cat((self.v, v), dim=-2)
            self.positions = torch.cat((self.positions, positions), dim=1)
            if segments is not None and self.segments is not None:
                self.segments = torch.cat((self.segments, segments), dim=1)
        return self.k, self.v, self.positions, self.segments

    def reset(self) -> None:
        """Empty the cache (after injecting another encoding, or for a new sequence)."""
        self.__init__()


class KVCache:
    """The cache of a whole model: one `LayerKVCache` per attention layer (``cache[i]``).

    Args:
        n_layers: the number of attention layers.

    Examples:
        >>> cache = KVCache(n_layers=2)
        >>> len(cache), cache.length
        (2, 0)
    """

    def __init__(self, n_layers: int) -> None:
        self.layers = [LayerKVCache() for _ in range(n_layers)]

    def __getitem__(self, i: int) -> LayerKVCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def reset(self) -> None:
        """Empty every layer's cache."""
        for layer in self.layers:
            layer.reset()
