"""Stick-breaking attention (Tan et al., 2024, "Scaling Stick-Breaking Attention: An Efficient
Implementation and In-depth Study", eqs. 1-3), in log space.

For query ``i`` the visible keys are broken off in order, nearest first:
``A_ij = beta_ij prod_{j<k<i} (1 - beta_ik)``, ``beta = sigmoid(z)``, so that
``log A_ij = z_ij - sum_{k=j}^{i-1} softplus(z_ik)`` (``log sigmoid(z) = z - softplus(z)``,
``log(1 - sigmoid(z)) = -softplus(z)``). The weights of a query sum to at most 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

#: above it softplus(x) == x in float32 (the stabilized softplus returns x)
SOFTPLUS_THRESHOLD = 15.0
#: blockwise weights are ``exp(max(log A, EXP_FLOOR))``: below it exp is a denormal float32, which
#: x86 computes in slow microcode; a weight of at most exp(-80) = 1.8e-35 instead of a smaller one
EXP_FLOOR = -80.0


def stable_softplus(x: Tensor) -> Tensor:
    """``log(1 + exp(x))`` for ``x <= 15`` and ``x`` above (no overflow)."""
    return F.softplus(x, beta=1.0, threshold=SOFTPLUS_THRESHOLD)


def stick_spent(tail: Tensor) -> Tensor:
    """Whether every row's carried sum ``tail`` reaches ``-EXP_FLOOR`` (a 0-d bool tensor): then
    every farther key's ``log A_ij = log sigmoid(z_ij) - tail_i - ... <= -tail_i`` is below
    `EXP_FLOOR`, i.e. the rest of each stick is under ``exp(-80) = 1.8e-35`` (those weights are
    0 to float32 next to the nearer ones, which sum to ``1 - exp(-tail)``)."""
    return tail.amin() >= -EXP_FLOOR


def stick_breaking_mask(nq: int, nk: int, q_offset: int = 0, attend_current: bool = False,
                        device: torch.device | None = None) -> Tensor:
    """bool ``[Nq, Nk]``: key ``j`` is before query ``i`` (at index ``i + q_offset``); the
    diagonal only when ``attend_current``."""
    qi = torch.arange(nq, device=device)[:, None] + q_offset
    kj = torch.arange(nk, device=device)[None, :]
    return kj <= qi if attend_current else kj < qi


def stick_breaking_weights(logits: Tensor, mask: Tensor) -> Tensor:
    """Stick-breaking weights ``[..., Nq, Nk]`` from logits and a bool mask (True = visible).

    The mask must already exclude keys after the query (and the query itself unless it may
    attend to itself); keys are ordered by index and broken off from the last visible one.
    Computed as ``exp(log beta_ij - sum_{k > j, visible} softplus(z_ik))`` in float32, the sum an
    exclusive reverse cumulative sum (so a key's own term never cancels against itself).
    """
    z = logits.float()
    zero = torch.zeros((), device=z.device)
    sp = torch.where(mask, stable_softplus(z), zero)  # -log(1 - beta)
    tail = sp.flip(-1).cumsum(-1).flip(-1)  # sum over visible k >= j
    excl = torch.cat((tail[..., 1:], torch.zeros_like(tail[..., :1])), dim=-1)  # k > j
    log_beta = z - sp  # log sigmoid(z) with the stabilized softplus
    log_a = torch.where(mask, log_beta - excl, torch.full((), -torch.inf, device=z.device))
    return log_a.exp()


def _carried_cumsum(x: Tensor, carry: Tensor) -> Tensor:
    """``carry[..., None] + cumsum(x, -1)`` in place in ``x``: the carry enters as the first term of
    the running sum (one small addition instead of a pass over the tile)."""
    x[..., 0].add_(carry)
    return x.cumsum_(-1)


def stick_breaking_tile(z: Tensor, keep: Tensor | None, tail: Tensor, out: Tensor | None = None
                        ) -> tuple[Tensor, Tensor]:
    """One tile of eq. 3 with its keys in *descending* order (nearest first along the last dim).

    ``keep``: 1.0 where the key is visible, 0.0 where not (None: all visible; a multiplier, ~10x
    cheaper on CPU than a boolean fill). ``tail [..., rows]``: ``sum softplus(z_ik)`` over the
    visible keys nearer than the tile (the log-space cumulative sum carried across key tiles, as
    the Triton kernel's). Returns ``A = exp(z_ij - tail - sum_{k >= j in the tile} softplus(z_ik))``
    (0 where not visible) and the tail after the tile.

    ``out``: a buffer of z's shape for ``A`` (may be ``z`` itself, which is then consumed); the
    running sums' tensor when None.
    """
    c = _carried_cumsum(_visible(stable_softplus(z), keep), tail)
    tail = c[..., -1].clone()
    return _weights(z, c, keep, out=c if out is None else out), tail


def _visible(x: Tensor, keep: Tensor | None) -> Tensor:
    return x if keep is None else x.mul_(keep)


def _weights(z: Tensor, c: Tensor, keep: Tensor | None, out: Tensor) -> Tensor:
    """``A = exp(z - c)`` into ``out`` (may alias ``z`` or ``c``): ``z - c <= 0`` where visible (``c``
    holds ``softplus(z) >= z`` plus non-negative terms), clamped to [EXP_FLOOR, 0] so that hidden
    entries stay finite before ``keep`` zeroes them (and exp never takes its slow path below -87)."""
    return _visible(torch.sub(z, c, out=out).clamp_(EXP_FLOOR, 0.0).exp_(), keep)


def stick_breaking_tail(z: Tensor, keep: Tensor | None, tail: Tensor) -> Tensor:
    """``tail`` plus the tile's ``sum softplus(z_ik)`` over its visible keys (the carry of
    `stick_breaking_tile` alone, for a backward that walks the tiles farthest first)."""
    return _visible(stable_softplus(z), keep).sum(-1).add_(tail)


def stick_breaking_tile_backward(z: Tensor, keep: Tensor | None, tail: Tensor, dp: Tensor,
                                 g_far: Tensor, sp: Tensor | None = None, beta: Tensor | None = None
                                 ) -> tuple[Tensor, Tensor, Tensor]:
    """The weights of a `stick_breaking_tile` recomputed, the gradient of its logits, and ``g_far``
    with the tile's ``g`` added, for tiles walked farthest first: ``(A, dz, g_far)``.

    With ``g_ij = A_ij dp_ij`` (``dp = dO_i . v_j``, overwritten by ``dz``): ``dz_ik = g_ik -
    sigmoid(z_ik) sum_{j <= k} g_ij`` (``d log A_ij / dz_ik = [k = j] - [k >= j] sigmoid(z_ik)``).
    ``g_far [..., rows]``: ``sum g`` over the farther tiles, so that the sum over ``j <= k`` is
    accumulated from the far end (no cancellation against ``dO . o``, which would cost the far keys
    their precision). ``sp``, ``beta``: buffers of z's shape (``A`` is returned in ``sp``, ``sigmoid(z)``
    written in ``beta``); fresh tensors when None.
    """
    beta = torch.sigmoid(z, out=beta) if beta is not None else torch.sigmoid(z)
    s = stable_softplus(z)
    c = _carried_cumsum(_visible(s, keep), tail)
    a = _weights(z, c, keep, out=c if sp is None else sp)
    g = dp.mul_(a)
    upto = _carried_cumsum(g.flip(-1), g_far)  # sum over j <= k, from the far end (reversed)
    g_far = upto[..., -1].clone()
    dz = g.addcmul_(beta, upto.flip(-1), value=-1.0)
    return a, _visible(dz, keep), g_far
