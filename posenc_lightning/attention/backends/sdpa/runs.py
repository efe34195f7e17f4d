"""sdpa's rows of a block whose bias is one value per query row before some key ``c``
(`Bias.constant_before`: a clamped count), on SDPA's CPU kernel: the keys of that run with no
mask at all, their bias added to the kernel's log-sum-exp; the keys from ``c`` on with their rows as
the mask; the two parts joined by their log-sum-exps. No tensor as wide as the block's keys is
written, so the run costs what the same keys cost without a bias.

Backward, the kernel gives each part's ``dq, dk, dv`` from the joined output and log-sum-exp (the
softmax's normalizer is the whole row's), and the bias gets ``dS = P * (dO v^T - rowsum(dO * O))``
for the keys from ``c`` on only: each row of ``dS`` sums to 0, so the run's value gets minus their
sum (`Bias.rows_past` from ``c - 1``: the run's value, then the keys past it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from posenc_lightning.attention.backends.engine.blocks import BlockRows, hide_after_diagonal, owned_rows
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import Bias, cut
from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def run_of(bias: Bias, start: int, stop: int, k_stop: int, *, tunables: Tunables = DEFAULT_TUNABLES) -> int:
    """The key ``c`` where the keys past the constant run of rows ``[start, stop)`` begin, where this
    form pays (`Tunables.run_share`); 0 where it does not."""
    c = bias.constant_before(start, stop, k_stop)
    return c if 0 < c < k_stop and k_stop - c <= tunables.run_share * k_stop else 0


def run_rows(keys: int, batch: int, heads: int, *, tunables: Tunables = DEFAULT_TUNABLES) -> int:
    """Query rows of a run-form block whose first query sees ``keys`` keys (`Tunables.run_keys_per_row`),
    within the block budget (`Tunables.run_live`)."""
    most = (tunables.bias_block_bytes / (tunables.run_live * 4 * 2 * batch * heads)) ** 0.5
    return max(tunables.min_rows, int(min(most, (tunables.run_keys_per_row * max(keys, 1)) ** 0.5)))


def run_blocks(bias: Bias, mask: AttentionMask, batch: int, heads: int, n_q: int, n_k: int, rows: int, *,
               tunables: Tunables = DEFAULT_TUNABLES) -> Iterator[tuple[int, int, int, int]]:
    """Consecutive blocks of query rows ``(start, stop, k_stop, c)``: a block of `run_rows` rows where
    it runs in the run form (``c`` its run's end, `run_of`), else one of ``rows`` rows (``c = 0``)."""
    start = 0
    while start < n_q:
        stop = min(n_q, start + run_rows(mask.q_offset + start if mask.causal else n_k, batch, heads,
                                         tunables=tunables))
        k_stop = min(n_k, mask.q_offset + stop) if mask.causal else n_k
        c = run_of(bias, start, stop, k_stop, tunables=tunables)
        if mask.causal and c > mask.q_offset + start:  # the first query sees all the run and a key past it
            c = 0
        if not c:
            stop = min(n_q, start + rows)
            k_stop = min(n_k, mask.q_offset + stop) if mask.causal else n_k
        yield start, stop, k_stop, c
        start = stop


def _band_mask(rows: Tensor, own: bool, mask: AttentionMask, start: int, c: int, k_stop: int,
               hides: dict | None = None) -> Tensor:
    """The rows of keys ``[c, k_stop)`` as the kernel's float mask, ``-inf`` where the causal mask hides
    key ``c + j`` from query ``start + i`` (at key ``start + q_offset + i``): written into the rows
    where they are the caller's own (`blocks.owned_rows`), else into a copy. The kernel reads the
    mask with any row stride."""
    return _hide_after(rows if own else rows.clone(), mask, start, c, k_stop, hides)


def _hide_after(t: Tensor, mask: AttentionMask, start: int, c: int, k_stop: int, hides: dict | None = None
                ) -> Tensor:
    """``t [..., r, k_stop - c]``, keys ``[c, k_stop)`` of queries from ``start``, with ``-inf`` added in
    place where the causal mask hides the key (`blocks.hide_after_diagonal`: the block's diagonal
    corner only; ``hides``: the caller's triangles, built once a shape)."""
    return hide_after_diagonal(t, start + mask.q_offset, c, hides) if mask.causal else t


def attend_run(q: Tensor, k: Tensor, v: Tensor, bias: Bias, mask: AttentionMask, scale: float, start: int,
               stop: int, k_stop: int, c: int, lse: Tensor, hides: dict | None = None) -> Tensor:
    """The output of queries ``[start, stop)`` over keys ``[0, k_stop)`` whose bias is one value per row
    before key ``c`` (`run_of`), with their log-sum-exp written into ``lse [B, H, Nq]``.

    Args:
        q, k, v: the attention's inputs (float32).
        bias: the bias (recomputable); mask: causal or none, no segments or padding; scale: logit scale.
        start, stop: the query rows; k_stop: keys ``0..k_stop-1``; c: the run's end.
        lse: written at ``[:, :, start:stop]``.
        hides: a dict kept by the caller across the blocks of one call, where the causal triangle of
            each block shape is built once (`blocks.hide_after_diagonal`).

    Returns:
        ``[B, H, stop - start, D]``.
    """
    views = cut(bias.grad_inputs(), bias.input_windows(start, stop, k_stop))
    rows = bias.rows_past(start, stop, c - 1, k_stop, views).to(q.dtype)
    own = owned_rows(rows, bias, mask, q.shape[0], compiling=False)  # the run form runs eagerly
    qb = q[:, :, start:stop]
    o_run, l_run = _flash(qb, k[:, :, :c], v[:, :, :c], 0.0, False, scale=scale)
    o_band, l_band = _flash(qb, k[:, :, c:k_stop], v[:, :, c:k_stop], 0.0, False,
                            attn_mask=_band_mask(rows[..., 1:], own, mask, start, c, k_stop, hides), scale=scale)
    l_run = l_run + rows[..., 0]
    joint = torch.logaddexp(l_run, l_band)
    lse[:, :, start:stop] = joint
    return torch.addcmul(o_run * (l_run - joint).exp_().unsqueeze(-1), o_band, (l_band - joint).exp_().unsqueeze(-1))


def run_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, d_out: Tensor, lse: Tensor, bias: Bias,
                 inputs: Sequence[Tensor], live: Sequence[bool], mask: AttentionMask, scale: float, start: int,
                 stop: int, k_stop: int, c: int, grads: tuple[Tensor, Tensor, Tensor], into: Callable[[int], Tensor],
                 compiling: bool = False, hides: dict | None = None, eager_autograd: bool = True) -> None:
    """The backward of `attend_run`: ``dq, dk, dv`` added to ``grads`` (float32 accumulators of the
    shapes of q, k, v), the bias's inputs' gradients to ``into(i)`` (`BlockRows.backward`).

    Args:
        q, k, v, out, d_out: the forward's tensors and the output's gradient; lse: the forward's.
        bias, inputs, live: the bias, its `Bias.grad_inputs` and which need a gradient.
        mask, scale, start, stop, k_stop, c: as `attend_run`'s.
        grads: ``(dq, dk, dv)``; into: the accumulator of input ``i``'s gradient.
        compiling, eager_autograd: as `BlockRows.of`'s; hides: as `attend_run`'s.
    """
    block = BlockRows.of(bias, inputs, live, start, stop, k_stop, compiling, k_start=c - 1,
                         eager_autograd=eager_autograd)
    qb, dob, ob, lb = q[:, :, start:stop], d_out[:, :, start:stop], out[:, :, start:stop], lse[:, :, start:stop]
    dq, dk, dv = grads
    # the run's logits carry their bias in the normalizer: exp(s + run - lse) = exp(s - (lse - run))
    gq, gk, gv = _flash_backward(dob, qb, k[:, :, :c], v[:, :, :c], ob, (lb - block.rows[..., 0]).contiguous(),
                                 0.0, False, scale=scale)
    dq[:, :, start:stop] += gq
    dk[:, :, :c] += gk
    dv[:, :, :c] += gv
    # the keys past the run: their weights and dS, which the bias needs anyway, give their dq, dk,
    # dv in three products (a kernel call would compute the weights and dP again); a query group
    # against its kv head (GQA), as rows of one matrix; dS written where the rows' gradient goes
    b, h, r, d = qb.shape
    h_kv = k.shape[1]
    kb, vb = k[:, :, c:k_stop], v[:, :, c:k_stop]
    qg, dog = (t.reshape(b, h_kv, -1, t.shape[-1]) for t in (qb, dob))
    n_b = k_stop - c
    # the logits with their bias, the scale applied by the product: one operator
    band = block.rows[..., 1:].to(q.dtype).expand(b, h, r, n_b).reshape(b * h_kv, -1, n_b)
    p = torch.baddbmm(band, qg.reshape(b * h_kv, -1, d), kb.reshape(b * h_kv, n_b, d).mT, alpha=scale).view(b, h, r, n_b)
    p = _hide_after(p.sub_(lb.unsqueeze(-1)), mask, start, c, k_stop, hides).exp_()
    dv[:, :, c:k_stop] += torch.matmul(p.view(b, h_kv, -1, p.shape[-1]).mT, dog)
    d_rows = torch.empty(b, h, r, 1 + p.shape[-1], dtype=p.dtype, device=p.device)
    ds = torch.mul(torch.matmul(dog, vb.mT).view(b, h, r, -1).sub_((dob * ob).sum(-1, keepdim=True)), p,
                   out=d_rows[..., 1:])
    del p
    dsg = ds.view(b, h_kv, -1, ds.shape[-1])
    dq[:, :, start:stop] += torch.matmul(dsg, kb).view(b, h, r, d).mul_(scale)
    dk[:, :, c:k_stop] += torch.matmul(dsg.mT, qg).mul_(scale)
    if block.pullback is not None:
        torch.sum(ds, -1, out=d_rows[..., 0]).neg_()
        block.backward(d_rows, into)
