"""Flush-to-zero of denormals around biased attention on CPU, forward and backward (the sdpa
backend's biased calls; `call_flushing_denormals` for a compiled region)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor

#: biased softmax weights decay into the denormal range (exp(-90)), where x86 CPU arithmetic
#: is many times slower (3x for a causal ALiBi backward at N=2048); flush them to zero inside the
#: biased SDPA calls and their backward (CPU only). The setting is restored to PyTorch's
#: default (off) afterwards.
FLUSH_DENORMALS = True


def _flush_in_backward(*xs: Tensor) -> bool:
    return (FLUSH_DENORMALS and torch.is_grad_enabled() and xs[0].device.type == "cpu"
            and any(x.requires_grad for x in xs) and not torch.compiler.is_compiling())


class _DenormalsOnForBackward(torch.autograd.Function):
    """Identity on the attention output; in backward it turns flush-to-zero on, before the
    SDPA backward runs (the autograd engine runs CPU nodes on the calling thread). It is turned
    off by `_DenormalsOffAfterBackward` once the gradients of q, k, v are in, and, should that
    node not run (``autograd.grad`` to a bias parameter only, an error in between), at the end
    of the backward pass at the latest (an engine callback)."""

    @staticmethod
    def forward(ctx, out: Tensor) -> Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        torch.set_flush_denormal(True)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: torch.set_flush_denormal(False))
        return grad


class _DenormalsOffAfterBackward(torch.autograd.Function):
    """Identity on q, k, v; its backward runs once all of their gradients are in (after the
    attention's backward) and turns flush-to-zero off again."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, gq: Tensor, gk: Tensor, gv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        torch.set_flush_denormal(False)
        return gq, gk, gv


def call_flushing_denormals(fn: Callable[..., Tensor], *args: object) -> Tensor:
    """``fn(*args)`` with flush-to-zero of denormals on CPU, forward and backward: for a compiled
    region, inside which the setting cannot be changed (measured: a compiled FIRE TinyGPT step
    267 -> 180 ms at N=512; biased softmax weights fall into the denormal range). Off again after
    the call, and at the end of the backward pass (as for the eager biased paths)."""
    with _flush_denormals(torch.device("cpu")):
        out = fn(*args)
    if FLUSH_DENORMALS and torch.is_grad_enabled() and out.requires_grad and out.device.type == "cpu":
        out = _DenormalsOnForBackward.apply(out)
    return out


@contextlib.contextmanager
def _flush_denormals(device: torch.device):
    if torch.compiler.is_compiling() or not (FLUSH_DENORMALS and device.type == "cpu"
                                               and torch.set_flush_denormal(True)):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
