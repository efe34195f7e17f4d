"""The blockwise normalizers (`blockwise` backend): autograd Functions whose forward and backward
walk query blocks x key tiles (`tiles.Tiling`), recomputing each tile in backward: nothing larger
than a block of rows x the keys it sees (or than the keys) is ever built, and nothing but q, k, v,
plus for stick-breaking the carried sum before each tile of a row (no larger than q, else recomputed)
and for softmax the output and one log-sum-exp per query row, is kept for backward.

- `StickBreakingBlocks`: stick-breaking (Tan et al., 2024, eqs. 1-3) walked nearest key tile
  first, the log-space sum of ``softplus`` carried across tiles (as the Triton kernel does);
  backward per block: the carried sums kept by the forward, then the gradient farthest first
  (`functional.stick_breaking.stick_breaking_tile_backward`). A block stops at the tile before
  which every row's stick is spent (`functional.stick_breaking.stick_spent`: the farther weights
  are under ``exp(EXP_FLOOR)``, 0 instead of that floor); backward stops at the same tile.
- `SoftmaxBlocks`: ``softmax(s * mod(i, j))`` for a normalizer's modulation of the scaled
  logits (`Normalizer.modulation`; plain ``softmax(s)`` without one), an online softmax over key tiles (Milakov & Gimelshein, 2018;
  FlashAttention's forward) with the log-sum-exp kept per row, and the softmax gradient by tiles.

Weights below ``exp(EXP_FLOOR)`` are computed as that, and forward and backward run with denormals
flushed to zero on CPU (`_flushing`): x86 arithmetic on denormals is many times slower, and the
products of small weights and gradients fall there.
Inputs of a bias that need a gradient come after ``spec`` (so autograd routes their gradients);
the tiles' bias gradient reaches them through `tiles.BiasTiles` (the block engine's `blocks.BlockRows`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from posenc_lightning.attention.backends.blockwise.tiles import (
    BiasTiles,
    Tile,
    Tiling,
    add_product,
    batched,
    flat,
    grouped,
    skipping_rows,
    ungrouped,
    wide_dtype,
)
from posenc_lightning.attention.backends.engine.denormals import _flush_denormals
from posenc_lightning.encodings.base import Bias, KeyOnly
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.stick_breaking import (
    EXP_FLOOR,
    stick_breaking_tail,
    stick_breaking_tile,
    stick_breaking_tile_backward,
    stick_spent,
)
from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables


@dataclass(eq=False)
class TilesSpec:
    """What the Functions need besides tensors: the tiling, the bias and its inputs that need a
    gradient (``extra``), the logit scale, and for the softmax walk the modulation (or None)
    ``mod(q_pos, k_pos) -> [B, 1, Nq, Nk]`` and the positions. ``keep_tails``: stick-breaking's
    forward keeps the tail before every tile for backward (`Tiling.max_tiles` floats per query row),
    which then skips recomputing them. ``stop_spent``: stick-breaking walks a block's key tiles only
    until every row's stick is spent (`stick_spent`, read on the host: eagerly on CPU only).
    ``ascending``: `AttentionContext.ascending` (`BiasTiles`). ``fold``: the bias (`Bias.head_scaled`) added as two extra q/k
    channels instead of per tile (`FoldedBias`); its weights' gradient is still taken per tile.
    ``mod_shift``: the positions are ``a + arange``, ``c + arange`` with ``a - c = mod_shift`` and the
    modulation depends on their difference only: a tile's is read off one diagonal (`_modulation`)."""

    tiling: Tiling
    bias: Bias | None
    extra: tuple[Tensor, ...]
    scale: float
    modulation: Callable[[Tensor, Tensor], Tensor] | None = None
    q_pos: Tensor | None = None
    k_pos: Tensor | None = None
    keep_tails: bool = False
    fold: KeyOnly | None = None
    ascending: bool = False
    stop_spent: bool = False
    mod_shift: int | None = None
    #: the call's block budgets and switches (`functional.mode.Mode.tunables`)
    tunables: Tunables = DEFAULT_TUNABLES

    def bias_tiles(self, h_kv: int, dtype: torch.dtype, mode: Mode, needs: tuple[bool, ...] = ()) -> BiasTiles:
        """`BiasTiles` of a pass in ``mode`` with, per bias input, whether it needs a gradient (an
        ``extra`` that needs one)."""
        bt = BiasTiles(self.bias, self.tiling, h_kv, dtype, self.q_pos, self.k_pos, mode.compiling,
                       in_channels=self.fold is not None, ascending=self.ascending,
                       eager_autograd=mode.tunables.eager_autograd)
        if needs:
            bt.need = tuple(any(t is x and n for x, n in zip(self.extra, needs)) for t in bt.inputs)
        return bt

    def extra_grads(self, bt: BiasTiles) -> list[Tensor | None]:
        out: list[Tensor | None] = []
        for x in self.extra:
            g = None
            for t, gi in zip(bt.inputs, bt.grads):
                if t is x and gi is not None:
                    g = gi if g is None else g + gi
            out.append(None if g is None else g.to(x.dtype))
        return out


