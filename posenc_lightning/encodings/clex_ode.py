"""CLEX's ODE solve as one operator forward and one backward (issue 49).

``posenc::clex_solve`` solves the ODE (`functional.clex.clex_log_freq`) and
``posenc::clex_solve_backward`` differentiates it (autograd through the same RK4 steps): one
operator each, however many RK4 steps the scale t (so the length) asks for. The ODE is tiny
(``R/2`` states, ``[R/2, hidden]`` weights), so both run on the host in float64: on CUDA each is
a few copies (and one sync) instead of ~60 launches per RK4 step, a count independent of N.
"""

from __future__ import annotations

import concurrent.futures

import torch
from torch import Tensor

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
