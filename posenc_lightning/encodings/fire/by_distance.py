"""FIRE's rows at known ``start + arange`` positions, computed by distance (`_FireDiagonalRows`, called
by `rows.fire_rows`), forward and backward written out (Li et al., 2024, eq. 3); the helpers it
shares with the rows by key are in `functions`, its tuning knobs in the call's `Tunables`
(``fire_column_group``, ``fire_span_slack``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posenc_lightning.encodings.fire.functions import _distances, _runs
from posenc_lightning.encodings.fire.layouts import distance_layout, end_layouts, padded_rows
from posenc_lightning.functional.fire import fire_mlp_fold, fire_psi, fire_unit_states
from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables

# Rows at ``start + arange`` positions, by distance: ``x[r, j] = p[R - 1 - r + j] / n[r]`` with ``p``
# the block's ``R + C - 1`` values of ``psi(i - j)`` (descending distances) and ``n`` the rows'
# normalizers. In the "distance layout" ``[R, T]`` (row ``r``, table index ``m``; row ``r`` of the
# block reads ``m`` in ``[R - 1 - r, R - 1 - r + C)``) a column holds one distance for every row,
# so its ``x`` spans only the rows' spread of ``n`` (a few percent of ``[0, 1]``): nearly every unit
# keeps its sign down a whole group of columns and is folded into a per-column ``A x + B``; a unit
# switches in a narrow band of distances (where ``psi(d) ~ t n``), evaluated per element there. The
# block is then its skewed view (one copy). In the key layout a unit's switch is a diagonal line
# crossing every group of keys a block's rows see, so far more of them switched per group.


def _distance_x(p: Tensor, n: Tensor, dt: torch.dtype) -> Tensor:
    """``x`` in the distance layout ``[R, T]``: ``p[m] / n[r]`` (float32, as the formula), in ``dt``."""
    return (p[None, :] / n[:, None]).to(dt)


def _diagonal_select(p: Tensor, n: Tensor, dt: torch.dtype, w1: Tensor, b1: Tensor, group: int, slack: int
                     ) -> tuple[Tensor, list[tuple[list[int], int, int]]]:
    """The units selected per group of ``group`` columns of ``x = p / n`` (distance
    layout, `_distance_x`): ``on`` ``[groups, W]`` (0/1, folded into ``A x + B`` there) and the
    runs ``(units, first column, column past the last)`` where units are evaluated per element.

    A column's min and max of ``x`` are ``p / max n`` and ``p / min n`` (the same division, monotone).
    A unit switches in a group where its pre-activation (the per-element arithmetic, monotone in
    ``x``) has different signs at the group's min and max of ``x``. Each maximal run of groups
    where a unit switches is a span (``p`` is V-shaped about distance 0: a unit may switch twice);
    spans are merged into runs of units evaluated together (`_merge_spans`, within ``slack``), and
    a unit is folded nowhere inside a run of its own."""
    nc = p.shape[-1]
    g = group
    groups = -(-nc // g)
    pg = torch.nn.functional.pad(p, (0, groups * g - nc), value=float(p[-1])).view(groups, g)  # repeats: no new extremes
    # x's extremes per group: p's, divided by n's (a positive divisor keeps the order)
    ends = torch.stack(torch.aminmax(pg, dim=1)) / torch.stack(torch.aminmax(n)).flip(0)[:, None]  # [2, groups]
    on, straddling = fire_unit_states(*ends.to(dt), w1, b1)  # [groups, W]
    edges = torch.nn.functional.pad(straddling.t().to(torch.int8), (1, 1)).diff(dim=1)  # [W, groups + 1]
    flips = edges.nonzero().tolist()  # (unit, group) where a span starts, then where it stops
    runs = _merge_spans([[u, f, e] for (u, f), (_, e) in zip(flips[::2], flips[1::2])], n.shape[0], g, slack)
    if runs:  # evaluated per element there: folded nowhere in the run (one indexing for all runs)
        w = on.shape[1]
        on.view(-1)[torch.tensor([q * w + u for units, a, z in runs for q in range(a, z) for u in units])] = False
    return on.to(dt), [(units, a * g, min(z * g, nc)) for units, a, z in runs]


def _merge_spans(spans: list[list[int]], rows: int, group: int, slack: int) -> list[tuple[list[int], int, int]]:
    """Spans ``(unit, first group, group past the last)`` merged into runs ``(units, first, past
    the last)`` that cover disjoint groups (so no unit is evaluated twice on a column): spans
    that overlap share a run over their union; one that starts past a run joins it when the
    elements this adds (``rows`` per column of each widened span, ``group`` columns a group) stay
    under ``slack`` (a run costs a fixed number of operations). A unit is listed once per run."""
    g = group
    out: list[tuple[list[int], int, int]] = []
    units: list[int] = []
    lo = hi = 0
    for u, f, e in sorted(spans, key=lambda s: (s[1], -s[2])):
        if units and f >= hi:  # disjoint from the run: join it only within the slack
            new = u not in units
            extra = ((max(hi, e) - hi) * len(units) + ((max(hi, e) - lo) - (e - f) if new else 0)) * g * rows
            if extra > slack:
                out.append((units, lo, hi))
                units = []
        if not units:
            units, lo, hi = [u], f, e
            continue
        if u not in units:
            units.append(u)
        hi = max(hi, e)
    return out + ([(units, lo, hi)] if units else [])


def _group_coef(on: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, nc: int, group: int) -> Tensor:
    """``[2H, C]``: per column, the slope ``A`` and the intercept ``B - b2`` of the units folded there
    (``on`` per group of ``group`` columns, `fire_mlp_fold`)."""
    return fire_mlp_fold(on, w1, b1, w2).repeat_interleave(group, 1)[:, :nc]


def _run_budget(size: int) -> int:
    """The elements a run's hidden units and product may take at once: 1/16 of a block of ``size``
    (its peak stays the block's), or 2^17 in small blocks (fewer, larger steps)."""
    return max(size // 16, 1 << 17)


def _run_steps(units: list[int], a: int, z: int, rows: int, heads: int, budget: int):
    """``(units index, first column, column past the last)``: a run's columns by chunks whose hidden
    units and product stay within ``budget`` elements."""
    step = max(1, budget // (max(len(units), heads) * rows))
    for a0 in range(a, z, step):
        yield a0, min(z, a0 + step)


class _RunSteps:
    """A block's runs (`_diagonal_select`) as steps ``(i, j, a, z)``: the run's units ``[i, j)`` of
    `units` (in runs' order) over columns ``[a, z)`` (`_run_steps`), and each step's units one after
    another (`step_units`, for one ``index_add_`` of every step's unit gradients). The runs' units
    are taken as rows of a ``[S, 2 + H]`` packing of ``w1``, ``b1``, ``w2`` (`packed`)."""

    def __init__(self, runs: list[tuple[list[int], int, int]], rows: int, heads: int, budget: int,
                 device: torch.device) -> None:
        self.steps: list[tuple[int, int, int, int]] = []
        flat: list[int] = []
        each: list[int] = []
        for us, a, z in runs:
            i = len(flat)
            flat.extend(us)
            for a0, z0 in _run_steps(us, a, z, rows, heads, budget):
                self.steps.append((i, len(flat), a0, z0))
                each.extend(us)
        self.units = torch.tensor(flat, device=device)
        self.step_units = self.units if len(each) == len(flat) else torch.tensor(each, device=device)

    def packed(self, w1: Tensor, b1: Tensor, w2: Tensor) -> Tensor:
        """``[S, 2 + H]``: ``w1``, ``b1`` and ``w2`` of the runs' units."""
        return torch.cat((w1[:, None], b1[:, None], w2.t()), 1).index_select(0, self.units)


def _step_x(p: Tensor, n_col: Tensor, a: int, z: int, dt: torch.dtype) -> Tensor:
    """``x = p / n`` ``[1, R (z - a)]`` of columns ``[a, z)`` (the formula's division), in ``dt``;
    ``n_col`` ``[R, 1]``."""
    x = torch.div(p[a:z], n_col).view(1, -1)
    return x if x.dtype == dt else x.to(dt)


def _diagonal_rows(p: Tensor, n: Tensor, dt: torch.dtype, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor,
                   on: Tensor, runs: list[tuple[list[int], int, int]], n_keys: int, group: int,
                   table: Tensor | None = None, keep: list[Tensor | None] | None = None, reuse: bool = False
                   ) -> tuple[Tensor, Tensor]:
    """The block ``[1, H, R, C]`` of ``x = p / n`` and the folded units' per-column slope and
    intercept ``[2H, T]``: computed in the distance layout ``[H, R, T]`` of its own buffer
    (`padded_rows`), per column the folded units' ``A x + B`` (one pass), then the runs' units per
    element. No skewed copy: the rows are the buffer's other view.

    In float32 the folded pass is ``B + (A p) (1 / n)``: a ``[H, T]`` and an ``[R]`` factor, so no
    ``[R, T]`` ``x`` is built or read (the runs take their columns' ``x``, the formula's division);
    in a wider dtype ``A x + B`` with the formula's float32 ``x``.

    ``keep`` (a list): each run step's hidden units ``relu(w1 x + b1)`` ``[U, R S]`` are appended,
    for the pullback to reuse instead of recomputing them, while together they hold at most a
    quarter of the block's elements or 2^18 (None for a step past that: recomputed there).
    ``reuse``: the buffer is `padded_rows`' reused one."""
    nr, nt = n.shape[0], p.shape[0]
    h = w2.shape[0]
    rows, dist = padded_rows(h, nr, n_keys, dt, p.device, reuse)
    ab = _group_coef(on, w1, b1, w2, nt, group)
    b = ab[h:] + b2[:, None] if table is None else ab[h:] + b2[:, None] + table.to(dt)  # a table: per column
    if dt == p.dtype:
        torch.addcmul(b[:, None], (ab[:h] * p)[:, None], (1 / n)[:, None], out=dist)
    else:
        torch.addcmul(b[:, None], ab[:h, None], _distance_x(p, n, dt), out=dist)
    if not runs:
        return rows, ab
    plan = _RunSteps(runs, nr, h, _run_budget(h * nr * nt), p.device)
    packed = plan.packed(w1, b1, w2)  # [S, 2 + H]
    w2t = packed[:, 2:].t().contiguous()  # [H, S]: MKL takes a transposed slice of `packed` ~2x slower
    n_col = n[:, None]
    room = max(h * nr * nt // 4, 1 << 18)  # the hidden units kept for the pullback (`keep`)
    for i, j, a0, z0 in plan.steps:
        w = packed[i:j]
        hid = torch.addmm(w[:, 1:2], w[:, :1], _step_x(p, n_col, a0, z0, dt)).relu_()  # [U, R S]
        dist.narrow(2, a0, z0 - a0).add_(torch.mm(w2t[:, i:j], hid).view(h, nr, z0 - a0))  # in place: no write-back
        if keep is not None:
            room -= hid.numel()
            keep.append(hid if room >= 0 else None)
    return rows, ab


class _Diagonals:
    """``g`` ``[H, R, C]`` read in the distance layout (`distance_layout`) without copying most of
    it: columns ``m`` in ``[R - 1, C)`` see every row, ``g[h, r, m - (R - 1) + r]``, a strided view
    of ``g`` itself (rows one element further apart); the two triangles at either end (the first
    and the last ``R - 1`` keys) are laid out on their own, together (`end_layouts`). `pieces`
    are ``(first column, [H, R, width])`` covering ``[0, R + C - 1)`` in order."""

    def __init__(self, g: Tensor) -> None:
        h, r, k = g.shape
        g = g if g.stride(-1) == 1 else g.contiguous()
        self.ends: Tensor | None = None
        if k < r - 1:  # the triangles would overlap: one layout of the whole
            self.pieces = [(0, distance_layout(g))]
            return
        mid = g.as_strided((h, r, k - r + 1), (g.stride(0), g.stride(1) + 1, 1), g.storage_offset())
        if r == 1:
            self.pieces = [(0, mid)]
            return
        self.ends = end_layouts(g)
        self.pieces = [(0, self.ends[:h]), (r - 1, mid), (k, self.ends[h:])]

    def columns(self, a: int, z: int) -> Tensor:
        """Columns ``[a, z)`` ``[H, R, z - a]`` (a copy)."""
        parts = [v[..., max(a - c, 0):min(z - c, v.shape[-1])] for c, v in self.pieces
                 if c < z and c + v.shape[-1] > a]
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, -1)

    def matmul_left(self, m: Tensor) -> Tensor:
        """``m @ layout`` ``[H, X, T]`` for ``m`` ``[X, R]`` (both triangles in one product)."""
        if self.ends is None:
            return torch.matmul(m, self.pieces[0][1])
        e = torch.matmul(m, self.ends)  # [2H, X, R - 1]
        h = e.shape[0] // 2
        return torch.cat((e[:h], torch.matmul(m, self.pieces[1][1]), e[h:]), -1)

    def row_dots(self, u: Tensor) -> Tensor:
        """``sum_h sum_m layout[h, r, m] u[h, m]`` ``[R]`` for ``u`` ``[H, T]``: each piece's product
        taken transposed (``u`` as a row times the piece's transpose, a column-major operand: half
        the time of the piece times a column here)."""
        if self.ends is None:
            v = self.pieces[0][1]
            return torch.matmul(u[:, None], v.transpose(1, 2)).sum((0, 1))
        _, (c, mid), (k, _) = self.pieces
        ue = torch.cat((u[:, :c], u[:, k:]))[:, None]  # [2H, 1, R - 1]
        out = torch.matmul(u[:, None, c:k], mid.transpose(1, 2)).sum((0, 1))
        return out.add_(torch.matmul(ue, self.ends.transpose(1, 2)).sum((0, 1)))


def _diagonal_inputs(c: Tensor, thr: Tensor, q_pos: Tensor, k_pos: Tensor, shift: int) -> tuple[Tensor, Tensor]:
    """``(n [R], p [T])``: the rows' normalizers and ``psi`` of the block's descending distances."""
    n = fire_psi(torch.maximum(q_pos[0].to(torch.float32), thr.to(torch.float32).abs()), c)
    return n, fire_psi(_distances(q_pos, k_pos, shift), c)


#: a block's selection (`_selection`) kept by its bias between the engine's forward and backward
#: (the same blocks where both take a block of the same rows), under a key of its inputs
Memo = tuple[dict, tuple]


def _selection(c: Tensor, thr: Tensor, w1: Tensor, b1: Tensor, q_pos: Tensor, k_pos: Tensor, eps: float,
               shift: int, dt: torch.dtype, tunables: Tunables, memo: Memo | None = None,
               last: int | None = None) -> tuple:
    """``(n, p, on, runs, spans)`` of a block (`_diagonal_inputs`, `_diagonal_select` with the groups
    and slack of ``tunables``); ``memo``: a
    dict and the key of this block's inputs there (the bias's, `FireBias`): computed once per key.
    ``last``: the last column the caller's causal mask shows (`FireBias.causal_rows`): the runs stop
    there, and the columns past it hold the folded units only (finite, masked by the caller)."""
    if memo is not None and memo[1] in memo[0]:
        return memo[0][memo[1]]
    n, p = _diagonal_inputs(c, thr, q_pos, k_pos, shift)
    n = n + eps
    on, runs = _diagonal_select(p, n, dt, w1, b1, tunables.fire_column_group, tunables.fire_span_slack)
    if last is not None:
        runs = [(units, a, min(z, last + 1)) for units, a, z in runs if a <= last]
    spans = torch.tensor([(u, a, z) for units, a, z in runs for u in units], dtype=torch.long).view(-1, 3)
    out = (n, p, on, runs, spans)
    if memo is not None:
        memo[0][memo[1]] = out
    return out


def _forward(c: Tensor, thr: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, table: Tensor | None,
             q_pos: Tensor, k_pos: Tensor, eps: float, shift: int, keep: list[Tensor | None] | None = None,
             memo: Memo | None = None, last: int | None = None,
             tunables: Tunables = DEFAULT_TUNABLES, reuse: bool = False) -> tuple[Tensor, ...]:
    """`_FireDiagonalRows`'s outputs; ``keep``: `_diagonal_rows`' (the runs' hidden units); ``memo``,
    ``last`` and ``tunables``: `_selection`'s; ``reuse``: the rows are written into `padded_rows`'
    reused buffer (valid until the next such call on this thread)."""
    dt = torch.promote_types(torch.promote_types(torch.float32, c.dtype), w2.dtype)  # n's, p's and w2's
    w1, b1, w2, b2 = (t if t.dtype == dt else t.to(dt) for t in (w1, b1, w2, b2))
    n, p, on, runs, spans = _selection(c, thr, w1, b1, q_pos, k_pos, eps, shift, dt, tunables, memo, last)
    group = tunables.fire_column_group
    if not _below(q_pos, thr):
        rows, ab = _diagonal_rows(p, n, dt, w1, b1, w2, b2, on, runs, k_pos.shape[1], group, table, keep, reuse)
        return rows, n, p, on, spans, ab
    # every row the same (one normalizer): its one row of the distance layout, then copied to each
    one, ab = _diagonal_rows(p, n[:1], dt, w1, b1, w2, b2, on, runs, p.shape[0], group, table, keep)
    rows, dist = padded_rows(w2.shape[0], n.shape[0], k_pos.shape[1], dt, p.device, reuse)
    dist.copy_(one[0].expand_as(dist))
    return rows, n, p, on, spans, ab


def _below(q_pos: Tensor, thr: Tensor) -> bool:
    """Every query of the block (``start + arange``, ascending) below ``L``, and more than one: the
    rows share one normalizer ``psi(L) + eps``, so in the distance layout every row is the same
    (``psi(i - j)`` a function of the distance alone). Strictly below: ``max(L, i)``'s gradient
    goes to ``L`` whole for each (at a tie torch splits it)."""
    return q_pos.shape[1] > 1 and bool(q_pos[0, -1] < thr.abs())


class _FireDiagonalRows(torch.autograd.Function):
    """`fire_rows` at ``start + arange`` positions (one row of positions), in the distance layout:
    outputs ``(rows, n, p, on, spans, ab)``, all but rows for backward (the selection of
    `_diagonal_select`, the same forward and backward, by ``tunables``)."""

    @staticmethod
    def forward(c: Tensor, thr: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor,  # type: ignore[override]
                table: Tensor | None, q_pos: Tensor, k_pos: Tensor, eps: float, shift: int, tunables: Tunables):
        return _forward(c, thr, w1, b1, w2, b2, table, q_pos, k_pos, eps, shift, tunables=tunables)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple) -> None:  # functorch-compatible (vjp)
        c, thr, _w1, _b1, _w2, _b2, table, q_pos, k_pos, ctx.eps, ctx.shift, tunables = inputs
        ctx.group = tunables.fire_column_group
        _, n, p, on, spans, ab = output
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)  # no zeros for the outputs kept for backward
        ctx.table = table is not None
        ctx.save_for_backward(c, thr, q_pos, k_pos, n, p, on, spans, ab, *inputs[2:6], table)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor, *_):
        c, thr, q_pos, k_pos, n, p, on, spans, ab, w1, b1, w2, b2, table = ctx.saved_tensors
        if grad is None:
            return (None,) * 12
        grads = _pullback(grad, (c, thr, q_pos, k_pos, n, p, on, spans, ab, w1, b1, w2, b2, table), ctx.shift,
                          ctx.needs_input_grad[0] or ctx.needs_input_grad[1], ctx.table and ctx.needs_input_grad[6],
                          ctx.group)
        return (*grads, None, None, None, None, None)


