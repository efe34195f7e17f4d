"""FIRE attention inside a compiled graph as one opaque operator (``posenc::fire_sdpa``), CPU only.

Eager FIRE picks its cheapest exact form from values: while every query is below the learned
threshold ``L`` the bias is ``f(i - j)`` (FIRE eq. 3 with the constant normalizer ``psi(L)``), an
O(N) table read through SDPA's zero-copy Toeplitz mask; past ``L`` the MLP runs per pair by
blocks of rows. A traced graph cannot branch on ``L``, so compiled FIRE would take the per-pair
form always (measured: a compiled TinyGPT step 0.76x eager's). This operator runs the eager
choice inside the graph, where reading a CPU tensor costs no sync, with its own backward
operator (the eager backward by blocks, nothing recomputed but the bias rows). On GPUs the
traced per-pair form stays (a read there would be a device sync).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc_lightning.attention.backends import sdpa
from posenc_lightning.attention.backends.sdpa import _toeplitz_template
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext, RelativeBias
from posenc_lightning.encodings.bias import FireBias
from posenc_lightning.functional.fire import fire_psi

__all__ = ["fire_attention"]

#: FIRE's parameters as the operators take them: c, l_mult, w1, b1, w2, b2
_N_PARAMS = 6


def fire_attention(q: Tensor, k: Tensor, v: Tensor, bias: FireBias, mask: AttentionMask, scale: float,
                   ctx: AttentionContext) -> Tensor | None:
    """``posenc::fire_sdpa`` for an unscaled FIRE bias on CPU under a plain (causal or full) mask;
    None where it does not apply (the caller's traced path then runs)."""
    if (q.device.type != "cpu" or bias.weight is not None or mask.q_segments is not None
            or mask.k_valid is not None):
        return None
    starts = [-1 if s is None else s for s in (ctx.q_start, ctx.k_start)]
    out, _, _ = torch.ops.posenc.fire_sdpa(q, k, v, bias.q_pos, bias.k_pos, *bias.grad_inputs(), bias.init_L,
                                           bias.eps, mask.causal, mask.q_offset, scale, starts)
    return out


def _bias(q_pos: Tensor, k_pos: Tensor, params: tuple[Tensor, ...], init_L: Tensor, eps: float,
          starts: list[int]) -> FireBias:
    q_start, k_start = (None if s < 0 else s for s in starts)
    return FireBias(q_pos, k_pos, *params[:2], init_L, *params[2:], eps=eps, q_start=q_start, k_start=k_start)


def _relative_range(bias: FireBias) -> int | None:
    """The largest ``|i - j|`` when every query is below ``L`` (the bias is then ``f(i - j)``), else
    None. Host reads: this runs eagerly on CPU tensors."""
    qp, kp = bias.q_pos, bias.k_pos
    if qp.dtype.is_floating_point or kp.dtype.is_floating_point or not qp.numel() or not kp.numel():
        return None
    q_max, q_min, k_max, k_min = torch.stack((qp.max(), qp.min(), kp.max(), kp.min())).tolist()
    if q_max >= float((bias.l_mult * bias.init_L).abs()):
        return None
    return int(max(abs(q_max - k_min), abs(k_max - q_min)))


def _template(params: tuple[Tensor, ...], bias: FireBias, r: int, mask: AttentionMask, ctx: AttentionContext) -> Tensor | None:
    """The Toeplitz template ``u [H, Nq + Nk - 1]`` of FIRE below ``L`` (as `FIRE.relative_table`,
    causal ``-inf`` folded in), differentiable in ``params``; None when positions are not arange."""
    c, l_mult, w1, b1, w2, b2 = params
    dt = torch.promote_types(c.dtype, torch.float32)
    d = torch.arange(-r, r + 1, device=c.device, dtype=dt)
    x = fire_psi(d, c.to(dt)) / (fire_psi((l_mult * bias.init_L).abs().to(dt), c.to(dt)) + bias.eps)
    table = F.linear(F.relu(F.linear(x[:, None].to(w1.dtype), w1, b1)), w2, b2).float().t()  # [H, 2r + 1]
    return _toeplitz_template(RelativeBias(table, bias.q_pos, bias.k_pos), mask, mask.n_q, mask.n_k, ctx)


def _context(q_pos: Tensor, k_pos: Tensor, causal: bool, starts: list[int]) -> AttentionContext:
    q_start, k_start = (None if s < 0 else s for s in starts)
    same = q_pos is k_pos or (q_start is not None and q_start == k_start and q_pos.shape == k_pos.shape)
    return AttentionContext(q_pos, q_pos if same else k_pos, causal, q_start=q_start, k_start=k_start)


@torch.library.custom_op("posenc::fire_sdpa", mutates_args=())
def fire_sdpa(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, c: Tensor, l_mult: Tensor, w1: Tensor,
              b1: Tensor, w2: Tensor, b2: Tensor, init_L: Tensor, eps: float, causal: bool, q_offset: int,
              scale: float, starts: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, u, toeplitz)``: the attention output ``[B, H, Nq, Dv]``, the template ``u`` the
    backward reads (zeros unless ``toeplitz``) and whether the Toeplitz form ran."""
    params = (c, l_mult, w1, b1, w2, b2)
    n_q, n_k = q.shape[-2], k.shape[-2]
    mask = AttentionMask(causal, q_offset, n_q, n_k)
    gqa = k.shape[1] != q.shape[1]
    bias = _bias(q_pos, k_pos, params, init_L, eps, starts)
    with torch.no_grad():
        r = _relative_range(bias)
        u = None if r is None else _template(params, bias, r, mask, _context(q_pos, k_pos, causal, starts))
        if u is not None:
            out = sdpa._attend_toeplitz(q, k, v, u.to(q.dtype), mask, scale, gqa)
        else:
            out = sdpa._attend_by_rows(q, k, v, bias, mask, scale, gqa, sdpa.block_rows(q.shape[1], n_q, n_k))
    u_out = u.float() if u is not None else q.new_zeros(w2.shape[0], n_q + n_k - 1, dtype=torch.float32)
    return _sdpa_layout(q, v).copy_(out), u_out, torch.tensor(u is not None)


def _sdpa_layout(q: Tensor, v: Tensor) -> Tensor:
    """An empty output ``[B, H, Nq, Dv]`` laid out ``[B, Nq, H, Dv]`` as SDPA's own (callers view
    ``out.transpose(1, 2)`` as ``[B, Nq, H * Dv]``)."""
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[-1]).transpose(1, 2)


@fire_sdpa.register_fake
def _(q, k, v, q_pos, k_pos, c, l_mult, w1, b1, w2, b2, init_L, eps, causal, q_offset, scale, starts):
    n_q, n_k = q.shape[-2], k.shape[-2]
    return (_sdpa_layout(q, v), q.new_empty(w2.shape[0], n_q + n_k - 1, dtype=torch.float32),
            q.new_empty((), dtype=torch.bool))


@torch.library.custom_op("posenc::fire_sdpa_backward", mutates_args=())
def fire_sdpa_backward(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, u: Tensor, toeplitz: Tensor,
                       q_pos: Tensor, k_pos: Tensor, c: Tensor, l_mult: Tensor, w1: Tensor, b1: Tensor, w2: Tensor,
                       b2: Tensor, init_L: Tensor, eps: float, causal: bool, q_offset: int, scale: float,
                       starts: list[int], need: list[bool]) -> list[Tensor]:
    """``[dq, dk, dv, dc, dl_mult, dw1, db1, dw2, db2]`` (zeros where ``need`` is False): the eager
    backward of the form the forward ran (`sdpa.toeplitz_backward` then the template's vjp, or
    `sdpa.blockwise_backward`)."""
    params = (c, l_mult, w1, b1, w2, b2)
    mask = AttentionMask(causal, q_offset, q.shape[-2], k.shape[-2])
    bias = _bias(q_pos, k_pos, params, init_L, eps, starts)
    grads: list[Tensor | None]
    if bool(toeplitz):
        dq, dk, dv, du = sdpa.toeplitz_backward(q, k, v, u, out, d_out, causal, q_offset, scale,
                                                any(need[3:]))
        grads = [None] * _N_PARAMS
        if any(need[3:]):
            r = _relative_range(bias)
            ctx = _context(q_pos, k_pos, causal, starts)
            with torch.enable_grad():
                _, vjp = torch.func.vjp(lambda *p: _template(p, bias, r, mask, ctx), *params)
            grads = list(vjp(du.to(torch.float32)))
    else:
        extra = [p for p, n in zip(params, need[3:]) if n]
        targets: list[int | None] = []  # each parameter's index among the extra inputs, or None
        for n in need[3:]:
            targets.append(len(targets) - targets.count(None) if n else None)
        spec = (bias, mask, scale, params, targets)
        dq, dk, dv, g = sdpa.blockwise_backward(q, k, v, out, d_out, spec, (*need[:3], False, *[True] * len(extra)))
        grads = [None if t is None else g[t] for t in targets]
    full = [dq, dk, dv, *grads]  # laid out as their inputs (the fake's empty_like)
    return [torch.zeros_like(t) if gi is None or not n else torch.empty_like(t).copy_(gi)
            for gi, t, n in zip(full, (q, k, v, *params), need)]


@fire_sdpa_backward.register_fake
def _(d_out, q, k, v, out, u, toeplitz, q_pos, k_pos, c, l_mult, w1, b1, w2, b2, init_L, eps, causal, q_offset,
      scale, starts, need):
    return [torch.empty_like(t) for t in (q, k, v, c, l_mult, w1, b1, w2, b2)]


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, q_pos, k_pos, c, l_mult, w1, b1, w2, b2, init_L, eps, causal, q_offset, scale, starts = inputs
    out, u, toeplitz = output
    ctx.save_for_backward(q, k, v, out, u, toeplitz, q_pos, k_pos, c, l_mult, w1, b1, w2, b2, init_L)
    ctx.args = (eps, causal, q_offset, scale, starts)


def _backward(ctx, d_out: Tensor, _du: Tensor, _dt: Tensor) -> tuple:
    q, k, v, out, u, toeplitz, q_pos, k_pos, *params, init_L = ctx.saved_tensors
    need = [ctx.needs_input_grad[i] for i in (0, 1, 2, 5, 6, 7, 8, 9, 10)]
    g = torch.ops.posenc.fire_sdpa_backward(d_out.contiguous(), q, k, v, out, u, toeplitz, q_pos, k_pos, *params,
                                            init_L, *ctx.args, need)
    kept = [gi if n else None for gi, n in zip(g, need)]
    return (*kept[:3], None, None, *kept[3:], None, None, None, None, None, None)


fire_sdpa.register_autograd(_backward, setup_context=_setup_context)


sdpa.COMPILED_FORMS[FireBias] = fire_attention
