"""sdpa's Toeplitz form: a bias ``f(i - j)`` at arange positions is a template ``u [H, Nq + Nk - 1]``
(O(H N)) whose ``[H, N, N]`` mask is a zero-copy strided view, and the backward that also gives the
template's gradient (`toeplitz_backward`, for a learned table), the forward (`attend_toeplitz`) and
its autograd Function (`ToeplitzAttention`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc_lightning.attention.backends.engine.block_grad import Scratch, attention_backward_by_blocks
from posenc_lightning.attention.backends.engine.blocks import backward_rows
from posenc_lightning.attention.backends.sdpa.rows import collect_rows
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext, Bias
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.positions import arange_offset
from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables


def toeplitz_shift(bias: Bias, mask: AttentionMask, n_q: int, n_k: int, ctx: AttentionContext | None) -> int | None:
    """``a - c`` when the bias depends on ``i - j`` only (`Bias.distance_only`) and the positions
    are ``a + arange``, ``c + arange`` under a mask without documents or padding (else None).
    Reads the positions only where that is free (`functional.positions.arange_offset`)."""
    if (ctx is None or mask.q_segments is not None or mask.k_valid is not None or mask.local
            or not bias.distance_only):
        return None
    a, c = arange_offset(ctx.q_pos, ctx.q_start), arange_offset(ctx.k_pos, ctx.k_start)
    if a is None or c is None or ctx.q_pos.shape[1] != n_q or ctx.k_pos.shape[1] != n_k:
        return None
    return a - c


def template_at(bias: Bias, mask: AttentionMask, n_q: int, n_k: int, shift: int, device: torch.device
                ) -> Tensor | None:
    """``u [H, n_q + n_k - 1]`` with ``bias[h, i, j] = u[h, j - i + n_q - 1]``, causal -inf folded
    in, at positions ``shift`` apart (`toeplitz_shift`); None when the kind has no value there.

    O(H N) work and memory instead of O(H N^2): the ``[H, N, N]`` mask is a strided view of it.
    """
    d = torch.arange(-(n_q - 1), n_k, device=device)  # j - i
    # position distance i_pos - j_pos = (a - c) - (j - i)
    kind = bias.at(torch.full((1, 1), shift, device=device), d[None])
    if kind is None:
        return None
    u = kind.materialize()[0, :, 0, :]  # [H, L]; a learned table keeps its graph (`sdpa.toeplitz.ToeplitzAttention`)
    if mask.causal:
        u = u.masked_fill(d[None, :] > mask.q_offset, float("-inf"))
    return u.contiguous()


def toeplitz_backward(q: Tensor, k: Tensor, v: Tensor, u: Tensor, out: Tensor, d_out: Tensor, causal: bool,
                      q_offset: int, scale: float, need_du: bool, compiling: bool = False,
                      tunables: Tunables = DEFAULT_TUNABLES) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`sdpa.toeplitz.ToeplitzAttention`'s backward: ``dq, dk, dv`` and ``du`` (zeros unless ``need_du``).

    From the standard softmax attention gradient by blocks of query rows, ``du[h, t]`` the sum of
    ``dS`` over the diagonal ``j - i + n_q - 1 = t`` (summed over the batch). ``compiling``:
    traced by ``torch.compile`` (`mode.Mode`; a custom operator's kernel runs eagerly); ``tunables``:
    the call's block budget.
    """
    b, h, n_q, _ = q.shape
    h_kv, n_k = k.shape[1], k.shape[-2]
    g = h // h_kv
    uf = u.detach().to(torch.promote_types(q.dtype, torch.float32)).contiguous()
    length = uf.shape[-1]
    du = torch.zeros_like(uf)

    # rows in reverse order, rr = stop - 1 - i: the bias rows are the zero-copy view
    # u[h, j + rr + n_q - stop] (both strides +1), as in the forward
    def add_bias(start: int, stop: int, k_stop: int, s: Tensor) -> None:
        s.add_(uf.as_strided((h_kv, g, stop - start, k_stop), (g * length, length, 1, 1), n_q - stop))

    rows = backward_rows(b, h, n_q, n_k, tunables=tunables)
    # buffer 1 (a block's weights, free while on_ds runs) also takes the padded rows of dS
    block = b * h * rows * n_k
    scratch = Scratch((block, max(block, h * rows * (n_k + rows))), torch.promote_types(q.dtype, torch.float32),
                      q.device, compiling)

    def diagonal_sums(start: int, stop: int, k_stop: int, ds: Tensor) -> None:
        # pad each row with r zeros and re-read the rows with length k_stop + r - 1: that
        # shifts row rr right by rr, so column c = j + rr, i.e. u's index minus (n_q - stop)
        r, w = stop - start, k_stop + stop - start - 1
        ds_h = ds.reshape(b, h, r, k_stop)
        if scratch.eager:
            pad = scratch.view(1, (h, r, k_stop + r))
            torch.sum(ds_h, 0, out=pad[..., :k_stop])
            pad[..., k_stop:].zero_()
        else:
            pad = F.pad(ds_h[0] if b == 1 else ds_h.sum(0), (0, r))
        skew = pad.flatten(1)[:, :r * w].view(h, r, w)
        du[:, n_q - stop: n_q - stop + w] += skew.sum(1)

    dq, dk, dv = attention_backward_by_blocks(
        q, k, v, out, d_out, scale=scale, causal=causal, q_offset=q_offset, rows=rows,
        add_bias=add_bias, on_ds=diagonal_sums if need_du else None, reverse_rows=True, scratch=scratch)
    return dq, dk, dv, du.to(u.dtype)