def _logits(qb: Tensor, keys_t: Tensor, bt: BiasTiles, t: Tile, views: tuple[Tensor, Tensor], grad: bool = False
            ) -> Tensor:
    """``(q s) k^T (+ bias)`` of a tile in the buffer ``views`` (`TileBuffers.views`), from the
    block's scaled queries ``qb [B * H_kv, g * r, d]`` (the scale applied once per block, not once
    per tile) and the tile's keys transposed ``[B * H_kv, d, c]``: the tile ``[B, H_kv, g, r, c]``."""
    torch.bmm(qb, keys_t, out=views[1])
    return bt.add_tile(views[0], t, grad)


class TileBuffers:
    """``n`` tile-sized buffers reused by every tile of a pass (an op writing a fresh multi-MiB
    tensor pays its page faults): `views` gives buffer ``i`` as a tile ``[B, H_kv, g, r, c]`` and
    as ``[B * H_kv, g * r, c]`` for ``bmm``, the views made once per shape."""

    def __init__(self, n: int, tl: Tiling, b: int, h: int, dtype: torch.dtype, device: torch.device) -> None:
        size = b * h * min(tl.rows, tl.n_q) * min(tl.cols, tl.n_k)
        self.flat = [torch.empty(size, dtype=dtype, device=device) for _ in range(n)]
        self._views: dict[tuple[int, ...], tuple[Tensor, Tensor]] = {}

    def views(self, i: int, shape: tuple[int, ...], cols: int) -> tuple[Tensor, Tensor]:
        key = (i, *shape, cols)
        v = self._views.get(key)
        if v is None:
            b, h_kv, g, r = shape
            tile = self.flat[i][:b * h_kv * g * r * cols].view(b, h_kv, g, r, cols)
            v = self._views[key] = (tile, tile.view(b * h_kv, g * r, cols))
        return v


