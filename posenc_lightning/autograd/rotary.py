"""RoPE's half-layout rotation with a hand-written backward (`functional.rope.apply_rotary` is the
formula users call; `functional.rope.apply_rotary_reference` the paper's form it is tested against)."""

from __future__ import annotations

import torch
from torch import Tensor


def rotary_dtype(x: Tensor, cos: Tensor) -> torch.dtype:
    """float32 math (float64 when given float64), whatever the activation dtype."""
    return torch.promote_types(torch.promote_types(x.dtype, cos.dtype), torch.float32)


def rotate_half_into(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Half layout written into one preallocated buffer: no chunk/cat temporaries (on CPU each
    temporary is a fresh allocation, which costs more than the arithmetic)."""
    h = cos.shape[-1]
    r = 2 * h
    wdt = rotary_dtype(x, cos)
    cos, sin = cos.to(wdt), sin.to(wdt)
    out = torch.empty(x.shape, dtype=wdt, device=x.device)
    x1, x2, o1, o2 = x[..., :h], x[..., h:r], out[..., :h], out[..., h:r]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1.0)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)  # x2 cos + x1 sin
    if x.shape[-1] > r:
        out[..., r:].copy_(x[..., r:])
    return out if out.dtype == x.dtype else out.to(x.dtype)


class RotaryHalf(torch.autograd.Function):
    """The half-layout rotation with a hand-written backward: a rotation's adjoint is the
    rotation by the opposite angle (``sin -> -sin``), so nothing but cos/sin is saved."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return rotate_half_into(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return RotaryHalf.apply(grad, cos, -sin), None, None
