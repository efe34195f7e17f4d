"""FIRE's bias as a tile of the Triton kernels (`TileBias`, Li et al., 2024, eq. 3):
``f_theta(psi(i - j) / (psi(max(L, i)) + eps))`` with ``psi(x) = log(|c x| + 1)`` and
``f_theta(x) = w2 relu(w1 x + b1) + b2``, evaluated from the positions, one hidden unit at a time
(no ``[.., W]`` tensor), and its parameter gradients reduced per tile.

``FIRE`` points at the packed float parameters ``[c, L, w1 (W), b1 (W), b2 (H), w2 (H x W)]``
(`FireBias.kernel_params`; ``L`` is already ``|L_multiplier * init_L|``). A tile's gradients come
back packed in one ``[FB]`` vector, ``FB = 4 * BW`` (``BW`` = W rounded up to a power of two):
``[dw2[h, :] (BW) | dw1 (BW) | db1 (BW) | db2[h], dc, dL, 0...]``; the kernels sum the
per-program rows per head and `unpack_grads` lays them out as the parameters.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from posenc_lightning.encodings.bias.tile import TileBias

#: the MLP width of `example_tile` (the paper's 32)
EXAMPLE_WIDTH = 32


@triton.jit
def _log1p(x):
    """``log(1 + x)`` to a few ulps for small x too (Goldberg: ``log(u) * x / (u - 1)``, ``u = 1 + x``)."""
    u = 1.0 + x
    d = u - 1.0
    return tl.where(d == 0.0, x, tl.log(u) * (x / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def fire_input(qp, kp, FIRE, eps, ACC: tl.constexpr):
    """``(x, c * (i - j), c * max(L, i), psi(max(L, i)) + eps)``: the MLP input ``[BM, BN]`` and
    the pieces of its gradient (eq. 3; ``qp`` ``[BM]``, ``kp`` ``[BN]`` float positions)."""
    c = tl.load(FIRE).to(ACC)
    thr = tl.load(FIRE + 1).to(ACC)
    cr = c * (qp[:, None] - kp[None, :])
    cn = c * tl.maximum(qp, thr)
    den = _log1p(tl.abs(cn)) + eps
    return _log1p(tl.abs(cr)) / den[:, None], cr, cn, den


@triton.jit
def fire_tile(h, qp, kp, FIRE, FW, H, eps, BM: tl.constexpr, BN: tl.constexpr, ACC: tl.constexpr):
    """FIRE's bias ``[BM, BN]`` of head ``h``."""
    x, _, _, _ = fire_input(qp, kp, FIRE, eps, ACC)
    out = tl.zeros((BM, BN), ACC) + tl.load(FIRE + 2 + 2 * FW + h).to(ACC)
    w2_row = FIRE + 2 + 2 * FW + H + h * FW
    for u in range(FW):
        w1 = tl.load(FIRE + 2 + u).to(ACC)
        b1 = tl.load(FIRE + 2 + FW + u).to(ACC)
        out += tl.load(w2_row + u).to(ACC) * tl.maximum(w1 * x + b1, 0.0)
    return out


