"""``torch.nn.functional.scaled_dot_product_attention``: rotary is applied before; a bias is
materialized into the float mask one block of query rows at a time (`Bias.rows`); the plain
causal case uses SDPA's ``is_causal`` fast path."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc_lightning.attention.backends._block_grad import Scratch, attention_backward_by_blocks, block_vjp
from posenc_lightning.attention.backends._denormals import (
    _DenormalsOffAfterBackward,
    _DenormalsOnForBackward,
    _flush_denormals,
    _flush_in_backward,
)
from posenc_lightning.attention.backends._key_bias import _attend_key_bias, _attend_key_channel, _key_mask_works
from posenc_lightning.attention.backends._opaque_form import opaque_attention
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext, Bias, Encoding
from posenc_lightning.functional.positions import arange_offset

NAME = "sdpa"
#: rotates q, k in-kernel with ``ctx.rotary`` (the mixin then skips ``encoding.rotate``)
FUSES_ROTARY = False


def supports(encoding: Encoding, device: torch.device, requires_grad: bool) -> str | None:
    if "normalize" in encoding.stages:
        return f"{encoding.name} replaces softmax (stage 4), which SDPA cannot do"
    return None


def attend(q: Tensor, k: Tensor, v: Tensor, *, bias: Bias | None, mask: AttentionMask, scale: float,
           normalize: Callable | None = None, ctx: AttentionContext | None = None) -> Tensor:
    if normalize is not None:
        raise ValueError("the sdpa backend cannot replace softmax; use backend='eager'")
    gqa = k.shape[1] != q.shape[1]
    if bias is None and (mask.is_plain_causal or mask.is_trivial):
        return F.scaled_dot_product_attention(q, k, v, is_causal=mask.causal, scale=scale, enable_gqa=gqa)
    if bias is not None:
        flush = _flush_in_backward(q, k, v)
        given = (q, k)  # a bias computed from q or k names these (CoPE)
        if flush:
            q, k, v = _DenormalsOffAfterBackward.apply(q, k, v)
        with _flush_denormals(q.device):
            out = _attend_biased(q, k, v, bias, mask, scale, gqa, ctx, given)
        return _DenormalsOnForBackward.apply(out) if flush else out
    if mask.causal and mask.q_offset > 0 and 4 * q.shape[0] * q.shape[-2] * k.shape[-2] > BIAS_BLOCK_BYTES:
        # a causal offset (a context-parallel chunk, a long prefill after a KV cache), which SDPA's
        # is_causal cannot express, with a mask larger than a bias block: its rows a block at a time
        return _attend_blockwise(q, k, v, _zero_rows(q.shape[1], q.shape[-2], k.shape[-2], q.device), mask, scale, gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.materialize(q.device), scale=scale,
                                          enable_gqa=gqa)


def _zero_rows(n_heads: int, n_q: int, n_k: int, device: torch.device) -> Bias:
    """A zero bias computed by rows (the blockwise path then applies the mask rows alone)."""
    from posenc_lightning.encodings.bias import DenseBias

    def rows(start: int, stop: int, k_stop: int) -> Tensor:
        return torch.zeros(1, n_heads, stop - start, k_stop, device=device)

    return DenseBias.lazy(rows, n_q, n_k, inputs=(), window=lambda start, stop, k_stop: ())


def _attend_biased(q: Tensor, k: Tensor, v: Tensor, bias: Bias, mask: AttentionMask, scale: float, gqa: bool,
                   ctx: AttentionContext | None, given: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """The cheapest exact form of a biased attention, in this order: a key-only bias
    (`Bias.key_only`: ALiBi, FoX) as a key mask or one extra q/k channel, a zero-copy Toeplitz view (``f(i - j)`` at
    arange positions; a learned table gets its own backward), blocks of query rows. Under
    ``torch.compile`` on CPU, a small attention is one traced block (`COMPILED_ONE_BLOCK_BYTES`),
    and a kind whose cheapest form depends on values runs as one opaque operator
    (`Bias.opaque_operands`, `_opaque_form`), eager inside."""
    key_only = bias.key_only(q.dtype, mask.is_plain_causal, ctx is not None and ctx.ascending)
    if key_only is None and _compiled_one_block(q, k):
        return _attend_rows(q, k, v, bias, mask, scale, gqa, 0, q.shape[-2])
    if torch.compiler.is_compiling() and ctx is not None:
        out = opaque_attention(q, k, v, bias, mask, scale, ctx)
        if out is not None:
            return out
    if key_only is not None:
        key_bias = key_only.key_bias()
        if (mask.is_plain_causal or mask.is_trivial) and _key_mask_works(q, k, key_bias):
            return _attend_key_bias(q, k, v, key_bias, mask.causal, scale)
        return _attend_key_channel(q, k, v, key_only, mask, scale, gqa)
    u = _toeplitz_template(bias, mask, q.shape[-2], k.shape[-2], ctx)
    if u is not None:
        if u.requires_grad and torch.is_grad_enabled():
            return _ToeplitzAttention.apply(q, k, v, u, mask.causal, mask.q_offset, scale, gqa)
        return _attend_toeplitz(q, k, v, u.to(q.dtype), mask, scale, gqa)
    return _attend_blockwise(q, k, v, bias, mask, scale, gqa, given)


#: under compile on CPU, an attention whose weights ``[B, H, Nq, Nk]`` fit in this many bytes
#: (float32) runs as one traced block: the bias rows, SDPA's math form and its backward through
#: autograd, all fused by inductor (at most this much saved for backward). Below it, the fixed
#: cost of a loop over blocks (the own backward, the opaque operator) outweighs the work.
#: Measured (compiled / eager TinyGPT FIRE step, `benchmarks/compile_step.py`, one thread):
#: B 16, H 2, N 64 (0.5 MiB) 1.19x one block, 1.03x operator; N 128 (2 MiB) 1.10x, 0.96x;
#: B 4, H 4, N 256 (4 MiB) 1.03x, 1.08x; N 512 (16 MiB) 0.75x, 1.0x.
COMPILED_ONE_BLOCK_BYTES = 2 * 2**20


def _compiled_one_block(q: Tensor, k: Tensor) -> bool:
    return (torch.compiler.is_compiling() and q.device.type == "cpu"
            and 4 * q.shape[0] * q.shape[1] * q.shape[-2] * k.shape[-2] <= COMPILED_ONE_BLOCK_BYTES)


def _toeplitz_template(bias: Bias, mask: AttentionMask, n_q: int, n_k: int,
                       ctx: AttentionContext | None) -> Tensor | None:
    """``u [H, n_q + n_k - 1]`` with ``bias[h, i, j] = u[h, j - i + n_q - 1]``, causal -inf folded
    in, when the bias depends on ``i - j`` only and positions are a plain ``arange`` (else None).

    O(H N) work and memory instead of O(H N^2): the ``[H, N, N]`` mask is a strided view of it.
    """
    if ctx is None or mask.q_segments is not None or mask.k_valid is not None:
        return None
    if not bias.distance_only or torch.compiler.is_compiling():  # strided views of storage offsets do not trace
        return None
    a, c = arange_offset(ctx.q_pos, ctx.q_start), arange_offset(ctx.k_pos, ctx.k_start)
    if a is None or c is None or ctx.q_pos.shape[1] != n_q or ctx.k_pos.shape[1] != n_k:
        return None
    dev = ctx.q_pos.device
    d = torch.arange(-(n_q - 1), n_k, device=dev)  # j - i
    # position distance i_pos - j_pos = (a - c) - (j - i)
    kind = bias.at(torch.full((1, 1), a - c, device=dev), d[None])
    if kind is None:
        return None
    u = kind.materialize()[0, :, 0, :]  # [H, L]; a learned table keeps its graph (`_ToeplitzAttention`)
    if mask.causal:
        u = u.masked_fill(d[None, :] > mask.q_offset, float("-inf"))
    return u.contiguous()


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

    return _collect_rows(q, v, blocks())


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
                                           ctx.needs_input_grad[3])
        return dq, dk, dv, du, None, None, None, None


def toeplitz_backward(q: Tensor, k: Tensor, v: Tensor, u: Tensor, out: Tensor, d_out: Tensor, causal: bool,
                      q_offset: int, scale: float, need_du: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`_ToeplitzAttention`'s backward: ``dq, dk, dv`` and ``du`` (zeros unless ``need_du``)."""
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

    rows = backward_rows(b, h, n_q, n_k)
    # buffer 1 (a block's weights, free while on_ds runs) also takes the padded rows of dS
    block = b * h * rows * n_k
    scratch = Scratch((block, max(block, h * rows * (n_k + rows))), torch.promote_types(q.dtype, torch.float32),
                      q.device)

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