class FoldedBias:
    """A bias ``m_h (u_j - u_i)`` (`KeyOnly` with its ``q_row``: ``m = q_ch``, ``u_j = k_ch``,
    ``u_i = q_row``) as two extra channels of the logits' product: the block's queries get
    ``[q s, -m_h (u_i - c), m_h]``, the walked keys ``[k, 1, u_j - c]``, with ``c = u`` at the
    block's middle row. Nothing is computed per tile in forward.

    Rounding: the two terms are each up to ``m_h`` times the block's span (its rows and the keys
    nearest them) before they cancel, so a logit is within ``~eps m_h 256`` (float32, 256-row
    blocks) instead of ``eps |z|`` (N 2048, slopes up to 1: output 1e-6 of its scale against 5e-7
    per tile). The weights' gradient is not taken from these channels (``sum_i S_i - (u_i - c) R_i``
    cancels the same way, and there it is relative to a small sum: 1e-3 of a head's own gradient
    against 1e-5), but per tile from the pattern (`BiasTiles`, ``in_channels``)."""

    def __init__(self, form: KeyOnly, tl: Tiling, b: int, h_kv: int, g: int, d: int, wt: torch.dtype) -> None:
        self.d, self.b, self.h_kv, self.g = d, b, h_kv, g
        m = form.q_ch.detach().to(wt) if form.q_ch is not None else torch.ones(h_kv * g, dtype=wt, device=form.k_ch.device)
        self.m = m.reshape(1, h_kv, g, 1)
        self.u_k = tl.walking(form.k_ch.to(wt).expand(b, 1, -1)[:, 0])  # [B, Nk] walked
        self.u_q = form.q_row.to(wt).expand(b, 1, -1)[:, 0]  # [B, Nq]

    def keys(self, kw: Tensor) -> Tensor:
        """The walked keys ``[B * H_kv, Nk, d]`` with the two channels (their last one set per block)."""
        out = torch.empty((*kw.shape[:-1], self.d + 2), dtype=kw.dtype, device=kw.device)
        out[..., :self.d] = kw
        out[..., self.d] = 1.0
        return out

    def start(self, qb: Tensor, kf: Tensor, s: int, e: int) -> None:
        """The block's channels: ``qb [B * H_kv, g * r, d + 2]`` (the scaled queries in its first
        ``d``), ``kf`` the keys (`keys`)."""
        c = self.u_q[:, (s + e) // 2:(s + e) // 2 + 1]  # [B, 1]
        qc = qb.view(self.b, self.h_kv, self.g, e - s, self.d + 2)
        qc[..., self.d] = (self.u_q[:, s:e] - c)[:, None, None, :] * self.m
        qc[..., self.d].neg_()
        qc[..., self.d + 1] = self.m
        kf.view(self.b, self.h_kv, -1, self.d + 2)[..., self.d + 1] = (self.u_k - c)[:, None]


def _block_queries(q: Tensor, s: int, e: int, h_kv: int, wt: torch.dtype, scale: float,
                   fold: FoldedBias | None, kf: Tensor | None) -> Tensor:
    """The block's scaled queries ``[B * H_kv, g * r, d]`` (``d + 2`` with the fold's channels)."""
    x = batched(flat(grouped(q, s, e, h_kv, wt)))
    if fold is None:
        return x.mul(scale)
    qb = torch.empty((*x.shape[:-1], x.shape[-1] + 2), dtype=wt, device=q.device)
    qb[..., :-2] = x
    qb[..., :-2].mul_(scale)
    fold.start(qb, kf, s, e)
    return qb


def _fold(spec: TilesSpec, tl: Tiling, b: int, h_kv: int, g: int, d: int, wt: torch.dtype) -> FoldedBias | None:
    return None if spec.fold is None else FoldedBias(spec.fold, tl, b, h_kv, g, d, wt)


def _grad_buffers(ctx, spec: TilesSpec, q: Tensor, k: Tensor, v: Tensor, wt: torch.dtype
                  ) -> tuple[Tensor, Tensor, Tensor, BiasTiles]:
    """Zeroed ``dq, dk, dv`` accumulators in ``wt`` (``dk``, ``dv`` in walking order) and the bias
    tiles of a backward pass."""
    dq, dk, dv = (torch.zeros(t.shape, dtype=wt, device=t.device) for t in (q, k, v))
    return dq, dk, dv, spec.bias_tiles(k.shape[1], wt, Mode.of(q), ctx.needs_input_grad[4:])


def _tile_grads(t: Tile, span: slice, dz: Tensor, w3: Tensor, dz3: Tensor, qb: Tensor, kw: Tensor, dob: Tensor,
                dq_b: Tensor, dk3: Tensor, dv3: Tensor, bt: BiasTiles, g: int = 1) -> None:
    """One tile's share of the gradients from ``dz`` (of the scaled logits; ``dz3`` its ``bmm``
    view) and its weights ``w3``: ``dq += dz k``, ``dk += dz^T q``, ``dv += w^T dO`` accumulated in
    place (``dk3``, ``dv3``, ``kw``: ``[B * H_kv, N, d]`` in walking order, ``span`` the tile's
    keys there; ``qb``, ``dob``: the tile's rows, `skipping_rows` its first `Tile.r0`), and the tile's
    bias gradient."""
    add_product(dq_b, g, t.r0, dz3, kw[:, span])
    d = dk3.shape[-1]
    dk3[:, span].baddbmm_(dz3.transpose(1, 2), qb if qb.shape[-1] == d else qb[..., :d])  # without the fold's channels
    dv3[:, span].baddbmm_(w3.transpose(1, 2), dob)
    bt.tile_grad(t, dz)


def _flushing(fn: Callable) -> Callable:
    """An autograd Function's ``forward`` / ``backward`` run with denormals flushed to zero on CPU."""

    @functools.wraps(fn)
    def run(ctx, x: Tensor, *args):
        spec = args[2] if len(args) > 2 else ctx.spec  # forward(ctx, q, k, v, spec, ...), backward(ctx, d_out)
        with _flush_denormals(Mode.of(x, spec.tunables)):
            return fn(ctx, x, *args)

    return run


class StickBreakingBlocks(torch.autograd.Function):
    """Stick-breaking attention by tiles: ``o_i = sum_j A_ij v_j`` (see the module docstring).

    Backward per query block: the tails (softplus sums) at every tile, nearest first (kept by the
    forward when `TilesSpec.keep_tails`, else recomputed), then the tiles farthest first, where the
    sum of ``g`` over the farther keys is carried exactly."""

    @staticmethod
    @_flushing
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, spec: TilesSpec, *extra: Tensor) -> Tensor:
        out, tails = _sb_forward(q, k, v, spec, wide_dtype(q))
        ctx.save_for_backward(q, k, v, *(() if tails is None else (tails,)))
        ctx.spec = spec
        return out.to(q.dtype)

    @staticmethod
    @_flushing
    def backward(ctx, d_out: Tensor):
        q, k, v, *kept = ctx.saved_tensors
        spec: TilesSpec = ctx.spec
        b, h, _, d = q.shape
        h_kv, g, wt = k.shape[1], h // k.shape[1], wide_dtype(q)
        tl = spec.tiling
        kw, vw = batched(tl.walked(k, wt)), batched(tl.walked(v, wt))
        fold = _fold(spec, tl, b, h_kv, g, d, wt)
        kw = kw if fold is None else fold.keys(kw)
        kwt, vwt = kw.transpose(1, 2), vw.transpose(1, 2)
        dq, dk, dv, bt = _grad_buffers(ctx, spec, q, k, v, wt)
        dk3, dv3 = batched(dk), batched(dv)
        buf = TileBuffers(4, tl, b, h, wt, q.device)  # logits, dP (then dz), softplus (then A), sigmoid
        made: dict = {}  # the pass's masks (`Tiling.keep`)
        reads = spec.stop_spent and Mode.of(q).host_reads
        for s, e, k_stop in tl.blocks():
            if k_stop == 0:
                continue
            shape = (b, h_kv, g, e - s)
            qb = _block_queries(q, s, e, h_kv, wt, spec.scale, fold, kw)
            dob = batched(flat(grouped(d_out, s, e, h_kv, wt)))
            bt.start(s, e, k_stop, grad=True)
            tiles = tl.tiles(s, k_stop, e)
            if kept:
                tails = [kept[0][:, :, s:e, i].reshape(shape) for i in range(len(tiles))]
            else:
                tails = [torch.zeros(shape, dtype=wt, device=q.device)]
                for t in tiles[:-1]:
                    sub = (*shape[:3], e - s - t.r0)
                    z = _logits(skipping_rows(qb, g, t.r0), kwt[:, :, tl.span(t)], bt, t, buf.views(0, sub, t.k1 - t.k0))
                    tails.append(_rows_set(tails[-1].clone(), t.r0, stick_breaking_tail(
                        z, tl.keep(s + t.r0, e, t, wt, q.device, made), tails[-1][..., t.r0:])))
                    if reads and bool(stick_spent(tails[-1])):
                        break
            if reads:  # the tiles the forward walked (`stick_spent`, on the same tails)
                live = next((i for i in range(1, len(tails)) if bool(stick_spent(tails[i]))), len(tails))
                tiles, tails = tiles[:live], tails[:live]
            g_far = torch.zeros(shape, dtype=wt, device=q.device)
            dq_b = torch.zeros_like(qb)
            for t, tail in zip(reversed(tiles), reversed(tails)):
                span, c, r0 = tl.span(t), t.k1 - t.k0, t.r0
                zv, (dp, dp3), (sp, a3), (beta, _) = (buf.views(i, (*shape[:3], e - s - r0), c) for i in range(4))
                qs, dos = skipping_rows(qb, g, r0), skipping_rows(dob, g, r0)
                z = _logits(qs, kwt[:, :, span], bt, t, zv, grad=True)
                torch.bmm(dos, vwt[:, :, span], out=dp3)
                _, dz, gf = stick_breaking_tile_backward(z, tl.keep(s + r0, e, t, wt, q.device, made), tail[..., r0:],
                                                         dp, g_far[..., r0:], sp=sp, beta=beta)
                g_far = _rows_set(g_far, r0, gf)
                # dz in dP's buffer, A in the softplus one
                _tile_grads(t, span, dz, a3, dp3, qs, kw, dos, dq_b, dk3, dv3, bt, g)
            dq[:, :, s:e] = ungrouped(dq_b.view(*shape, -1)[..., :d].mul_(spec.scale))
            bt.finish()
        dk, dv = tl.unwalked(dk), tl.unwalked(dv)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, *spec.extra_grads(bt))


