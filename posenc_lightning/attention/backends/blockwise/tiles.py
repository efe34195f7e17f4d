"""Query blocks x key tiles of one attention call, for the blockwise normalizers (`blockwise`).

A `Tiling` knows, from Python ints only (shapes, the mask's offset), which keys a block of query
rows may see and in which order the key tiles are walked, and gives each tile's keys and
visibility mask; `BiasTiles` gives each tile's bias (any kind) and routes its gradient. Query
heads are laid out grouped (``[B, H_kv, g, r, .]``: grouped kv heads are never repeated).
Nothing built here is larger than one block of rows x the keys it sees, or, in backward, than the
keys themselves (`Tiling.walked`: the keys and values in walking order, once per pass).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from posenc_lightning.attention.backends.engine.blocks import BlockRows, wide_zeros
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import Bias


@dataclass(frozen=True)
class Tile:
    """Keys ``[k0, k1)`` of the block's keys ``[0, k_stop)``; ``full``: every key of it is
    visible to every query of the block (no mask needed); ``r0``: the block's first ``r0`` rows
    see none of its keys (their share of the tile is skipped)."""

    k0: int
    k1: int
    full: bool
    r0: int = 0


class Tiling:
    """The blocks of one call. ``diag``: query ``i`` may see key ``j`` only if ``j <= i + diag``
    (None: any key); ``descending``: key tiles are walked nearest first, each tile's keys in
    descending order (stick-breaking: `key_tile` and `walked` flip the keys). ``split_diagonal``
    (descending): a block's nearest tile is half its rows wide, so that the rows of its first half,
    which see none of those keys, skip it (`Tile.r0`): a quarter of the causal triangle's tile."""

    def __init__(self, mask: AttentionMask, n_q: int, n_k: int, diag: int | None, rows: int, cols: int,
                 descending: bool, split_diagonal: bool = False) -> None:
        self.mask, self.n_q, self.n_k, self.diag = mask, n_q, n_k, diag
        self.rows, self.cols, self.descending = max(1, rows), max(1, cols), descending
        self.split_diagonal = split_diagonal and descending and diag is not None
        dense = mask.q_segments is not None or mask.k_valid is not None or bool(mask.local)
        self.dense_mask = dense
        ks = mask.k_segments if mask.k_segments is not None else mask.q_segments
        # the per-key masks ([B, Nk], small) in walking order, read through `span`
        self.k_seg = None if mask.q_segments is None else self.walking(ks)
        self.k_valid = None if mask.k_valid is None else self.walking(mask.k_valid)

    def walking(self, t: Tensor) -> Tensor:
        """A per-key ``[B, Nk]`` tensor in walking order."""
        return t.flip(-1) if self.descending else t

    def key_tile(self, x: Tensor, t: Tile, dtype: torch.dtype) -> Tensor:
        """The tile's keys of ``x [B, H_kv, Nk, X]`` in walking order and ``dtype`` (a tile-sized
        copy at most: the forward passes, which keep nothing the size of the keys)."""
        x = x[:, :, t.k0:t.k1].to(dtype)
        return x.flip(-2) if self.descending else x

    def walked(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """All keys of ``x [B, H_kv, Nk, X]`` in walking order and ``dtype``, once per pass (the
        backward passes, which build key-sized gradients anyway: one flip, not three per tile)."""
        x = x.to(dtype)
        return x.flip(-2) if self.descending else x

    def unwalked(self, x: Tensor) -> Tensor:
        """A walked per-key ``[B, H_kv, Nk, X]`` tensor back in key order."""
        return x.flip(-2) if self.descending else x

    def walked_tile(self, xw: Tensor, t: Tile) -> Tensor:
        """The tile's keys of a `walked` tensor (a view, in walking order)."""
        return xw[:, :, self.span(t)]

    def blocks(self) -> Iterator[tuple[int, int, int]]:
        """``(start, stop, k_stop)``: query rows ``[start, stop)`` see keys ``[0, k_stop)`` at most."""
        for s in range(0, self.n_q, self.rows):
            e = min(self.n_q, s + self.rows)
            k_stop = self.n_k if self.diag is None else max(0, min(self.n_k, e + self.diag))
            yield s, e, k_stop

    def max_tiles(self) -> int:
        """The most key tiles of any block."""
        return max([1] + [len(self.tiles(s, k, e)) for s, e, k in self.blocks()])

    def tiles(self, start: int, k_stop: int, stop: int | None = None) -> list[Tile]:
        """The key tiles of a block, in walking order; given the block's ``stop``, each with the rows
        it skips (`Tile.r0`) and, with `split_diagonal`, the nearest one half the rows wide."""
        out, i, width = [], 0, self.cols
        if self.split_diagonal and stop is not None and 0 < (stop - start) // 2 < self.cols:
            width = (stop - start) // 2
        while i < k_stop:
            k0, k1 = (max(0, k_stop - i - width), k_stop - i) if self.descending else (i, min(k_stop, i + width))
            full = not self.dense_mask and (self.diag is None or k1 - 1 <= start + self.diag)
            r0 = 0 if stop is None or self.diag is None else min(stop - start, max(0, k0 - self.diag - start))
            out.append(Tile(k0, k1, full, r0))
            i, width = i + width, self.cols
        return out

    def span(self, t: Tile) -> slice:
        """The tile's keys in a per-key ``[B, Nk]`` tensor in walking order (flipped when descending)."""
        return slice(self.n_k - t.k1, self.n_k - t.k0) if self.descending else slice(t.k0, t.k1)

    def row_span(self, t: Tile, k_stop: int) -> slice:
        """The tile's keys in a block's bias rows ``[..., :k_stop]`` taken through `rows_order`."""
        return slice(k_stop - t.k1, k_stop - t.k0) if self.descending else slice(t.k0, t.k1)

    def rows_order(self, rows: Tensor) -> Tensor:
        return rows.flip(-1) if self.descending else rows

    def keep(self, start: int, stop: int, t: Tile, dtype: torch.dtype, device: torch.device,
             made: dict | None = None) -> Tensor | None:
        """``[B|1, 1, 1, r, cols]`` (the grouped layout) in ``dtype``: 1 where the key is visible,
        else 0 (a multiplier); None when all are visible. A mask of the diagonal alone depends on
        the tile's shape and its offset to the diagonal only: with ``made`` (a pass's own dict) it
        is made once per pass (the blocks' nearest tiles share it)."""
        if t.full:
            return None
        if self.dense_mask or made is None:
            return self._keep(start, stop, t, dtype, device)
        key = (stop - start, t.k1 - t.k0, start + self.diag - t.k0, dtype, device)
        m = made.get(key)
        if m is None:
            m = made[key] = self._keep(start, stop, t, dtype, device)
        return m

    def _keep(self, start: int, stop: int, t: Tile, dtype: torch.dtype, device: torch.device) -> Tensor:
        j = torch.arange(t.k0, t.k1, device=device)
        j = j.flip(0) if self.descending else j
        m = None
        if self.diag is not None:
            i = torch.arange(start, stop, device=device)
            m = (j[None, :] <= i[:, None] + self.diag)[None]
        local = self.mask.local_allowed(torch.arange(start, stop, device=device)[:, None] + self.mask.q_offset,
                                        j[None, :])
        if local is not None:
            m = local[None] if m is None else m & local[None]
        sl = self.span(t)
        if self.k_seg is not None:
            seg = self.mask.q_segments[:, start:stop, None] == self.k_seg[:, None, sl]
            m = seg if m is None else m & seg
        if self.k_valid is not None:
            kv = self.k_valid[:, None, sl]
            m = kv if m is None else m & kv
        return m[:, None, None].to(dtype)


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


class BiasTiles:
    """The bias of each tile, in walking order and the grouped layout, and its gradient.

    A bias that depends on ``i - j`` only (`Bias.distance_only`: linear penalties, relative tables) is
    computed per tile at the tile's positions (`Bias.at` at the context's positions, as the sdpa
    backend's Toeplitz path reads it): nothing larger than a tile. Any other
    kind: one block of `Bias.rows` at a time, sliced. Gradients: `Bias.rows_from` on detached
    windows of `Bias.grad_inputs` (the engine's `blocks.BlockRows`, as sdpa's rows), added window by
    window into full-size accumulators of the inputs that need one (``need``, per input).
    ``compiling``: the pass is traced by ``torch.compile`` (`mode.Mode`). ``in_channels``: the
    logits' product already holds the (`Bias.head_scaled`) bias: tiles add nothing, the weights'
    gradient is still taken per tile. ``ascending``: queries and keys are the same tokens at
    ``start + arange(N)`` (`AttentionContext.ascending`): a distance-only pattern then depends on
    the tile's shape and its offset to the diagonal only, and is made once per pass and offset
    (from indices, shared by the batch)."""

    def __init__(self, bias: Bias | None, tiling: Tiling, h_kv: int, dtype: torch.dtype,
                 q_pos: Tensor | None = None, k_pos: Tensor | None = None, compiling: bool = False,
                 in_channels: bool = False, ascending: bool = False, eager_autograd: bool = True) -> None:
        self.bias, self.tiling, self.h_kv, self.dtype = bias, tiling, h_kv, dtype
        self.inputs = tuple(bias.grad_inputs() or ()) if bias is not None else ()
        self.need: tuple[bool, ...] = (False,) * len(self.inputs)
        self.grads: list[Tensor | None] = [None] * len(self.inputs)
        self.per_tile = (bias is not None and bias.distance_only and q_pos is not None and k_pos is not None
                         and q_pos.dim() == 2)
        self.q_pos = q_pos
        self.k_pos = None if k_pos is None else tiling.walking(k_pos)
        self._block: tuple[int, int, int] = (0, 0, 0)
        self._rows: Tensor | None = None
        self._d_rows: Tensor | None = None
        self._vjp: _Routed | None = None
        self.compiling = compiling
        self.eager_autograd = eager_autograd  # `Tunables.eager_autograd`
        # w[h] * pattern: a tile is one broadcast product, w's gradient a reduction (`Bias.head_scaled`);
        # ``_w``: w in the grouped layout ``[1, H_kv, g, 1, 1]``
        self.factored = bias.head_scaled() if self.per_tile else None
        self._w_slot = -1 if self.factored is None else next(
            (i for i, x in enumerate(self.inputs) if x is self.factored.w), -1)
        self._pattern: Tensor | None = None
        self._w = None if self.factored is None else self.factored.w.detach().to(dtype).reshape(1, h_kv, -1, 1, 1)
        self.in_channels = in_channels
        self._by_offset: dict[tuple[int, int, int], Tensor] | None = {} if ascending else None
        if in_channels and self.factored is None:
            raise ValueError("a bias in the logits' channels needs its head_scaled form")

    @property
    def grad(self) -> bool:
        return any(self.need)

    def _grouped(self, rows: Tensor) -> Tensor:
        r = rows.to(self.dtype)
        b, h = r.shape[:2]
        return r.reshape(b, self.h_kv, h // self.h_kv, *r.shape[2:]) if h > 1 else r[:, :, None]

    def _differentiated(self, bias: Bias, start: int, stop: int, k_stop: int) -> tuple[Tensor, _Routed]:
        """``rows_from`` of ``bias`` and what routes their gradient to the inputs that need one."""
        inputs = bias.grad_inputs()
        slots = [next((i for i, x in enumerate(self.inputs) if x is t), -1) for t in inputs]
        need = [slot >= 0 and self.need[slot] for slot in slots]
        block = BlockRows.of(bias, inputs, need, start, stop, k_stop, self.compiling,
                             eager_autograd=self.eager_autograd)
        return block.rows, _Routed(block, slots, self)

    def start(self, start: int, stop: int, k_stop: int, grad: bool = False) -> None:
        """Begin a block of query rows (rows mode: its bias rows, kept with their vjp when ``grad``)."""
        self._block, self._rows, self._d_rows, self._vjp = (start, stop, k_stop), None, None, None
        if self.bias is None or self.per_tile or k_stop == 0:
            return
        if grad and self.grad:
            raw, self._vjp = self._differentiated(self.bias, start, stop, k_stop)
        else:
            raw = self.bias.rows(start, stop, k_stop)
        self._rows = self._grouped(self.tiling.rows_order(raw))

    def tile(self, t: Tile, grad: bool = False) -> Tensor | None:
        """The tile's bias ``[B|1, H_kv|1, g|1, r, c]`` in walking order (None: no bias)."""
        if self.bias is None:
            return None
        s, e, k_stop = self._block
        s += t.r0
        if not self.per_tile:
            return self._rows[..., t.r0:, self.tiling.row_span(t, k_stop)]
        if self.factored is not None:
            self._pattern = self.factored.pattern(self.q_pos[:, s:e], self.k_pos[:, self.tiling.span(t)])
            return self._pattern.to(self.dtype)[:, None, None] * self._w
        tb = self.bias.at(self.q_pos[:, s:e], self.k_pos[:, self.tiling.span(t)])
        if grad and self.grad:
            raw, self._vjp = self._differentiated(tb, 0, e - s, t.k1 - t.k0)
        else:
            raw = tb.rows(0, e - s, t.k1 - t.k0)
        return self._grouped(raw)

    def add_tile(self, z: Tensor, t: Tile, grad: bool = False) -> Tensor:
        """``z`` (a tile's logits ``[B, H_kv, g, r, c]``) plus the tile's bias, in place (a
        `Bias.head_scaled` bias as one fused ``w[h] * pattern`` pass, no product tensor)."""
        if self.bias is None or self.in_channels:
            return z
        if self.factored is None:
            return z.add_(self.tile(t, grad))
        return z.addcmul_(self._tile_pattern(t).to(self.dtype)[:, None, None], self._w)

    def _tile_pattern(self, t: Tile) -> Tensor:
        s, e, _ = self._block
        s += t.r0
        if self._by_offset is None:
            self._pattern = self.factored.pattern(self.q_pos[:, s:e], self.k_pos[:, self.tiling.span(t)])
            return self._pattern
        key = (e - s, t.k1 - t.k0, s - t.k0)
        p = self._by_offset.get(key)
        if p is None:
            dev = self.q_pos.device
            keys = self.tiling.walking(torch.arange(t.k0, t.k1, device=dev)[None])
            p = self._by_offset[key] = self.factored.pattern(torch.arange(s, e, device=dev)[None], keys)
        self._pattern = p
        return p

    def tile_grad(self, t: Tile, dz: Tensor) -> None:
        """Take the gradient of the tile's bias (``dz [B, H_kv, g, r, c]``, walking order)."""
        if self.bias is None or not self.grad:
            return
        if self.factored is not None:
            if self.in_channels:
                self._tile_pattern(t)
            self._add_weight_grad(dz)
            return
        if self.per_tile:
            self._vjp(ungrouped_rows(dz))
            return
        s, e, k_stop = self._block
        if self._d_rows is None:
            b, h_kv, g = dz.shape[:3]
            self._d_rows = torch.zeros((b, h_kv, g, e - s, k_stop), dtype=dz.dtype, device=dz.device)
        self._d_rows[..., t.r0:, self.tiling.row_span(t, k_stop)] = dz

    def _add_weight_grad(self, dz: Tensor) -> None:
        """``dw[h] += sum over the tile of dz * pattern`` (``dz [B, H_kv, g, r, c]``)."""
        if self._w_slot < 0 or not self.need[self._w_slot]:
            return
        b, h_kv, g, r, c = dz.shape
        pat = self._pattern.to(dz.dtype).expand(b, r, c).reshape(b, r * c, 1)
        dw = torch.bmm(dz.reshape(b, h_kv * g, r * c), pat).sum(0).reshape(-1)  # [H]
        if self.grads[self._w_slot] is None:
            self.grads[self._w_slot] = wide_zeros(self.inputs[self._w_slot])
        self.grads[self._w_slot].add_(dw.reshape(self.grads[self._w_slot].shape))

    def finish(self) -> None:
        """End a block (rows mode: its rows' gradient to the inputs)."""
        if self._vjp is not None and self._d_rows is not None and not self.per_tile:
            self._vjp(self.tiling.rows_order(ungrouped_rows(self._d_rows)))
        self._rows = self._d_rows = self._vjp = None


def ungrouped_rows(t: Tensor) -> Tensor:
    """``[B, H_kv, g, r, K]`` -> ``[B, H, r, K]``."""
    return t.flatten(1, 2)


class _Routed:
    """A block's (or a per-tile bias's) `BlockRows` with its inputs' slots among `BiasTiles.inputs`:
    called with the rows' gradient ``[B, H, r, K]``, adds it to the tiles' accumulators."""

    def __init__(self, block: BlockRows, slots: list[int], tiles: BiasTiles) -> None:
        self.block, self.slots, self.tiles = block, slots, tiles

    def __call__(self, d_rows: Tensor) -> None:
        self.block.backward(d_rows, self._into)

    def _into(self, i: int) -> Tensor:
        slot, grads = self.slots[i], self.tiles.grads
        if grads[slot] is None:
            grads[slot] = wide_zeros(self.tiles.inputs[slot])
        return grads[slot]


def skipping_rows(x: Tensor, g: int, r0: int) -> Tensor:
    """A block's ``[B * H_kv, g * r, X]`` without each head's first ``r0`` rows (a copy when ``g > 1``)."""
    if r0 == 0:
        return x
    if g == 1:
        return x[:, r0:]
    n, gr, d = x.shape
    return x.view(n, g, gr // g, d)[:, :, r0:].reshape(n, -1, d)


def add_product(acc: Tensor, g: int, r0: int, a: Tensor, b: Tensor) -> None:
    """``acc`` (``[B * H_kv, g * r, X]``) without each head's first ``r0`` rows ``+= a @ b``."""
    if r0 == 0 or g == 1:
        acc[:, r0:].baddbmm_(a, b)
    else:
        n, gr, d = acc.shape
        acc.view(n, g, gr // g, d)[:, :, r0:].add_(torch.bmm(a, b).view(n, g, -1, d))


def batched(x: Tensor) -> Tensor:
    """``[B, H_kv, m, n]`` as ``[B * H_kv, m, n]`` (a view: ``baddbmm_`` accumulates a product in place)."""
    return x.flatten(0, 1)


def wide_dtype(q: Tensor) -> torch.dtype:
    """The dtype a block accumulates ``q``'s products in: at least float32."""
    return torch.promote_types(q.dtype, torch.float32)
