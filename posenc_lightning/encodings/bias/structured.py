"""The structured kinds: O(N) data, every ``N x N`` value computed from it (ALiBi slopes, a
relative table, FoX's cumulative gates)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from posenc_lightning.encodings.bias.kinds import _WIDE, Bias, HeadScaled, KernelBias, KeyOnly, ScoreTerm
from posenc_lightning.encodings.bias.windows import Index, pair_distance, span
from posenc_lightning.functional.positions import host_reads_ok

__all__ = ["DecayBias", "LinearBias", "RelativeBias"]


def _negative_distance(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``-|i - j|`` float32 ``[B, Nq, Nk]``: ALiBi's pattern, scaled by each head's slope.

    Integer positions are subtracted in float64 (exact below 2^53), then rounded to float32 as
    the integer's conversion would: the same values as in int64, in vectorized float passes
    (int64 ``abs`` is a scalar loop, ~2.5x slower per tile)."""
    if not (q_pos.is_floating_point() or k_pos.is_floating_point()):
        q_pos, k_pos = q_pos.double(), k_pos.double()
    return pair_distance(q_pos, k_pos).abs_().to(torch.float32).neg_()


@dataclass(eq=False)
class LinearBias(Bias):
    """ALiBi: ``-slopes[h] * |i - j|`` (Press et al., 2022, eq. 1).

    Args:
        slopes: one slope per head ``[H]``.
        q_pos: query positions ``[B, Nq]``.
        k_pos: key positions ``[B, Nk]``.
    """

    slopes: Tensor  # [H]
    q_pos: Tensor  # [B, Nq]
    k_pos: Tensor  # [B, Nk]
    recomputable = True
    fresh_rows = True
    fused_in: ClassVar[frozenset[str]] = frozenset({"kernel", "score_mod"})
    distance_only = True

    def materialize(self) -> Tensor:
        dist = pair_distance(self.q_pos, self.k_pos).abs().to(torch.float32)
        return -self.slopes.to(torch.float32)[None, :, None, None] * dist[:, None]

    def rows(self, start: int, stop: int, k_stop: int) -> Tensor:
        return LinearBias(self.slopes, self.q_pos[:, start:stop], self.k_pos[:, :k_stop]).materialize()

    def grad_inputs(self) -> tuple[Tensor, ...]:
        return (self.slopes,)

    def rows_from(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        return LinearBias(views[0], self.q_pos, self.k_pos).rows(start, stop, k_stop)

    def at(self, q_pos: Tensor, k_pos: Tensor) -> Bias:
        return LinearBias(self.slopes, q_pos, k_pos)

    @property
    def positions(self) -> tuple[Tensor, Tensor]:
        return self.q_pos, self.k_pos

    def key_only(self, dtype: torch.dtype, plain_causal: bool, ascending: bool = False) -> KeyOnly | None:
        """Causal ALiBi with keys never after their queries in position: where ``j <= i``,
        ``-m_h (i - j) = m_h j - m_h i``, i.e. ``m_h (j - c)`` for any constant c (the middle
        position, which keeps the channel small). bf16 cannot hold ``m_h j``: wide dtypes only.
        Ascending positions are known (``ascending``) or read where that is free."""
        qp, kp = self.q_pos, self.k_pos
        if not plain_causal or dtype not in _WIDE or qp.dim() != 2 or qp.shape != kp.shape:
            return None
        if not ascending and not (host_reads_ok(qp) and (kp is qp or torch.equal(kp, qp))
                                  and bool((qp[:, 1:] >= qp[:, :-1]).all())):
            return None
        pos = kp.to(dtype)
        centered = pos - (pos[:, :1] + pos[:, -1:]) / 2  # [B, Nk]
        # the queries are the keys: query i's own term is -m_h (i - c)
        return KeyOnly(self.slopes.to(dtype), centered[:, None, :], centered[:, None, :])

    def scaled(self, w: Tensor) -> Bias:
        return LinearBias(self.slopes * w, self.q_pos, self.k_pos)

    def head_scaled(self) -> HeadScaled:
        return HeadScaled(self.slopes, _negative_distance)

    def score_term(self, b_size: int, n_heads: int) -> ScoreTerm:
        slopes = self.slopes.to(torch.float32)
        qp, kp = self.q_pos.to(torch.float32), self.k_pos.to(torch.float32)
        return lambda b, h, qi, ki: -slopes[h] * (qp[b, qi] - kp[b, ki]).abs()

    def fold_into(self, args: KernelBias) -> None:
        if not args.claim_positions(self.q_pos, self.k_pos):
            return super().fold_into(args)
        args.slopes = self.slopes if args.slopes is None else args.slopes + self.slopes


@dataclass(eq=False)
class RelativeBias(Bias):
    """``table[h, clamp(i - j, -R, R) + R]`` for a table ``[H, 2R + 1]`` (T5, any f(i - j)).

    Args:
        table: the values by distance ``[H, 2R + 1]``, distance ``-R`` first.
        q_pos: query positions ``[B, Nq]``.
        k_pos: key positions ``[B, Nk]``.
    """

    table: Tensor  # [H, 2R+1]
    q_pos: Tensor
    k_pos: Tensor
    recomputable = True
    fresh_rows = True
    fused_in: ClassVar[frozenset[str]] = frozenset({"kernel", "score_mod"})
    distance_only = True

    @property
    def max_distance(self) -> int:
        return (self.table.shape[-1] - 1) // 2

    def materialize(self) -> Tensor:
        r = self.max_distance
        idx = pair_distance(self.q_pos, self.k_pos).long().clamp(-r, r) + r  # [B, Nq, Nk]
        out = self.table.to(torch.float32)[:, idx]  # [H, B, Nq, Nk]
        return out.permute(1, 0, 2, 3)

    def rows(self, start: int, stop: int, k_stop: int) -> Tensor:
        return RelativeBias(self.table, self.q_pos[:, start:stop], self.k_pos[:, :k_stop]).materialize()

    def grad_inputs(self) -> tuple[Tensor, ...]:
        return (self.table,)

    def rows_from(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        return RelativeBias(views[0], self.q_pos, self.k_pos).rows(start, stop, k_stop)

    def at(self, q_pos: Tensor, k_pos: Tensor) -> Bias:
        return RelativeBias(self.table, q_pos, k_pos)

    @property
    def positions(self) -> tuple[Tensor, Tensor]:
        return self.q_pos, self.k_pos

    def scaled(self, w: Tensor) -> Bias:
        return RelativeBias(self.table * w, self.q_pos, self.k_pos)

    def score_term(self, b_size: int, n_heads: int) -> ScoreTerm:
        r = self.max_distance
        table = self.table.to(torch.float32)
        qp, kp = self.q_pos.long(), self.k_pos.long()
        return lambda b, h, qi, ki: table[h, (qp[b, qi] - kp[b, ki]).clamp(-r, r) + r]

    def widened(self, r: int) -> Tensor:
        """The same values as a wider table, its edges repeated.

        Args:
            r: the new largest distance (``r >= max_distance``).

        Returns:
            The table over ``[-r, r]``, ``[H, 2r + 1]``.
        """
        if r == self.max_distance:
            return self.table
        idx = torch.arange(-r, r + 1, device=self.table.device).clamp(-self.max_distance, self.max_distance)
        return self.table[:, idx + self.max_distance]

    def fold_into(self, args: KernelBias) -> None:
        if not args.claim_positions(self.q_pos, self.k_pos):
            return super().fold_into(args)
        if args.table is None:
            args.table = self.table
            return
        # the kernels read one table: the sum of both over the wider range (FIRE below L + T5 in a mixture)
        other = RelativeBias(args.table, self.q_pos, self.k_pos)
        r = max(self.max_distance, other.max_distance)
        args.table = other.widened(r) + self.widened(r)


@dataclass(eq=False)
class DecayBias(Bias):
    """``c_q[b, h, i] - c_k[b, h, j]`` from cumulative log-gates (FoX, Lin et al., 2025).

    Args:
        c_q: the queries' cumulative log-gates ``[B, H, Nq]``.
        c_k: the keys' cumulative log-gates ``[B, H, Nk]``.
    """

    c_q: Tensor  # [B, H, Nq]
    c_k: Tensor  # [B, H, Nk]
    recomputable = True
    fresh_rows = True
    fused_in: ClassVar[frozenset[str]] = frozenset({"kernel", "score_mod"})

    def materialize(self) -> Tensor:
        return self.c_q.to(torch.float32)[..., :, None] - self.c_k.to(torch.float32)[..., None, :]

    def rows(self, start: int, stop: int, k_stop: int) -> Tensor:
        return DecayBias(self.c_q[..., start:stop], self.c_k[..., :k_stop]).materialize()

    def grad_inputs(self) -> tuple[Tensor, ...]:
        return (self.c_q, self.c_k)

    def input_windows(self, start: int, stop: int, k_stop: int) -> tuple[Index, ...]:
        return (span(start, stop), span(0, k_stop))

    def rows_from(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        return DecayBias(views[0], views[1]).materialize()

    def key_only(self, dtype: torch.dtype, plain_causal: bool, ascending: bool = False) -> KeyOnly | None:
        """``c_i - c_j`` is ``-(c_j - c)`` up to the query's own term, under any mask, for a
        constant c (the middle of the range, to keep the channel small; it carries no gradient,
        so ``c_k``'s gradient comes through the channel and ``c_q``'s is exactly 0)."""
        if dtype not in _WIDE:  # bf16 cannot hold c
            return None
        c_k = self.c_k.to(dtype)
        centre = (c_k.amax(-1, keepdim=True) + c_k.amin(-1, keepdim=True)).detach() / 2
        return KeyOnly(None, centre - c_k)

    def scaled(self, w: Tensor) -> Bias:
        return DecayBias(self.c_q * w, self.c_k * w)

    def score_term(self, b_size: int, n_heads: int) -> ScoreTerm:
        # compiled flex differentiates a captured tensor indexed once: c_k is often c_q itself
        cq, ck = self.c_q.to(torch.float32), self.c_k.to(torch.float32).clone()
        return lambda b, h, qi, ki: cq[b, h, qi] - ck[b, h, ki]

    def fold_into(self, args: KernelBias) -> None:
        args.c_q = self.c_q if args.c_q is None else args.c_q + self.c_q
        args.c_k = self.c_k if args.c_k is None else args.c_k + self.c_k
