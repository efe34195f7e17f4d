"""T5 relative-position buckets (Raffel et al., 2020, section 2.1; the Mesh TensorFlow code).

Half the buckets (per direction when bidirectional) hold exact distances, the rest grow
logarithmically up to ``max_distance``; farther distances share the last bucket.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["t5_relative_position_bucket"]


def t5_relative_position_bucket(relative_position: Tensor, bidirectional: bool = True,
                                num_buckets: int = 32, max_distance: int = 128) -> Tensor:
    """Bucket of ``relative_position = memory_position - query_position`` (= j - i), as in T5."""
    ret = torch.zeros_like(relative_position, dtype=torch.long)
    n = -relative_position
    if bidirectional:
        num_buckets //= 2
        ret = ret + (n < 0).long() * num_buckets
        n = n.abs()
    else:
        n = n.clamp(min=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    val_if_large = max_exact + (
        torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).long()
    val_if_large = val_if_large.clamp(max=num_buckets - 1)
    return ret + torch.where(is_small, n, val_if_large)