def rows_and_pullback(c: Tensor, thr: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, table: Tensor | None,
                      q_pos: Tensor, k_pos: Tensor, eps: float, shift: int, need_x: bool, memo: Memo | None = None,
                      last: int | None = None, tunables: Tunables = DEFAULT_TUNABLES
                      ) -> tuple[Tensor, Callable[[Tensor], tuple[Tensor | None, ...]]]:
    """`_FireDiagonalRows`'s rows and its backward as a pullback, with no autograd Function (no
    recording, no ``autograd.grad``: a fixed cost of each of the engine's backward blocks,
    `FireBias.rows_and_pullback`). ``pullback(grad [1, H, R, C])`` gives the Function's
    gradients ``(c, thr, w1, b1, w2, b2, table)`` (``c``'s and ``thr``'s zeros unless ``need_x``;
    ``table``'s None without a table). The runs' hidden units of the rows are kept for the
    pullback (`_diagonal_rows`' ``keep``), not recomputed; ``memo``: `_selection`'s; ``last``: as
    `_selection`'s, ``grad`` then 0 past it (the caller's mask); ``tunables``: the call's. The rows
    are written into `padded_rows`' reused buffer: valid until the next such call on this thread
    (the engine adds them to a block's logits first, `HandRows`)."""
    hids: list[Tensor | None] = []
    rows, n, p, on, spans, ab = _forward(c, thr, w1, b1, w2, b2, table, q_pos, k_pos, eps, shift, hids, memo, last,
                                         tunables, reuse=True)
    saved = (c, thr, q_pos, k_pos, n, p, on, spans, ab, w1, b1, w2, b2, table)
    group = tunables.fire_column_group
    return rows, lambda grad: _pullback(grad, saved, shift, need_x, table is not None, group, hids)


