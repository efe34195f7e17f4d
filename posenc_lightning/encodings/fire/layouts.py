"""The distance layout of FIRE's rows by distance (`by_distance`): row ``r`` of a block of ``R`` rows
and ``C`` keys reads table index ``m`` in ``[R - 1 - r, R - 1 - r + C)`` of ``[H, R, R + C - 1]``,
so a column holds one distance for every row. The views and buffers that lay rows out that way."""

from __future__ import annotations

import threading

import torch
from torch import Tensor


def padded_rows(h: int, r: int, k: int, dt: torch.dtype, device: torch.device, reuse: bool = False
                ) -> tuple[Tensor, Tensor]:
    """``(rows [1, H, r, k], dist [H, r, r + k - 1])``: two views of one buffer, ``dist[h, i, m] =
    rows[0, h, i, m - (r - 1 - i)]`` where that is a key (the distance layout; its other entries are
    padding, ``r`` a row). ``rows`` is a tensor of its own over the buffer's storage (not a view:
    the attention may write its mask into it, as into any fresh rows). ``reuse`` (on CPU): the
    buffer is this thread's `RowsBuffer`, overwritten by the next such call (for rows the caller
    consumes before asking for more: `FireBias.hand_rows`)."""
    size = r - 1 + r * (k + r)
    if reuse and device.type == "cpu":
        buf = _ROWS_BUFFER.get(h * size, dt, device).view(h, size)
    else:
        buf = torch.empty(h, size, dtype=dt, device=device)
    dist = buf.as_strided((h, r, r + k - 1), (size, k + r + 1, 1))
    rows = torch.empty(0, dtype=dt, device=device).set_(buf.untyped_storage(), r - 1, (1, h, r, k),
                                                        (h * size, size, k + r, 1))
    return rows, dist


def distance_layout(g: Tensor) -> Tensor:
    """``g`` ``[H, R, C]`` in the distance layout ``[H, R, R + C - 1]`` (zeros outside the block's
    columns): a view of one buffer, each row written at its offset (one copy, no full zeroing)."""
    h, r, k = g.shape
    buf = g.new_empty(h, r - 1 + r * (k + r))
    buf[:, :r - 1] = 0
    body = buf[:, r - 1:].view(h, r, k + r)
    body[..., :k] = g
    body[..., k:] = 0
    return buf.as_strided((h, r, r + k - 1), (buf.stride(0), k + r + 1, 1))


class EndBuffer(threading.local):
    """`end_layouts`'s buffer, kept per thread for the last shape: the layouts' padding is zeroed
    once, when it is made, and never written (each call copies the keys over the last's), so a
    block's backward writes only its triangles' keys, not a fresh zeroed buffer (~1 MiB a block
    of 128 rows, whose new pages cost more than the copy). Never handed out: read only by the
    products of the call that filled it."""

    key: tuple | None = None
    buf: Tensor | None = None

    def get(self, n: int, dt: torch.dtype, device: torch.device) -> Tensor:
        key = (n, dt, device)
        if self.key != key:
            self.key, self.buf = key, torch.zeros(n, dtype=dt, device=device)
        return self.buf


_END_BUFFER = EndBuffer()


class RowsBuffer(threading.local):
    """`padded_rows`' buffer where the rows are consumed before the next block's (``reuse``), kept
    per thread at the largest size asked (a block of rows: within the attention's block budget).
    A block's rows written into a buffer new to the process fault in its pages (glibc hands a
    freed block of this size back to the system), ~2000 a block of 128 rows at N 2048; this one
    is faulted in once. Its first elements, as a flat tensor, are handed out by `get`."""

    buf: Tensor | None = None

    def get(self, n: int, dt: torch.dtype, device: torch.device) -> Tensor:
        b = self.buf
        if b is None or b.dtype != dt or b.device != device or b.numel() < n:
            self.buf = b = torch.empty(n, dtype=dt, device=device)
        return b[:n]


_ROWS_BUFFER = RowsBuffer()


def reused_buffer(shape: tuple[int, ...], dt: torch.dtype, device: torch.device) -> Tensor:
    """A contiguous tensor of ``shape`` over this thread's `RowsBuffer`, overwritten by the next
    reused rows of this thread (the caller consumes it first). A tensor of its own over the
    buffer's storage, not a view (as `padded_rows`' rows: the attention may write its mask into it)."""
    n = 1
    for s in shape:
        n *= s
    buf = _ROWS_BUFFER.get(n, dt, device)
    return torch.empty(0, dtype=dt, device=device).set_(buf.untyped_storage(), buf.storage_offset(), shape)


def end_layouts(g: Tensor) -> Tensor:
    """The distance layout's two end triangles of ``g`` ``[H, R, C]`` (``C >= R - 1``) ``[2H, R, R -
    1]``: columns ``[0, R - 1)`` (the first ``R - 1`` keys) of each head, then columns ``[C, C + R -
    1)`` (the last), zeros outside the block's keys, each laid out as `distance_layout`'s. One
    buffer (`EndBuffer`) written by one strided copy; the second triangles' layouts start ``R - 1``
    elements early, so that all ``2H`` are one batch (one stride: a product takes them as they are)."""
    h, r, k = g.shape
    w = r - 1
    size = 2 * w + r * (w + r)  # `distance_layout` of w keys, and w to spare
    buf = _END_BUFFER.get(2 * h * size, g.dtype, g.device)
    ends = g.as_strided((2, h, r, w), (k - w, g.stride(0), g.stride(1), 1), g.storage_offset())
    buf.as_strided((2, h, r, w), (h * size - w, size, w + r, 1), w).copy_(ends)  # the layouts' bodies
    return buf.as_strided((2 * h, r, w), (size, w + r + 1, 1))
