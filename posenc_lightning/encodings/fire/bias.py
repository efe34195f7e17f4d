"""`FireBias`: FIRE's bias (Li et al., 2024, eq. 3) described by its O(N) data — positions, ``c``,
the threshold ``L``, ``eps`` and the MLP ``f_theta`` (``1 -> W -> H``, ReLU) — so that every
``N x N`` value is computed where it is used: rows (SDPA), a ``score_mod`` (flex) or a tile of
the Triton kernels, which also reduce its parameter gradients per tile."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from posenc_lightning.encodings.bias.forms import HandRows, ValueDependentForm
from posenc_lightning.encodings.bias.kinds import Bias, BiasSum, KernelBias, OpaqueOperands, ScoreTerm
from posenc_lightning.encodings.bias.opaque import register_opaque_kind
from posenc_lightning.encodings.bias.tile import TileBias, register_tile_kind
from posenc_lightning.encodings.bias.windows import same_positions
from posenc_lightning.encodings.fire import by_distance, compiled, segment_rows, template
from posenc_lightning.encodings.fire.rows import fire_rows
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.positions import arange_offset
from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables

__all__ = ["FireBias", "FireTableSum"]

#: FIRE's name as an opaque operator's kind (`OpaqueOperands.kind`) and as a kernel tile (`TileBias.name`)
KIND = "fire"


@dataclass(eq=False)
class FireBias(Bias):
    """``weight * f_theta(psi(i - j) / (psi(max(L, i)) + eps))`` with ``psi(x) = log(|c x| + 1)``,
    ``f_theta(x) = w2 relu(w1 x + b1) + b2`` and ``L = |l_mult * init_L|`` (FIRE eq. 3 and its
    reference code), at the tokens' positions.

    The parameters are held as given (``c`` ``[1]``, ``l_mult`` ``[1]``, ``init_L`` a constant,
    ``w1`` ``[W, 1]`` (``Linear(1, W).weight``), ``b1`` ``[W]``, ``w2`` ``[H, W]``, ``b2`` ``[H]``,
    ``weight`` a scalar or None): whatever is derived from them is derived per call, so one bias
    can be differentiated several times (blockwise SDPA's recomputed rows).

    Its cheapest exact form depends on values (`template`): below ``L`` an O(N) table of
    ``f(i - j)``, past it the MLP per pair, so a compiled graph takes it as an opaque operator's
    operands (`value_dependent`), whose backward differentiates rows in the inductor-compiled
    formula (`compiled_rows_from`). At known ``start + arange`` positions it computes rows by
    distance and differentiates them by hand (`hand_rows`: `causal_rows`, `rows_and_pullback`)."""

    q_pos: Tensor  # [B, Nq]
    k_pos: Tensor  # [B, Nk]
    c: Tensor
    l_mult: Tensor
    init_L: Tensor
    w1: Tensor
    b1: Tensor
    w2: Tensor
    b2: Tensor
    eps: float = 1e-6
    weight: Tensor | None = None
    q_start: int | None = None  # every row of q_pos / k_pos is start + arange (`AttentionContext`)
    k_start: int | None = None
    #: the call's tunables (`Mode.tunables`): the rows' unit selection (`fire_rows`)
    tunables: Tunables = DEFAULT_TUNABLES
    recomputable = True
    #: a block's rows cost a fixed number of operators and keep their unit selection (`_memo`) from
    #: the forward's block for the backward's block of the same rows (`Bias.forward_blocks`)
    forward_blocks = True
    fused_in: ClassVar[frozenset[str]] = frozenset({"kernel", "score_mod"})
    # inductor's flex backward does not lower its per-unit MLP: flex refuses it for training
    score_mod_backward: ClassVar[bool] = False
    #: the blocks' selections by distance (`_memo`), for this call's forward and backward
    _selections: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def rows_shape(self) -> tuple[int, int] | None:
        return self.q_pos.shape[1], self.k_pos.shape[1]  # the MLP per pair: computed by rows

    def grad_inputs(self) -> tuple[Tensor, ...]:
        params = (self.c, self.l_mult, self.w1, self.b1, self.w2, self.b2)
        return params if self.weight is None else (*params, self.weight)

    @staticmethod
    def _mlp_out(views: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """``(w2, b2)`` with the scale folded in (``w f = (w w2) relu(..) + w b2``)."""
        w2, b2 = views[4], views[5]
        return (w2, b2) if len(views) == 6 else (w2 * views[6], b2 * views[6])

    def _positions(self, start: int, stop: int, k_stop: int) -> tuple[Tensor, Tensor]:
        qp, kp = self.q_pos[:, start:stop], self.k_pos[:, :k_stop]
        return (qp[:1], kp[:1]) if self._one_row else (qp, kp)  # rows shared by the batch: computed once

    def rows_from(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor],
                  table: Tensor | None = None, diagonal: int | None = None, reuse: bool = False) -> Tensor:
        """The rows from ``views`` of `grad_inputs`; ``table``: a distance-only term's window ``[H,
        rows + k_stop - 1]`` (``table[h, rows - 1 - r + j]`` at row r, key j) added to them, inside
        the MLP's per-distance intercept (`FireTableSum`; only at known ``start + arange``
        positions); ``diagonal``: as `causal_rows`'; ``reuse``: as `causal_rows`' (by distance,
        without grad)."""
        c, l_mult, w1, b1 = views[:4]
        w2, b2 = self._mlp_out(views)
        qp, kp = self._positions(start, stop, k_stop)
        if Mode.tracing():  # the traced formula (`fire_rows` inside a traced
            # torch.func.vjp failed functorch's level check)
            return compiled.traced_rows(qp, kp, c, l_mult * self.init_L, w1, b1, w2, b2, self.eps)
        arange = self.q_start is not None and self.k_start is not None  # psi(i - j) then by distance
        shift = self.q_start + start - self.k_start if arange else None
        last = _last_column(start, stop, diagonal)
        return fire_rows(qp, kp, c, (l_mult * self.init_L).abs(), w1[:, 0], b1, w2, b2, self.eps, shift,
                         table, self._memo(start, stop, k_stop, views, last)
                         if arange and not torch.is_grad_enabled() else None, last, self.tunables, reuse).float()

    def causal_rows(self, start: int, stop: int, k_stop: int, diagonal: int) -> Tensor:
        """`rows`; at known ``start + arange`` positions (by distance) the switching units are not
        evaluated on the keys the caller's mask hides (the block's negative distances, where a
        unit that switches about distance 0 would be evaluated a second time): those keys hold the
        folded units' values only. Without grad they are written into a buffer that the next hand
        rows of this thread overwrite (`HandRows`: the caller consumes them first)."""
        return self.rows_from(start, stop, k_stop, self.grad_inputs(), diagonal=diagonal, reuse=True)

    def rows_and_pullback(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor], need: Sequence[bool],
                          diagonal: int | None = None, table: Tensor | None = None
                          ) -> tuple[Tensor, Callable[[Tensor], tuple[Tensor, ...]]] | None:
        """At known ``start + arange`` positions (rows by distance), `rows_from` and its gradient
        by `by_distance.rows_and_pullback`, the chain to the views (``L = |l_mult init_L|``, ``w1``
        ``[W, 1]``, the scale folded into ``w2``, ``b2``) by hand; ``table`` as `rows_from`'s. With
        ``table`` the pullback's first gradient is the table's (always), then the views' where
        ``need``; ``diagonal``: as `causal_rows`' (and ``d_rows`` 0 past it). None elsewhere (the
        engine differentiates `rows_from`)."""
        if self.q_start is None or self.k_start is None or not self._one_row or stop <= start or k_stop <= 0 \
                or Mode.tracing():
            return None
        c, l_mult, w1, b1, w2, b2 = views[:6]
        weight = views[6] if len(views) == 7 else None
        qp, kp = self._positions(start, stop, k_stop)
        t = l_mult * self.init_L
        w2s, b2s = (w2, b2) if weight is None else (w2 * weight, b2 * weight)
        last = _last_column(start, stop, diagonal)
        shift = self.q_start + start - self.k_start
        got = segment_rows.rows_and_pullback(c, t.abs(), w1[:, 0], b1, w2s, b2s, table, qp, kp, self.eps, shift,
                                             need[0] or need[1], last, self.tunables, self._selections)
        rows, pullback = got if got is not None else by_distance.rows_and_pullback(
            c, t.abs(), w1[:, 0], b1, w2s, b2s, table, qp, kp, self.eps, shift, need[0] or need[1],
            self._memo(start, stop, k_stop, views, last), last, self.tunables)

        def grads(d_rows: Tensor) -> tuple[Tensor, ...]:
            gc, gthr, gw1, gb1, gw2, gb2, gt = pullback(d_rows)
            out = [gc, (gthr * t.sgn() * self.init_L).sum_to_size(l_mult.shape), gw1[:, None], gb1,
                   gw2 if weight is None else gw2 * weight, gb2 if weight is None else gb2 * weight]
            if weight is not None:
                out.append(((gw2 * w2).sum() + (gb2 * b2).sum()).reshape(weight.shape))
            out = [g.to(v.dtype) for g, v, n in zip(out, views, need) if n]
            return tuple(out) if table is None else (gt, *out)

        return rows.float(), grads

    def _memo(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor], last: int | None = None
              ) -> by_distance.Memo | None:
        """Where a block's selection by distance is kept (`by_distance._selection`): computed once
        for the engine's forward and backward blocks of the same rows (grad mode off), keyed by the
        block and the storage and version of ``c``, ``l_mult``, ``w1``, ``b1`` (the views of the
        same parameters share them; an in-place update changes the version) and ``last`` (the
        selection stops there, `by_distance._selection`). None for tensors
        with no storage of their own (a functorch transform's)."""
        try:
            key = (start, stop, k_stop, last, *((v.data_ptr(), v._version) for v in views[:4]))
        except RuntimeError:
            return None
        return self._selections, key

    def compiled_rows_from(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        """The traced formula compiled by inductor (`compiled.compiled_rows`)."""
        c, l_mult, w1, b1 = views[:4]
        w2, b2 = self._mlp_out(views)
        qp, kp = self._positions(start, stop, k_stop)
        return compiled.compiled_rows()(qp, kp, c, l_mult * self.init_L, w1, b1, w2, b2, self.eps)

    def value_dependent(self) -> ValueDependentForm | None:
        """Operands: positions, ``init_L`` and the parameters (`from_operands` rebuilds the bias);
        None once scaled (the traced rows then)."""
        if self.weight is not None:
            return None
        starts = tuple(-1 if s is None else s for s in (self.q_start, self.k_start))
        operands = OpaqueOperands(KIND, (self.q_pos, self.k_pos, self.init_L, *self.grad_inputs()), starts,
                                  (self.eps, *self.tunables.as_floats()))
        return ValueDependentForm(operands, self.distance_shift, self.distance_table, self.compiled_rows_from)

    def hand_rows(self) -> HandRows:
        return HandRows(self.causal_rows, self.rows_and_pullback)

    @classmethod
    def from_operands(cls, tensors: Sequence[Tensor], ints: Sequence[int], floats: Sequence[float]) -> FireBias:
        """The bias again from its operands (`value_dependent`; registered, `register_opaque_kind`):
        ``floats`` are ``eps`` and the tunables (`Tunables.as_floats`)."""
        q_pos, k_pos, init_L, c, l_mult, w1, b1, w2, b2 = tensors
        q_start, k_start = (None if s < 0 else s for s in ints)
        return cls(q_pos, k_pos, c, l_mult, init_L, w1, b1, w2, b2, eps=floats[0], q_start=q_start, k_start=k_start,
                   tunables=Tunables.from_floats(list(floats[1:])))

    def distance_shift(self) -> int | None:
        """Every query below ``L`` (`template.below_threshold`) at integer ``start + arange`` positions."""
        qp, kp = self.q_pos, self.k_pos
        if qp.dtype.is_floating_point or kp.dtype.is_floating_point or not qp.numel() or not kp.numel():
            return None
        top = qp.shape[-1] - 1 + self.q_start if self.q_start is not None else float(qp.max())
        if not template.below_threshold(top, self.l_mult * self.init_L):
            return None
        a, c = arange_offset(qp, self.q_start), arange_offset(kp, self.k_start)
        return None if a is None or c is None else a - c

    def distance_table(self, distances: Tensor) -> Tensor:
        return template.distance_table(distances, self.c, self.l_mult * self.init_L, self.eps, self.w1, self.b1,
                                       *self._mlp_out(self.grad_inputs()))

    @property
    def _one_row(self) -> bool:
        """Every batch row has the same positions (known ``start + arange``, or expanded): rows are
        computed once, ``[1, H, r, K]``."""
        qp, kp = self.q_pos, self.k_pos
        return (self.q_start is not None and self.k_start is not None or qp.stride(0) == kp.stride(0) == 0
                or qp.shape[0] == kp.shape[0] == 1)

    @property
    def fresh_rows(self) -> bool:
        """New tensors, but rows shared by a batch of several take no per-batch mask in place."""
        return self.q_pos.shape[0] == 1 or not self._one_row

    def rows(self, start: int, stop: int, k_stop: int) -> Tensor:
        return self.rows_from(start, stop, k_stop, self.grad_inputs())

    def materialize(self) -> Tensor:
        return self.rows(0, self.q_pos.shape[1], self.k_pos.shape[1])

    def scaled(self, w: Tensor) -> Bias:
        """Still a FIRE bias: the scale is folded into ``w2``, ``b2`` where it is used."""
        return FireBias(self.q_pos, self.k_pos, self.c, self.l_mult, self.init_L, self.w1, self.b1, self.w2, self.b2,
                        self.eps, w if self.weight is None else self.weight * w, self.q_start, self.k_start,
                        self.tunables)

    def score_term(self, b_size: int, n_heads: int) -> ScoreTerm:
        """The MLP per (b, h, q_idx, kv_idx), one hidden unit at a time (no tensor beyond scalars)."""
        f32 = torch.float32
        qp, kp = self.q_pos.to(f32), self.k_pos.to(f32)
        c = self.c.to(f32).reshape(())
        thr = (self.l_mult * self.init_L).abs().to(f32).reshape(())
        w2, b2 = (t.to(f32) for t in self._mlp_out(self.grad_inputs()))
        w1, b1 = self.w1.to(f32)[:, 0], self.b1.to(f32)
        eps, width = self.eps, self.width

        def term(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
            i = qp[b, qi]
            x = torch.log1p((c * (i - kp[b, ki])).abs()) / (torch.log1p((c * torch.maximum(i, thr)).abs()) + eps)
            out = b2[h]
            for u in range(width):
                out = out + w2[h, u] * torch.relu(w1[u] * x + b1[u])
            return out

        return term

    def fold_into(self, args: KernelBias) -> None:
        if args.tile is not None or not args.claim_positions(self.q_pos, self.k_pos):
            return super().fold_into(args)  # the kernels evaluate one tile bias
        args.tile = self.kernel_tile()

    def kernel_tile(self, dtype: torch.dtype | None = None) -> TileBias:
        """FIRE's tile for the Triton kernels (`encodings.fire.tile`): the MLP evaluated per tile.

        Args:
            dtype: the dtype of the packed parameters (default: float32, float64 for float64
                parameters; the kernels cast them to their accumulation dtype).

        Returns:
            The tile, its ``params`` `kernel_params` (differentiable).
        """
        from posenc_lightning.encodings.fire.tile import kernel_tile

        if dtype is None:
            dtype = functools.reduce(torch.promote_types, (t.dtype for t in self.grad_inputs()), torch.float32)
        return kernel_tile(self.kernel_params(dtype), self.width, self.eps)

    def kernel_params(self, dtype: torch.dtype) -> Tensor:
        """The kernels' packed parameters ``[c, L, w1 (W), b1 (W), b2 (H), w2 (H x W)]`` in ``dtype``
        (differentiable: the kernels' gradient of it reaches every parameter)."""
        w2, b2 = self._mlp_out(self.grad_inputs())
        parts = (self.c.reshape(1), (self.l_mult * self.init_L).abs().reshape(1), self.w1[:, 0], self.b1, b2,
                 w2.reshape(-1))
        return torch.cat([t.to(dtype) for t in parts])

    @property
    def width(self) -> int:
        return self.w1.shape[0]


register_opaque_kind(KIND)(FireBias.from_operands)


@register_tile_kind(KIND)
def example_tile(n_heads: int) -> TileBias:
    """A FIRE tile with zero parameters of the paper's width, to compile the kernels with
    (`posenc_lightning.kernels.resource_report`; triton is imported here, not at registration).

    Args:
        n_heads: H.

    Returns:
        The tile.
    """
    from posenc_lightning.encodings.fire import tile

    return tile.example_tile(n_heads)


def _last_column(start: int, stop: int, diagonal: int | None) -> int | None:
    """The last column of a block's distance layout (`by_distance`) that a causal mask shows: row
    ``r`` reads key ``m - (R - 1 - r)`` at column ``m`` and sees keys up to ``diagonal + r``, so every
    row sees columns up to ``diagonal + R - 1``, and none past it."""
    return None if diagonal is None else diagonal + stop - start - 1


@dataclass(eq=False)
class FireTableSum(BiasSum):
    """FIRE's bias plus distance-only terms (a mixture's ALiBi and T5 buckets): a `BiasSum` whose
    rows, at known ``start + arange`` positions, add the terms' table of distances inside FIRE's
    per-distance intercept (`FireBias.rows_from`'s ``table``; FIRE computes its rows by distance,
    so the table is one more value per column) instead of as a block of its own, and whose
    table gradient is FIRE's column sums. Every other form (score terms, kernels, compiled) is the
    `BiasSum`'s."""

    @classmethod
    def of(cls, bias: Bias | None) -> Bias | None:
        """``bias`` as a `FireTableSum` where it is a sum of one `FireBias` and distance-only terms."""
        terms = [] if bias is None else bias.terms  # a sum's parts; any other kind is its one term
        if len(terms) < 2 or sum(isinstance(p, FireBias) for p in terms) != 1:
            return bias
        if not all(isinstance(p, FireBias) or p.distance_only for p in terms):
            return bias
        return cls(list(terms))

    def _fire_term(self) -> int | None:
        """The index of the FIRE term whose rows take the table, or None (no table, positions not
        a known ``start + arange``, or another term left beside it)."""
        g = self._group
        if g is None or not g.arange:
            return None
        rest = [i for i in range(len(self.parts)) if i not in g.terms]
        if len(rest) != 1:
            return None
        f = self.parts[rest[0]]
        if not isinstance(f, FireBias) or f.q_start is None or f.k_start is None or not f._one_row:
            return None
        return rest[0] if same_positions(f.q_pos, g.q_pos) and same_positions(f.k_pos, g.k_pos) else None

    def rows_and_pullback(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor], need: Sequence[bool],
                          diagonal: int | None = None
                          ) -> tuple[Tensor, Callable[[Tensor], tuple[Tensor, ...]]] | None:
        """Where FIRE's rows take the table (`_fire_term`), `FireBias.rows_and_pullback` with the
        table's window (``views[0]``, `BiasSum.grad_inputs`' first): its gradient FIRE's column
        sums; the rows as `rows`' (expanded to the batch; the pullback sums it); ``diagonal``: as
        `FireBias.causal_rows`'."""
        i = self._fire_term() if stop > start and k_stop > 0 else None
        if i is None:
            return None
        got = self.parts[i].rows_and_pullback(start, stop, k_stop, views[1:], need[1:], diagonal, table=views[0])
        if got is None:
            return None
        rows, pullback = got
        b = self._group.q_pos.shape[0]

        def grads(d_rows: Tensor) -> tuple[Tensor, ...]:
            gt, *rest = pullback(d_rows if d_rows.shape[0] == 1 else d_rows.sum(0, keepdim=True))
            return (gt, *rest) if need[0] else tuple(rest)

        return (rows if b == rows.shape[0] else rows.expand(b, *rows.shape[1:])), grads

    def hand_rows(self) -> HandRows:
        return HandRows(self.causal_rows, self.rows_and_pullback)

    def causal_rows(self, start: int, stop: int, k_stop: int, diagonal: int) -> Tensor:
        """`rows`, FIRE's as `FireBias.causal_rows` where its rows take the table."""
        if self._fire_term() is None or stop <= start or k_stop <= 0:
            return self.rows(start, stop, k_stop)
        return self._rows(start, stop, k_stop, None, [None] * len(self.parts), diagonal, reuse=True)

    def _rows(self, start: int, stop: int, k_stop: int, u: Tensor | None,
              views: Sequence[Sequence[Tensor] | None], diagonal: int | None = None, reuse: bool = False) -> Tensor:
        i = self._fire_term() if stop > start and k_stop > 0 else None
        if i is None:
            return super()._rows(start, stop, k_stop, u, views)
        f, v = self.parts[i], views[i]
        if u is None:  # the table's own window (`BiasSum.rows`)
            g = self._group
            u = g.u[g.window(start, stop, k_stop)]
        rows = f.rows_from(start, stop, k_stop, f.grad_inputs() if v is None else v, table=u, diagonal=diagonal,
                           reuse=reuse)
        b = self._group.q_pos.shape[0]  # as the table's rows: one row of positions, expanded
        return rows if b == rows.shape[0] else rows.expand(b, *rows.shape[1:])