def _pullback(grad: Tensor, saved: tuple, shift: int, need_x: bool, need_table: bool, group: int,
              hids: list[Tensor | None] | None = None) -> tuple[Tensor | None, ...]:
    """`_FireDiagonalRows`'s gradients ``(c, thr, w1, b1, w2, b2, table)`` from ``grad`` and its
    saved tensors (`rows_and_pullback`, the Function's backward; ``group``: the forward's columns per
    selection); ``hids``: the forward's hidden
    units of the run steps (`_diagonal_rows`' ``keep``), recomputed where None or absent."""
    c, thr, q_pos, k_pos, n, p, on, spans, ab, w1, b1, w2, b2, table = saved
    dt = on.dtype
    w1d, b1d, w2d = (t if t.dtype == dt else t.to(dt) for t in (w1, b1, w2))
    g = grad[0] if grad.dtype == dt else grad[0].to(dt)
    qp = q_pos[0]
    if _below(q_pos, thr):  # one row (`_forward`): its gradient is the column sums of the layout
        g = _Diagonals(g).matmul_left(torch.ones(1, n.shape[0], dtype=dt, device=g.device))  # [H, 1, T]
        n, qp = n[:1], qp[:1]
    gw1, gb1, gw2, gb2, gcx, gn, s0 = _diagonal_grads(
        g, p, n, w1d, b1d, w2d, on, ab, spans, _distances(q_pos, k_pos, shift).to(dt) if need_x else None, c.to(dt),
        group, hids)
    gc, gthr = torch.zeros_like(c), torch.zeros_like(thr)
    if need_x:
        gc, gthr = _normalizer_grads(gcx, gn, c, thr, qp)
    gt = s0.to(table.dtype) if need_table else None  # the table: per column
    return gc, gthr, gw1.to(w1.dtype), gb1.to(b1.dtype), gw2.to(w2.dtype), gb2.to(b2.dtype), gt


