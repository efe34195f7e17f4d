"""FoX (Lin et al., 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate"), eqs. 5-7.

``f_t = sigmoid(w^T x_t + b)`` per head; ``D_ij = sum_{l=j+1}^{i} log f_l = c_i - c_j`` with the
cumulative log-gates ``c_t = sum_{l<=t} log f_l``; ``O = softmax(Q K^T + D) V``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def fox_log_forget(gate_logits: Tensor) -> Tensor:
    """``log f_t = log sigmoid(gate_logits)`` computed stably (never ``log(0)``), in float32 for
    half-precision logits (the cumulative sums need it), float64 for float64 ones."""
    return F.logsigmoid(gate_logits.to(torch.promote_types(gate_logits.dtype, torch.float32)))


def fox_cumulative(log_f: Tensor, start: Tensor | None = None) -> Tensor:
    """``c_t = start + sum_{l<=t} log f_l`` along the last dim (``start``: ``[...]`` or None)."""
    c = log_f.cumsum(-1)
    return c if start is None else c + start[..., None]


def fox_dense_bias(log_f: Tensor) -> Tensor:
    """``D_ij = c_i - c_j`` as a dense ``[..., N, N]`` tensor (reference/visualization only)."""
    c = log_f.cumsum(-1)
    return c[..., :, None] - c[..., None, :]