def _rows_set(full: Tensor, r0: int, rows: Tensor) -> Tensor:
    """A per-row state ``[..., r]`` with its rows from ``r0`` on replaced by ``rows`` (in place)."""
    if r0 == 0:
        return rows
    full[..., r0:] = rows
    return full


def _forward_blocks(q: Tensor, v: Tensor, spec: TilesSpec, bt: BiasTiles, h_kv: int, wt: torch.dtype,
                    fold: FoldedBias | None = None, kf: Tensor | None = None):
    """The query blocks of a forward pass that see a key, their bias tiles started:
    ``(s, e, k_stop, shape, qb, acc)`` with ``shape = (B, H_kv, g, rows)``, the block's scaled
    queries ``qb [B * H_kv, g * r, d]`` (`_block_queries`) and a zeroed output accumulator ``acc``."""
    b, h = q.shape[:2]
    g = h // h_kv
    for s, e, k_stop in spec.tiling.blocks():
        if k_stop == 0:
            continue
        bt.start(s, e, k_stop)
        yield (s, e, k_stop, (b, h_kv, g, e - s), _block_queries(q, s, e, h_kv, wt, spec.scale, fold, kf),
               torch.zeros((b, h_kv, g * (e - s), v.shape[-1]), dtype=wt, device=q.device))


