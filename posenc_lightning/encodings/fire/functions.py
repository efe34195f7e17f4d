"""FIRE's autograd Functions, their backwards written out (Li et al., 2024, eq. 3 differentiated by
hand): `fire_mlp` (the MLP over the units that switch, `_SwitchingReluMLP`) and `_FireRows` (a block
of the bias by key, `rows.fire_rows`), with no autograd graph of their ``[B, Nq, Nk]``
intermediates, and the helpers the rows by distance share (`by_distance`). The formulas they
compute are `posenc_lightning.functional.fire`'s."""

from __future__ import annotations

import torch
from torch import Tensor

from posenc_lightning.functional.fire import fire_mlp_fold, fire_mlp_piecewise, fire_psi, fire_unit_states
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables

# The tuning knobs (columns per step of `fire_mlp`, keys per unit selection, a run's span slack) are
# `Tunables.fire_mlp_chunk`, `fire_column_group` and `fire_span_slack`, passed in by the call.


def fire_mlp(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor,
             tunables: Tunables = DEFAULT_TUNABLES) -> Tensor:
    """``f_theta(x) = W2 relu(w1 x + b1) + b2`` for scalar inputs ``x`` ``[B, M]``: ``[B, H, M]``.

    The same function, forward and backward, as ``nn.Sequential(Linear(1, W), ReLU(), Linear(W, H))``
    (``w1``/``b1`` ``[W]``, ``w2`` ``[H, W]``, ``b2`` ``[H]``), computed without its ``[B, M, W]``
    hidden tensor: f is piecewise linear in x, so over the range ``[min x, max x]`` a hidden unit
    whose pre-activation has the same sign at both ends (it is monotone in x) is either always
    off (dropped) or always on (folded into one linear term ``A x + B``, exact since
    ``relu(u) = u`` there). Only the units that switch inside the range are evaluated per element,
    in chunks of ``tunables.fire_mlp_chunk`` columns, head-major (the layout attention wants), and
    recomputed in backward, so the saved state is ``x`` alone.
    """
    dt = torch.promote_types(x.dtype, w2.dtype)
    x, w1, b1, w2, b2 = (t.to(dt) for t in (x, w1, b1, w2, b2))
    if Mode.tracing():  # the unit selection below has a data-dependent shape; the
        return fire_mlp_piecewise(x, w1, b1, w2, b2)  # compiler fuses the segment lookup per element
    if x.numel() == 0:
        return x.new_zeros(x.shape[0], w2.shape[0], x.shape[1]) + 0 * b2.sum()
    switching, _, w_aug = _fold(x, w1, b1, w2, b2)
    return _SwitchingReluMLP.apply(x, w1.index_select(0, switching), b1.index_select(0, switching), w_aug,
                                   tunables.fire_mlp_chunk)


