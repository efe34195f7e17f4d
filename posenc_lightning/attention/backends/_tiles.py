"""Query blocks x key tiles of one attention call, for the blockwise normalizers (`blockwise`).

A `Tiling` knows, from Python ints only (shapes, the mask's offset), which keys a block of query
rows may see and in which order the key tiles are walked; it gives each tile's visibility mask,
its slice of the bias (from the block's `Bias.rows`, so any kind works) and the grouped layout
of the query heads (``[B, H_kv, g, r, .]``: grouped kv heads are never repeated). Nothing it
builds is larger than one block of rows x the keys it sees.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import Bias


@dataclass(frozen=True)
class Tile:
    """Keys ``[k0, k1)`` of the block's keys ``[0, k_stop)``; ``full``: every key of it is
    visible to every query of the block (no mask needed)."""

    k0: int
    k1: int
    full: bool


class Tiling:
    """The blocks of one call. ``diag``: query ``i`` may see key ``j`` only if ``j <= i + diag``
    (None: any key); ``descending``: key tiles are walked nearest first, each tile's keys in
    descending order (stick-breaking; the key-side tensors are then read from flipped copies)."""

    def __init__(self, mask: AttentionMask, n_q: int, n_k: int, diag: int | None, rows: int, cols: int,
                 descending: bool) -> None:
        self.mask, self.n_q, self.n_k, self.diag = mask, n_q, n_k, diag
        self.rows, self.cols, self.descending = max(1, rows), max(1, cols), descending
        dense = mask.q_segments is not None or mask.k_valid is not None
        self.dense_mask = dense
        ks = mask.k_segments if mask.k_segments is not None else mask.q_segments
        flip = self._keys
        self.k_seg = None if mask.q_segments is None else flip(ks)
        self.k_valid = None if mask.k_valid is None else flip(mask.k_valid)

    def _keys(self, t: Tensor) -> Tensor:
        return t.flip(-1) if self.descending else t

    def keys(self, t: Tensor) -> Tensor:
        """A key-side tensor ``[..., Nk, X]`` in walking order (flipped when descending)."""
        return t.flip(-2) if self.descending else t

    def blocks(self) -> Iterator[tuple[int, int, int]]:
        """``(start, stop, k_stop)``: query rows ``[start, stop)`` see keys ``[0, k_stop)`` at most."""
        for s in range(0, self.n_q, self.rows):
            e = min(self.n_q, s + self.rows)
            k_stop = self.n_k if self.diag is None else max(0, min(self.n_k, e + self.diag))
            yield s, e, k_stop

    def tiles(self, start: int, k_stop: int) -> list[Tile]:
        """The key tiles of a block, in walking order."""
        out = []
        for i in range(0, k_stop, self.cols):
            k0, k1 = (max(0, k_stop - i - self.cols), k_stop - i) if self.descending else (i, min(k_stop, i + self.cols))
            full = not self.dense_mask and (self.diag is None or k1 - 1 <= start + self.diag)
            out.append(Tile(k0, k1, full))
        return out

    def span(self, t: Tile) -> slice:
        """The tile's keys in a key-side tensor taken through `keys` (walking order)."""
        return slice(self.n_k - t.k1, self.n_k - t.k0) if self.descending else slice(t.k0, t.k1)

    def row_span(self, t: Tile, k_stop: int) -> slice:
        """The tile's keys in a block's bias rows ``[..., :k_stop]`` taken through `rows_order`."""
        return slice(k_stop - t.k1, k_stop - t.k0) if self.descending else slice(t.k0, t.k1)

    def rows_order(self, rows: Tensor) -> Tensor:
        return rows.flip(-1) if self.descending else rows

    def visible(self, start: int, stop: int, t: Tile, device: torch.device) -> Tensor | None:
        """bool ``[B|1, 1, 1, r, cols]`` (the grouped layout), None when all visible."""
        if t.full:
            return None
        j = torch.arange(t.k0, t.k1, device=device)
        j = j.flip(0) if self.descending else j
        m = None
        if self.diag is not None:
            i = torch.arange(start, stop, device=device)
            m = (j[None, :] <= i[:, None] + self.diag)[None]
        sl = self.span(t)
        if self.k_seg is not None:
            seg = self.mask.q_segments[:, start:stop, None] == self.k_seg[:, None, sl]
            m = seg if m is None else m & seg
        if self.k_valid is not None:
            kv = self.k_valid[:, None, sl]
            m = kv if m is None else m & kv
        return m[:, None, None]