def _sb_forward(q: Tensor, k: Tensor, v: Tensor, spec: TilesSpec, wt: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """The output and, when `TilesSpec.keep_tails`, the tail before every tile of every row,
    ``[B, H, Nq, tiles]`` (else None)."""
    b, h, n_q, _ = q.shape
    h_kv, d_v = k.shape[1], v.shape[-1]
    g, tl = h // h_kv, spec.tiling
    out = torch.zeros((b, h, n_q, d_v), dtype=wt, device=q.device)
    kept = torch.zeros((b, h, n_q, tl.max_tiles()), dtype=wt, device=q.device) if spec.keep_tails else None
    bt = spec.bias_tiles(h_kv, wt, Mode.of(q))
    buf = TileBuffers(1, tl, b, h, wt, q.device)  # logits (then A)
    made: dict = {}  # the pass's masks (`Tiling.keep`)
    # training: the keys and values flipped once (backward keeps as much); inference: tile by tile
    # (with a fold: the keys walked once, with its channels)
    walked = (batched(tl.walked(k, wt)), batched(tl.walked(v, wt))) if kept is not None else None
    fold = _fold(spec, tl, b, h_kv, g, k.shape[-1], wt)
    kf = None if fold is None else fold.keys(walked[0] if walked is not None else batched(tl.walked(k, wt)))
    reads = spec.stop_spent and Mode.of(q).host_reads
    for s, e, k_stop, shape, qb, acc in _forward_blocks(q, v, spec, bt, h_kv, wt, fold, kf):
        tail = torch.zeros(shape, dtype=wt, device=q.device)
        acc3 = batched(acc)
        for i, t in enumerate(tl.tiles(s, k_stop, e)):
            if kept is not None and i > 0:
                kept[:, :, s:e, i] = tail.view(b, h, e - s)
            if i > 0 and reads and bool(stick_spent(tail)):
                break  # the farther weights are all below exp(EXP_FLOOR): 0, not computed (backward reads it in kept)
            if walked is None:
                kt, vt = batched(tl.key_tile(k, t, wt)), batched(tl.key_tile(v, t, wt))
            else:
                kt, vt = walked[0][:, tl.span(t)], walked[1][:, tl.span(t)]
            if kf is not None:
                kt = kf[:, tl.span(t)]
            sub, c = (*shape[:3], e - s - t.r0), t.k1 - t.k0
            zv = buf.views(0, sub, c)
            z = _logits(skipping_rows(qb, g, t.r0), kt.transpose(1, 2), bt, t, zv)
            _, new = stick_breaking_tile(z, tl.keep(s + t.r0, e, t, wt, q.device, made), tail[..., t.r0:],
                                         out=z)  # A in z's buffer
            tail = _rows_set(tail, t.r0, new)
            add_product(acc3, g, t.r0, zv[1], vt)
        out[:, :, s:e] = ungrouped(acc.view(*shape, d_v))
    return out, kept


class SoftmaxBlocks(torch.autograd.Function):
    """``softmax((q k^T s + bias) * mod(i, j))`` by tiles, ``mod`` the normalizer's modulation or
    none (see the module docstring)."""

    @staticmethod
    @_flushing
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, spec: TilesSpec, *extra: Tensor) -> Tensor:
        wt = wide_dtype(q)
        out, lse = _softmax_forward(q, k, v, spec, wt)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        return out.to(q.dtype)

    @staticmethod
    @_flushing
    def backward(ctx, d_out: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        spec: TilesSpec = ctx.spec
        b, h, _, d = q.shape
        h_kv, g, wt = k.shape[1], h // k.shape[1], out.dtype
        tl = spec.tiling
        kw, vw = batched(tl.walked(k, wt)), batched(tl.walked(v, wt))
        kwt, vwt = kw.transpose(1, 2), vw.transpose(1, 2)
        dq, dk, dv, bt = _grad_buffers(ctx, spec, q, k, v, wt)
        dk3, dv3 = batched(dk), batched(dv)
        buf = TileBuffers(2, tl, b, h, wt, q.device)  # logits (then P), dP (then dz)
        made: dict = {}  # the pass's masks (`Tiling.keep`) and modulations (`_modulation`)
        for s, e, k_stop in tl.blocks():
            if k_stop == 0:
                continue
            shape = (b, h_kv, g, e - s)
            qb, dob = batched(flat(grouped(q, s, e, h_kv, wt))).mul(spec.scale), grouped(d_out, s, e, h_kv, wt)
            delta = (dob * grouped(out, s, e, h_kv, wt)).sum(-1, keepdim=True)
            dob = batched(flat(dob))
            neg_lse = lse[:, :, s:e].reshape(*shape, 1).neg()
            bt.start(s, e, k_stop, grad=True)
            dq_b = torch.zeros_like(qb)
            for t in tl.tiles(s, k_stop):
                span = tl.span(t)
                zv, (dp, dp3) = buf.views(0, shape, t.k1 - t.k0), buf.views(1, shape, t.k1 - t.k0)
                z = _logits(qb, kwt[:, :, span], bt, t, zv, grad=True)
                mod = _modulation(spec, s, e, t.k0, t.k1, wt, made)
                # P = exp(z mod - lse) <= 1 where visible; clamped so that hidden entries stay finite
                p = (z.add_(neg_lse) if mod is None else torch.addcmul(neg_lse, z, mod, out=z)
                     ).clamp_(EXP_FLOOR, 0.0).exp_()
                vis = tl.keep(s, e, t, wt, q.device, made)
                if vis is not None:
                    p = p.mul_(vis)
                torch.bmm(dob, vwt[:, :, span], out=dp3)
                dz = dp.sub_(delta).mul_(p)  # d(q k^T s + bias) = P (dP - delta) mod
                dz = dz if mod is None else dz.mul_(mod)
                _tile_grads(t, span, dz, zv[1], dp3, qb, kw, dob, dq_b, dk3, dv3, bt)  # P in z's buffer
            dq[:, :, s:e] = ungrouped(dq_b.view(*shape, d)).mul_(spec.scale)
            bt.finish()
        dk, dv = tl.unwalked(dk), tl.unwalked(dv)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, *spec.extra_grads(bt))