def _fold(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The units that switch inside ``[min x, max x]`` ``[K]``, those on throughout (0/1 ``[W]``) and
    ``w_aug = [w2 of the switching ones, A, B]`` ``[H, K + 2]`` (`fire_mlp`; `fire_unit_states`,
    `fire_mlp_fold`: the same arithmetic as per element below)."""
    with torch.no_grad():
        lo, hi = torch.aminmax(x.detach())
        on, straddling = fire_unit_states(lo, hi, w1, b1)
        switching = torch.nonzero(straddling).squeeze(1)
    on = on.to(w2.dtype)
    h = w2.shape[0]
    ab = fire_mlp_fold(on, w1, b1, w2)  # the always-on units' slope and intercept  [2H]
    return switching, on, torch.cat((w2.index_select(1, switching), ab[:h, None], (b2 + ab[h:])[:, None]), 1)


def _hidden(x: Tensor, w1: Tensor, b1: Tensor, out: Tensor) -> Tensor:
    """``[relu(w1 x + b1); x; 1]`` ``[K + 2, C]`` into ``out``."""
    k = w1.shape[0]
    torch.mul(w1[:, None], x[None], out=out[:k])
    out[:k].add_(b1[:, None]).relu_()
    out[k] = x
    out[k + 1] = 1
    return out


def _mlp_rows(x: Tensor, w1: Tensor, b1: Tensor, w_aug: Tensor, chunk: int) -> Tensor:
    """``out[b] = w_aug @ [relu(w1 x_b + b1); x_b; 1]`` ``[B, H, M]``, ``chunk`` columns at a time."""
    nb, m = x.shape
    out = x.new_empty(nb, w_aug.shape[0], m)
    hid = x.new_empty(w1.shape[0] + 2, min(m, chunk))
    for i in range(nb):
        for s in range(0, m, chunk):
            xc = x[i, s:s + chunk]
            h = _hidden(xc, w1, b1, hid[:, :xc.shape[0]])
            torch.mm(w_aug, h, out=out[i, :, s:s + xc.shape[0]])
    return out


def _mlp_grads(x: Tensor, w1: Tensor, b1: Tensor, w_aug: Tensor, grad: Tensor, need_x: bool,
               chunk: int) -> tuple[Tensor | None, Tensor, Tensor, Tensor]:
    """The gradients of `_mlp_rows` to ``(x, w1, b1, w_aug)``, the hidden units recomputed."""
    nb, m = x.shape
    k = w1.shape[0]
    gx = torch.empty_like(x) if need_x else None
    gw1, gb1, gw = torch.zeros_like(w1), torch.zeros_like(b1), torch.zeros_like(w_aug)
    hid = x.new_empty(k + 2, min(m, chunk))
    for i in range(nb):
        for s in range(0, m, chunk):
            xc = x[i, s:s + chunk]
            g = grad[i, :, s:s + xc.shape[0]]  # [H, C]
            h = _hidden(xc, w1, b1, hid[:, :xc.shape[0]])
            gw.addmm_(g, h.t())
            gh = w_aug.t() @ g  # [K + 2, C]: row K is the grad of the linear term's x
            gpre = gh[:k].mul_(h[:k] > 0)  # relu'(u) = 1 where u > 0 (0 at u = 0, as torch)
            gw1 += gpre @ xc
            gb1 += gpre.sum(1)
            if gx is not None:
                torch.addmv(gh[k], gpre.t(), w1, out=gx[i, s:s + xc.shape[0]])
    return gx, gw1, gb1, gw


class _SwitchingReluMLP(torch.autograd.Function):
    """`_mlp_rows`; backward recomputes."""

    @staticmethod
    def forward(x: Tensor, w1: Tensor, b1: Tensor, w_aug: Tensor, chunk: int) -> Tensor:  # type: ignore[override]
        return _mlp_rows(x, w1, b1, w_aug, chunk)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Tensor) -> None:  # functorch-compatible (vjp)
        ctx.save_for_backward(*inputs[:4])
        ctx.chunk = inputs[4]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        x, w1, b1, w_aug = ctx.saved_tensors
        return (*_mlp_grads(x, w1, b1, w_aug, grad, ctx.needs_input_grad[0], ctx.chunk), None)


def _toeplitz(table: Tensor, rows: int, keys: int) -> Tensor:
    """``[1, rows, keys]`` with ``[0, r, j] = table[rows - 1 - r + j]``."""
    rev = torch.arange(rows - 1, -1, -1, device=table.device)  # index_select, not flip: row-major out
    return table.as_strided((rows, keys), (1, 1)).index_select(0, rev)[None]


def _distances(q_pos: Tensor, k_pos: Tensor, shift: int | None) -> Tensor:
    """``i - j`` in float32 ``[B, Nq, Nk]``; with ``shift`` the descending table ``[Nq + Nk - 1]``."""
    if shift is None:
        return q_pos.to(torch.float32)[:, :, None] - k_pos.to(torch.float32)[:, None, :]
    return torch.arange(shift + q_pos.shape[1] - 1, shift - k_pos.shape[1], -1, dtype=torch.float32,
                        device=q_pos.device)


class _FireRows(torch.autograd.Function):
    """`fire_rows`: outputs ``(rows, x, n, on, spans)``, all but rows for backward: the units
    selected per group of keys (`_select`), the same selection forward (`_column_rows`) and
    backward (`_column_grads`); the groups and the runs' slack from ``tunables``."""

    @staticmethod
    def forward(c: Tensor, thr: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor,  # type: ignore[override]
                q_pos: Tensor, k_pos: Tensor, eps: float, shift: int | None, tunables: Tunables):
        qf = q_pos.to(torch.float32)
        n = fire_psi(torch.maximum(qf, thr.to(torch.float32).abs()), c) + eps  # [B, Nq]
        p = fire_psi(_distances(q_pos, k_pos, shift), c)
        x = (p if shift is None else _toeplitz(p, q_pos.shape[1], k_pos.shape[1])) / n[:, :, None]
        dt = torch.promote_types(x.dtype, w2.dtype)
        x, w1, b1, w2, b2 = (t.to(dt) for t in (x, w1, b1, w2, b2))
        nb, nq, nk = x.shape
        if x.numel() == 0:  # nothing switches, nothing is on
            return x.new_zeros(nb, w2.shape[0], nq, nk), x, n, x.new_zeros(0, w1.shape[0]), \
                torch.zeros(0, 3, dtype=torch.long)
        group = tunables.fire_column_group
        on, spans = _select(x, w1, b1, group, tunables.fire_span_slack)
        return _column_rows(x, w1, b1, w2, b2, on, spans, group), x, n, on, spans

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple) -> None:  # functorch-compatible (vjp)
        c, thr, _w1, _b1, _w2, _b2, q_pos, k_pos, ctx.eps, ctx.shift, tunables = inputs
        ctx.group = tunables.fire_column_group
        _, x, n, on, spans = output
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(c, thr, q_pos, k_pos, x, n, on, spans, *inputs[2:6])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor, *_):
        c, thr, q_pos, k_pos, x, n, on, spans, w1, b1, w2, b2 = ctx.saved_tensors
        w1d, b1d, w2d = (t.to(x.dtype) for t in (w1, b1, w2))
        need_x = (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]) and x.numel() > 0
        if x.numel() == 0:
            gx, gw1, gb1, gw2, gb2 = None, torch.zeros_like(w1d), torch.zeros_like(b1d), torch.zeros_like(w2d), \
                torch.zeros_like(b2, dtype=x.dtype)
        else:
            gx, gw1, gb1, gw2, gb2 = _column_grads(x, grad.to(x.dtype), w1d, b1d, w2d, on, spans, ctx.group,
                                                   need_x)
        gc, gthr = torch.zeros_like(c), torch.zeros_like(thr)
        if gx is not None:
            gc, gthr = _ratio_grads(gx, x, n, c, thr, q_pos, k_pos, ctx.shift)
        return gc, gthr, gw1.to(w1.dtype), gb1.to(b1.dtype), gw2.to(w2.dtype), gb2.to(b2.dtype), \
            None, None, None, None, None


