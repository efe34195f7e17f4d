"""``torch.nn.functional.scaled_dot_product_attention``: rotary is applied before; a bias is
materialized into the float mask one block of query rows at a time (`Bias.rows`); the plain
causal case uses SDPA's ``is_causal`` fast path.

Each call's form is decided once (`_plan.choose`, from a `_plan.Call` of declarations and shapes
and the `_plan.Mode`), then run here (`_run`). See docs/architecture.md, section 4.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc_lightning.attention.backends import _runs
from posenc_lightning.attention.backends._blocks import backward_rows, forward_rows, owned_rows
from posenc_lightning.attention.backends._denormals import (
    _DenormalsOffAfterBackward,
    _DenormalsOnForBackward,
    _flush_denormals,
    _flush_in_backward,
)
from posenc_lightning.attention.backends._key_bias import _attend_key_bias, _attend_key_channel, _key_mask_works
from posenc_lightning.attention.backends._opaque_form import opaque_attention
from posenc_lightning.attention.backends._plan import Call, Form, Mode, Plan, choose
from posenc_lightning.attention.backends._rows import (
    RowsSpec,
    Sink,
    collect_rows,
    masked,
    rows_backward,
)
from posenc_lightning.attention.backends._toeplitz import template_at, toeplitz_backward, toeplitz_shift
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext, Bias, Encoding, KeyOnly

__all__ = ["attend", "backward_rows", "block_rows", "rows_backward", "supports",
           "toeplitz_backward"]

NAME = "sdpa"
#: rotates q, k in-kernel with ``ctx.rotary`` (the mixin then skips ``encoding.rotate``)
FUSES_ROTARY = False
#: recompute each block's bias in backward instead of keeping every block alive until then
CHECKPOINT_BLOCKS = True
#: under compile on CPU, an attention whose weights ``[B, H, Nq, Nk]`` fit in this many bytes
#: (float32) runs as one traced block: the bias rows, SDPA's math form and its backward through
#: autograd, all fused by inductor (at most this much saved for backward). Below it, the fixed
#: cost of a loop over blocks (the own backward, the opaque operator) outweighs the work (the
#: measurements are in CHANGELOG.md).
COMPILED_ONE_BLOCK_BYTES = 2 * 2**20
#: query rows per block of sdpa's forward by rows (`_blocks.forward_rows`), the name `_opaque_op` calls
block_rows = forward_rows


def supports(encoding: Encoding, device: torch.device, requires_grad: bool) -> str | None:
    if "normalize" in encoding.stages:
        return f"{encoding.name} replaces softmax (stage 4), which SDPA cannot do"
    return None


def attend(q: Tensor, k: Tensor, v: Tensor, *, bias: Bias | None, mask: AttentionMask, scale: float,
           normalize: Callable | None = None, ctx: AttentionContext | None = None) -> Tensor:
    if normalize is not None:
        raise ValueError("the sdpa backend cannot replace softmax; use backend='eager'")
    gqa = k.shape[1] != q.shape[1]
    if bias is not None:
        flush = _flush_in_backward(q, k, v)
        given = (q, k)  # a bias computed from q or k names these
        if flush:
            q, k, v = _DenormalsOffAfterBackward.apply(q, k, v)
        with _flush_denormals(q.device):
            out = _attend_biased(q, k, v, bias, mask, scale, gqa, ctx, given)
        return _DenormalsOnForBackward.apply(out) if flush else out
    b, n_q, n_k = q.shape[0], q.shape[-2], k.shape[-2]
    call = Call(b, q.shape[1], n_q, n_k, bias=False, plain_mask=mask.is_plain_causal or mask.is_trivial,
                offset_causal=mask.causal and mask.q_offset > 0, recomputable=True,
                grads=q.requires_grad or k.requires_grad or v.requires_grad, grad_mode=torch.is_grad_enabled())
    mode = Mode.of(q)
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
                   ctx: AttentionContext | None, given: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """The cheapest exact form of a biased attention (`_plan.Form`): what the call declares is read
    once (`_declared`), the form chosen from it (`_plan.choose`), then run (`_run`)."""
    mode = Mode.of(q)
    call, found = _declared(q, k, v, bias, mask, ctx, given, mode)
    return _run(choose(call, mode, COMPILED_ONE_BLOCK_BYTES), q, k, v, bias, mask, scale, gqa, ctx, given, mode,
                found)


@dataclass(frozen=True, eq=False)
class _Found:
    """What reading a call's declarations computed, for the form that uses it: the key-only form
    and its key bias, the Toeplitz shift (`_toeplitz.toeplitz_shift`)."""

    key_only: KeyOnly | None
    key_bias: Tensor | None
    shift: int | None


def _declared(q: Tensor, k: Tensor, v: Tensor, bias: Bias, mask: AttentionMask, ctx: AttentionContext | None,
              given: tuple[Tensor, Tensor] | None, mode: Mode) -> tuple[Call, _Found]:
    """The `_plan.Call` of a biased call (no ``N x N`` work), and what reading it computed."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    plain = mask.is_plain_causal or mask.is_trivial
    key_only = bias.key_only(q.dtype, mask.is_plain_causal, ctx is not None and ctx.ascending)
    key_bias = None if key_only is None else key_only.key_bias()
    # compiled, a kind whose cheapest form depends on values runs as one opaque operator (`_opaque_form`)
    opaque = mode.compiling and ctx is not None and bias.opaque_operands() is not None
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
                opaque=opaque,
                kernel_runs=q.dtype == torch.float32 and mask.k_valid is None and mask.q_segments is None
                and bias.recomputable)
    return call, _Found(key_only, key_bias, shift)


