"""FIRE attention inside a compiled graph as one opaque operator (``posenc::fire_sdpa``), CPU only.

Eager FIRE picks its cheapest exact form from values: while every query is below the learned
threshold ``L`` the bias is ``f(i - j)`` (FIRE eq. 3 with the constant normalizer ``psi(L)``), an
O(N) table read through SDPA's zero-copy Toeplitz mask; past ``L`` the MLP runs per pair by
blocks of rows. A traced graph cannot branch on ``L``, so compiled FIRE would take the per-pair
form always (measured: a compiled TinyGPT step 0.76x eager's). This operator runs the eager
choice inside the graph, where reading a CPU tensor costs no sync, with its own backward
operator (the eager backward by blocks, nothing recomputed but the bias rows; past ``L`` each
block's rows differentiated in the traced formula compiled by inductor, `FireBias.compiled_rows`,
twice as fast as the eager Function there). On GPUs the traced per-pair form stays (a read there
would be a device sync).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc_lightning.attention.backends import sdpa
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext
from posenc_lightning.encodings.bias import FireBias
from posenc_lightning.functional.fire import fire_psi
from posenc_lightning.functional.positions import arange_offset

__all__ = ["fire_attention"]

#: FIRE's parameters as the operators take them: c, l_mult, w1, b1, w2, b2
_N_PARAMS = 6


def fire_attention(q: Tensor, k: Tensor, v: Tensor, bias: FireBias, mask: AttentionMask, scale: float,
                   ctx: AttentionContext) -> Tensor | None:
    """``posenc::fire_sdpa`` for an unscaled FIRE bias on CPU under a plain (causal or full) mask;
    None where it does not apply (the caller's traced path then runs). Positions known to be
    ``start + arange`` give the Toeplitz template in the graph (O(N), fused by the compiler, its
    gradient to the parameters traced); the operator only decides whether it applies."""
    if (q.device.type != "cpu" or bias.weight is not None or mask.q_segments is not None
            or mask.k_valid is not None):
        return None
    static = ctx.q_start is not None and ctx.k_start is not None and not bias.q_pos.dtype.is_floating_point
    u = _template(bias.grad_inputs(), bias.init_L, bias.eps, ctx.q_start - ctx.k_start, mask) if static else None
    starts = [-1 if s is None else s for s in (ctx.q_start, ctx.k_start)]
    out, _, _ = torch.ops.posenc.fire_sdpa(q, k, v, bias.q_pos, bias.k_pos, *bias.grad_inputs(), bias.init_L, u,
                                           bias.eps, mask.causal, mask.q_offset, scale, starts)
    return out


def _bias(q_pos: Tensor, k_pos: Tensor, params: tuple[Tensor, ...], init_L: Tensor, eps: float,
          starts: list[int]) -> FireBias:
    q_start, k_start = (None if s < 0 else s for s in starts)
    return FireBias(q_pos, k_pos, *params[:2], init_L, *params[2:], eps=eps, q_start=q_start, k_start=k_start,
                    compiled_rows=True)


def _toeplitz_shift(bias: FireBias) -> int | None:
    """``a - c`` when every query is below ``L`` (the bias is then ``f(i - j)``, FIRE eq. 3 with the
    constant normalizer ``psi(L)``) and the positions are ``a + arange``, ``c + arange``; else None.
    Host reads (of the positions where their starts are not known): this runs eagerly on CPU."""
    qp, kp = bias.q_pos, bias.k_pos
    if qp.dtype.is_floating_point or kp.dtype.is_floating_point or not qp.numel() or not kp.numel():
        return None
    top = qp.shape[-1] - 1 + bias.q_start if bias.q_start is not None else float(qp.max())
    if top >= float((bias.l_mult * bias.init_L).abs()):
        return None
    a, c = arange_offset(qp, bias.q_start), arange_offset(kp, bias.k_start)
    return None if a is None or c is None else a - c


def _template(params: tuple[Tensor, ...], init_L: Tensor, eps: float, shift: int, mask: AttentionMask) -> Tensor:
    """The Toeplitz template ``u [H, Nq + Nk - 1]``, ``bias[h, i, j] = u[h, j - i + Nq - 1]``, of FIRE
    below ``L`` at positions ``a + arange``, ``c + arange`` (``shift = a - c``), causal ``-inf`` folded
    in: the values of `FIRE.relative_table` at each distance, differentiable in ``params``."""
    c, l_mult, w1, b1, w2, b2 = params[:_N_PARAMS]
    dt = torch.promote_types(c.dtype, torch.float32)
    d = torch.arange(-(mask.n_q - 1), mask.n_k, device=c.device)  # j - i
    dist = (shift - d).to(dt)  # i_pos - j_pos
    x = fire_psi(dist, c.to(dt)) / (fire_psi((l_mult * init_L).abs().to(dt), c.to(dt)) + eps)
    u = F.linear(F.relu(F.linear(x[:, None].to(w1.dtype), w1, b1)), w2, b2).float().t()  # [H, T]
    if mask.causal:
        u = u.masked_fill(d[None, :] > mask.q_offset, float("-inf"))
    return u.contiguous()


@torch.library.custom_op("posenc::fire_sdpa", mutates_args=())
def fire_sdpa(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, c: Tensor, l_mult: Tensor, w1: Tensor,
              b1: Tensor, w2: Tensor, b2: Tensor, init_L: Tensor, u: Tensor | None, eps: float, causal: bool,
              q_offset: int, scale: float, starts: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, u_used, toeplitz)``: the attention output ``[B, H, Nq, Dv]`` (laid out as SDPA's),
    the template the backward reads (zeros unless ``toeplitz``) and whether the Toeplitz form ran.
    ``u``: the template computed in the graph (static positions), or None: computed here."""
    params = (c, l_mult, w1, b1, w2, b2)
    n_q, n_k = q.shape[-2], k.shape[-2]
    mask = AttentionMask(causal, q_offset, n_q, n_k)
    gqa = k.shape[1] != q.shape[1]
    bias = _bias(q_pos, k_pos, params, init_L, eps, starts)
    with torch.no_grad():  # (blocks written straight into SDPA's layout)
        shift = _toeplitz_shift(bias)
        if shift is not None:
            u = u if u is not None else _template(params, init_L, eps, shift, mask)
            # detached: a mask that requires grad sends SDPA to its math kernel, even here
            out = sdpa._attend_toeplitz(q, k, v, u.detach().to(q.dtype), mask, scale, gqa)
        else:
            out = sdpa._attend_by_rows(q, k, v, bias, mask, scale, gqa, sdpa.block_rows(q.shape[1], n_q, n_k))
    u_out = u.float().clone() if shift is not None else q.new_zeros(w2.shape[0], n_q + n_k - 1, dtype=torch.float32)
    return _laid_out(out, _sdpa_layout(q, v)), u_out, torch.tensor(shift is not None)


def _sdpa_layout(q: Tensor, v: Tensor) -> Tensor:
    """An empty output ``[B, H, Nq, Dv]`` laid out ``[B, Nq, H, Dv]`` as SDPA's own (callers view
    ``out.transpose(1, 2)`` as ``[B, Nq, H * Dv]``)."""
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[-1]).transpose(1, 2)


