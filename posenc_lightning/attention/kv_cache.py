"""A key/value cache for incremental decoding.

Static encodings cache *rotated* keys. Dynamic encodings (``Encoding.dynamic``: dynamic_ntk,
long_rope's switching factor sets, clex) cache keys *before* rotation and the mixin rotates all
of them at attend time, so growing past a switch point never leaves keys rotated with stale
frequencies. Encodings with per-token state (FoX's cumulative gates) keep it in ``extra``.

A layer with a sliding window or chunk drops the keys no later query can see (`LayerKVCache.drop`,
called by the mixin after each step): its memory stays O(window) however long the decoding runs.
Keys are counted in two ways: `LayerKVCache.length` held, `LayerKVCache.seen` ever appended.
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
        #: keys dropped from the front (`drop`): held key ``j`` is the ``dropped + j``-th appended
        self.dropped = 0

    @property
    def length(self) -> int:
        """Keys held now."""
        return 0 if self.k is None else self.k.shape[-2]

    @property
    def seen(self) -> int:
        """Keys appended since the last reset (held and dropped): the next token's index."""
        return self.dropped + self.length

    def invisible(self, window: int | None, chunk: int | None) -> int:
        """How many of the oldest held keys no later query can see.

        With a chunk the count stops at a chunk boundary, so that held indices keep their chunks;
        0 while ``extra`` holds per-token state (it is indexed like the keys).

        Args:
            window: a causal sliding window (a query sees itself and the ``window - 1`` keys
                before it), or None.
            chunk: chunked attention (a query sees the keys of its own chunk of indices), or None.

        Returns:
            The number of keys `drop` may forget.
        """
        if self.extra or self.k is None:
            return 0
        first = 0  # the first index (of all appended) a later query can see
        if window is not None:
            first = self.seen - window + 1
        if chunk is not None:
            first = max(first, self.seen // chunk * chunk) // chunk * chunk
        return max(0, first - self.dropped)

    def drop(self, n: int) -> None:
        """Forget the oldest held keys, with their values, positions and segments.

        Args:
            n: how many (`invisible` says how many no later query sees).
        """
        if n <= 0:
            return
        self.k, self.v, self.positions = self.k[..., n:, :], self.v[..., n:, :], self.positions[:, n:]
        if self.segments is not None:
            self.segments = self.segments[:, n:]
        if self.start is not None:
            self.start += n
        self.dropped += n

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
        """Tokens appended so far (a windowed layer may hold fewer keys: `LayerKVCache.seen`)."""
        return self.layers[0].seen if self.layers else 0

    def reset(self) -> None:
        """Empty every layer's cache."""
        for layer in self.layers:
            layer.reset()
