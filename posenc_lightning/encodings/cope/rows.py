"""CoPE's bias rows with hand-written backwards (the formulas are `functional.cope`'s): the lookup
``z_i[p]`` with its interpolation's gradient (`cope_lookup`), causal rows of whole blocks of keys
(`cope_causal_rows`) and rows computed on each row's band of keys (`cope_band_rows`), each one
autograd Function that keeps the lookup's indices, fractions and slopes instead of a graph."""

from __future__ import annotations

import torch
from torch import Tensor

from posenc_lightning.functional.cope import (
    band_view,
    cope_band_counts,
    cope_counts,
    packed_rows,
    query_groups,
    zero_after_query,
)


def cope_lookup(z: Tensor, positions: Tensor, max_position: int | None = None) -> Tensor:
    """``cope_interpolate(z, positions.clamp(max=max_position - 1))`` (positions ``>= 0``;
    ``max_position`` at most ``P``, default ``P``), forward and
    backward, in fewer passes: one gather of ``(z[p], z[p + 1] - z[p])`` pairs at ``floor(p)``, and
    only ``positions`` and ``z`` kept for backward (not the indices, weights and clamp input)."""
    top = z.shape[-1] - 1 if max_position is None else int(max_position) - 1
    if not 0 <= top < z.shape[-1]:
        raise ValueError(f"cope_lookup: max_position must be in [1, {z.shape[-1]}], got {max_position}")
    return _CoPELookup.apply(z, positions, top)


class _CoPELookup(torch.autograd.Function):
    @staticmethod
    def forward(z: Tensor, positions: Tensor, top: int) -> Tensor:  # type: ignore[override]
        p = positions.clamp(max=top)
        lo = p.long()  # floor: p >= 0
        w = p.frac_()
        dz = torch.diff(z, dim=-1, append=z[..., -1:])  # z[m + 1] - z[m]; 0 at the top
        pairs = torch.complex(z.contiguous(), dz) if z.dtype in (torch.float32, torch.float64) else None
        if pairs is not None:
            g = pairs.gather(-1, lo)
            out = torch.addcmul(g.real, g.imag, w)
        else:
            out = torch.addcmul(z.gather(-1, lo), dz.gather(-1, lo), w)
        return out

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Tensor) -> None:  # functorch-compatible (vjp)
        z, positions, top = inputs
        ctx.save_for_backward(z, positions)
        ctx.top = top

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        z, positions = ctx.saved_tensors
        top = ctx.top
        p = positions.clamp(max=top)
        lo = p.long()
        w = p.frac_()
        gz = gp = None
        if ctx.needs_input_grad[0]:
            gw = grad * w
            gz = torch.zeros_like(z).scatter_add_(-1, lo, grad - gw)
            gz.scatter_add_(-1, (lo + 1).clamp_(max=top), gw)  # hi = ceil(p): weight w (0 if p is whole)
        if ctx.needs_input_grad[1]:
            dz = torch.diff(z, dim=-1, append=z[..., -1:])
            # d/dp (z[ceil p] - z[floor p]) weight: 0 where p is whole (ceil = floor) or clamped
            gp = grad * dz.gather(-1, lo)
            gp.masked_fill_((w == 0) | (positions > top), 0.0)
        return gz, gp, None