def _modulation(spec: TilesSpec, s: int, e: int, k0: int, k1: int, wt: torch.dtype, made: dict | None = None
                ) -> Tensor | None:
    """``mod`` of the tile, ``[B|1, 1, 1, r, c]``, or None without a modulation. With
    `TilesSpec.mod_shift` it depends on the tile's shape and ``s - k0`` only (`_diagonal_modulation`): with ``made`` (a pass's own dict) each
    is made once per pass (together at most the block's rows times twice the keys, for one head)."""
    if spec.modulation is None:
        return None
    if spec.mod_shift is None:
        return spec.modulation(spec.q_pos[:, s:e], spec.k_pos[:, k0:k1]).to(wt)[:, :, None]
    if made is None:
        return _diagonal_modulation(spec, s, e, k0, k1, wt)
    key = ("modulation", e - s, k1 - k0, s - k0, wt)
    if key not in made:
        made[key] = _diagonal_modulation(spec, s, e, k0, k1, wt)
    return made[key]


def _hidden(vis: Tensor, made: dict) -> Tensor:
    """``-inf`` where ``vis`` (`Tiling.keep`) is 0, else 0; made once per pass for a mask ``made`` keeps."""
    key = ("hidden", id(vis))
    kept = made.get(key)
    if kept is None or kept[0] is not vis:
        kept = made[key] = (vis, torch.zeros_like(vis).masked_fill_(vis == 0, float("-inf")))
    return kept[1]


