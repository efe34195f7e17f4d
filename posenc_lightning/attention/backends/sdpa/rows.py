"""sdpa's blocks of query rows: the masks of a block, the output assembled from its blocks, and the
engine's own backward for a bias that recomputes its rows (`rows_backward`), with the typed records
it reads: where each bias input's gradient goes (`Target`) and what the backward needs besides
tensors (`RowsSpec`); the forward by rows (`attend_by_rows`) and its autograd Function (`RowsAttention`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc_lightning.attention.backends.engine.block_grad import LOG2E, Scratch, attention_backward_by_blocks
from posenc_lightning.attention.backends.engine.blocks import (
    BlockRows,
    backward_rows,
    forward_rows,
    hide_after_diagonal,
    owned_rows,
    wide_zeros,
)
from posenc_lightning.attention.backends.sdpa import runs as _runs
from posenc_lightning.attention.backends.sdpa.runs import run_backward, run_blocks
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import Bias
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables


class Sink(enum.Enum):
    """Where a bias input's gradient goes."""

    Q = "q"  # the input is q itself: into dq
    K = "k"  # the input is k itself: into dk
    EXTRA = "extra"  # another tensor that needs a gradient: into its own accumulator
    NONE = "none"  # nowhere


@dataclass(frozen=True)
class Target:
    """Where one bias input's gradient goes; ``slot``: its index among the extra inputs (`Sink.EXTRA`)."""

    sink: Sink
    slot: int = -1


@dataclass(frozen=True, eq=False)
class RowsSpec:
    """What the engine's backward by rows needs besides q, k, v: the bias, the mask, the logit
    scale, the bias's `Bias.grad_inputs` and, per input, where its gradient goes."""

    bias: Bias
    mask: AttentionMask
    scale: float
    inputs: tuple[Tensor, ...]
    targets: tuple[Target, ...]
    #: the forward keeps its rows' log-sum-exp, so that blocks whose bias is one value per row over
    #: a run of keys run on SDPA's CPU kernel, forward and backward (`runs`)
    kernel_runs: bool = False
    #: the call's block budgets and switches (`functional.mode.Mode.tunables`)
    tunables: Tunables = DEFAULT_TUNABLES

    @classmethod
    def route(cls, bias: Bias, mask: AttentionMask, scale: float, inputs: Sequence[Tensor], q: Tensor, k: Tensor,
              given: tuple[Tensor, Tensor] | None = None, tunables: Tunables = DEFAULT_TUNABLES
              ) -> tuple[RowsSpec, list[Tensor]]:
        """The spec and the distinct extra inputs that need a gradient (in their slots' order).

        Args:
            bias: the bias; mask: the mask; scale: the logit scale.
            inputs: ``bias.grad_inputs()``.
            q, k: the attention's q and k.
            given: the q and k the caller was given, when ``q``/``k`` are identity stand-ins for them.
            tunables: the call's (`functional.mode.Mode.tunables`).

        Returns:
            ``(spec, extra)``.
        """
        q0, k0 = given if given is not None else (q, k)
        slots: dict[int, int] = {}
        targets: list[Target] = []
        extra: list[Tensor] = []
        for t in inputs:
            if t is q or t is q0 or t is k or t is k0:
                targets.append(Target(Sink.Q if t is q or t is q0 else Sink.K))
            elif isinstance(t, Tensor) and t.requires_grad:
                if id(t) not in slots:
                    slots[id(t)] = len(extra)
                    extra.append(t)
                targets.append(Target(Sink.EXTRA, slots[id(t)]))
            else:
                targets.append(Target(Sink.NONE))
        return cls(bias, mask, scale, tuple(inputs), tuple(targets), tunables=tunables), extra


@dataclass
class _InFlight:
    """The block whose rows were added to the logits and whose ``dS`` is still to come."""

    block: BlockRows | None = None