#: a bias is materialized one block of query rows at a time, about this many bytes per block
#: (``[B|1, H, rows, keys]`` float), never the whole ``[H, N, N]``. Content-dependent rows
#: (FIRE's MLP, CoPE's gates and counts) have several temporaries of this size, so it is kept
#: small next to the attention's own memory (at N=4096, d_model=512: 48 MiB of activations).
#: Measured there (one layer, peak allocated fwd+bwd / nope's, and fwd+bwd time), 4 -> 8 -> 16 MiB:
#: fire 1.09 -> 1.22 -> 1.33x memory, 2.83 -> 2.39 -> 2.00 s; cope 1.08 -> 1.18 -> 1.26x,
#: 3.08 -> 2.37 -> 2.05 s (nope 1.18 s): the per-block overhead against a 1.3x memory bound.
BIAS_BLOCK_BYTES = 8 * 2**20
#: recompute each block's bias in backward instead of keeping every block alive until then
CHECKPOINT_BLOCKS = True


def block_rows(n_heads: int, n_q: int, n_k: int) -> int:
    """Query rows per SDPA call so that one block of bias is about `BIAS_BLOCK_BYTES`."""
    rows = BIAS_BLOCK_BYTES // (4 * n_heads * max(n_k, 1))
    return int(min(n_q, max(16, rows)))


