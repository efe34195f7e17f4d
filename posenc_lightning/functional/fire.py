"""FIRE (Li et al., 2024, "Functional Interpolation for Relative Positions Improves Long Context
Transformers"), eq. 3: ``b(i, j) = f_theta( psi(i - j) / psi(max(L, i)) )`` with
``psi(x) = log(c * x + 1)``.

Dividing by ``psi(max(L, i))`` ("progressive interpolation") maps every causal distance into
``[0, 1]`` at any length, so the MLP ``f_theta`` only ever sees inputs from the training range.
"""

from __future__ import annotations

import torch
from torch import Tensor


def fire_psi(x: Tensor, c: Tensor | float) -> Tensor:
    """``psi(x) = log(|c * x| + 1)`` (FIRE eq. 3; the absolute value as in the paper's code)."""
    return torch.log1p((c * x).abs())


def fire_normalized_distance(q_pos: Tensor, k_pos: Tensor, c: Tensor | float, threshold: Tensor | float,
                             eps: float = 1e-6) -> Tensor:
    """The MLP input ``psi(i - j) / psi(max(L, i))``: ``[B, Nq, Nk]`` from ``[B, Nq]``, ``[B, Nk]``.

    For causal pairs (``0 <= j <= i``) it lies in ``[0, 1]`` whatever the length.
    """
    qp = q_pos.to(torch.float32)
    kp = k_pos.to(torch.float32)
    rel = qp[:, :, None] - kp[:, None, :]
    thr = torch.as_tensor(threshold, dtype=torch.float32, device=qp.device).abs()
    norm = torch.maximum(qp, thr)[:, :, None]
    return fire_psi(rel, c) / (fire_psi(norm, c) + eps)


#: columns of ``x`` per step of `fire_mlp` (the hidden activations of one step stay in cache)
FIRE_MLP_CHUNK = 16384


