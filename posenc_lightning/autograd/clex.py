"""CLEX's learned frequencies as few operators per training step, whatever the length (issue 49).

- ``posenc::clex_solve`` solves the ODE (`functional.clex.clex_log_freq`) forward and
  ``posenc::clex_solve_backward`` differentiates it (autograd through the same RK4 steps): one
  operator each, however many RK4 steps the scale t (so the length) asks for. The ODE is tiny
  (``R/2`` states, ``[R/2, hidden]`` weights), so both run on the host in float64: on CUDA each is
  a few copies (one sync) instead of ~60 launches per RK4 step, a count independent of N.
- `LearnedRotaryPair` rotates q and k by ``posenc::rotate_pair`` with tables that carry no graph
  and routes the gradient of the frequencies through ``posenc::rotary_freq_grad``: rotating by
  angle ``p f`` has ``dL/dθ = g_2 x_1 - g_1 x_2`` with ``g`` the un-rotated gradient and ``x`` the
  un-rotated input (rotations commute), so ``dL/df_i = sum_{b,h,n} p_{b,n} dL/dθ_{b,h,n,i}``.
"""

from __future__ import annotations

import concurrent.futures

import torch
from torch import Tensor

from posenc_lightning.autograd.rotary import rotate_pair
from posenc_lightning.functional.clex import clex_log_freq


def _host(*ts: Tensor) -> tuple[Tensor, ...]:
    return tuple(t.detach().to("cpu", torch.float64) for t in ts)


@torch.library.custom_op("posenc::clex_solve", mutates_args=())
def clex_solve(z0: Tensor, w_up: Tensor, w_down: Tensor, t: float, step: float, base: float) -> Tensor:
    """``z(t)`` of CLEX's ODE from ``z(1) = z0`` (`functional.clex.clex_log_freq`), solved on the
    host in float64, returned in z0's device and dtype."""
    with torch.no_grad():
        z = clex_log_freq(*_host(z0, w_up, w_down), t, step, base)
    return z.to(device=z0.device, dtype=z0.dtype, copy=True)  # never an alias of z0


@clex_solve.register_fake
def _(z0, w_up, w_down, t, step, base):
    return torch.empty_like(z0)


@torch.library.custom_op("posenc::clex_solve_backward", mutates_args=())
def clex_solve_backward(grad: Tensor, z0: Tensor, w_up: Tensor, w_down: Tensor, t: float, step: float,
                        base: float) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of `clex_solve` in ``(z0, w_up, w_down)`` given that of its output (backprop
    through the RK4 steps, on the host in float64)."""
    def backprop() -> tuple[Tensor, ...]:
        leaves = [x.requires_grad_(True) for x in _host(z0, w_up, w_down)]
        with torch.enable_grad():
            z = clex_log_freq(*leaves, t, step, base)
            return torch.autograd.grad(z, leaves, _host(grad)[0], allow_unused=True, materialize_grads=True)

    # a custom op's body runs below the autograd dispatch key (nothing records), a key set that is
    # thread-local: autograd through the RK4 steps runs in a worker thread, which starts without it
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        grads = pool.submit(backprop).result()
    return tuple(g.to(device=x.device, dtype=x.dtype, copy=True) for g, x in zip(grads, (z0, w_up, w_down)))


@clex_solve_backward.register_fake
def _(grad, z0, w_up, w_down, t, step, base):
    return torch.empty_like(z0), torch.empty_like(w_up), torch.empty_like(w_down)


def _solve_setup(ctx, inputs, output) -> None:
    z0, w_up, w_down, ctx.t, ctx.step, ctx.base = inputs
    ctx.save_for_backward(z0, w_up, w_down)


def _solve_backward(ctx, grad):
    g = clex_solve_backward(grad, *ctx.saved_tensors, ctx.t, ctx.step, ctx.base)
    return (*g, None, None, None)


clex_solve.register_autograd(_solve_backward, setup_context=_solve_setup)


def _freq_grad(g: Tensor, x: Tensor, pos: Tensor, interleaved: bool, half: int) -> Tensor:
    dt = torch.float64 if g.dtype == torch.float64 else torch.float32
    g, x = g.to(dt), x.to(dt)
    if interleaved:
        g1, g2, x1, x2 = g[..., 0:2 * half:2], g[..., 1:2 * half:2], x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    else:
        g1, g2, x1, x2 = g[..., :half], g[..., half:2 * half], x[..., :half], x[..., half:2 * half]
    dtheta = (g2 * x1 - g1 * x2).sum(1)  # [B, N, R/2]: summed over heads
    return torch.einsum("bn,bni->i", pos.to(dt), dtheta)


@torch.library.custom_op("posenc::rotary_freq_grad", mutates_args=())
def rotary_freq_grad(gq: Tensor, q: Tensor, pos_q: Tensor, gk: Tensor, k: Tensor, pos_k: Tensor,
                     half: int, interleaved: bool) -> Tensor:
    """``dL/d inv_freq`` ``[half]`` of q, k rotated by ``pos * inv_freq``, from the un-rotated
    gradients ``gq``, ``gk`` and the un-rotated inputs (module docstring), in the compute dtype."""
    return _freq_grad(gq, q, pos_q, interleaved, half) + _freq_grad(gk, k, pos_k, interleaved, half)


@rotary_freq_grad.register_fake
def _(gq, q, pos_q, gk, k, pos_k, half, interleaved):
    dt = torch.float64 if gq.dtype == torch.float64 else torch.float32
    return gq.new_empty(half, dtype=dt)


class LearnedRotaryPair(torch.autograd.Function):
    """q, k rotated by tables of ``pos * inv_freq`` (given, without a graph) with the gradient of
    ``inv_freq`` (attention scaling 1): forward one ``posenc::rotate_pair``; backward its inverse
    and one ``posenc::rotary_freq_grad``. Saves the un-rotated q, k (views attention keeps)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, inv_freq: Tensor, cos_q: Tensor, sin_q: Tensor,  # type: ignore[override]
                cos_k: Tensor, sin_k: Tensor, pos_q: Tensor, pos_k: Tensor, interleaved: bool
                ) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(q, k, cos_q, sin_q, cos_k, sin_k, pos_q, pos_k)
        ctx.interleaved, ctx.freq_dtype = interleaved, inv_freq.dtype
        return rotate_pair(q, k, cos_q, sin_q, cos_k, sin_k, interleaved, False)

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor):  # type: ignore[override]
        q, k, cq, sq, ck, sk, pq, pk = ctx.saved_tensors
        gq, gk = rotate_pair(dq, dk, cq, sq, ck, sk, ctx.interleaved, True)
        gf = None
        if ctx.needs_input_grad[2]:
            gf = rotary_freq_grad(gq, q, pq, gk, k, pk, cq.shape[-1], ctx.interleaved).to(ctx.freq_dtype)
        return gq, gk, gf, None, None, None, None, None, None, None
