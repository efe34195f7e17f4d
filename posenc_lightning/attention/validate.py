"""Input checks at the `attend` / `embed_positions` boundary.

Each bad argument raises a ValueError naming the argument, the shape (or dtype) expected and the
one given, instead of a broadcast error deep inside an encoding or a backend. Shapes, dtypes
and devices only: nothing here reads a device value (no host sync, compile-clean).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _fail(arg: str, expected: str, got: Tensor, fix: str = "") -> None:
    raise ValueError(f"{arg}: expected {expected}, got shape {tuple(got.shape)} dtype {got.dtype}"
                     + (f"; {fix}" if fix else ""))


def _is_index(t: Tensor) -> bool:
    return not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool


def check_positions(positions: Tensor | None, batch: int, n: int, device: torch.device,
                    arg: str = "positions") -> None:
    """``positions``: ``[N]``, ``[B or 1, N]`` or ``[B or 1, N, k]``, integer or float, on ``device``."""
    if positions is None:
        return
    if not isinstance(positions, Tensor):
        raise TypeError(f"{arg}: expected a tensor [B, N] of positions, got {type(positions).__name__}")
    if positions.dtype == torch.bool or positions.dtype.is_complex:
        _fail(arg, "an integer or floating dtype", positions)
    if positions.dim() not in (1, 2, 3):
        _fail(arg, f"[B, N] = [{batch}, {n}] (or [B, N, k] for an N-d encoding)", positions)
    length = positions.shape[0] if positions.dim() == 1 else positions.shape[1]
    if length != n:
        _fail(arg, f"{n} positions along dim {0 if positions.dim() == 1 else 1} (one per token), "
                   f"i.e. shape [{batch}, {n}]", positions)
    if positions.dim() >= 2 and positions.shape[0] not in (1, batch):
        _fail(arg, f"batch size {batch} (or 1) along dim 0, i.e. shape [{batch}, {n}]", positions)
    if positions.device != device:
        raise ValueError(f"{arg}: expected a tensor on {device} (where the tokens are), got one on "
                         f"{positions.device}")


def check_attend(enc: Any, q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None, hidden: Tensor | None,
                 cache: Any, segment_ids: Tensor | None, key_padding_mask: Tensor | None) -> None:
    """Every argument of `PosEncAttentionMixin.attend` against q's ``[B, H, Nq, D]``."""
    if q.dim() != 4:
        _fail("q", "[B, H, Nq, D]", q)
    b, _, n, d = q.shape
    for arg, t in (("k", k), ("v", v)):
        if t.dim() != 4 or t.shape[0] != b:
            _fail(arg, f"[B, Hkv, Nk, D] with B = {b}", t)
    if k.shape[:3] != v.shape[:3] or k.shape[-1] != d:
        raise ValueError(f"k, v: expected [B, Hkv, Nk, D] with the same B, Hkv, Nk and k's D = q's D = {d}, "
                         f"got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"k: expected a number of heads dividing q's {q.shape[1]} (grouped-query "
                         f"attention), got shape {tuple(k.shape)}")
    check_positions(positions, b, n, q.device)
    if hidden is not None:  # its width matters to the encodings that read it (fox's gate)
        d_model = getattr(enc, "d_model", None) if enc.requires_hidden else None
        if hidden.dim() != 3 or hidden.shape[:2] != (b, n) or (d_model and hidden.shape[-1] != d_model):
            _fail("hidden", f"the layer input [B, Nq, d_model] = [{b}, {n}, {d_model or 'd_model'}]", hidden)
    if segment_ids is not None and (segment_ids.shape != (b, n) or not _is_index(segment_ids)):
        _fail("segment_ids", f"integer document ids of shape [B, Nq] = [{b}, {n}]", segment_ids)
    if key_padding_mask is not None:
        n_k = (cache.seen if cache is not None else 0) + k.shape[-2]
        if key_padding_mask.shape != (b, n_k) or key_padding_mask.dtype != torch.bool:
            _fail("key_padding_mask", f"bool [B, Nk] = [{b}, {n_k}] (every key, cached ones included; "
                                      f"False = padding)", key_padding_mask)


def check_embed(h: Tensor, positions: Tensor | None, d_model: int | None) -> None:
    """`PosEncEmbeddingMixin.embed_positions`: ``h`` ``[B, N, d_model]`` and its positions."""
    if h.dim() != 3 or (d_model and h.shape[-1] != d_model):
        _fail("h", f"token embeddings [B, N, d_model] with d_model = {d_model or 'd_model'}", h)
    check_positions(positions, h.shape[0], h.shape[1], h.device)