def rows_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, d_out: Tensor, spec: RowsSpec,
                  needs_input_grad: tuple[bool, ...], compiling: bool = False, lse: Tensor | None = None
                  ) -> tuple[Tensor, Tensor, Tensor, list[Tensor | None]]:
    """The backward of the rows form (`sdpa.rows.RowsAttention`): ``dq, dk, dv`` and the gradients of
    its extra inputs, by blocks of query rows; each block's bias rows recomputed (`BlockRows`).

    With the forward's log-sum-exp (``lse``, `RowsSpec.kernel_runs`), a block whose bias is one
    value per row before key ``c`` (`Bias.constant_before`) runs on SDPA's CPU kernel, with ``dS``
    for the keys from ``c`` on only (`runs.run_backward`). Other blocks run the engine's own
    backward (`block_grad.attention_backward_by_blocks`), with the weights from that log-sum-exp
    (base-2 logits: the rows are added times `block_grad.LOG2E`), each stretch of them in one call.

    Args:
        q, k, v, out, d_out: the forward's tensors and the output's gradient.
        spec: the bias and where its inputs' gradients go.
        needs_input_grad: as the Function's: q, k, v, spec, then the extra inputs.
        compiling: traced by ``torch.compile`` (`mode.Mode`; a custom operator's kernel runs eagerly).
        lse: the forward's ``logsumexp`` of each query's logits ``[B, H, Nq]`` (float32), or None.

    Returns:
        ``(dq, dk, dv, extra gradients)``.
    """
    need_extra = needs_input_grad[4:]
    live = [(tg.sink is Sink.Q and needs_input_grad[0]) or (tg.sink is Sink.K and needs_input_grad[1])
            or (tg.sink is Sink.EXTRA and need_extra[tg.slot]) for tg in spec.targets]
    b, h, n_q, _ = q.shape
    n_k = k.shape[-2]
    wt = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=wt, device=q.device)
    dk = torch.zeros(k.shape, dtype=wt, device=k.device)
    g_extra: list[Tensor | None] = [None] * len(need_extra)
    flight = _InFlight()
    hides: dict | None = None if compiling else {}  # the blocks' causal triangles (`masked`)

    def into(i: int) -> Tensor:  # the accumulator of input i's gradient
        tg = spec.targets[i]
        if tg.sink is Sink.Q:
            return dq
        if tg.sink is Sink.K:
            return dk
        if g_extra[tg.slot] is None:
            g_extra[tg.slot] = wide_zeros(spec.inputs[i])
        return g_extra[tg.slot]

    def add_bias(start: int, stop: int, k_stop: int, s: Tensor, unit: float = 1.0) -> None:
        flight.block = BlockRows.of(spec.bias, spec.inputs, live, start, stop, k_stop, compiling,
                                    diagonal=start + spec.mask.q_offset if spec.mask.causal else None,
                                    eager_autograd=spec.tunables.eager_autograd)
        s.add_(flight.block.release().to(s.dtype).view(-1, *s.shape[1:]), alpha=unit)  # the rows freed here
        masked(s, spec.mask, start, stop, k_stop, inplace=True, group_dim=True, hides=hides)

    def to_inputs(start: int, stop: int, k_stop: int, ds: Tensor) -> None:
        block, flight.block = flight.block, None
        block.backward(ds.reshape(b, h, stop - start, k_stop), into)

    rows = backward_rows(b, h, n_q, n_k, spec.bias.backward_share, released=True,  # `add_bias` releases
                         threads=1 if compiling else torch.get_num_threads(),
                         forward_blocks=spec.bias.forward_blocks, tunables=spec.tunables)
    on_ds = to_inputs if any(live) else None
    if lse is None:
        dq, dk, dv = attention_backward_by_blocks(
            q, k, v, out, d_out, scale=spec.scale, causal=spec.mask.causal, q_offset=spec.mask.q_offset, rows=rows,
            add_bias=add_bias, on_ds=on_ds, dq=dq, dk=dk, empty_rows=spec.mask.k_valid is not None,
            compiling=compiling)
    else:
        dv = torch.zeros(v.shape, dtype=wt, device=v.device)
        own: list[tuple[int, int]] = []  # consecutive blocks of the own backward, run together
        size = b * h * min(rows, n_q) * n_k
        scratch: list[Scratch] = []  # the own blocks' buffers, made once and shared by every stretch

        def run_own() -> None:
            if own:  # the logits come in base 2 (`block_grad.LOG2E`)
                if not scratch:
                    scratch.append(Scratch((size, size), wt, q.device, compiling))
                attention_backward_by_blocks(
                    q, k, v, out, d_out, scale=spec.scale, causal=spec.mask.causal, q_offset=spec.mask.q_offset,
                    rows=rows, add_bias=lambda s0, s1, ks, s: add_bias(s0, s1, ks, s, LOG2E), on_ds=on_ds, dq=dq,
                    dk=dk, dv=dv, scratch=scratch[0], compiling=compiling, lse=lse, blocks=own)
                own.clear()

        for start, stop, k_stop, c in run_blocks(spec.bias, spec.mask, b, h, n_q, n_k, rows, tunables=spec.tunables):
            if c:
                run_own()
                run_backward(q, k, v, out, d_out, lse, spec.bias, spec.inputs, live, spec.mask, spec.scale, start,
                             stop, k_stop, c, (dq, dk, dv), into, compiling, hides, spec.tunables.eager_autograd)
            else:
                own.append((start, stop))
        run_own()
    firsts = [next(i for i, tg in enumerate(spec.targets) if tg.slot == s) for s in range(len(need_extra))]
    g_all = [None if g is None else g.to(spec.inputs[i].dtype) for g, i in zip(g_extra, firsts)]
    return dq, dk, dv, g_all