def _diagonal_grads(g: Tensor, p: Tensor, n: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, on: Tensor, ab: Tensor,
                    spans: Tensor, dist: Tensor | None, c: Tensor, group: int, hids: list[Tensor | None] | None = None
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor]:
    """The gradients of `_diagonal_rows` (``d rows = g`` ``[H, R, C]``) to ``(w1, b1, w2, b2)``, and
    with ``dist`` (the block's descending distances) the direct part of ``c``'s (through ``p``),
    the rows' normalizers' ``gn`` ``[R]`` and the column sums of ``g`` ``[H, T]`` (a table's). With
    ``g`` read in the distance layout (`_Diagonals`) the folded units need two products: its
    column sums (of ``g`` and ``g / n``: ``sum_r g x = p * sum_r g / n``) and its row sums against
    ``A p`` (``sum_m g A x``, for ``n``); the runs' units per element, their hidden units from
    ``hids`` (the forward's, one per run step) where given.

    A run step's gradient to the pre-activations ``gpre`` ``[U, R, S]`` is reduced once, against
    its columns' ``[p, 1, dpsi]`` (``[3, S] @ [S, U R]``), into ``acc`` ``[W, R, 3]``: ``w1``'s
    gradient is ``sum_r acc[.., r, 0] / n_r`` (``x = p / n``), ``b1``'s ``sum_r acc[.., r, 1]``, and
    ``sum_u w1_u acc[u]`` the rows' ``sum g_x p`` and ``sum g_x dpsi`` (the normalizers', ``c``'s)."""
    dt = g.dtype
    h, nr, nk = g.shape
    gd = _Diagonals(g)  # [H, R, T]
    nt = nr + nk - 1
    pd, inv_n = p.to(dt), 1 / n.to(dt)
    s0, sn = gd.matmul_left(torch.stack((torch.ones_like(inv_n), inv_n))).unbind(1)  # [H, T] each
    grp = group
    s01 = torch.nn.functional.pad(torch.stack((s0, sn * pd)), (0, -nt % grp))  # [2, H, groups * grp]
    p0, p1 = s01.view(2, h, -1, grp).sum(-1) @ on  # [H, W] each: sum of g, of g x over the folded
    gw2 = w1 * p1 + b1 * p0
    gw1, gb1 = (w2 * torch.stack((p1, p0))).sum(1)
    gcx = gn = dpsi = None
    if dist is not None:
        a = ab[:h]  # [H, T]
        cz = c * dist
        dpsi = cz.sgn() * dist / (1 + cz.abs())  # d psi(d) / d c  [T]
        gcx = (a * sn).sum(0) @ dpsi
        gn = gd.row_dots(a * pd) * (-inv_n * inv_n)  # [R]
    if not spans.numel():
        return gw1, gb1, gw2, s0.sum(1), gcx, gn, s0
    plan = _RunSteps(_runs(spans), nr, h, _run_budget(h * nr * nt), g.device)  # the forward's steps
    packed = plan.packed(w1, b1, w2)  # [S, 2 + H]
    # each run step's d loss / d pre-activation against its columns' [p, 1, dpsi]
    # [2|3, T], taken as [2|3, S] @ [S, U R]: the long S dimension inner and contiguous, the form
    # MKL runs fastest for so few output rows
    cols = torch.stack((pd, torch.ones_like(pd)) if dist is None else (pd, torch.ones_like(pd), dpsi))
    steps = iter(hids or ())
    n_col = n[:, None]
    per_w2, per_acc = [], []
    for i, j, a0, z0 in plan.steps:
        w = packed[i:j]
        hid = next(steps, None)
        if hid is None:  # recomputed as the forward did: x its division
            hid = torch.addmm(w[:, 1:2], w[:, :1], _step_x(p, n_col, a0, z0, dt)).relu_()
        gs = gd.columns(a0, z0).view(h, -1)  # [H, R S]
        per_w2.append(torch.mm(hid, gs.t()).t())  # [H, U] (MKL: ~1.5x faster than gs @ hid.t())
        gpre = torch.ops.aten.threshold_backward(torch.mm(w[:, 2:], gs), hid, 0)  # relu': 0 at u = 0, as torch
        per_acc.append(torch.mm(cols[:, a0:z0], gpre.view(-1, z0 - a0).t()).t())  # [U R, 2|3]
    gw2.index_add_(1, plan.step_units, torch.cat(per_w2, 1))
    acc = g.new_zeros(w1.shape[0], nr, cols.shape[0])  # [W, R, 2 or 3]
    acc.index_add_(0, plan.step_units, torch.cat(per_acc).view(-1, nr, cols.shape[0]))
    gw1 = gw1 + acc[..., 0] @ inv_n
    gb1 = gb1 + acc[..., 1].sum(1)
    if dist is not None:
        per_row = (w1 @ acc.view(w1.shape[0], -1)).view(nr, -1)  # [R, 3]: sum g_x p, -, sum g_x dpsi
        gcx = gcx + inv_n @ per_row[:, 2]
        gn = gn - per_row[:, 0] * inv_n * inv_n
    return gw1, gb1, gw2, s0.sum(1), gcx, gn, s0