def cope_causal_rows(q: Tensor, k: Tensor, emb: Tensor, scale: float, max_position: int, q_offset: int,
                     clamped: int = 0, counted: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Causal CoPE bias rows ``z_i[p_ij]`` (eqs. 3-5), forward and backward in few passes.

    ``q [B, H, r, D]`` (query ``i`` at key ``i + q_offset``), ``k [B, H_kv, K, D]`` the keys from
    index ``clamped`` on (GQA: a query group shares its kv head, no repeat), ``emb [1|H, D, P]``,
    all float32; gates ``sigmoid(scale q.k)``. Returns ``[B, H, r, clamped + K]``: ``z_i[top]``
    at the ``clamped`` keys before ``k`` (the caller knows ``p_ij >= top`` there, see
    `CoPE.clamped_keys`), elsewhere equal to ``cope_lookup(q @ emb, cope_positions(gates, True,
    q_offset), max_position)``: the same sums in the same order, but one gather of the
    ``(z, dz)`` pairs at ``floor(p)`` along each row, no gradient graph (one Function), and
    ``dz``'s gradient by two scatters along the row into a row one wider than ``z`` (no
    index arithmetic). The keys after each query count 0 gates: ``z_i[0]`` there.

    ``counted``: ``(gates, suffix)`` already computed for these rows and keys (`cope_counts`, as
    `CoPE.clamped_keys` does while it looks for the clamp), so that they are not computed twice;
    read only, never written."""
    top = int(max_position) - 1
    q, k = packed_rows(q), packed_rows(k)
    with torch.autocast(q.device.type, enabled=False):  # float32 throughout, as given
        if torch.is_grad_enabled():
            return _CoPECausalRows.apply(q, k, emb, scale, top, q_offset, clamped, counted)[0]
        return _causal_rows(q, k, torch.matmul(q, emb), scale, top, q_offset, clamped, False, counted)[0]


def _causal_rows(q: Tensor, k: Tensor, z: Tensor, scale: float, top: int, q_offset: int, clamped: int, keep: bool,
                 counted: tuple[Tensor, Tensor] | None = None):
    """``(rows, gates, floor, frac, slope)`` from ``z = q @ emb`` (``keep=False``: only the rows;
    ``counted``: `cope_counts` of these rows and keys, read only): ``floor(p)`` (int64), its
    fraction ``w`` and the slope ``z[ceil p] - z[floor p]`` (0 where ``p`` is whole), the
    backward's inputs."""
    b, h, r, _ = q.shape
    out = z.new_empty(b, h, r, clamped + k.shape[-2])
    out[..., :clamped] = z[..., top:top + 1]
    if counted is None:
        g, rev = cope_counts(q, k, scale, q_offset - clamped)
    else:
        g, rev = counted
    if not keep:
        del g
    p = rev.flip(-1).clamp_(max=top)  # p_ij = sum_{t=j..i} g_it (eq. 4); a copy: rev is not written
    del rev
    lo = p.to(torch.int64)  # floor: p >= 0
    w = p.frac_()  # p - floor(p), exactly
    dz = torch.diff(z, dim=-1, append=z[..., -1:])  # z[m + 1] - z[m]; 0 at the last
    pair = torch.complex(z, dz).gather(-1, lo)  # (z, dz) at floor(p): one gather for both
    torch.addcmul(pair.real, pair.imag, w, out=out[..., clamped:])
    if not keep:
        return out, None, None, None, None
    # d/dp: z[ceil p] - z[floor p], 0 where p is whole (ceil = floor; clamped: p = top); w in [0, 1)
    slope = torch.mul(pair.imag, w.sign())
    return out, g, lo, w, slope


class _CoPELookupRows(torch.autograd.Function):
    """What the rows' Functions share: inputs ``(q, k, emb, *ints and floats, counted)``, outputs
    ``(rows, gates, floor, frac, slope)``; the lookup's state is saved for the backward, the other
    arguments kept as ``ctx.args``."""

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: tuple) -> None:  # functorch-compatible (vjp)
        q, k, emb, *args, _ = inputs
        _, g, lo, w, slope = output
        ctx.save_for_backward(q, k, emb, g, lo, w, slope)
        ctx.args = tuple(args)
        ctx.mark_non_differentiable(g, lo, w, slope)
        ctx.set_materialize_grads(False)  # no zeros for the saved outputs' gradients


class _CoPECausalRows(_CoPELookupRows):
    @staticmethod
    def forward(q: Tensor, k: Tensor, emb: Tensor, scale: float, top: int, q_offset: int,  # type: ignore[override]
                clamped: int, counted: tuple[Tensor, Tensor] | None):
        return _causal_rows(q, k, torch.matmul(q, emb), scale, top, q_offset, clamped, True, counted)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor, *_):
        with torch.autocast(grad.device.type, enabled=False):
            return _CoPECausalRows.grads(ctx, grad.float())

    @staticmethod
    def grads(ctx, grad: Tensor) -> tuple:
        q, k, emb, g, lo, w, slope = ctx.saved_tensors
        scale, top, q_offset, clamped = ctx.args
        b, h, r, d = q.shape
        h_kv = k.shape[1]
        grad_top, grad = grad[..., :clamped].sum(-1), grad[..., clamped:]  # z_i[top] at the clamped keys
        # p_ij = sum_{t=j..i} g_it: dg_it = sum_{j <= t} dp_ij; sigmoid' = g (1 - g); 0 after the query
        dl = torch.ops.aten.sigmoid_backward(torch.mul(grad, slope).cumsum_(-1), g)
        zero_after_query(dl, q_offset - clamped)
        dl = query_groups(dl, h_kv)
        dq = torch.matmul(dl, k).mul_(scale).view(b, h, r, d)
        dk = torch.matmul(dl.mT, query_groups(q, h_kv)).mul_(scale)
        return dq, dk, _lookup_grads(grad, w, lo, grad_top, top, q, emb, dq), None, None, None, None, None


def _lookup_grads(grad: Tensor, w: Tensor, lo: Tensor, grad_top: Tensor, top: int, q: Tensor, emb: Tensor,
                  dq: Tensor) -> Tensor:
    """The lookup's backward (eq. 5) from the rows' gradient ``grad`` at ``floor(p) = lo`` with fraction
    ``w``, and ``grad_top`` for ``z_i[top]``: ``z = q @ emb``'s gradient added to ``dq`` (in place), and
    ``emb``'s returned. ``dz[m]``: ``grad (1 - w)`` summed where ``floor(p) = m``, ``grad w`` where
    ``floor(p) = m - 1``: scattered into columns ``0..P-1`` and ``1..P`` of one more column than ``z``
    has (``w = 0`` at the top: no index arithmetic), in key order."""
    b, h, r, _ = grad.shape
    n_p = emb.shape[-1]
    gw = grad * w
    wide = torch.zeros(b, h, r, n_p + 1, dtype=grad.dtype, device=grad.device)
    wide[..., :n_p].scatter_add_(-1, lo, grad.sub(gw))
    wide[..., 1:].scatter_add_(-1, lo, gw)
    gz = wide[..., :n_p]
    gz[..., top] += grad_top
    dq += torch.matmul(gz, emb.mT)
    demb = torch.matmul(q.mT, gz).sum(0, keepdim=True)
    if emb.shape[0] == 1:
        demb = demb.sum(1)
    return demb.view(emb.shape)