def mask_rows(mask: AttentionMask, start: int, stop: int, k_stop: int, device: torch.device) -> Tensor | None:
    """``mask.materialize()[..., start:stop, :k_stop]``, built for those rows only."""
    m = None
    if mask.causal:
        qi = torch.arange(start, stop, device=device)[:, None] + mask.q_offset
        kj = torch.arange(k_stop, device=device)[None, :]
        m = kj <= qi
        local = mask.local_allowed(qi, kj)
        m = (m if local is None else m & local)[None, None]
    if mask.q_segments is not None:
        ks = mask.k_segments if mask.k_segments is not None else mask.q_segments
        seg = mask.q_segments[:, None, start:stop, None] == ks[:, None, None, :k_stop]
        m = seg if m is None else m & seg
    if mask.k_valid is not None:
        kv = mask.k_valid[:, None, None, :k_stop]
        m = kv if m is None else m & kv
    return m


def masked(t: Tensor, mask: AttentionMask, start: int, stop: int, k_stop: int, inplace: bool,
           group_dim: bool = False, hides: dict | None = None) -> Tensor:
    """``t [..., r, k_stop]`` with ``-inf`` where query ``start + r`` may not see the key, in place
    or on a copy. A purely causal mask writes only the block's diagonal keys (those before its
    first query are visible to every row of it); other masks go through `mask_rows`
    (``group_dim``: ``t`` has a query-group dim after the heads, as in the own backward).
    ``hides``: a dict kept by the caller across the blocks of one call (eagerly), where the causal
    triangle of each block shape is built once."""
    if mask.causal and mask.q_segments is None and mask.k_valid is None and not mask.local:
        first = start + mask.q_offset
        if k_stop - 1 <= first:  # the last key is visible to the first query: nothing hidden
            return t
        # the sum with a 0/-inf triangle (finite logits): one pass, where a broadcast masked_fill
        # also builds its mask
        return hide_after_diagonal(t if inplace else t.clone(), first, 0, hides)
    m = mask_rows(mask, start, stop, k_stop, t.device)
    if m is None:
        return t
    hidden = ~(m[:, :, None] if group_dim else m)
    return t.masked_fill_(hidden, float("-inf")) if inplace else t.masked_fill(hidden, float("-inf"))


def collect_rows(q: Tensor, v: Tensor, blocks: Iterable[tuple[int, int, Tensor]]) -> Tensor:
    """The attention output from its blocks of query rows ``(start, stop, out)``. Without autograd
    each block is written into one buffer as it comes (never the list of blocks and their
    concatenation together), laid out ``[B, N, H, D]`` as SDPA's own outputs are, so that the
    usual ``out.transpose(1, 2).reshape(B, N, H * D)`` is a view."""
    if torch.is_grad_enabled():
        outs = [o for _, _, o in blocks]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
    out = q.new_empty(q.shape[0], q.shape[-2], q.shape[1], v.shape[-1]).transpose(1, 2)
    for start, stop, o in blocks:
        out[:, :, start:stop] = o
    return out