def _laid_out(t: Tensor, like: Tensor) -> Tensor:
    """``t`` in the dtype and strides of ``like`` (as the fake implementations state them): ``t``
    itself when it already is (the blocks were written into SDPA's layout), else a copy."""
    return t if t.stride() == like.stride() and t.dtype == like.dtype else like.copy_(t)


@fire_sdpa.register_fake
def _(q, k, v, q_pos, k_pos, c, l_mult, w1, b1, w2, b2, init_L, u, eps, causal, q_offset, scale, starts):
    n_q, n_k = q.shape[-2], k.shape[-2]
    return (_sdpa_layout(q, v), q.new_empty(w2.shape[0], n_q + n_k - 1, dtype=torch.float32),
            q.new_empty((), dtype=torch.bool))


@torch.library.custom_op("posenc::fire_sdpa_backward", mutates_args=())
def fire_sdpa_backward(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, u: Tensor, toeplitz: Tensor,
                       q_pos: Tensor, k_pos: Tensor, c: Tensor, l_mult: Tensor, w1: Tensor, b1: Tensor, w2: Tensor,
                       b2: Tensor, init_L: Tensor, eps: float, causal: bool, q_offset: int, scale: float,
                       starts: list[int], u_given: bool, need: list[bool]) -> list[Tensor]:
    """``[dq, dk, dv, dc, dl_mult, dw1, db1, dw2, db2, du]`` (zeros where ``need`` is False or the
    form that ran has none): the eager backward of that form (`sdpa.toeplitz_backward`, then
    ``du`` to the given template or, computed here, through the template's vjp; or
    `sdpa.blockwise_backward`)."""
    params = (c, l_mult, w1, b1, w2, b2)
    mask = AttentionMask(causal, q_offset, q.shape[-2], k.shape[-2])
    bias = _bias(q_pos, k_pos, params, init_L, eps, starts)
    grads: list[Tensor | None] = [None] * (_N_PARAMS + 1)
    if bool(toeplitz):
        want_u = any(need[3:])
        dq, dk, dv, du = sdpa.toeplitz_backward(q, k, v, u, out, d_out, causal, q_offset, scale, want_u)
        if u_given:
            grads[-1] = du
        elif want_u:
            shift = _toeplitz_shift(bias)
            _, vjp = torch.func.vjp(lambda *p: _template(p, init_L, eps, shift, mask), *params)
            grads[:_N_PARAMS] = vjp(du.to(torch.float32))
    else:
        extra = [p for p, n in zip(params, need[3:]) if n]
        targets: list[int | None] = []  # each parameter's index among the extra inputs, or None
        for n in need[3:_N_PARAMS + 3]:
            targets.append(len(targets) - targets.count(None) if n else None)
        spec = (bias, mask, scale, params, targets)
        dq, dk, dv, g = sdpa.blockwise_backward(q, k, v, out, d_out, spec, (*need[:3], False, *[True] * len(extra)))
        grads[:_N_PARAMS] = [None if t is None else g[t] for t in targets]
    full = [dq, dk, dv, *grads]  # laid out as their inputs (the fake's empty_like)
    return [torch.zeros_like(t) if gi is None or not n else _laid_out(gi, torch.empty_like(t))
            for gi, t, n in zip(full, (q, k, v, *params, u), need)]