def cope_band_rows(q: Tensor, k: Tensor, emb: Tensor, scale: float, max_position: int, width: int,
                   lead: int = 1, counted: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Causal CoPE bias rows ``z_i[p_ij]`` (eqs. 3-5) of rows whose keys before their band are all
    clamped (``p_ij >= max_position - 1`` before key ``o - width + i`` in row ``i``), computed on the
    bands only: ``width + 1`` keys a row where `cope_causal_rows` computes all ``width + r``.

    ``q [B, H, r, D]`` (query ``i`` at key ``o + i``), ``k [B, H_kv, width + r, D]`` the keys
    ``o - width .. o + r - 1``, ``emb [1|H, D, P]``, float32; ``counted``: `cope_band_counts` of
    these rows and keys, if already computed (read only). Returns ``[B, H, r, lead + width + r]``:
    ``lead`` columns ``z_i[top]`` (keys before ``k``), then ``k``'s keys: ``z_i[top]`` before each
    row's band, ``z_i[p_ij]`` on it, and ``z_i[top]`` at the keys after the query, which a causal
    mask hides (`cope_causal_rows` has ``z_i[0]`` there); their gradient goes to ``z_i[top]``."""
    top = int(max_position) - 1
    q, k = packed_rows(q), packed_rows(k)
    with torch.autocast(q.device.type, enabled=False):
        if torch.is_grad_enabled():
            return _CoPEBandRows.apply(q, k, emb, scale, top, width, lead, counted)[0]
        return _band_rows(q, k, torch.matmul(q, emb), scale, top, width, lead, False, counted)[0]


def _band_rows(q: Tensor, k: Tensor, z: Tensor, scale: float, top: int, width: int, lead: int, keep: bool,
               counted: tuple[Tensor, Tensor] | None = None):
    """``(rows, gates, floor, frac, slope)`` on the bands (`_causal_rows`' outputs, the rows
    written around them; ``keep=False``: only the rows)."""
    b, h, r, _ = q.shape
    g, suffix = cope_band_counts(q, k, scale, width) if counted is None else counted
    out = z[..., top:top + 1].expand(b, h, r, lead + k.shape[-2]).contiguous()
    p = suffix.flip(-1).clamp_(max=top)  # a copy: suffix is not written
    lo = p.to(torch.int64)  # floor: p >= 0
    w = p.frac_()
    dz = torch.diff(z, dim=-1, append=z[..., -1:])
    pair = torch.complex(z, dz).gather(-1, lo)
    torch.addcmul(pair.real, pair.imag, w, out=band_view(out, width, lead))
    if not keep:
        return out, None, None, None, None
    return out, g, lo, w, torch.mul(pair.imag, w.sign())


class _CoPEBandRows(_CoPELookupRows):
    @staticmethod
    def forward(q: Tensor, k: Tensor, emb: Tensor, scale: float, top: int, width: int, lead: int,  # type: ignore[override]
                counted: tuple[Tensor, Tensor] | None):
        return _band_rows(q, k, torch.matmul(q, emb), scale, top, width, lead, True, counted)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor, *_):
        with torch.autocast(grad.device.type, enabled=False):
            return _CoPEBandRows.grads(ctx, grad.float().contiguous())

    @staticmethod
    def grads(ctx, grad: Tensor) -> tuple:
        q, k, emb, g, lo, w, slope = ctx.saved_tensors
        scale, top, width, lead = ctx.args
        b, h, r, d = q.shape
        h_kv, n_k = k.shape[1], k.shape[-2]
        band = band_view(grad, width, lead)
        grad_top = grad.sum(-1) - band.sum(-1)  # every column off the bands holds z_i[top]
        # as `_CoPECausalRows.grads`, on the bands: dg_it = sum_{j <= t} dp_ij along the band
        dl = torch.ops.aten.sigmoid_backward(torch.mul(band, slope).cumsum_(-1), g)
        wide_dl = torch.zeros(b, h, r, n_k, dtype=grad.dtype, device=grad.device)
        band_view(wide_dl, width).copy_(dl)
        del dl
        wide_dl = query_groups(wide_dl, h_kv)
        dq = torch.matmul(wide_dl, k).mul_(scale).view(b, h, r, d)
        dk = torch.matmul(wide_dl.mT, query_groups(q, h_kv)).mul_(scale)
        return dq, dk, _lookup_grads(band, w, lo, grad_top, top, q, emb, dq), None, None, None, None, None