def _ratio_grads(gx: Tensor, x: Tensor, n: Tensor, c: Tensor, thr: Tensor, q_pos: Tensor, k_pos: Tensor,
                 shift: int | None) -> tuple[Tensor, Tensor]:
    """``(d c, d L)`` of ``x = psi(i - j) / n_i``, ``n_i = psi(max(L, i)) + eps`` from ``d x``, with
    ``d psi(z) / d c = sgn(c z) z / (1 + |c z|)`` and ``max``'s gradient split at ties (as torch)."""
    cd = c.to(gx.dtype)
    d = _distances(q_pos, k_pos, shift).to(gx.dtype)
    cz = cd * d
    dpsi = cz.sgn() * d / (1 + cz.abs())  # d psi(i - j) / d c, per element or per distance
    if shift is not None:
        dpsi = _toeplitz(dpsi, q_pos.shape[1], k_pos.shape[1])
    gn = -(gx * x).sum(-1) / n  # [B, Nq]
    qf, th = q_pos.to(torch.float32), thr.to(torch.float32).abs()
    m = torch.maximum(qf, th).to(gx.dtype)
    cm = cd * m
    gc = ((gx * dpsi).sum(-1) / n).sum() + (gn * cm.sgn() * m / (1 + cm.abs())).sum()
    gm = gn * cm.sgn() * cd / (1 + cm.abs())
    share = torch.where(th > qf, 1.0, torch.where(th == qf, 0.5, 0.0))  # torch.maximum's backward
    gthr = (gm * share).sum() * thr.sgn()
    return gc.reshape(c.shape).to(c.dtype), gthr.reshape(thr.shape).to(thr.dtype)