def toeplitz_template(bias: Bias, mask: AttentionMask, n_q: int, n_k: int,
                       ctx: AttentionContext | None) -> Tensor | None:
    """The Toeplitz template ``u`` of an eager call (`toeplitz.template_at`), or None where that
    form does not apply (other positions, not `Bias.distance_only`)."""
    shift = toeplitz_shift(bias, mask, n_q, n_k, ctx)
    return None if shift is None else template_at(bias, mask, n_q, n_k, shift, ctx.q_pos.device)


def attend_toeplitz(q: Tensor, k: Tensor, v: Tensor, u: Tensor, mask: AttentionMask, scale: float,
                     gqa: bool, tunables: Tunables = DEFAULT_TUNABLES) -> Tensor:
    """SDPA with a Toeplitz bias given by its template ``u`` as a zero-copy strided mask.

    Rows are taken in reverse order so that both strides of the view are +1
    (``bias[h, r, j] = u[h, j + r + n_q - stop]`` for ``r = stop - 1 - i``); causal runs go by
    blocks of query rows, each seeing only the keys up to its last query.
    """
    n_q, n_k, n_h, length = q.shape[-2], k.shape[-2], u.shape[0], u.shape[1]
    rows = max(128, -(-n_q // 8)) if mask.causal else n_q

    def blocks():
        for start in range(0, n_q, rows):
            stop = min(n_q, start + rows)
            k_stop = min(n_k, mask.q_offset + stop) if mask.causal else n_k
            m = u.as_strided((1, n_h, stop - start, k_stop), (n_h * length, length, 1, 1),
                             u.storage_offset() + n_q - stop)
            o = F.scaled_dot_product_attention(q[:, :, start:stop].flip(-2), k[:, :, :k_stop], v[:, :, :k_stop],
                                               attn_mask=m, scale=scale, enable_gqa=gqa)
            yield start, stop, o.flip(-2)

    return collect_rows(q, v, blocks())


class ToeplitzAttention(torch.autograd.Function):
    """SDPA with a learned Toeplitz bias ``bias[h, i, j] = u[h, j - i + n_q - 1]`` (T5 / any
    learned ``f(i - j)`` at arange positions), with a backward that also returns ``du``.

    Forward: `attend_toeplitz` (the bias is a zero-copy view; SDPA's fast kernel, which cannot
    differentiate a mask). Backward, by blocks of query rows, from the standard softmax
    attention gradient: ``P = softmax(S)``, ``dS = P * (dO V^T - rowsum(dO * O))``,
    ``dQ = dS K s``, ``dK = dS^T Q s``, ``dV = P^T dO`` and ``du[h, t] = sum over the diagonal
    j - i + n_q - 1 = t of dS`` (summed over the batch). Memory: a few blocks of rows, never the
    ``H x N x N`` mask and its gradient that a differentiable mask would keep.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, u: Tensor, causal: bool, q_offset: int, scale: float,
                gqa: bool, tunables: Tunables = DEFAULT_TUNABLES) -> Tensor:
        mask = AttentionMask(causal, q_offset, q.shape[-2], k.shape[-2])
        # detached: a mask that requires grad sends SDPA to its math kernel even in no-grad mode
        out = attend_toeplitz(q, k, v, u.detach().to(q.dtype), mask, scale, gqa)
        ctx.save_for_backward(q, k, v, u, out)
        ctx.causal, ctx.q_offset, ctx.scale, ctx.tunables = causal, q_offset, scale, tunables
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor):
        q, k, v, u, out = ctx.saved_tensors
        dq, dk, dv, du = toeplitz_backward(q, k, v, u, out, d_out, ctx.causal, ctx.q_offset, ctx.scale,
                                           ctx.needs_input_grad[3], Mode.of(q).compiling, ctx.tunables)
        return dq, dk, dv, du, None, None, None, None, None
