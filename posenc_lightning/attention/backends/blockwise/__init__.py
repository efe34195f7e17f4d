"""Blockwise normalizers: the encodings that replace softmax (stage 4), in O(N x block) memory.

Runs the normalizer an encoding's stage 4 describes (`Normalizer` with "tiles" in its ``fused_in``),
never an ``N x N`` tensor, forward and backward (`normalizers`: query blocks x key tiles,
recomputed in backward), by the walk it declares (`Normalizer.walk`):

- `Walk.STICK_BREAKING`: key tiles nearest first, the log-space sum of ``softplus``
  carried across tiles as the Triton kernel does; any bias kind added per tile (`Bias.rows`),
  its inputs' gradients (a learned penalty's slopes) through `Bias.rows_from`.
- `Walk.SOFTMAX`: an online softmax of ``(q k^T s + bias) * mod`` over key tiles, ``mod`` from
  `Normalizer.modulation` at the tile's positions (any positions; none when it gives none).

A backend of its own (not a branch of eager or sdpa): ``auto`` picks it on CPU after sdpa (which
refuses normalizers) and on CUDA after triton and flex (the fallback without triton, and the
distance-modulated softmax's path there), and the conformance suite holds it to the eager reference like the others.
Compile-clean: loops over Python ints from shapes, no host reads of tensor values.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posenc_lightning.attention.backends.blockwise.normalizers import SoftmaxBlocks, StickBreakingBlocks, TilesSpec
from posenc_lightning.attention.backends.blockwise.tiles import Tiling
from posenc_lightning.attention.backends.engine.blocks import rows_within, tile_rows
from posenc_lightning.attention.mask import LOCAL_KINDS, AttentionMask
from posenc_lightning.encodings.base import AttentionContext, Bias, Encoding, KeyOnly, Normalizer, Walk
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.positions import arange_offset
from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables

NAME = "blockwise"
#: rotates q, k in-kernel with ``ctx.rotary`` (the mixin then skips ``encoding.rotate``)
FUSES_ROTARY = False
#: the local masks it honors (`attention.mask.LOCAL_KINDS`): a sliding window, a chunk
LOCAL_MASKS = LOCAL_KINDS
#: the fused form of a normalizer this backend runs (`Normalizer.fused_in`)
FUSED_NORMALIZER = "tiles"


def supports(encoding: Encoding, device: torch.device, requires_grad: bool) -> str | None:
    if "normalize" not in encoding.stages:
        return (f"{encoding.name} keeps softmax; the blockwise backend runs only encodings that replace it "
                f"(use sdpa, flex or triton)")
    kind = encoding.normalizer_kind
    if kind is None or FUSED_NORMALIZER not in kind.fused_in:
        return (f"{encoding.name} replaces softmax with a normalizer the blockwise tiles do not run "
                f"(declare its Encoding.normalizer_kind with 'tiles' in fused_in, or use backend='eager')")
    return None


def block_rows(bias: Bias | None, b: int, h: int, n_k: int, tunables: Tunables = DEFAULT_TUNABLES) -> int:
    """Query rows per block: within the block budget for a tile's intermediates
    (`Tunables.tile_live` of them, at most `Tunables.block_rows`), fewer with a bias computed by
    blocks of rows (not `Bias.distance_only`; at least `Tunables.min_bias_rows`)."""
    t = tunables
    if bias is None or bias.distance_only:
        return rows_within(t.block_rows, 4 * b * h * max(1, min(n_k, t.block_keys)), live=t.tile_live,
                           least=t.min_bias_rows, tunables=t)
    return tile_rows(b, h, n_k, t.block_rows, t.min_bias_rows, tunables=t)


def attend(q: Tensor, k: Tensor, v: Tensor, *, bias: Bias | None, mask: AttentionMask, scale: float,
           normalizer: Normalizer | None = None, ctx: AttentionContext | None = None,
           tunables: Tunables | None = None) -> Tensor:
    if normalizer is None or FUSED_NORMALIZER not in normalizer.fused_in:
        raise ValueError("the blockwise backend runs the normalizers that replace softmax by tiles "
                         "(Normalizer.fused_in 'tiles'); use backend='auto' or 'eager'")
    n_q, n_k = q.shape[-2], k.shape[-2]
    extra = _grad_inputs(bias)
    if extra is None:  # a bias whose rows cannot be recomputed from stand-ins: the reference path
        from posenc_lightning.attention.backends import eager

        return eager.attend(q, k, v, bias=bias, mask=mask, scale=scale, normalizer=normalizer, ctx=ctx)
    mode = Mode.of(q, ctx.mode.tunables if tunables is None and ctx is not None else tunables)
    tunables = mode.tunables
    rows = block_rows(bias, q.shape[0], q.shape[1], n_k, tunables)
    if ctx is not None:
        normalizer.check_causal(ctx.causal)
    if normalizer.walk is Walk.STICK_BREAKING:
        # key j is broken off for query i (at index i + n_k - n_q) iff j < i + n_k - n_q (j = i too
        # when attend_current), within the causal mask
        diag = n_k - n_q - (0 if normalizer.attend_current else 1)
        if mask.causal:
            diag = min(diag, mask.q_offset)
        tiling = Tiling(mask, n_q, n_k, diag, rows, tunables.block_keys, descending=True, split_diagonal=True)
        fold = _channels(bias, mask, ctx, extra, torch.promote_types(q.dtype, torch.float32))
        spec = TilesSpec(tiling, bias, extra, scale, None,
                         *((ctx.q_pos, ctx.k_pos) if ctx is not None else (None, None)),
                         keep_tails=_keeps_tails(q, k, v, extra, tiling), fold=fold,
                         ascending=ctx is not None and ctx.ascending, stop_spent=tunables.stop_spent and mode.host_reads,
                         tunables=tunables)
        return StickBreakingBlocks.apply(q, k, v, spec, *extra)
    if ctx is None:
        raise ValueError(f"{normalizer.name}: the blockwise softmax walk needs the positions (ctx)")
    tiling = Tiling(mask, n_q, n_k, mask.q_offset if mask.causal else None, rows, tunables.block_keys,
                    descending=False)
    modulation = normalizer.modulation if normalizer.modulated else None
    spec = TilesSpec(tiling, bias, extra, scale, modulation, ctx.q_pos, ctx.k_pos,
                     mod_shift=_modulation_shift(normalizer, ctx) if modulation is not None else None,
                     tunables=tunables)
    return SoftmaxBlocks.apply(q, k, v, spec, *extra)


def _channels(bias: Bias | None, mask: AttentionMask, ctx: AttentionContext | None, extra: tuple[Tensor, ...],
              dtype: torch.dtype) -> KeyOnly | None:
    """The bias as two extra q/k channels (`normalizers.FoldedBias`): a `Bias.key_only` form with
    its query term, under a plain causal mask (stick-breaking sees keys before the query only), of
    a bias whose tiles are `Bias.head_scaled` by that form's per-head weight (its gradient is taken
    per tile from the pattern) and that needs no other gradient."""
    if bias is None or not mask.is_plain_causal or ctx is None or not bias.distance_only:
        return None
    hs = bias.head_scaled()
    if hs is None or ctx.q_pos.dim() != 2:
        return None
    form = bias.key_only(dtype, True, ctx.ascending)
    if form is None or form.q_row is None or form.k_ch.dim() != 3 or form.k_ch.shape[1] != 1:
        return None
    if form.q_row.dim() != 3 or form.q_row.shape[1] != 1 or form.q_ch is not hs.w or any(x is not hs.w for x in extra):
        return None
    return form


def _modulation_shift(normalizer: Normalizer, ctx: AttentionContext) -> int | None:
    """``a - c`` when the modulation depends on ``q_pos - k_pos`` only
    (`Normalizer.modulation_distance_only`) and the positions are ``a + arange``, ``c + arange``
    (read only where that is free: `functional.positions.arange_offset`), else None."""
    if not normalizer.modulation_distance_only:
        return None
    a, c = arange_offset(ctx.q_pos, ctx.q_start), arange_offset(ctx.k_pos, ctx.k_start)
    return None if a is None or c is None else a - c


def _keeps_tails(q: Tensor, k: Tensor, v: Tensor, extra: tuple[Tensor, ...], tiling: Tiling) -> bool:
    """Stick-breaking keeps its per-tile carried sums for backward when a gradient will be taken and
    they are no larger than ``q`` (one float per key tile and query row against ``head_dim``)."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *extra))
    return grad and tiling.max_tiles() <= q.shape[-1]


def _grad_inputs(bias: Bias | None) -> tuple[Tensor, ...] | None:
    """The distinct inputs of ``bias`` that need a gradient (passed to the Functions so autograd
    routes theirs), () when none does; None when some may but the bias cannot recompute its rows."""
    if bias is None or not torch.is_grad_enabled():
        return ()
    inputs = bias.grad_inputs()
    if inputs is None or not bias.recomputable:
        return None
    out: list[Tensor] = []
    for t in inputs:
        if isinstance(t, Tensor) and t.requires_grad and all(t is not x for x in out):
            out.append(t)
    return tuple(out)