def _select(x: Tensor, w1: Tensor, b1: Tensor, group: int, slack: int) -> tuple[Tensor, Tensor]:
    """The units selected per group of ``group`` keys of a block of rows ``x`` ``[B, R, C]``:
    ``on`` ``[groups, W]`` (0/1: folded into ``A x + B`` there) and ``spans`` ``[S, 3]`` (unit, first
    key, key past the last) where a unit is evaluated per element.

    Along a row ``x`` sweeps ``[0, 1]``, but down a few keys of a block of rows it spans a narrow
    range, where nearly every unit keeps its sign. A unit that switches is evaluated per element
    over the span of groups from the first to the last where it switches (and folded nowhere in
    that span). The selection is `fire_mlp`'s: the per-element arithmetic at the group's min and
    max (monotone). Overlapping spans are merged (`_merged`): their units are evaluated together,
    a few products for all of them instead of several passes per unit (within ``slack``)."""
    nc = x.shape[-1]
    g = group
    pad = -nc % g  # a ragged last group: padded with values that move neither min nor max
    lo = torch.nn.functional.pad(x.amin((0, 1)), (0, pad), value=float("inf")).view(-1, g).amin(1)
    hi = torch.nn.functional.pad(x.amax((0, 1)), (0, pad), value=float("-inf")).view(-1, g).amax(1)
    on_both, switching = fire_unit_states(lo, hi, w1, b1)  # [groups, W]
    groups = switching.shape[0]
    idx = torch.arange(groups, device=x.device)[:, None]
    first = torch.where(switching, idx, groups).amin(0)
    last = torch.where(switching, idx, -1).amax(0)
    fl = torch.stack((first, last)).tolist()  # read on the host once: the spans are a few lists
    merged = _merged([[u, f, e] for u, (f, e) in enumerate(zip(*fl)) if e >= 0], x.shape[0] * x.shape[1], g,
                     slack)
    spans = torch.tensor([(u, f * g, min((e + 1) * g, nc)) for u, f, e in merged], dtype=torch.long).view(-1, 3)
    bounds = [[groups] * len(fl[0]), [-1] * len(fl[0])]
    for u, f, e in merged:
        bounds[0][u], bounds[1][u] = f, e
    first, last = torch.tensor(bounds, device=x.device)
    on = (on_both & ((idx < first) | (idx > last))).to(x.dtype)  # folded: outside the spans
    return on, spans


def _merged(spans: list[list[int]], rows: int, group: int, slack: int) -> list[tuple[int, int, int]]:
    """``(unit, first group, last group)`` with spans widened to their union, in runs of equal spans
    (a unit evaluated per element over more groups is still exact): a span joins the run before it
    when the elements this adds (``rows`` per key of each widened span, ``group`` keys a group)
    stay under ``slack``, as a run costs a fixed number of operations."""
    g = group
    out: list[tuple[int, int, int]] = []
    run: list[int] = []
    lo = hi = -1
    for u, f, e in sorted(spans, key=lambda s: (s[1], -s[2])):
        top = max(hi, e)
        extra = ((top - hi) * len(run) + (top - lo) - (e - f)) * g * rows
        if run and extra > slack:
            out += [(v, lo, hi) for v in run]
            run = []
        lo, hi = (f, e) if not run else (lo, top)
        run.append(u)
    return out + [(v, lo, hi) for v in run]


def _runs(spans: Tensor) -> list[tuple[list[int], int, int]]:
    """The spans as ``(units, first key, key past the last)`` runs (`_merged`)."""
    out: list[tuple[list[int], int, int]] = []
    for u, a, z in spans.tolist():
        if out and out[-1][1:] == (a, z):
            out[-1][0].append(u)
        else:
            out.append(([u], a, z))
    return out


def _column_slopes(on: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, nc: int, group: int) -> Tensor:
    """``[2H, C]``: per key, the slope ``A`` and the intercept ``B - b2`` of the units folded there
    (``on`` per group of ``group`` keys, `fire_mlp_fold`)."""
    return fire_mlp_fold(on, w1, b1, w2).repeat_interleave(group, 1)[:, :nc]


