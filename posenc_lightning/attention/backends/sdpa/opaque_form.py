"""A bias whose cheapest exact form depends on values, inside a compiled graph (CPU only): one
opaque operator, ``posenc::opaque_sdpa`` (`opaque_op`), runs the eager choice of form there.

A traced graph cannot branch on a value, so it would take the per-pair rows always. A kind that
declares such a form (`Bias.value_dependent`, a `ValueDependentForm`) is handed to the operator as
its tensors and constants instead; the operator rebuilds it by its registered name
(`posenc_lightning.encodings.bias.rebuild_bias`) and, where reading a CPU tensor costs no sync, asks
its form: a function of ``i - j`` here (`ValueDependentForm.distance_shift`)? Then SDPA reads the O(N)
template of `ValueDependentForm.distance_table` through a zero-copy Toeplitz mask; otherwise rows by
blocks, whose backward differentiates each block by `ValueDependentForm.compiled_rows_from`. On GPUs the traced rows stay (a read there would be a device sync).
This module is what the graph holds: the operator call and, where the positions are known
``start + arange``, the template traced in the graph (fused, its gradient traced).
"""

from __future__ import annotations

import torch
from torch import Tensor

from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext, Bias
from posenc_lightning.encodings.bias import ValueDependentForm
from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables

__all__ = ["opaque_attention", "template"]


def opaque_attention(q: Tensor, k: Tensor, v: Tensor, bias: Bias, mask: AttentionMask, scale: float,
                     ctx: AttentionContext, tunables: Tunables = DEFAULT_TUNABLES) -> Tensor | None:
    """``posenc::opaque_sdpa`` for a bias with a value-dependent form, on CPU, under a plain (causal
    or full) mask.

    Args:
        q: ``[B, H, Nq, D]``.
        k: ``[B, Hkv, Nk, D]``.
        v: ``[B, Hkv, Nk, Dv]``.
        bias: the bias (`Bias.value_dependent`).
        mask: the attention mask.
        scale: the logit scale.
        ctx: the positions (``q_start``/``k_start`` known: the template is traced in the graph).
        tunables: the call's block budgets (`Tunables.as_floats` into the operator).

    Returns:
        The attention output ``[B, H, Nq, Dv]``, or None where the operator does not apply (the
        caller's traced path then runs).
    """
    form = bias.value_dependent()
    if (form is None or q.device.type != "cpu" or mask.q_segments is not None or mask.k_valid is not None
            or mask.local):
        return None
    operands = form.operands
    static = ctx.q_start is not None and ctx.k_start is not None and not ctx.q_pos.dtype.is_floating_point
    u = template(form, ctx.q_start - ctx.k_start, mask, q.shape[1], q.device) if static else None
    out, _, _ = torch.ops.posenc.opaque_sdpa(q, k, v, list(operands.tensors), u, operands.kind, list(operands.ints),
                                             list(operands.floats), mask.causal, mask.q_offset, scale,
                                             tunables.as_floats())
    return out


def template(form: ValueDependentForm, shift: int, mask: AttentionMask, n_heads: int, device: torch.device) -> Tensor:
    """The Toeplitz template ``u [H, Nq + Nk - 1]``, ``bias[h, i, j] = u[h, j - i + Nq - 1]``, of a
    bias that is a function of ``i - j`` at positions ``a + arange``, ``c + arange``
    (``shift = a - c``: `ValueDependentForm.distance_shift`), causal ``-inf`` folded in.

    Args:
        form: the bias's form (`ValueDependentForm.distance_table`).
        shift: ``a - c``.
        mask: the attention mask (its sizes and causal offset).
        n_heads: ``H``, the query heads.
        device: where the distances are made.

    Returns:
        ``u``, float32, differentiable in the bias's tensors.
    """
    d = torch.arange(-(mask.n_q - 1), mask.n_k, device=device)  # j - i
    u = form.distance_table(shift - d)  # at position distances i_pos - j_pos = shift - (j - i)
    if mask.causal:
        u = u.masked_fill(d[None, :] > mask.q_offset, float("-inf"))
    return u.expand(n_heads, -1).contiguous()