def fire_mlp(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """``f_theta(x) = W2 relu(w1 x + b1) + b2`` for scalar inputs ``x`` ``[B, M]``: ``[B, H, M]``.

    The same function, forward and backward, as ``nn.Sequential(Linear(1, W), ReLU(), Linear(W, H))``
    (``w1``/``b1`` ``[W]``, ``w2`` ``[H, W]``, ``b2`` ``[H]``), computed without its ``[B, M, W]``
    hidden tensor: f is piecewise linear in x, so over the range ``[min x, max x]`` a hidden unit
    whose pre-activation has the same sign at both ends (it is monotone in x) is either always
    off (dropped) or always on (folded into one linear term ``A x + B``, exact since
    ``relu(u) = u`` there). Only the units that switch inside the range are evaluated per element,
    in chunks, head-major (the layout attention wants), and recomputed in backward, so the saved
    state is ``x`` alone.
    """
    dt = torch.promote_types(x.dtype, w2.dtype)
    x, w1, b1, w2, b2 = (t.to(dt) for t in (x, w1, b1, w2, b2))
    if torch.compiler.is_compiling():  # the unit selection below has a data-dependent shape; the
        return fire_mlp_piecewise(x, w1, b1, w2, b2)  # compiler fuses the segment lookup per element
    if x.numel() == 0:
        return x.new_zeros(x.shape[0], w2.shape[0], x.shape[1]) + 0 * b2.sum()
    with torch.no_grad():
        lo, hi = torch.aminmax(x.detach())
        pre_lo, pre_hi = w1 * lo + b1, w1 * hi + b1  # the same arithmetic as per element below
        on = (pre_lo > 0) & (pre_hi > 0)
        switching = torch.nonzero(~on & ((pre_lo > 0) | (pre_hi > 0))).squeeze(1)
    on = on.to(dt)
    a = (w2 * (w1 * on)).sum(1)  # slope of the always-on units  [H]
    b = b2 + (w2 * (b1 * on)).sum(1)  # their intercept, plus b2  [H]
    w_aug = torch.cat((w2.index_select(1, switching), a[:, None], b[:, None]), 1)  # [H, K + 2]
    return _SwitchingReluMLP.apply(x, w1.index_select(0, switching), b1.index_select(0, switching), w_aug)


def fire_mlp_reference(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """`fire_mlp` as written: ``W2 relu(w1 x + b1) + b2`` with its ``[B, W, M]`` hidden tensor."""
    hidden = torch.relu(w1[None, :, None] * x[:, None, :] + b1[None, :, None])  # [B, W, M]
    return torch.einsum("hw,bwm->bhm", w2, hidden) + b2[None, :, None]


def fire_mlp_piecewise(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """`fire_mlp` as the piecewise-linear function it is: the ``W`` breakpoints ``-b1/w1`` cut the
    line into ``W + 1`` segments on each of which the set of active units is fixed, so
    ``f(x) = A[:, s] x + B[:, s]`` with ``s`` the segment of ``x`` (``A = W2 (active * w1)``,
    ``B = b2 + W2 (active * b1)``, ``[H, W + 1]``, differentiable in every weight). Per element:
    one binary search and one multiply-add per head, instead of ``W`` hidden units."""
    # a unit with w1 = 0 is constant: no breakpoint (+inf), active everywhere iff b1 > 0
    t = torch.where(w1 != 0, -b1 / torch.where(w1 != 0, w1, torch.ones_like(w1)), torch.full_like(w1, float("inf")))
    t_sorted = torch.sort(t.detach()).values
    finite = torch.where(torch.isfinite(t_sorted), t_sorted, torch.zeros_like(t_sorted))
    lo, hi = finite.min() - 1, finite.max() + 1
    edges = torch.cat((lo[None], torch.where(torch.isfinite(t_sorted), t_sorted, hi)))  # [W + 1]
    nxt = torch.cat((edges[1:], (hi + 1)[None]))
    mid = (edges + nxt) / 2  # a point inside each segment (segment s: (t_s, t_{s+1}]]
    active = ((w1.detach()[:, None] * mid[None, :] + b1.detach()[:, None]) > 0).to(x.dtype)  # [W, W + 1]
    a = w2 @ (active * w1[:, None])  # [H, W + 1]
    b = b2[:, None] + w2 @ (active * b1[:, None])
    seg = torch.searchsorted(t_sorted.contiguous(), x.detach().contiguous())  # [B, M]: #breakpoints < x
    return a[:, seg].permute(1, 0, 2) * x[:, None, :] + b[:, seg].permute(1, 0, 2)


def _hidden(x: Tensor, w1: Tensor, b1: Tensor, out: Tensor) -> Tensor:
    """``[relu(w1 x + b1); x; 1]`` ``[K + 2, C]`` into ``out``."""
    k = w1.shape[0]
    torch.mul(w1[:, None], x[None], out=out[:k])
    out[:k].add_(b1[:, None]).relu_()
    out[k] = x
    out[k + 1] = 1
    return out


class _SwitchingReluMLP(torch.autograd.Function):
    """``out[b] = w_aug @ [relu(w1 x_b + b1); x_b; 1]`` chunk by chunk; backward recomputes."""

    @staticmethod
    def forward(x: Tensor, w1: Tensor, b1: Tensor, w_aug: Tensor) -> Tensor:  # type: ignore[override]
        nb, m = x.shape
        out = x.new_empty(nb, w_aug.shape[0], m)
        hid = x.new_empty(w1.shape[0] + 2, min(m, FIRE_MLP_CHUNK))
        for i in range(nb):
            for s in range(0, m, FIRE_MLP_CHUNK):
                xc = x[i, s:s + FIRE_MLP_CHUNK]
                h = _hidden(xc, w1, b1, hid[:, :xc.shape[0]])
                torch.mm(w_aug, h, out=out[i, :, s:s + xc.shape[0]])
        return out

    @staticmethod
    def setup_context(ctx, inputs: tuple[Tensor, ...], output: Tensor) -> None:  # functorch-compatible (vjp)
        ctx.save_for_backward(*inputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        x, w1, b1, w_aug = ctx.saved_tensors
        nb, m = x.shape
        k = w1.shape[0]
        gx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        gw1, gb1, gw = torch.zeros_like(w1), torch.zeros_like(b1), torch.zeros_like(w_aug)
        hid = x.new_empty(k + 2, min(m, FIRE_MLP_CHUNK))
        for i in range(nb):
            for s in range(0, m, FIRE_MLP_CHUNK):
                xc = x[i, s:s + FIRE_MLP_CHUNK]
                g = grad[i, :, s:s + xc.shape[0]]  # [H, C]
                h = _hidden(xc, w1, b1, hid[:, :xc.shape[0]])
                gw.addmm_(g, h.t())
                gh = w_aug.t() @ g  # [K + 2, C]: row K is the grad of the linear term's x
                gpre = gh[:k].mul_(h[:k] > 0)  # relu'(u) = 1 where u > 0 (0 at u = 0, as torch)
                gw1 += gpre @ xc
                gb1 += gpre.sum(1)
                if gx is not None:
                    torch.addmv(gh[k], gpre.t(), w1, out=gx[i, s:s + xc.shape[0]])
        return gx, gw1, gb1, gw
