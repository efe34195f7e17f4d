"""RoPE's rotation with hand-written backwards (`functional.rope.apply_rotary` is the formula users
call; `functional.rope.apply_rotary_reference` the paper's form it is tested against).

`RotaryHalf` rotates one tensor (half layout). `RotaryPair` rotates q and k together, either layout,
through one operator, ``posenc::rotate_pair``: on CUDA one Triton launch for both tensors
(`autograd.rotary_triton`, when triton is installed), elsewhere the same math in torch. Its backward
is the inverse rotation of ``dq`` and ``dk`` (the same operator with ``inverse=True``: ``sin`` negated
inside, nothing allocated for it), so it saves only the cos/sin tables.
"""

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


def rotate_into(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, inverse: bool) -> Tensor:
    """``x`` ``[B, H, N, D]`` rotated (``inverse``: by the opposite angle) in the tables' dtype
    (cos/sin ``[B|1, H|1, N, R/2]``, float32 or float64) into one new contiguous buffer, returned
    in ``x.dtype``. Pairs ``(j, j + R/2)`` (half) or ``(2j, 2j + 1)`` (interleaved); channels from
    ``R`` on are copied. With ``cos``/``sin`` in ``x``'s dtype the half layout is `rotate_half_into`
    to the last bit."""
    h = cos.shape[-1]
    r = 2 * h
    wdt = rotary_dtype(x, cos)
    cos, sin = cos.to(wdt), sin.to(wdt)  # no-ops for tables cached in the compute dtype
    out = torch.empty(x.shape, dtype=wdt, device=x.device)
    if interleaved:
        x1, x2, o1, o2 = x[..., 0:r:2], x[..., 1:r:2], out[..., 0:r:2], out[..., 1:r:2]
    else:
        x1, x2, o1, o2 = x[..., :h], x[..., h:r], out[..., :h], out[..., h:r]
    sign = -1.0 if inverse else 1.0
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-sign)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin, value=sign)  # x2 cos + x1 sin
    if x.shape[-1] > r:
        out[..., r:].copy_(x[..., r:])
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _triton_ready(x: Tensor) -> bool:
    if x.device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@torch.library.custom_op("posenc::rotate_pair", mutates_args=())
def rotate_pair(q: Tensor, k: Tensor, cos_q: Tensor, sin_q: Tensor, cos_k: Tensor, sin_k: Tensor,
                interleaved: bool, inverse: bool) -> tuple[Tensor, Tensor]:
    """q ``[B, H, Nq, D]`` and k ``[B, Hkv, Nk, D]`` rotated by their tables (`rotate_into`) in one
    operator: one Triton launch on CUDA, `rotate_into` twice elsewhere. Returns new contiguous
    tensors in the inputs' dtypes."""
    if _triton_ready(q):
        from posenc_lightning.autograd.rotary_triton import rotate_pair_triton

        return rotate_pair_triton(q, k, cos_q, sin_q, cos_k, sin_k, interleaved, inverse)
    return (rotate_into(q, cos_q, sin_q, interleaved, inverse),
            rotate_into(k, cos_k, sin_k, interleaved, inverse))


@rotate_pair.register_fake
def _(q, k, cos_q, sin_q, cos_k, sin_k, interleaved, inverse):
    return q.new_empty(q.shape), k.new_empty(k.shape)


class RotaryPair(torch.autograd.Function):
    """q and k rotated together by ``posenc::rotate_pair`` (``inverse``: by the opposite angles);
    backward un-rotates ``dq`` and ``dk`` together (a rotation's adjoint is its inverse), through this
    Function again, so it differentiates twice. Saves the four tables only: no rotated or un-rotated
    copy of q or k. The tables take no gradient (learned frequencies: plain autograd)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, cos_q: Tensor, sin_q: Tensor, cos_k: Tensor, sin_k: Tensor,  # type: ignore[override]
                interleaved: bool, inverse: bool = False) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(cos_q, sin_q, cos_k, sin_k)
        ctx.interleaved, ctx.inverse = interleaved, inverse
        return rotate_pair(q, k, cos_q, sin_q, cos_k, sin_k, interleaved, inverse)

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor):  # type: ignore[override]
        cos_q, sin_q, cos_k, sin_k = ctx.saved_tensors
        gq, gk = RotaryPair.apply(dq, dk, cos_q, sin_q, cos_k, sin_k, ctx.interleaved, not ctx.inverse)
        return gq, gk, None, None, None, None, None, None