def _run(plan: Plan, q: Tensor, k: Tensor, v: Tensor, bias: Bias, mask: AttentionMask, scale: float, gqa: bool,
         ctx: AttentionContext | None, given: tuple[Tensor, Tensor] | None, mode: Mode,
         found: _Found | None = None) -> Tensor:
    """Run ``plan`` (its fallback where the form declines)."""
    n_q = q.shape[-2]
    form = plan.form
    if form is Form.ONE_BLOCK:
        return _attend_rows(q, k, v, bias, mask, scale, gqa, 0, n_q, mode.compiling)
    if form is Form.OPAQUE:
        out = opaque_attention(q, k, v, bias, mask, scale, ctx)
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
            return _ToeplitzAttention.apply(q, k, v, u, mask.causal, mask.q_offset, scale, gqa)
        return _attend_toeplitz(q, k, v, u.to(q.dtype), mask, scale, gqa)
    if form is Form.OWN_BACKWARD:
        spec, extra = RowsSpec.route(bias, mask, scale, bias.grad_inputs(), q, k, given)
        return _RowsAttention.apply(q, k, v, replace(spec, kernel_runs=plan.kernel_runs), *extra)
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32) if plan.kernel_runs else None  # no backward reads it
    if plan.rows >= n_q:
        return _attend_rows(q, k, v, bias, mask, scale, gqa, 0, n_q, mode.compiling, lse)
    return _attend_by_rows(q, k, v, bias, mask, scale, gqa, plan.rows,
                           checkpointed=CHECKPOINT_BLOCKS and torch.is_grad_enabled(), compiling=mode.compiling,
                           lse=lse)


def _toeplitz_template(bias: Bias, mask: AttentionMask, n_q: int, n_k: int,
                       ctx: AttentionContext | None) -> Tensor | None:
    """The Toeplitz template ``u`` of an eager call (`_toeplitz.template_at`), or None where that
    form does not apply (other positions, not `Bias.distance_only`)."""
    shift = toeplitz_shift(bias, mask, n_q, n_k, ctx)
    return None if shift is None else template_at(bias, mask, n_q, n_k, shift, ctx.q_pos.device)


def _attend_toeplitz(q: Tensor, k: Tensor, v: Tensor, u: Tensor, mask: AttentionMask, scale: float,
                     gqa: bool) -> Tensor:
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


