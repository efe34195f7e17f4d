"""``torch.nn.functional.scaled_dot_product_attention``: rotary is applied before; a bias is
materialized into the float mask one block of query rows at a time (`Bias.rows`); the plain
causal case uses SDPA's ``is_causal`` fast path.

Each call's form is decided once (`plan.choose`, from a `plan.Call` of declarations and shapes
and the `functional.mode.Mode`), then run here (`_run`); the forms' code is in this package's modules. See docs/architecture.md, section 4.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc_lightning.attention.backends.engine.blocks import backward_rows, forward_rows
from posenc_lightning.attention.backends.engine.denormals import (
    _DenormalsOffAfterBackward,
    _DenormalsOnForBackward,
    _flush_denormals,
    _flush_in_backward,
)
from posenc_lightning.attention.backends.sdpa.key_bias import _attend_key_bias, _attend_key_channel, _key_mask_works
from posenc_lightning.attention.backends.sdpa.opaque_form import opaque_attention
from posenc_lightning.attention.backends.sdpa.plan import Call, Form, Plan, choose
from posenc_lightning.attention.backends.sdpa.rows import (
    RowsAttention,
    RowsSpec,
    Sink,
    attend_by_rows,
    attend_rows,
    rows_backward,
)
from posenc_lightning.attention.backends.sdpa.toeplitz import (
    ToeplitzAttention,
    attend_toeplitz,
    template_at,
    toeplitz_backward,
    toeplitz_shift,
)
from posenc_lightning.attention.mask import LOCAL_KINDS, AttentionMask
from posenc_lightning.encodings.base import AttentionContext, Bias, Encoding, KeyOnly, Normalizer
from posenc_lightning.encodings.bias import OwnAttention
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.tunables import Tunables

__all__ = ["attend", "backward_rows", "block_rows", "rows_backward", "supports",
           "toeplitz_backward"]

NAME = "sdpa"
#: rotates q, k in-kernel with ``ctx.rotary`` (the mixin then skips ``encoding.rotate``)
FUSES_ROTARY = False
#: the local masks it honors (`attention.mask.LOCAL_KINDS`): a sliding window, a chunk
LOCAL_MASKS = LOCAL_KINDS
#: query rows per block of sdpa's forward by rows (`blocks.forward_rows`), the name `opaque_op` calls
block_rows = forward_rows


def supports(encoding: Encoding, device: torch.device, requires_grad: bool) -> str | None:
    if "normalize" in encoding.stages:
        return f"{encoding.name} replaces softmax (stage 4), which SDPA cannot do"
    return None


def attend(q: Tensor, k: Tensor, v: Tensor, *, bias: Bias | None, mask: AttentionMask, scale: float,
           normalizer: Normalizer | None = None, ctx: AttentionContext | None = None,
           tunables: Tunables | None = None) -> Tensor:
    """``tunables``: the block budgets and switches of this call (None: the context's, which carry
    the attention module's ``posenc_tunables``, else the defaults)."""
    if normalizer is not None:
        raise ValueError("the sdpa backend cannot replace softmax; use backend='eager'")
    gqa = k.shape[1] != q.shape[1]
    mode = Mode.of(q, ctx.mode.tunables if tunables is None and ctx is not None else tunables)
    if bias is not None:
        flush = _flush_in_backward(mode, q, k, v)
        given = (q, k)  # a bias computed from q or k names these
        if flush:
            q, k, v = _DenormalsOffAfterBackward.apply(q, k, v)
        with _flush_denormals(mode):
            out = _attend_biased(q, k, v, bias, mask, scale, gqa, ctx, given, mode)
        return _DenormalsOnForBackward.apply(out) if flush else out
    b, n_q, n_k = q.shape[0], q.shape[-2], k.shape[-2]
    call = Call(b, q.shape[1], n_q, n_k, bias=False, plain_mask=mask.is_plain_causal or mask.is_trivial,
                # a window or chunk, as an offset, is a mask SDPA's is_causal cannot express
                offset_causal=mask.causal and (mask.q_offset > 0 or bool(mask.local)), recomputable=True,
                grads=q.requires_grad or k.requires_grad or v.requires_grad, grad_mode=torch.is_grad_enabled())
    plan = choose(call, mode)
    if plan.form is Form.SDPA:
        return F.scaled_dot_product_attention(q, k, v, is_causal=mask.causal, scale=scale, enable_gqa=gqa)
    if plan.form is Form.MASK:
        allowed = mask.materialize(q.device)
        if mask.k_valid is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
        # a query whose keys are all padding: its output is 0 (as eager's). SDPA's CUDA kernels give
        # such a row other values in bf16, so open the row and zero its output.
        empty = ~allowed.any(-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | empty, scale=scale, enable_gqa=gqa)
        return out.masked_fill(empty, 0.0)
    # a causal offset SDPA's is_causal cannot express, larger than a bias block: a zero bias by rows
    zero = _zero_rows(q.shape[1], n_q, n_k, q.device)
    return _run(plan, q, k, v, zero, mask, scale, gqa, None, None, mode)


def _zero_rows(n_heads: int, n_q: int, n_k: int, device: torch.device) -> Bias:
    """A zero bias computed by rows (the blockwise path then applies the mask rows alone)."""
    from posenc_lightning.encodings.bias import DenseBias

    def rows(start: int, stop: int, k_stop: int) -> Tensor:
        return torch.zeros(1, n_heads, stop - start, k_stop, device=device)

    return DenseBias.lazy(rows, n_q, n_k, inputs=(), window=lambda start, stop, k_stop: ())


def _attend_biased(q: Tensor, k: Tensor, v: Tensor, bias: Bias, mask: AttentionMask, scale: float, gqa: bool,
                   ctx: AttentionContext | None, given: tuple[Tensor, Tensor] | None, mode: Mode) -> Tensor:
    """The cheapest exact form of a biased attention (`plan.Form`): what the call declares is read
    once (`_declared`), the form chosen from it (`plan.choose`), then run (`_run`)."""
    call, found = _declared(q, k, v, bias, mask, ctx, given, mode)
    return _run(choose(call, mode, mode.tunables.compiled_one_block_bytes), q, k, v, bias, mask, scale, gqa, ctx,
                given, mode, found)


@dataclass(frozen=True, eq=False)
class _Found:
    """What reading a call's declarations computed, for the form that uses it: the key-only form
    and its key bias, the Toeplitz shift (`toeplitz.toeplitz_shift`), the kind's own attention."""

    key_only: KeyOnly | None
    key_bias: Tensor | None
    shift: int | None
    own: OwnAttention | None = None


def _declared(q: Tensor, k: Tensor, v: Tensor, bias: Bias, mask: AttentionMask, ctx: AttentionContext | None,
              given: tuple[Tensor, Tensor] | None, mode: Mode) -> tuple[Call, _Found]:
    """The `plan.Call` of a biased call (no ``N x N`` work), and what reading it computed."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    plain = mask.is_plain_causal or mask.is_trivial
    own = None if mode.compiling else bias.own_attention()
    if own is not None and not (given is not None and own.q is given[0] and own.k is given[1] and mask.causal
                                and mask.k_valid is None and not mask.local):
        own = None  # other operands or a mask it does not take: the other forms
    key_only = bias.key_only(q.dtype, mask.is_plain_causal, ctx is not None and ctx.ascending)
    key_bias = None if key_only is None else key_only.key_bias()
    # compiled, a kind whose cheapest form depends on values runs as one opaque operator (`opaque_form`)
    opaque = mode.compiling and ctx is not None and bias.value_dependent() is not None
    shift = None if key_only is not None or mode.compiling else toeplitz_shift(bias, mask, n_q, n_k, ctx)
    grad_mode = torch.is_grad_enabled()
    recomputable = grads = False
    if key_only is None and shift is None:  # the rows forms are reachable: how their gradients go
        inputs = bias.grad_inputs() if grad_mode else None
        recomputable = inputs is not None and bias.recomputable
        grads = q.requires_grad or k.requires_grad or v.requires_grad
        if recomputable and not grads:
            grads = any(t.sink is Sink.EXTRA for t in RowsSpec.route(bias, mask, 1.0, inputs, q, k, given)[0].targets)
    call = Call(q.shape[0], q.shape[1], n_q, n_k, plain_mask=plain, key_only=key_only is not None,
                key_mask=key_bias is not None and plain and _key_mask_works(q, k, key_bias),
                toeplitz=shift is not None, recomputable=recomputable, grads=grads, grad_mode=grad_mode,
                opaque=opaque, own=own is not None,
                kernel_runs=q.dtype == torch.float32 and mask.k_valid is None and mask.q_segments is None
                and not mask.local and bias.recomputable)
    return call, _Found(key_only, key_bias, shift, own)


def _run(plan: Plan, q: Tensor, k: Tensor, v: Tensor, bias: Bias, mask: AttentionMask, scale: float, gqa: bool,
         ctx: AttentionContext | None, given: tuple[Tensor, Tensor] | None, mode: Mode,
         found: _Found | None = None) -> Tensor:
    """Run ``plan`` (its fallback where the form declines)."""
    n_q = q.shape[-2]
    form = plan.form
    if form is Form.OWN:
        segments = None if mask.q_segments is None else (
            mask.q_segments, mask.q_segments if mask.k_segments is None else mask.k_segments)
        out = found.own.attend(v, mask.q_offset, scale, None, segments)
        return out if out is not None else _run(plan.fallback, q, k, v, bias, mask, scale, gqa, ctx, given, mode,
                                                found)
    if form is Form.ONE_BLOCK:
        return attend_rows(q, k, v, bias, mask, scale, gqa, 0, n_q, mode.compiling)
    if form is Form.OPAQUE:
        out = opaque_attention(q, k, v, bias, mask, scale, ctx, mode.tunables)
        return out if out is not None else _run(plan.fallback, q, k, v, bias, mask, scale, gqa, ctx, given, mode,
                                                found)
    if form is Form.KEY_MASK:
        return _attend_key_bias(q, k, v, found.key_bias, mask.causal, scale)
    if form is Form.KEY_CHANNEL:
        return _attend_key_channel(q, k, v, found.key_only, mask, scale, gqa)
    if form is Form.TOEPLITZ:
        u = template_at(bias, mask, n_q, k.shape[-2], found.shift, ctx.q_pos.device)
        if u is None:
            return _run(plan.fallback, q, k, v, bias, mask, scale, gqa, ctx, given, mode, found)
        if u.requires_grad and torch.is_grad_enabled():  # a learned template: its own backward
            return ToeplitzAttention.apply(q, k, v, u, mask.causal, mask.q_offset, scale, gqa, mode.tunables)
        return attend_toeplitz(q, k, v, u.to(q.dtype), mask, scale, gqa)
    if form is Form.OWN_BACKWARD:
        spec, extra = RowsSpec.route(bias, mask, scale, bias.grad_inputs(), q, k, given, tunables=mode.tunables)
        return RowsAttention.apply(q, k, v, replace(spec, kernel_runs=plan.kernel_runs), *extra)
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32) if plan.kernel_runs else None  # no backward reads it
    if plan.rows >= n_q:
        return attend_rows(q, k, v, bias, mask, scale, gqa, 0, n_q, mode.compiling, lse)
    return attend_by_rows(q, k, v, bias, mask, scale, gqa, plan.rows,
                           checkpointed=mode.tunables.checkpoint_blocks and torch.is_grad_enabled(),
                           compiling=mode.compiling, lse=lse, tunables=mode.tunables)