@triton.jit
def fire_grads(ds, h, qp, kp, ok, FIRE, FW, H, eps, FB: tl.constexpr, ACC: tl.constexpr):
    """This tile's packed parameter gradients ``[FB]`` from ``ds = dL/dbias`` ``[BM, BN]``
    (zero where masked), by the chain rule through eq. 3 (torch's conventions: ``relu'(0) = 0``,
    ``|x|' = sign(x)``, ``max(a, b)`` splits the gradient evenly at a tie)."""
    BW = FB // 4
    c = tl.load(FIRE).to(ACC)
    thr = tl.load(FIRE + 1).to(ACC)
    x, cr, cn, den = fire_input(qp, kp, FIRE, eps, ACC)
    ds = tl.where(ok, ds, 0.0)
    x = tl.where(ok, x, 0.0)
    offs = tl.arange(0, FB)
    acc = tl.where(offs == 3 * BW, tl.sum(tl.sum(ds, 1), 0), 0.0)  # db2[h]
    dx = tl.zeros_like(ds)
    w2_row = FIRE + 2 + 2 * FW + H + h * FW
    for u in range(FW):
        w1 = tl.load(FIRE + 2 + u).to(ACC)
        b1 = tl.load(FIRE + 2 + FW + u).to(ACC)
        pre = w1 * x + b1
        on = pre > 0.0
        g = tl.where(on, ds * tl.load(w2_row + u).to(ACC), 0.0)  # dL/d(w1 x + b1)
        acc += tl.where(offs == u, tl.sum(tl.sum(tl.where(on, ds * pre, 0.0), 1), 0), 0.0)
        acc += tl.where(offs == BW + u, tl.sum(tl.sum(g * x, 1), 0), 0.0)
        acc += tl.where(offs == 2 * BW + u, tl.sum(tl.sum(g, 1), 0), 0.0)
        dx += g * w1
    # x = a / den, a = log(|c (i - j)| + 1), den = log(|c max(L, i)| + 1) + eps
    inv = 1.0 / den
    sg_r = tl.where(cr > 0.0, 1.0, tl.where(cr < 0.0, -1.0, 0.0))
    rel = qp[:, None] - kp[None, :]
    d_den = -tl.sum(dx * x, 1) * inv  # dL/dden per query row
    sg_n = tl.where(cn > 0.0, 1.0, tl.where(cn < 0.0, -1.0, 0.0))
    dden_dn = sg_n / (1.0 + tl.abs(cn))  # d log(|cn| + 1) / d(cn)
    nq = tl.maximum(qp, thr)
    dc = tl.sum(tl.sum(dx * sg_r * rel / (1.0 + tl.abs(cr)), 1) * inv, 0) + tl.sum(d_den * dden_dn * nq, 0)
    share = tl.where(thr > qp, 1.0, tl.where(thr == qp, 0.5, 0.0))
    dthr = tl.sum(d_den * dden_dn * c * share, 0)
    acc += tl.where(offs == 3 * BW + 1, dc, 0.0) + tl.where(offs == 3 * BW + 2, dthr, 0.0)
    return acc


def grad_block(width: int) -> int:
    """``FB``: the length of a packed gradient row, 4 x W rounded up to a power of two."""
    return 4 * triton.next_power_of_2(max(width, 4))


def unpack_grads(per_head: Tensor, width: int) -> Tensor:
    """The gradient of the packed parameters ``[c, L, w1, b1, b2, w2]`` from the kernels' rows
    summed per head ``[H, FB]`` (``[dw2[h] | dw1 | db1 | db2[h], dc, dL]``).

    Args:
        per_head: the per-program gradient rows summed over batch and programs.
        width: W, the MLP's hidden width.

    Returns:
        ``[2 + 2 W + H (W + 1)]``.
    """
    p, w, bw = per_head, width, grad_block(width) // 4
    return torch.cat((p[:, 3 * bw + 1].sum()[None], p[:, 3 * bw + 2].sum()[None], p[:, bw:bw + w].sum(0),
                      p[:, 2 * bw:2 * bw + w].sum(0), p[:, 3 * bw], p[:, :w].reshape(-1)))


def kernel_tile(params: Tensor, width: int, eps: float) -> TileBias:
    """FIRE's tile for the kernels.

    Args:
        params: the packed parameters ``[c, L, w1 (W), b1 (W), b2 (H), w2 (H x W)]``.
        width: W, the MLP's hidden width.
        eps: the normalizer's eps.

    Returns:
        The tile (`KernelBias.tile`).
    """
    heads = (params.numel() - 2 - 2 * width) // (width + 1)
    if params.dim() != 1 or params.numel() != 2 + 2 * width + heads * (width + 1):
        raise ValueError(f"fire: {params.numel()} packed parameters, expected 2 + 2 W + H (W + 1) for W = {width}")
    return TileBias(name="fire", params=params, heads=heads, width=width, eps=float(eps),
                    grad_block=grad_block(width), value=fire_tile, grads=fire_grads,
                    unpack=functools.partial(unpack_grads, width=width))


def example_tile(n_heads: int) -> TileBias:
    """A tile of width `EXAMPLE_WIDTH` with zero parameters, for compiling the kernels
    (`posenc_lightning.kernels.resource_report`).

    Args:
        n_heads: H.

    Returns:
        The tile.
    """
    w = EXAMPLE_WIDTH
    return kernel_tile(torch.zeros(2 + 2 * w + n_heads * (w + 1)), w, 1e-6)