class _ToeplitzAttention(torch.autograd.Function):
    """SDPA with a learned Toeplitz bias ``bias[h, i, j] = u[h, j - i + n_q - 1]`` (T5 / any
    learned ``f(i - j)`` at arange positions), with a backward that also returns ``du``.

    Forward: `_attend_toeplitz` (the bias is a zero-copy view; SDPA's fast kernel, which cannot
    differentiate a mask). Backward, by blocks of query rows, from the standard softmax
    attention gradient: ``P = softmax(S)``, ``dS = P * (dO V^T - rowsum(dO * O))``,
    ``dQ = dS K s``, ``dK = dS^T Q s``, ``dV = P^T dO`` and ``du[h, t] = sum over the diagonal
    j - i + n_q - 1 = t of dS`` (summed over the batch). Memory: a few blocks of rows, never the
    ``H x N x N`` mask and its gradient that a differentiable mask would keep.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, u: Tensor, causal: bool, q_offset: int, scale: float,
                gqa: bool) -> Tensor:
        mask = AttentionMask(causal, q_offset, q.shape[-2], k.shape[-2])
        # detached: a mask that requires grad sends SDPA to its math kernel even in no-grad mode
        out = _attend_toeplitz(q, k, v, u.detach().to(q.dtype), mask, scale, gqa)
        ctx.save_for_backward(q, k, v, u, out)
        ctx.causal, ctx.q_offset, ctx.scale = causal, q_offset, scale
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor):
        q, k, v, u, out = ctx.saved_tensors
        dq, dk, dv, du = toeplitz_backward(q, k, v, u, out, d_out, ctx.causal, ctx.q_offset, ctx.scale,
                                           ctx.needs_input_grad[3], Mode.of(q).compiling)
        return dq, dk, dv, du, None, None, None, None


def _attend_rows(q: Tensor, k: Tensor, v: Tensor, bias: Bias, mask: AttentionMask, scale: float, gqa: bool,
                 start: int, stop: int, compiling: bool, lse: Tensor | None = None, hides: dict | None = None
                 ) -> Tensor:
    """SDPA for the queries ``[start, stop)`` with their bias rows as its float mask; ``compiling``:
    traced by ``torch.compile`` (the mask is then never written into the rows in place); ``lse``:
    ``[B, H, Nq]`` to write the rows' log-sum-exp into, from SDPA's CPU kernel (eagerly, no key
    padding: `RowsSpec.kernel_runs`); ``hides``: the causal triangles of a call's blocks (`_rows.masked`)."""
    # causal by index: the queries [start, stop) see keys [0, q_offset + stop) only
    k_stop = min(k.shape[-2], mask.q_offset + stop) if mask.causal else k.shape[-2]
    # where the causal mask hides keys, the bias may leave them unspecified (`Bias.causal_rows`)
    attn_mask = (bias.causal_rows(start, stop, k_stop, start + mask.q_offset) if mask.causal
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


def _attend_by_rows(q: Tensor, k: Tensor, v: Tensor, bias: Bias, mask: AttentionMask, scale: float, gqa: bool,
                    rows: int, checkpointed: bool = False, compiling: bool = False, lse: Tensor | None = None
                    ) -> Tensor:
    """`_attend_rows` over consecutive blocks of ``rows`` queries, each recomputed in backward
    when ``checkpointed``; ``compiling``: traced by ``torch.compile`` (`_mode.Mode`; a custom
    operator's kernel runs eagerly); ``lse``: written with the rows' log-sum-exp, and blocks whose
    bias has a constant run in the run form (`_runs.run_blocks`)."""
    from torch.utils.checkpoint import checkpoint

    n_q = q.shape[-2]
    if lse is not None:
        blocks = _runs.run_blocks(bias, mask, q.shape[0], q.shape[1], n_q, k.shape[-2], rows)
        hides: dict = {}  # eagerly (`lse`): the blocks' causal triangles, built once a shape
        return collect_rows(q, v, ((s, e, _runs.attend_run(q, k, v, bias, mask, scale, s, e, ke, c, lse, hides) if c else
                                    _attend_rows(q, k, v, bias, mask, scale, gqa, s, e, compiling, lse, hides))
                                   for s, e, ke, c in blocks))

    def block(start: int) -> tuple[int, int, Tensor]:
        stop = min(n_q, start + rows)
        args = (q, k, v, bias, mask, scale, gqa, start, stop, compiling, lse)
        return start, stop, checkpoint(_attend_rows, *args, use_reentrant=False) if checkpointed else _attend_rows(*args)

    starts = range(0, n_q, rows)
    return collect_rows(q, v, [block(s) for s in starts] if torch.is_grad_enabled() else map(block, starts))


class _RowsAttention(torch.autograd.Function):
    """Blocks of query rows for a bias that can recompute its rows from stand-ins for its inputs
    (`Bias.rows_from`), with the engine's own backward (`_rows.rows_backward`): SDPA's kernel
    forward (block by block, nothing saved but q, k, v and the output); backward by blocks of
    query rows from the softmax attention gradient (as `_ToeplitzAttention`), each block's rows
    recomputed from detached windows of its inputs (`Bias.input_windows`) and differentiated to
    them (`_blocks.BlockRows`), so a bias input's gradient is built window by window (into dq / dk
    directly when the input is q or k itself). Memory: a few blocks, never ``H x N x N``, a
    checkpoint's recomputed SDPA, or a full-size gradient per block."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, spec: RowsSpec, *extra: Tensor) -> Tensor:
        gqa = k.shape[1] != q.shape[1]
        rows = block_rows(q.shape[1], q.shape[-2], k.shape[-2])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32) if spec.kernel_runs else None
        out = _attend_by_rows(q, k, v, spec.bias, spec.mask, spec.scale, gqa, rows, compiling=Mode.of(q).compiling,
                              lse=lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, g_extra = rows_backward(q, k, v, out, d_out, ctx.spec, ctx.needs_input_grad,
                                            Mode.of(q).compiling, lse)
        return (dq, dk, dv, None, *g_extra)