def backward_rows(b: int, n_heads: int, n_q: int, n_k: int) -> int:
    """Query rows per block of the own backward passes: half a forward block, as the logits, the
    weights, ``dS`` and the bias rows of a block are alive together."""
    return int(min(n_q, max(16, BIAS_BLOCK_BYTES // (2 * 4 * b * n_heads * max(n_k, 1)))))


def _mask_rows(mask: AttentionMask, start: int, stop: int, k_stop: int, device: torch.device) -> Tensor | None:
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


def _masked(t: Tensor, mask: AttentionMask, start: int, stop: int, k_stop: int, inplace: bool,
            group_dim: bool = False) -> Tensor:
    """``t [..., r, k_stop]`` with ``-inf`` where query ``start + r`` may not see the key, in place
    or on a copy. A purely causal mask writes only the block's diagonal keys (those before its
    first query are visible to every row of it); other masks go through `_mask_rows`
    (``group_dim``: ``t`` has a query-group dim after the heads, as in the own backward)."""
    if mask.causal and mask.q_segments is None and mask.k_valid is None:
        first = start + mask.q_offset
        if k_stop - 1 <= first:  # the last key is visible to the first query: nothing hidden
            return t
        c0 = max(0, first)
        qi = torch.arange(start, stop, device=t.device)[:, None] + mask.q_offset
        t = t if inplace else t.clone()
        t[..., c0:k_stop].masked_fill_(torch.arange(c0, k_stop, device=t.device)[None, :] > qi, float("-inf"))
        return t
    m = _mask_rows(mask, start, stop, k_stop, t.device)
    if m is None:
        return t
    hidden = ~(m[:, :, None] if group_dim else m)
    return t.masked_fill_(hidden, float("-inf")) if inplace else t.masked_fill(hidden, float("-inf"))


def _attend_rows(q: Tensor, k: Tensor, v: Tensor, bias: Bias, mask: AttentionMask, scale: float, gqa: bool,
                 start: int, stop: int) -> Tensor:
    # causal by index: the queries [start, stop) see keys [0, q_offset + stop) only
    k_stop = min(k.shape[-2], mask.q_offset + stop) if mask.causal else k.shape[-2]
    attn_mask = bias.rows(start, stop, k_stop).to(q.dtype)
    attn_mask = _masked(attn_mask, mask, start, stop, k_stop, inplace=_owned_rows(attn_mask, bias, mask, q.shape[0]))
    empty = None
    if mask.k_valid is not None:
        # a query whose keys are all padding: its output is 0 (as eager's), and an all -inf row
        # would give SDPA's backward NaN gradients; open the row, then zero its output
        empty = torch.isneginf(attn_mask).all(-1, keepdim=True)
        attn_mask = attn_mask.masked_fill(empty, 0.0)
    out = F.scaled_dot_product_attention(q[:, :, start:stop], k[:, :, :k_stop], v[:, :, :k_stop],
                                         attn_mask=attn_mask, scale=scale, enable_gqa=gqa)
    return out if empty is None else out.masked_fill(empty, 0.0)


def _owned_rows(rows: Tensor, bias: Bias, mask: AttentionMask, batch: int) -> bool:
    """The rows were computed just now (not a view or one of the bias's own tensors), so the mask
    may be written into them: one block-sized copy less. Only for kinds whose rows are new
    tensors (`Bias.fresh_rows`), and not rows shared by a batch (``[1, ...]``) that a per-batch
    mask (documents, padding) would have to widen."""
    if not bias.fresh_rows or rows.requires_grad or rows._base is not None or torch.compiler.is_compiling():
        return False
    if rows.shape[0] != batch and (mask.q_segments is not None or mask.k_valid is not None):
        return False
    ptr = rows.untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() != ptr for t in bias.grad_inputs() or ())


def _attend_blockwise(q: Tensor, k: Tensor, v: Tensor, bias: Bias, mask: AttentionMask, scale: float,
                      gqa: bool, given: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """SDPA over blocks of query rows, each with its own slice of the bias (`Bias.rows`).

    Exact (softmax is per row). Memory is one block of bias instead of ``H x N x N``; causal
    blocks skip the keys after their last query, which the float-mask kernel cannot know to skip.
    With gradients: our own backward (`_BlockwiseAttention`) when the bias can recompute its rows
    from stand-in inputs (`Bias.recomputable`), else each block checkpointed. ``given``: the q
    and k the caller was given, when ``q``/``k`` are identity stand-ins for them.
    """
    n_q = q.shape[-2]
    inputs = bias.grad_inputs() if torch.is_grad_enabled() else None
    if inputs is not None and bias.recomputable:
        # where each input's gradient goes: into dq / dk when it is q or k itself, else to the
        # distinct other tensors that need one (passed to the Function), or nowhere (None)
        uniq: dict[int, int] = {}
        targets: list[str | int | None] = []
        extra: list[Tensor] = []
        q0, k0 = given if given is not None else (q, k)
        for t in inputs:
            if t is q or t is q0 or t is k or t is k0:
                targets.append("q" if t is q or t is q0 else "k")
            elif isinstance(t, Tensor) and t.requires_grad:
                if id(t) not in uniq:
                    uniq[id(t)] = len(extra)
                    extra.append(t)
                targets.append(uniq[id(t)])
            else:
                targets.append(None)
        if extra or q.requires_grad or k.requires_grad or v.requires_grad:
            return _BlockwiseAttention.apply(q, k, v, (bias, mask, scale, inputs, targets), *extra)
    rows = block_rows(q.shape[1], n_q, k.shape[-2])
    if rows >= n_q:
        return _attend_rows(q, k, v, bias, mask, scale, gqa, 0, n_q)
    return _attend_by_rows(q, k, v, bias, mask, scale, gqa, rows,
                           checkpointed=CHECKPOINT_BLOCKS and torch.is_grad_enabled())


def _attend_by_rows(q: Tensor, k: Tensor, v: Tensor, bias: Bias, mask: AttentionMask, scale: float, gqa: bool,
                    rows: int, checkpointed: bool = False) -> Tensor:
    """`_attend_rows` over consecutive blocks of ``rows`` queries, each recomputed in backward
    when ``checkpointed``."""
    from torch.utils.checkpoint import checkpoint

    n_q = q.shape[-2]

    def block(start: int) -> tuple[int, int, Tensor]:
        args = (q, k, v, bias, mask, scale, gqa, start, min(n_q, start + rows))
        return args[-2:] + (checkpoint(_attend_rows, *args, use_reentrant=False) if checkpointed else _attend_rows(*args),)

    starts = range(0, n_q, rows)
    return _collect_rows(q, v, [block(s) for s in starts] if torch.is_grad_enabled() else map(block, starts))


def _collect_rows(q: Tensor, v: Tensor, blocks: Iterable[tuple[int, int, Tensor]]) -> Tensor:
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


class _BlockwiseAttention(torch.autograd.Function):
    """`_attend_blockwise` for a bias that can recompute its rows from stand-ins for its inputs
    (`Bias.rows_from`), with its own backward: SDPA's kernel forward (block by block, nothing
    saved but q, k, v and the output); backward by blocks of query rows from the softmax
    attention gradient (as `_ToeplitzAttention`). Each block's rows are recomputed from
    detached leaves cut to what the rows read (`Bias.input_windows`) and differentiated to them
    with ``dS``, so a bias input's gradient is built window by window (into dq / dk directly
    when the input is q or k, as CoPE's). Memory: a few blocks, never ``H x N x N``, a
    checkpoint's recomputed SDPA, or a full-size gradient per block."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, spec: tuple, *extra: Tensor) -> Tensor:
        bias, mask, scale, _inputs, _targets = spec
        gqa = k.shape[1] != q.shape[1]
        n_q = q.shape[-2]
        out = _attend_by_rows(q, k, v, bias, mask, scale, gqa, block_rows(q.shape[1], n_q, k.shape[-2]))
        ctx.save_for_backward(q, k, v, out)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor):
        q, k, v, out = ctx.saved_tensors
        dq, dk, dv, g_extra = blockwise_backward(q, k, v, out, d_out, ctx.spec, ctx.needs_input_grad)
        return (dq, dk, dv, None, *g_extra)


def blockwise_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, d_out: Tensor, spec: tuple,
                       needs_input_grad: tuple[bool, ...]) -> tuple[Tensor, Tensor, Tensor, list[Tensor | None]]:
    """`_BlockwiseAttention`'s backward: ``dq, dk, dv`` and the gradients of its extra inputs
    (``needs_input_grad`` as its Function's: q, k, v, spec, *extra)."""
    bias, mask, scale, inputs, targets = spec
    need_extra = needs_input_grad[4:]
    live = [tg if (tg == "q" and needs_input_grad[0]) or (tg == "k" and needs_input_grad[1])
            or (isinstance(tg, int) and need_extra[tg]) else None for tg in targets]
    b, h, n_q, _ = q.shape
    n_k = k.shape[-2]
    wt = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=wt, device=q.device)
    dk = torch.zeros(k.shape, dtype=wt, device=k.device)
    g_extra: list[Tensor | None] = [None] * len(need_extra)
    block: dict[str, object] = {}

    def add_bias(start: int, stop: int, k_stop: int, s: Tensor) -> None:
        views, idx = [], []
        for i, (t, w, tg) in enumerate(zip(inputs, bias.input_windows(start, stop, k_stop), live)):
            views.append(t.detach() if w is None else t.detach()[w])
            if tg is not None:
                idx.append(i)

        def rows_of(*diff: Tensor) -> Tensor:  # the rows as a function of the inputs that need a gradient
            vs = list(views)
            for i, d in zip(idx, diff):
                vs[i] = d
            return bias.rows_from(start, stop, k_stop, vs)  # [B|1, H, r, K]

        rows_, vjp = block_vjp(rows_of, *[views[i] for i in idx]) if idx else (rows_of(), None)
        block["rows"], block["vjp"], block["idx"] = rows_, vjp, idx
        s.add_(rows_.detach().to(s.dtype).view(-1, *s.shape[1:]))
        _masked(s, mask, start, stop, k_stop, inplace=True, group_dim=True)

    def to_inputs(start: int, stop: int, k_stop: int, ds: Tensor) -> None:
        rows_, vjp, idx = block.pop("rows"), block.pop("vjp"), block.pop("idx")
        if vjp is None:
            return
        d_rows = ds.reshape(b, h, stop - start, k_stop)
        if rows_.shape[0] == 1 and b > 1:
            d_rows = d_rows.sum(0, keepdim=True)
        windows = bias.input_windows(start, stop, k_stop)
        for i, gi in zip(idx, vjp(d_rows.to(rows_.dtype))):
            tg, w = live[i], windows[i]
            if isinstance(tg, int) and g_extra[tg] is None:
                t = inputs[targets.index(tg)]
                g_extra[tg] = torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, torch.float32), device=t.device)
            acc = dq if tg == "q" else dk if tg == "k" else g_extra[tg]
            (acc if w is None else acc[w]).add_(gi)

    rows = backward_rows(b, h, n_q, n_k)
    if "q" in targets or "k" in targets:  # rows computed from q, k (CoPE): more row-sized state
        rows = max(8, 3 * rows // 4)
    dq, dk, dv = attention_backward_by_blocks(
        q, k, v, out, d_out, scale=scale, causal=mask.causal, q_offset=mask.q_offset, rows=rows,
        add_bias=add_bias, on_ds=to_inputs if any(tg is not None for tg in live) else None, dq=dq, dk=dk,
        empty_rows=mask.k_valid is not None)
    g_all = [None if g is None else g.to(t.dtype) for g, t in
             zip(g_extra, [inputs[targets.index(i)] for i in range(len(need_extra))])]
    return dq, dk, dv, g_all
