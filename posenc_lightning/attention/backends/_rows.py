"""sdpa's blocks of query rows: the masks of a block, the output assembled from its blocks, and the
engine's own backward for a bias that recomputes its rows (`rows_backward`), with the typed records
it reads: where each bias input's gradient goes (`Target`) and what the backward needs besides
tensors (`RowsSpec`). The forward by rows and its autograd Function are in `sdpa`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from posenc_lightning.attention.backends._block_grad import LOG2E, Scratch, attention_backward_by_blocks
from posenc_lightning.attention.backends._blocks import BlockRows, backward_rows, hide_after_diagonal, wide_zeros
from posenc_lightning.attention.backends._runs import run_backward, run_blocks
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import Bias


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
    #: a run of keys run on SDPA's CPU kernel, forward and backward (`_runs`)
    kernel_runs: bool = False

    @classmethod
    def route(cls, bias: Bias, mask: AttentionMask, scale: float, inputs: Sequence[Tensor], q: Tensor, k: Tensor,
              given: tuple[Tensor, Tensor] | None = None) -> tuple[RowsSpec, list[Tensor]]:
        """The spec and the distinct extra inputs that need a gradient (in their slots' order).

        Args:
            bias: the bias; mask: the mask; scale: the logit scale.
            inputs: ``bias.grad_inputs()``.
            q, k: the attention's q and k.
            given: the q and k the caller was given, when ``q``/``k`` are identity stand-ins for them.

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
        return cls(bias, mask, scale, tuple(inputs), tuple(targets)), extra


@dataclass
class _InFlight:
    """The block whose rows were added to the logits and whose ``dS`` is still to come."""

    block: BlockRows | None = None


def rows_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, d_out: Tensor, spec: RowsSpec,
                  needs_input_grad: tuple[bool, ...], compiling: bool = False, lse: Tensor | None = None
                  ) -> tuple[Tensor, Tensor, Tensor, list[Tensor | None]]:
    """The backward of the rows form (`sdpa._RowsAttention`): ``dq, dk, dv`` and the gradients of
    its extra inputs, by blocks of query rows; each block's bias rows recomputed (`BlockRows`).

    With the forward's log-sum-exp (``lse``, `RowsSpec.kernel_runs`), a block whose bias is one
    value per row before key ``c`` (`Bias.constant_before`) runs on SDPA's CPU kernel, with ``dS``
    for the keys from ``c`` on only (`_runs.run_backward`). Other blocks run the engine's own
    backward (`_block_grad.attention_backward_by_blocks`), with the weights from that log-sum-exp
    (base-2 logits: the rows are added times `_block_grad.LOG2E`), each stretch of them in one call.

    Args:
        q, k, v, out, d_out: the forward's tensors and the output's gradient.
        spec: the bias and where its inputs' gradients go.
        needs_input_grad: as the Function's: q, k, v, spec, then the extra inputs.
        compiling: traced by ``torch.compile`` (`_mode.Mode`; a custom operator's kernel runs eagerly).
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
                                    diagonal=start + spec.mask.q_offset if spec.mask.causal else None)
        s.add_(flight.block.release().to(s.dtype).view(-1, *s.shape[1:]), alpha=unit)  # the rows freed here
        masked(s, spec.mask, start, stop, k_stop, inplace=True, group_dim=True, hides=hides)

    def to_inputs(start: int, stop: int, k_stop: int, ds: Tensor) -> None:
        block, flight.block = flight.block, None
        block.backward(ds.reshape(b, h, stop - start, k_stop), into)

    rows = backward_rows(b, h, n_q, n_k, spec.bias.backward_share, released=True,  # `add_bias` releases
                         threads=1 if compiling else torch.get_num_threads())
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
            if own:  # the logits come in base 2 (`_block_grad.LOG2E`)
                if not scratch:
                    scratch.append(Scratch((size, size), wt, q.device, compiling))
                attention_backward_by_blocks(
                    q, k, v, out, d_out, scale=spec.scale, causal=spec.mask.causal, q_offset=spec.mask.q_offset,
                    rows=rows, add_bias=lambda s0, s1, ks, s: add_bias(s0, s1, ks, s, LOG2E), on_ds=on_ds, dq=dq,
                    dk=dk, dv=dv, scratch=scratch[0], compiling=compiling, lse=lse, blocks=own)
                own.clear()

        for start, stop, k_stop, c in run_blocks(spec.bias, spec.mask, b, h, n_q, n_k, rows):
            if c:
                run_own()
                run_backward(q, k, v, out, d_out, lse, spec.bias, spec.inputs, live, spec.mask, spec.scale, start,
                             stop, k_stop, c, (dq, dk, dv), into, compiling, hides)
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
        m = (torch.arange(k_stop, device=device)[None, :] <= qi)[None, None]
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
    if mask.causal and mask.q_segments is None and mask.k_valid is None:
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
