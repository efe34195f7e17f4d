"""Sinusoidal position table (Vaswani et al., 2017, section 3.5).

``PE(pos, 2i) = sin(pos / 10000^(2i/d))``, ``PE(pos, 2i+1) = cos(pos / 10000^(2i/d))``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sinusoidal_table"]


def sinusoidal_table(positions: Tensor, d_model: int, base: float = 10000.0) -> Tensor:
    """``[..., N] -> [..., N, d_model]`` float32, sin on even channels and cos on odd ones."""
    half = torch.arange(0, d_model, 2, device=positions.device, dtype=torch.float64)
    div = base ** (half / d_model)
    ang = positions.to(torch.float64)[..., None] / div
    pe = torch.zeros(*positions.shape, d_model, dtype=torch.float64, device=positions.device)
    pe[..., 0::2] = torch.sin(ang)
    pe[..., 1::2] = torch.cos(ang[..., : d_model // 2])
    return pe.to(torch.float32)
