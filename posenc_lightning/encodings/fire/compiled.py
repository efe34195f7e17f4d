"""FIRE's rows as one traceable formula (eq. 3), for a compiler to fuse: inside a traced graph, and
compiled by inductor where an opaque operator differentiates rows (`FireBias.compiled_rows_from`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from posenc_lightning.encodings.fire.functions import fire_mlp
from posenc_lightning.functional.fire import fire_normalized_distance


def traced_rows(q_pos: Tensor, k_pos: Tensor, c: Tensor, threshold: Tensor, w1: Tensor, b1: Tensor, w2: Tensor,
                b2: Tensor, eps: float) -> Tensor:
    """FIRE's rows ``[B, H, r, K]`` (`fire_mlp`'s compiled form, one segment lookup per element).

    Args:
        q_pos: ``[B, r]`` query positions.
        k_pos: ``[B, K]`` key positions.
        c: ``[1]``.
        threshold: ``L`` (its absolute value is taken).
        w1: ``[W, 1]``.
        b1: ``[W]``.
        w2: ``[H, W]``.
        b2: ``[H]``.
        eps: added to the normalizer.

    Returns:
        The rows, float32.
    """
    x = fire_normalized_distance(q_pos, k_pos, c, threshold.abs(), eps)
    return fire_mlp(x.flatten(1), w1[:, 0], b1, w2, b2).float().view(x.shape[0], -1, *x.shape[1:])


@functools.cache
def compiled_rows() -> Callable[..., Tensor]:
    """`traced_rows` compiled by inductor (dynamic shapes: every block's own), built on first use:
    differentiated, faster than the eager Function; without gradients, slower (CHANGELOG.md)."""
    return torch.compile(traced_rows, dynamic=True, fullgraph=True)