def _diagonal_modulation(spec: TilesSpec, s: int, e: int, k0: int, k1: int, wt: torch.dtype) -> Tensor:
    """The Toeplitz ``mod[i, j] = u[i - j + c - 1]``, ``u`` the modulation at the tile's ``r + c - 1``
    position differences: ``u`` viewed with unit strides is ``mod`` with its columns reversed, so
    one flip makes the tile and the modulation's own passes run on ``u`` alone."""
    r, c, base = e - s, k1 - k0, spec.mod_shift + s - k0
    diffs = torch.arange(base - c + 1, base + r, device=spec.q_pos.device, dtype=spec.q_pos.dtype)
    u = spec.modulation(diffs[None], torch.zeros((1, 1), dtype=diffs.dtype, device=diffs.device))
    return u.to(wt).reshape(-1).as_strided((r, c), (1, 1)).flip(-1)[None, None, None]


def _softmax_forward(q: Tensor, k: Tensor, v: Tensor, spec: TilesSpec, wt: torch.dtype) -> tuple[Tensor, Tensor]:
    """The output and the log-sum-exp of every row (``+inf`` for a row that sees no key, whose
    output is 0 as eager's)."""
    b, h, n_q, _ = q.shape
    h_kv, d_v = k.shape[1], v.shape[-1]
    tl = spec.tiling
    out = torch.zeros((b, h, n_q, d_v), dtype=wt, device=q.device)
    lse = torch.full((b, h, n_q), float("inf"), dtype=wt, device=q.device)
    bt = spec.bias_tiles(h_kv, wt, Mode.of(q))
    buf = TileBuffers(1, tl, b, h, wt, q.device)  # logits (then P)
    made: dict = {}  # the pass's masks (`Tiling.keep`, `_hidden`) and modulations (`_modulation`)
    for s, e, k_stop, shape, qb, acc in _forward_blocks(q, v, spec, bt, h_kv, wt):
        m = torch.full(shape, float("-inf"), dtype=wt, device=q.device)
        den = torch.zeros(shape, dtype=wt, device=q.device)
        acc3 = batched(acc)
        for t in tl.tiles(s, k_stop):
            zv = buf.views(0, shape, t.k1 - t.k0)
            z = _logits(qb, batched(tl.key_tile(k, t, wt)).transpose(1, 2), bt, t, zv)
            mod, vis = _modulation(spec, s, e, t.k0, t.k1, wt, made), tl.keep(s, e, t, wt, q.device, made)
            if vis is None:
                z = z if mod is None else z.mul_(mod)
            elif mod is None:  # hidden keys: -inf for the running max, then 0
                z = z.add_(_hidden(vis, made))
            else:
                z = torch.addcmul(_hidden(vis, made), z, mod, out=z)
            m_new = torch.maximum(m, z.amax(-1))
            m_safe = m_new.masked_fill(torch.isneginf(m_new), 0.0)  # no key seen yet: exp(-inf) = 0
            p = z.sub_(m_safe[..., None]).clamp_min_(EXP_FLOOR).exp_()
            if vis is not None:
                p = p.mul_(vis)
            alpha = (m - m_safe).exp_()
            den = den.mul_(alpha).add_(p.sum(-1))
            acc3.mul_(alpha.view(acc3.shape[0], -1, 1)).baddbmm_(zv[1], batched(tl.key_tile(v, t, wt)))
            m = m_new
        m_safe = m.masked_fill(torch.isneginf(m), 0.0)
        o = acc.view(*shape, d_v) / den[..., None].clamp_min(torch.finfo(wt).tiny)
        out[:, :, s:e] = ungrouped(o)
        lse[:, :, s:e] = (m_safe + den.log()).masked_fill(den == 0, float("inf")).reshape(b, h, e - s)
    return out, lse