def grouped(t: Tensor, start: int, stop: int, h_kv: int, dtype: torch.dtype) -> Tensor:
    """Query rows ``[start, stop)`` of ``t [B, H, N, X]`` as ``[B, H_kv, g, r, X]`` in ``dtype``."""
    b, h, _, x = t.shape
    return t[:, :, start:stop].to(dtype).reshape(b, h_kv, h // h_kv, stop - start, x)


def ungrouped(t: Tensor) -> Tensor:
    """``[B, H_kv, g, r, X]`` -> ``[B, H, r, X]``."""
    b, h_kv, g, r, x = t.shape
    return t.reshape(b, h_kv * g, r, x)


def flat(t: Tensor) -> Tensor:
    """``[B, H_kv, g, r, X]`` -> ``[B, H_kv, g * r, X]`` for one matmul per kv head."""
    return t.flatten(2, 3)


class BiasRows:
    """A block's bias rows in walking order and their gradient.

    Forward: `Bias.rows`. Backward: `Bias.rows_from` on detached windows of `Bias.grad_inputs`
    differentiated with ``torch.func.vjp`` (traceable by dynamo, unlike ``autograd.grad``), the
    gradients added window by window into full-size accumulators of the inputs that need one."""

    def __init__(self, bias: Bias | None, tiling: Tiling, h_kv: int, dtype: torch.dtype,
                 need: Sequence[bool] = ()) -> None:
        self.bias, self.tiling, self.h_kv, self.dtype = bias, tiling, h_kv, dtype
        self.inputs = tuple(bias.grad_inputs() or ()) if bias is not None else ()
        self.need = tuple(need) or (False,) * len(self.inputs)
        self.grads: list[Tensor | None] = [None] * len(self.inputs)

    def _grouped(self, rows: Tensor) -> Tensor:
        r = self.tiling.rows_order(rows.to(self.dtype))
        b, h = r.shape[:2]
        return r.reshape(b, self.h_kv, h // self.h_kv, *r.shape[2:]) if h > 1 else r[:, :, None]

    def rows(self, start: int, stop: int, k_stop: int) -> Tensor | None:
        """``[B|1, H_kv|1, g|1, r, k_stop]`` in walking order, or None without a bias."""
        if self.bias is None or k_stop == 0:
            return None
        return self._grouped(self.bias.rows(start, stop, k_stop))

    def rows_with_grad(self, start: int, stop: int, k_stop: int):
        """The rows, and a function taking their gradient (same layout) into `grads`, or None."""
        if self.bias is None or k_stop == 0:
            return None, None
        if not any(self.need):
            return self.rows(start, stop, k_stop), None
        windows = self.bias.input_windows(start, stop, k_stop)
        views = [t.detach() if w is None else t.detach()[w] for t, w in zip(self.inputs, windows)]
        idx = [i for i, n in enumerate(self.need) if n]

        def f(*live: Tensor) -> Tensor:
            vs = list(views)
            for i, t in zip(idx, live):
                vs[i] = t
            return self.bias.rows_from(start, stop, k_stop, vs)

        raw, vjp = torch.func.vjp(f, *[views[i] for i in idx])

        def take(d_rows: Tensor) -> None:
            d = self.tiling.rows_order(ungrouped_rows(d_rows))
            if raw.shape[0] == 1 and d.shape[0] > 1:
                d = d.sum(0, keepdim=True)
            if raw.shape[1] == 1 and d.shape[1] > 1:
                d = d.sum(1, keepdim=True)
            for i, gi in zip(idx, vjp(d.to(raw.dtype))):
                t, w = self.inputs[i], windows[i]
                if self.grads[i] is None:
                    self.grads[i] = torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, torch.float32),
                                                device=t.device)
                (self.grads[i] if w is None else self.grads[i][w]).add_(gi)

        return self._grouped(raw.detach()), take


def ungrouped_rows(t: Tensor) -> Tensor:
    """``[B, H_kv, g, r, K]`` -> ``[B, H, r, K]``."""
    return t.flatten(1, 2)