def _span_hidden(x: Tensor, w1: Tensor, b1: Tensor, units: list[int], a: int,
                 z: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(relu(w1 x + b1) [U, B R S], index of the units, x [B R S])`` over keys ``[a, z)`` of ``x``:
    the pre-activations as one outer product (``addmm``, as ``nn.Linear``; faster than a broadcast)."""
    us = torch.tensor(units, device=x.device)
    xs = x[..., a:z].reshape(-1)
    return torch.addmm(b1.index_select(0, us)[:, None], w1.index_select(0, us)[:, None], xs[None]).relu_(), us, xs


def _column_rows(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, on: Tensor, spans: Tensor,
                 group: int) -> Tensor:
    """``f_theta(x)`` ``[B, H, R, C]`` for a block of rows ``x`` ``[B, R, C]``, the units selected per
    group of keys (`_select`) instead of over the block (`fire_mlp`): per group the on units fold
    into ``A x + B`` (one pass over the output), the units that switch are evaluated per element
    over their span, one product for a run of them, by chunks of keys whose hidden units and product
    stay within 1/16 of the output (the forward's peak memory stays the output's)."""
    ab = _column_slopes(on, w1, b1, w2, x.shape[-1], group)  # [2H, C]: A; B - b2
    nb, nr = x.shape[:2]
    h = w2.shape[0]
    out = torch.addcmul((ab[h:] + b2[:, None])[:, None], ab[:h, None], x[:, None])  # one pass
    budget = max(1, out.numel() // 16)  # a run's hidden units and their product: 1/16 of the output's size
    for units, a, z in _runs(spans):
        step = max(1, budget // (max(len(units), h) * nb * nr))
        for a0 in range(a, z, step):
            z0 = min(z, a0 + step)
            hid, us, _ = _span_hidden(x, w1, b1, units, a0, z0)
            out[..., a0:z0] += (w2.index_select(1, us) @ hid).view(h, nb, nr, z0 - a0).transpose(0, 1)
    return out


def _column_grads(x: Tensor, g: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, on: Tensor, spans: Tensor, group: int,
                  need_x: bool) -> tuple[Tensor | None, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of `_column_rows` (``d rows = g`` ``[B, H, R, C]``) to ``(x, w1, b1, w2, b2)``,
    by the same selection: a folded unit's terms are sums over its groups of keys (column sums of
    ``g`` and ``g x``, then one small product with ``on``), a switching unit's per element over its
    span (``relu'(u) = 1`` where ``u > 0``, 0 at ``u = 0``, as torch)."""
    nb, nr, nc = x.shape
    grp = group
    pad = -nc % grp
    h = w2.shape[0]
    s0 = g.sum((0, 2))  # [H, C]
    s1 = (g * x[:, None]).sum((0, 2))
    p0, p1 = (torch.nn.functional.pad(s, (0, pad)).view(h, -1, grp).sum(-1) @ on for s in (s0, s1))  # [H, W]
    gw2 = w1 * p1 + b1 * p0
    gw1, gb1 = (w2 * p1).sum(0), (w2 * p0).sum(0)
    gx = None
    if need_x:
        slope = _column_slopes(on, w1, b1, w2, nc, grp)[:h]  # [H, C]
        gx = g[:, 0] * slope[0]
        for i in range(1, h):
            gx.addcmul_(g[:, i], slope[i])
    for units, a, z in _runs(spans):
        hid, us, xs = _span_hidden(x, w1, b1, units, a, z)  # [U, E]
        gs = g[..., a:z].transpose(0, 1).reshape(h, -1)  # [H, E]
        gw2.index_add_(1, us, gs @ hid.t())
        # d loss / d pre-activation [U, E]: relu' = sign(relu(u)) (0 at u = 0, as torch; a float
        # multiplier, several times faster here than a boolean mask)
        gpre = (w2.index_select(1, us).t() @ gs).mul_(hid.sign())
        gw1.index_add_(0, us, gpre @ xs)
        gb1.index_add_(0, us, gpre.sum(1))
        if gx is not None:
            gx[..., a:z] += (w1.index_select(0, us) @ gpre).view(nb, nr, z - a)
    return gx, gw1, gb1, gw2, s0.sum(1)
