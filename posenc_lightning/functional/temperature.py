"""Llama 4's attention temperature tuning of its NoPE layers (Meta, Llama 4 model card, 2025;
transformers' ``Llama4TextAttention`` with ``attn_temperature_tuning``): the queries at position
``pos`` are scaled by ``log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1``, so that the
attention of a long context stays sharp. 1 below ``floor_scale - 1``: short contexts are unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["log_temperature"]


def log_temperature(positions: Tensor, floor_scale: float, attn_scale: float) -> Tensor:
    """The query scale ``log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1``, float32.

    Args:
        positions: ``[B, N]`` token positions.
        floor_scale: the positions per step of the scale (Llama 4: 8192).
        attn_scale: the scale's slope per log step (Llama 4: 0.1).

    Returns:
        ``[B, N]`` float32 (float64 for float64 positions).
    """
    dtype = torch.float64 if positions.dtype == torch.float64 else torch.float32
    pos = positions.to(dtype)
    return torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0