def _normalizer_grads(gcx: Tensor, gn: Tensor, c: Tensor, thr: Tensor, q_pos: Tensor) -> tuple[Tensor, Tensor]:
    """``(d c, d L)`` from the direct part of ``c``'s gradient and the rows' ``gn`` (``n_i =
    psi(max(L, i)) + eps``): with ``t = gn sgn(c m) / (1 + |c m|)`` (``m = max(L, i)``), ``d psi(m) /
    d c = t m / gn`` and ``d psi(m) / d m = t c / gn``; ``max``'s gradient split at ties (as torch:
    ``(sgn(L - i) + 1) / 2`` of it to ``L``). Both sums are one product (a row's few operations
    are most of its cost)."""
    dt = gn.dtype
    qf, th = q_pos.to(torch.float32), thr.to(torch.float32).abs()
    m = torch.maximum(qf, th).to(dt)
    cd = c.to(dt)
    cm = cd * m
    t = gn * cm.sgn() / (1 + cm.abs())
    sums = torch.stack((m, (th - qf).sgn().add_(1).to(dt))) @ t  # [2]: sum t m, 2 sum t share
    gc = gcx + sums[0]
    gthr = sums[1] * 0.5 * cd * thr.sgn()
    return gc.reshape(c.shape).to(c.dtype), gthr.reshape(thr.shape).to(thr.dtype)
