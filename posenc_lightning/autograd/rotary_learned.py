"""The rotation of q and k whose frequencies are learned (CLEX's ODE), as few operators as rope's.

`LearnedRotaryPair` rotates q and k by ``posenc::rotate_pair`` with tables that carry no graph
and routes the gradient of the frequencies through ``posenc::rotary_freq_grad``: rotating by
angle ``p f`` has ``dL/dθ = g_2 x_1 - g_1 x_2`` with ``g`` the un-rotated gradient and ``x`` the
un-rotated input (rotations commute), so ``dL/df_i = sum_{b,h,n} p_{b,n} dL/dθ_{b,h,n,i}``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posenc_lightning.autograd.rotary import rotate_pair


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
