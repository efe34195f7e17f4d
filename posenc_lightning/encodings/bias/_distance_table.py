"""The distance-only terms of a `BiasSum` (ALiBi, T5 and any ``f(i - j)`` at the same positions)
summed once into a table over distances, and the rows of a block read from it (a Toeplitz block at
arange positions, one lookup elsewhere)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posenc_lightning.encodings.bias.windows import same_positions
from posenc_lightning.functional.positions import arange_offset, host_reads_ok

__all__ = ["DistanceTable", "accumulate"]


def accumulate(out: Tensor | None, own: bool, r: Tensor, fresh: bool) -> tuple[Tensor, bool]:
    """``out + r`` and whether it is a new tensor: in place into ``out`` when it is one of the sum's shape."""
    if out is None:
        return r, fresh
    if own and out.shape == torch.broadcast_shapes(out.shape, r.shape):
        return out.add_(r), True
    return out + r, True


@dataclass(eq=False)
class DistanceTable:
    """Distance-only terms of a `BiasSum` (indices ``terms``) summed over distances: ``u[h, t]`` is
    their value at distance ``base - t``, for every distance of ``q_pos``, ``k_pos`` (``arange``:
    the positions are ``a + arange``, ``c + arange``, and ``base = a - c + Nq - 1``)."""

    terms: list[int]
    u: Tensor  # [H, L]
    base: int
    arange: bool
    q_pos: Tensor
    k_pos: Tensor

    @classmethod
    def of(cls, parts: list[Any]) -> DistanceTable | None:
        """The distance-only terms of ``parts`` (a sum's `Bias` terms) at the same integer positions
        (readable on the host), beside other terms, as one table over every distance their rows
        read (None: no such terms, or distances spread wider than ``16 (Nq + Nk)``)."""
        cand = [i for i, p in enumerate(parts) if p.distance_only and p.positions is not None
                and host_reads_ok(p.positions[0]) and not p.positions[0].dtype.is_floating_point
                and p.positions[0].numel() and p.positions[1].numel()]
        if len(parts) < 2 or not cand:
            return None
        q, k = parts[cand[0]].positions
        terms = [i for i in cand if same_positions(parts[i].positions[0], q) and same_positions(parts[i].positions[1], k)]
        a, c = arange_offset(q), arange_offset(k)
        if a is not None and c is not None:  # row i, key j at distance a - c + i - j
            base, length = a - c + q.shape[1] - 1, q.shape[1] + k.shape[1] - 1
        else:
            base, length = int(q.max() - k.min()), int(q.max() - k.min() - q.min() + k.max()) + 1
            if length > 16 * (q.shape[1] + k.shape[1]):  # a table far larger than a block of rows
                return None
        at = (torch.full((1, 1), base, dtype=q.dtype, device=q.device),
              torch.arange(length, dtype=q.dtype, device=q.device)[None])
        with torch.enable_grad():  # kept for the whole bias: first asked for maybe in a no-grad Function forward
            u = sum(parts[i].at(*at).materialize() for i in terms)[0, :, 0]
        return cls(terms, u, base, a is not None and c is not None, q, k)

    def window(self, start: int, stop: int, k_stop: int) -> Any:
        """The part of ``u`` the rows read: at arange positions row i, key j is at
        ``t = Nq - 1 - i + j``; else anywhere."""
        n_q = self.q_pos.shape[1]
        return (Ellipsis, slice(n_q - stop, n_q - start + k_stop - 1)) if self.arange else None

    def rows(self, u: Tensor, start: int, stop: int, k_stop: int) -> tuple[Tensor, bool]:
        """``[B, H, rows, keys]`` (B of the positions) from ``u`` cut by `window`, and whether it is
        a new tensor: at arange positions the reversed windows of the cut (a Toeplitz block, the
        same for every batch row), else one lookup of the block's distances."""
        b = self.q_pos.shape[0]
        if stop <= start or k_stop <= 0:
            return u.new_zeros(b, u.shape[0], stop - start, k_stop), True
        if self.arange:
            rows = _ReversedWindows.apply(u, k_stop)
            return (rows, True) if b == 1 else (rows.expand(b, -1, -1, -1), False)
        t = self.base - (self.q_pos[:, start:stop, None] - self.k_pos[:, None, :k_stop])  # [B, r, K]
        return u.index_select(-1, t.flatten()).view(-1, *t.shape).transpose(0, 1), True


class _ReversedWindows(torch.autograd.Function):
    """``rows[0, h, i, j] = u[h, (r - 1 - i) + j]`` ``[1, H, r, K]`` from ``u [H, r + K - 1]``
    (a Toeplitz block: the windows of ``u`` in reverse order). Backward sums the gradient along
    those diagonals: each row copied at its offset into a zeroed buffer of rows ``r + K`` wide
    (one strided copy), then the buffer's rows summed: three passes in three operations, where a
    row at a time took ``r`` small additions (most of the time, at 128 rows a block)."""

    @staticmethod
    def forward(u: Tensor, n_keys: int) -> Tensor:  # type: ignore[override]
        rev = torch.arange(u.shape[-1] - n_keys, -1, -1, device=u.device)
        return u.unfold(-1, n_keys, 1)[None].index_select(-2, rev)

    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor, int], output: Tensor) -> None:  # functorch-compatible (vjp)
        pass

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        g = grad[0]  # [H, r, K]
        h, r, n_keys = g.shape
        width = r + n_keys  # row i of g at columns [r - 1 - i, r - 1 - i + K) of buffer row i
        buf = g.new_zeros(h, r, width)
        buf.as_strided((h, r, n_keys), (r * width, width - 1, 1), buf.storage_offset() + r - 1).copy_(g)
        return buf.sum(-2)[:, :r + n_keys - 1], None
