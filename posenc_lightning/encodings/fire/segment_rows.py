"""FIRE's rows at known ``start + arange`` positions by segments of its piecewise-linear MLP, on CPU
through the compiled pass (`native`): the rows in one write, their pullback in one read of the
gradient, no unit selection and no per-element hidden units. The same inputs and gradients as
`by_distance.rows_and_pullback`, which stays the route wherever this returns None."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posenc_lightning.encodings.fire import native
from posenc_lightning.encodings.fire.by_distance import _diagonal_inputs, _normalizer_grads
from posenc_lightning.encodings.fire.functions import _distances
from posenc_lightning.encodings.fire.layouts import reused_buffer
from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables

Grads = tuple[Tensor | None, ...]


def _segments(w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, dt: torch.dtype, memo: dict | None
              ) -> native.Segments:
    """`native.Segments` of the MLP in ``dt``; with ``memo`` (a dict kept by the bias for its call)
    computed once per storage and version of the weights (the blocks' views of the same parameters
    share them; an in-place update changes the version)."""
    key = None
    if memo is not None:
        try:
            key = ("segments", dt, *((t.data_ptr(), t._version) for t in (w1, b1, w2, b2)))
        except RuntimeError:  # no storage of its own (a functorch transform's tensor)
            key = None
        if key is not None and key in memo:
            return memo[key]
    seg = native.Segments.of(*(t.detach().to(dt) for t in (w1, b1, w2, b2)))
    if key is not None:
        memo[key] = seg
    return seg


def _inputs(c: Tensor, thr: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, table: Tensor | None,
            q_pos: Tensor, k_pos: Tensor, eps: float, shift: int, tunables: Tunables, memo: dict | None
            ) -> tuple[torch.dtype, Tensor, Tensor, native.Segments] | None:
    """``(dtype, p, n, segments)`` of a block the compiled pass takes, or None: a distance table,
    another device or dtype, an empty block, ``tunables.fire_native`` off, or no library."""
    dt = torch.promote_types(torch.promote_types(torch.float32, c.dtype), w2.dtype)
    if (table is not None or not tunables.fire_native or c.device.type != "cpu" or dt not in native.C_TYPES
            or not q_pos.shape[1] or not k_pos.shape[1] or not native.available()):
        return None
    n, p = _diagonal_inputs(c, thr, q_pos, k_pos, shift)
    return dt, p.to(dt).contiguous(), (n + eps).to(dt).contiguous(), _segments(w1, b1, w2, b2, dt, memo)


def rows(c: Tensor, thr: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, table: Tensor | None,
         q_pos: Tensor, k_pos: Tensor, eps: float, shift: int, tunables: Tunables = DEFAULT_TUNABLES,
         reuse: bool = False, memo: dict | None = None) -> Tensor | None:
    """The block's rows ``[1, H, R, C]`` (no gradient), or None where the compiled pass does not
    take it (`_inputs`). ``reuse``: written into this thread's reused buffer (`layouts.reused_buffer`);
    ``memo``: where the MLP's segments are kept (`_segments`)."""
    got = _inputs(c, thr, w1, b1, w2, b2, table, q_pos, k_pos, eps, shift, tunables, memo)
    return None if got is None else _rows(got, w2.shape[0], q_pos, k_pos, reuse)


def _rows(got: tuple[torch.dtype, Tensor, Tensor, native.Segments], heads: int, q_pos: Tensor, k_pos: Tensor,
          reuse: bool) -> Tensor | None:
    """The rows of `_inputs`' block through the library, or None where it does not take them."""
    dt, p, n, seg = got
    shape = (1, heads, q_pos.shape[1], k_pos.shape[1])
    out = reused_buffer(shape, dt, p.device) if reuse else torch.empty(shape, dtype=dt, device=p.device)
    return out if native.rows(p, n, seg, shape[-1], out) else None


def rows_and_pullback(c: Tensor, thr: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, table: Tensor | None,
                      q_pos: Tensor, k_pos: Tensor, eps: float, shift: int, need_x: bool, last: int | None = None,
                      tunables: Tunables = DEFAULT_TUNABLES, memo: dict | None = None
                      ) -> tuple[Tensor, Callable[[Tensor], Grads]] | None:
    """`by_distance.rows_and_pullback` through the compiled pass, or None where it does not take
    the block (`_inputs`): the rows in this thread's reused buffer, and ``pullback(grad [1, H, R,
    C])`` giving ``(c, thr, w1, b1, w2, b2, table)``'s gradients (``c``'s and ``thr``'s zeros
    unless ``need_x``; the table's None); ``last``: the last table column the caller's mask shows
    (``grad`` is 0 past it); ``memo``: as `rows`'."""
    got = _inputs(c, thr, w1, b1, w2, b2, table, q_pos, k_pos, eps, shift, tunables, memo)
    out = None if got is None else _rows(got, w2.shape[0], q_pos, k_pos, reuse=True)
    if out is None:
        return None
    dt, p, n, seg = got
    w1d, b1d, w2d = (t.detach().to(dt) for t in (w1, b1, w2))
    dpsi = None
    if need_x:
        dist = _distances(q_pos, k_pos, shift).to(dt)
        cz = c.detach().to(dt) * dist
        dpsi = (cz.sgn() * dist / (1 + cz.abs())).contiguous()  # d psi(d) / d c

    def pullback(grad: Tensor) -> Grads:
        g = grad[0].to(dt)
        g = g if g.stride(-1) == 1 else g.contiguous()
        sums = native.pullback_sums(g, p, n, dpsi, seg, last)
        if sums is None:
            raise RuntimeError("fire: the compiled pullback took fewer pieces than its rows")  # same rows, same pieces
        g0, g1, row_c, row_n = sums
        gw1, gb1, gw2, gb2 = native.unit_grads(g0, g1, seg, w1d, b1d, w2d)
        gc, gthr = torch.zeros_like(c), torch.zeros_like(thr)
        if need_x:
            inv_n = 1 / n.double()
            gc, gthr = _normalizer_grads((row_c * inv_n).sum().to(dt), (-row_n * inv_n).to(dt), c, thr, q_pos[0])
        return gc, gthr, gw1.to(w1.dtype), gb1.to(b1.dtype), gw2.to(w2.dtype), gb2.to(b2.dtype), None

    return out, pullback