def attend_rows(q: Tensor, k: Tensor, v: Tensor, bias: Bias, mask: AttentionMask, scale: float, gqa: bool,
                 start: int, stop: int, compiling: bool, lse: Tensor | None = None, hides: dict | None = None
                 ) -> Tensor:
    """SDPA for the queries ``[start, stop)`` with their bias rows as its float mask; ``compiling``:
    traced by ``torch.compile`` (the mask is then never written into the rows in place); ``lse``:
    ``[B, H, Nq]`` to write the rows' log-sum-exp into, from SDPA's CPU kernel (eagerly, no key
    padding: `RowsSpec.kernel_runs`); ``hides``: the causal triangles of a call's blocks (`rows.masked`)."""
    # causal by index: the queries [start, stop) see keys [0, q_offset + stop) only
    k_stop = min(k.shape[-2], mask.q_offset + stop) if mask.causal else k.shape[-2]
    # where the causal mask hides keys, the bias may leave them unspecified (`HandRows.causal_rows`)
    hand = bias.hand_rows() if mask.causal else None
    attn_mask = (hand.causal_rows(start, stop, k_stop, start + mask.q_offset) if hand is not None
                 else bias.rows(start, stop, k_stop)).to(q.dtype)
    attn_mask = masked(attn_mask, mask, start, stop, k_stop,
                       inplace=owned_rows(attn_mask, bias, mask, q.shape[0], compiling), hides=hides)
    empty = None
    if mask.k_valid is not None:
        # a query whose keys are all padding: its output is 0 (as eager's), and an all -inf row
        # would give SDPA's backward NaN gradients; open the row, then zero its output
        empty = torch.isneginf(attn_mask).all(-1, keepdim=True)
        attn_mask = attn_mask.masked_fill(empty, 0.0)
    if lse is not None:
        out, lse[:, :, start:stop] = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[:, :, start:stop], k[:, :, :k_stop], v[:, :, :k_stop], 0.0, False, attn_mask=attn_mask, scale=scale)
        return out
    out = F.scaled_dot_product_attention(q[:, :, start:stop], k[:, :, :k_stop], v[:, :, :k_stop],
                                         attn_mask=attn_mask, scale=scale, enable_gqa=gqa)
    return out if empty is None else out.masked_fill(empty, 0.0)


def attend_by_rows(q: Tensor, k: Tensor, v: Tensor, bias: Bias, mask: AttentionMask, scale: float, gqa: bool,
                    rows: int, checkpointed: bool = False, compiling: bool = False, lse: Tensor | None = None,
                    tunables: Tunables = DEFAULT_TUNABLES) -> Tensor:
    """`attend_rows` over consecutive blocks of ``rows`` queries, each recomputed in backward
    when ``checkpointed``; ``compiling``: traced by ``torch.compile`` (`mode.Mode`; a custom
    operator's kernel runs eagerly); ``lse``: written with the rows' log-sum-exp, and blocks whose
    bias has a constant run in the run form (`runs.run_blocks`, sized by ``tunables``)."""
    from torch.utils.checkpoint import checkpoint

    n_q = q.shape[-2]
    if lse is not None:
        blocks = _runs.run_blocks(bias, mask, q.shape[0], q.shape[1], n_q, k.shape[-2], rows, tunables=tunables)
        hides: dict = {}  # eagerly (`lse`): the blocks' causal triangles, built once a shape
        return collect_rows(q, v, ((s, e, _runs.attend_run(q, k, v, bias, mask, scale, s, e, ke, c, lse, hides) if c else
                                    attend_rows(q, k, v, bias, mask, scale, gqa, s, e, compiling, lse, hides))
                                   for s, e, ke, c in blocks))

    def block(start: int) -> tuple[int, int, Tensor]:
        stop = min(n_q, start + rows)
        args = (q, k, v, bias, mask, scale, gqa, start, stop, compiling, lse)
        return start, stop, checkpoint(attend_rows, *args, use_reentrant=False) if checkpointed else attend_rows(*args)

    starts = range(0, n_q, rows)
    return collect_rows(q, v, [block(s) for s in starts] if torch.is_grad_enabled() else map(block, starts))


class RowsAttention(torch.autograd.Function):
    """Blocks of query rows for a bias that can recompute its rows from stand-ins for its inputs
    (`Bias.rows_from`), with the engine's own backward (`rows.rows_backward`): SDPA's kernel
    forward (block by block, nothing saved but q, k, v and the output); backward by blocks of
    query rows from the softmax attention gradient (as `ToeplitzAttention`), each block's rows
    recomputed from detached windows of its inputs (`Bias.input_windows`) and differentiated to
    them (`blocks.BlockRows`), so a bias input's gradient is built window by window (into dq / dk
    directly when the input is q or k itself). Memory: a few blocks, never ``H x N x N``, a
    checkpoint's recomputed SDPA, or a full-size gradient per block."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, spec: RowsSpec, *extra: Tensor) -> Tensor:
        gqa = k.shape[1] != q.shape[1]
        rows = forward_rows(q.shape[1], q.shape[-2], k.shape[-2], tunables=spec.tunables)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32) if spec.kernel_runs else None
        out = attend_by_rows(q, k, v, spec.bias, spec.mask, spec.scale, gqa, rows, compiling=Mode.of(q).compiling,
                              lse=lse, tunables=spec.tunables)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, g_extra = rows_backward(q, k, v, out, d_out, ctx.spec, ctx.needs_input_grad,
                                            Mode.of(q).compiling, lse)
        return (dq, dk, dv, None, *g_extra)
