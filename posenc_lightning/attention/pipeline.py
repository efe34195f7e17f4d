"""Stages 2-4 of one attention call, written once.

Every caller that runs an encoding's stages — the mixin (`mixin.PosEncAttentionMixin.attend`), the
context-parallel shards (`sharded.sharded_attend`), the Hugging Face adapter's fused attention and
the visualizer — makes the call's context with `context` and runs the stages with `run_stages`:

    rotate(q, k, ctx)        unless the backend rotates in-kernel (``ctx.rotary``) or it ran already
    bias(q, k, ctx)          a `Bias` description, plus any bias of the caller's own (a model's window)
    normalize(ctx)           a `Normalizer` description, or softmax
    backend.attend(...)      or the caller's own attention (the visualizer's weights, softcapping)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch import Tensor, nn

from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.attention.recompute import RotationRecompute
from posenc_lightning.encodings.base import AttentionContext, Bias, Encoding

__all__ = ["context", "fused_rotary", "run_stages"]


def fused_rotary(enc: Encoding, backend: ModuleType | None) -> Encoding | None:
    """The rotary encoding ``backend`` applies in-kernel (``FUSES_ROTARY``), or None: rotate before."""
    return enc.fused_rotary if backend is not None and backend.FUSES_ROTARY and "rotate" in enc.stages else None


def context(enc: Encoding, backend: ModuleType | None, q_pos: Tensor, k_pos: Tensor, *, causal: bool = True,
            hidden: Tensor | None = None, cache: Any = None, module: nn.Module | None = None,
            q_start: int | None = None, k_start: int | None = None, k_hidden: Tensor | None = None,
            context_len: int | None = None) -> AttentionContext:
    """The complete context of one call: the rotary encoding is set when ``backend`` rotates q and k
    in-kernel (``FUSES_ROTARY``; q and k then reach it un-rotated).

    Args:
        enc: the encoding; backend: the resolved backend module (None: the stages run un-fused).
        q_pos, k_pos, causal, hidden, cache, module, q_start, k_start, k_hidden, context_len: the
            `AttentionContext` fields.

    Returns:
        The context, with nothing left to set.
    """
    return AttentionContext(q_pos, k_pos, causal, hidden, cache, module, rotary=fused_rotary(enc, backend), q_start=q_start,
                            k_start=k_start, k_hidden=k_hidden, context_len=context_len)


def run_stages(enc: Encoding, backend: ModuleType, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext,
               mask: AttentionMask, scale: float, *, rotated: bool = False, recompute: bool = False,
               extra_bias: Bias | None = None, attend: Callable[..., Tensor] | None = None) -> Tensor:
    """The encoding's stages 2-4 and the attention.

    Args:
        enc: the encoding; backend: the resolved backend module.
        q: ``[B, H, Nq, D]``; k, v: ``[B, Hkv, Nk, D]``.
        ctx: the call's context (`context`); mask: the attention mask; scale: the logit scale.
        rotated: q and k are rotated already (a KV cache holding rotated keys).
        recompute: backward may rotate q and k again instead of keeping them
            (`Encoding.cheap_rotation`; eagerly only: a compiled graph decides what it keeps).
        extra_bias: a bias of the caller's own, added before the encoding's (a model's sliding window).
        attend: the attention to run instead of ``backend.attend`` (same keyword arguments).

    Returns:
        The attention output.
    """
    stages = enc.stages
    hooks: Any = contextlib.nullcontext()
    if not rotated and "rotate" in stages and ctx.rotary is None:
        raw = (q, k)
        q, k = enc.rotate(q, k, ctx)
        if recompute and enc.cheap_rotation and not ctx.mode.compiling:  # (saved-tensor hooks do not trace)
            hooks = RotationRecompute(enc, raw, (q, k), ctx).hooks()
    bias = enc.bias(q, k, ctx) if "bias" in stages else None
    if extra_bias is not None:
        bias = extra_bias + bias
    normalizer = enc.normalize(ctx) if "normalize" in stages else None
    with hooks:
        return (attend or backend.attend)(q, k, v, bias=bias, mask=mask, scale=scale, normalizer=normalizer,
                                          ctx=ctx)
