"""The Hugging Face adapter's attention under context parallelism (`posenc_lightning.parallel`).

transformers hands ``posenc_fused`` this rank's shard of the queries, keys and values with the
tokens' global ``position_ids``; the shard's attention to the whole sequence is
`attention.sharded.sharded_attend`, with padding and packed documents as segment ids as in
``posenc_fused`` (pads attend only pads; positions restarting start a document).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from posenc_lightning.attention.backends import resolve_backend
from posenc_lightning.attention.sharded import sharded_attend
from posenc_lightning.functional.mode import Mode
from posenc_lightning.parallel.group import ContextParallelGroup


def _document_ids(group: ContextParallelGroup, q_pos: Tensor) -> Tensor | None:
    """Packed documents of the whole sequence (a position that does not follow its predecessor
    starts one), as this rank's segment ids; None when nothing is packed."""
    pos_all = group.gather(q_pos, 1)
    restart = (pos_all[:, 1:] - pos_all[:, :-1]) != 1
    if not Mode.tracing() and not bool(restart.any()):
        return None
    seg_all = torch.nn.functional.pad(restart.long().cumsum(-1), (1, 0))
    return group.layout(q_pos.shape[1]).shard(seg_all, 1)


def sharded_hf_attention(group: ContextParallelGroup, module: nn.Module, enc: Any, query: Tensor, key: Tensor,
                         value: Tensor, padding: Tensor | None, q_pos: Tensor, hidden: Tensor | None,
                         scaling: float | None) -> Tensor:
    """``[B, n_local, H, D]``: this rank's attention output, as ``posenc_fused`` returns it.

    Args:
        group: the context-parallel group.
        module: the transformers attention module; enc: its encoding.
        query: ``[B, H, n_local, D]``; key, value: ``[B, Hkv, n_local, D]`` (un-rotated).
        padding: the 2-D padding mask of the shard (``posenc_fused``'s mask function), or None.
        q_pos: the shard's global positions ``[B, n_local]``.
        hidden: the layer input ``[B, n_local, d_model]``; scaling: transformers' logit scale.
    """
    if padding is not None and padding.dim() != 2:
        raise ValueError(f"attention_mask: context parallelism takes a 2-D padding mask [B, N], got shape "
                         f"{tuple(padding.shape)}")
    d = query.shape[-1]
    segments = padding.long() if padding is not None else _document_ids(group, q_pos)
    requires_grad = torch.is_grad_enabled() and (query.requires_grad or any(p.requires_grad for p in enc.parameters()))
    backend = resolve_backend(getattr(module, "posenc_backend", "auto"), enc, query.device, requires_grad)
    scale = (scaling if scaling is not None else d ** -0.5) * enc.softmax_scale(d) * d ** 0.5
    out = sharded_attend(group, module, enc, backend, scale, query, key, value, q_pos,
                         bool(getattr(module, "is_causal", True)), hidden, segments)
    return out.transpose(1, 2).to(value.dtype)
