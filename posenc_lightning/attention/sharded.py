"""Attention of a rank's query chunks to the keys of the whole sequence (context parallelism).

The keys, values and every per-token state the keys carry (positions, the layer input an encoding
reads, segment ids, padding) are all-gathered over the context-parallel group with autograd. Each of
the rank's two chunks then attends like a KV-cache call at its offset: queries ``[s, s + c)``, keys
``[0, s + c)`` (later keys are causally masked, so they are not gathered into the call), the causal
mask offset by ``s``, positions and context length those of the full sequence. The backends are the
ordinary ones; only what they are called with changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.attention.pipeline import context, run_stages
from posenc_lightning.encodings.base import Encoding
from posenc_lightning.functional.positions import arange_offset, max_position
from posenc_lightning.parallel.group import ContextParallelGroup


def _rows(t: Tensor | None, rows: slice, dim: int) -> Tensor | None:
    return None if t is None else t.narrow(dim, rows.start, rows.stop - rows.start)


def _prefix(t: Tensor | None, end: int, dim: int) -> Tensor | None:
    return None if t is None else t.narrow(dim, 0, end)


def sharded_attend(group: ContextParallelGroup, module: nn.Module, enc: Encoding, backend: Any, scale: float,
                   q: Tensor, k: Tensor, v: Tensor, positions: Tensor, causal: bool = True,
                   hidden: Tensor | None = None, segment_ids: Tensor | None = None,
                   key_padding_mask: Tensor | None = None, positions_start: int | None = None,
                   window: int | None = None, chunk: int | None = None) -> Tensor:
    """This rank's attention output ``[B, H, n_local, D]`` under context parallelism.

    Args:
        group: the context-parallel group.
        module: the attention module (``ctx.module``).
        enc: the encoding; backend: a resolved backend; scale: the logit scale.
        q: ``[B, H, n_local, D]``; k, v: ``[B, Hkv, n_local, D]``, un-rotated, this rank's tokens
            (head chunk then tail chunk, `ShardLayout`).
        positions: the tokens' global positions ``[B, n_local]`` (or ``[B, n_local, k]``).
        causal: must be True (a chunk's keys are the sequence up to its end).
        hidden: the layer input ``[B, n_local, d_model]`` (content-dependent encodings).
        segment_ids: ``[B, n_local]`` packed-document ids; key_padding_mask: ``[B, n_local]`` bool.
        positions_start: the global positions are known to be ``positions_start + arange(N)``.
        window, chunk: the layer's sliding window or chunk (`AttentionMask`), by global index.

    Raises:
        ValueError: a non-causal call (a chunk would need the keys after it).
    """
    if not causal:
        raise ValueError(f"context parallelism shards causal attention only (each chunk attends to the "
                         f"keys before it); {type(module).__name__} asked for causal=False")
    n_local = q.shape[-2]
    layout = group.layout(n_local)
    c = layout.chunk
    k_all, v_all = group.gather(k, 2), group.gather(v, 2)
    pos_all = group.gather(positions, 1)
    hid_all = group.gather(hidden, 1) if hidden is not None and enc.requires_hidden else None
    seg_all = group.gather(segment_ids, 1) if segment_ids is not None else None
    valid_all = group.gather(key_padding_mask, 1) if key_padding_mask is not None else None
    k_start = positions_start if positions_start is not None else (
        arange_offset(pos_all) if pos_all.dim() == 2 else None)
    # dynamic rotary laws read the context length: the full sequence's, as in one process
    seq_len = max_position(pos_all, k_start) if pos_all.dim() == 2 else None
    outs = []
    for j, s in enumerate(layout.starts):
        rows, end = slice(j * c, (j + 1) * c), s + c
        ctx = context(enc, backend, _rows(positions, rows, 1), _prefix(pos_all, end, 1), causal=True,
                      hidden=_rows(hidden, rows, 1), module=module,
                      q_start=None if k_start is None else k_start + s, k_start=k_start,
                      k_hidden=_prefix(hid_all, end, 1), context_len=seq_len)
        mask = AttentionMask(True, s, c, end, _rows(segment_ids, rows, 1), _prefix(seg_all, end, 1),
                             _prefix(valid_all, end, 1), window, chunk)
        outs.append(run_stages(enc, backend, _rows(q, rows, 2), _prefix(k_all, end, 2), _prefix(v_all, end, 2),
                               ctx, mask, scale))
    return torch.cat(outs, dim=2)