@fire_sdpa_backward.register_fake
def _(d_out, q, k, v, out, u, toeplitz, q_pos, k_pos, c, l_mult, w1, b1, w2, b2, init_L, eps, causal, q_offset,
      scale, starts, u_given, need):
    return [torch.empty_like(t) for t in (q, k, v, c, l_mult, w1, b1, w2, b2, u)]


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, q_pos, k_pos, c, l_mult, w1, b1, w2, b2, init_L, u_in, eps, causal, q_offset, scale, starts = inputs
    out, u, toeplitz = output
    ctx.save_for_backward(q, k, v, out, u, toeplitz, q_pos, k_pos, c, l_mult, w1, b1, w2, b2, init_L)
    ctx.args = (eps, causal, q_offset, scale, starts, u_in is not None)


def _backward(ctx, d_out: Tensor, _du: Tensor, _dt: Tensor) -> tuple:
    q, k, v, out, u, toeplitz, q_pos, k_pos, *params, init_L = ctx.saved_tensors
    # a given template (static positions) takes the Toeplitz form's gradient to the parameters
    need = [ctx.needs_input_grad[i] for i in (0, 1, 2, 5, 6, 7, 8, 9, 10)] + [ctx.args[-1] and ctx.needs_input_grad[12]]
    g = torch.ops.posenc.fire_sdpa_backward(d_out, q, k, v, out, u, toeplitz, q_pos, k_pos, *params,
                                            init_L, *ctx.args, need)
    kept = [gi if n else None for gi, n in zip(g, need)]
    return (*kept[:3], None, None, *kept[3:9], None, kept[9], None, None, None, None, None)


fire_sdpa.register_autograd(_backward, setup_context=_setup_context)


sdpa.COMPILED_FORMS[FireBias] = fire_attention
