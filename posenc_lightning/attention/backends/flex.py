"""``torch.nn.attention.flex_attention``: rotary is applied before; every bias kind gives its
term of one ``score_mod`` (`Bias.score_term`; positions looked up per (b, q_idx, kv_idx), so
KV-cache offsets and packed documents need no special case); causality, packed documents (segment ids) and padding
become a ``mask_mod`` and a block mask, so fully masked blocks are skipped. A normalizer that
declares the "score_mod" form (`Normalizer.fused_in`: a softmax walk whose modulation is a
`Normalizer.kernel_modulation`) multiplies the ``score_mod``'s logit, bias included, by its
modulation at the tokens' positions.

Compiled on GPU. On CPU flex runs eagerly (the unfused reference path) and has no backward:
`supports` refuses a CPU call that needs gradients, so ``auto`` never picks flex for CPU training.
Where it compiles, it refuses an encoding that may return a kind with no ``score_mod`` of its own
(``fused_in`` without "score_mod": lazy rows that read q and k), which it would materialize.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from posenc_lightning.attention.backends import unfused_bias
from posenc_lightning.attention.mask import LOCAL_KINDS, AttentionMask
from posenc_lightning.encodings.base import AttentionContext, Bias, Encoding, Normalizer, Walk

NAME = "flex"
#: rotates q, k in-kernel with ``ctx.rotary`` (the mixin then skips ``encoding.rotate``)
FUSES_ROTARY = False
#: the local masks it honors (`attention.mask.LOCAL_KINDS`): a sliding window, a chunk
LOCAL_MASKS = LOCAL_KINDS
#: the fused form it computes a bias kind in (`Bias.fused_in`)
FUSED_BIAS = "score_mod"
#: the fused form it runs a normalizer in (`Normalizer.fused_in`): a softmax with a modulation
FUSED_NORMALIZER = "score_mod"
#: the smallest head_dim inductor's flex attention kernels take on a GPU (tl.dot needs 16)
MIN_COMPILED_HEAD_DIM = 16


def _flex_module():
    from torch.nn.attention import flex_attention as fa

    return fa


def _small_head_dim(head_dim: int) -> str:
    return (f"compiled flex attention needs head_dim >= {MIN_COMPILED_HEAD_DIM} (inductor's tl.dot), got head_dim "
            f"{head_dim}; use backend='sdpa'")


def supports(encoding: Encoding, device: torch.device, requires_grad: bool) -> str | None:
    try:
        _flex_module()
    except ImportError as e:  # pragma: no cover - torch < 2.5
        return f"torch.nn.attention.flex_attention is unavailable ({e})"
    kind = encoding.normalizer_kind
    if "normalize" in encoding.stages and (kind is None or FUSED_NORMALIZER not in kind.fused_in
                                           or kind.walk is not Walk.SOFTMAX):
        return f"{encoding.name} replaces softmax (stage 4), which flex attention cannot do"
    if device.type == "cpu" and requires_grad:
        return "flex attention has no backward on CPU (it runs eagerly, forward only); use 'sdpa' or 'eager' to train"
    if device.type not in ("cpu", "cuda", "xpu"):
        return f"flex attention does not run on {device.type}"
    if device.type != "cpu":  # on CPU flex is the eager reference path: every score is computed anyway
        if encoding.head_dim is not None and encoding.head_dim < MIN_COMPILED_HEAD_DIM:
            return _small_head_dim(encoding.head_dim)
        no_backward = [k.__name__ for k in encoding.bias_kinds if not k.score_mod_backward]
        why = unfused_bias(encoding, FUSED_BIAS, "flex attention")
        if why is None and requires_grad and no_backward:
            why = (f"compiled flex attention has no backward for {', '.join(no_backward)}'s score_mod; "
                   f"use backend='triton' or 'sdpa' to train")
        return why
    return None


# ------------------------------------------------------------------------------- score_mod
def _bias_tensors(bias: Bias | None) -> list[Tensor]:
    """The tensors a bias is computed from (a CPU call refuses them when they need a gradient)."""
    out: list[Tensor] = []
    for t in bias.terms if bias is not None else []:
        out += [*(t.grad_inputs() or ()), *(x for x in vars(t).values() if isinstance(x, Tensor))]
    return out


def score_mod_for(bias: Bias | None, b_size: int, n_heads: int, modulation: Callable | None = None
                  ) -> Callable | None:
    """One ``score_mod(score, b, h, q_idx, kv_idx)`` adding every term of ``bias``, the sum then
    times ``modulation(b, q_idx, kv_idx)`` (a normalizer's, `modulation_for`) where given."""
    if bias is None and modulation is None:
        return None
    terms = [t.score_term(b_size, n_heads) for t in bias.terms] if bias is not None else []  # each kind its own

    def score_mod(score: Tensor, b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        out = score.to(torch.float32)
        for f in terms:
            out = out + f(b, h, qi, ki)
        if modulation is not None:
            out = out * modulation(b, qi, ki)
        return out.to(score.dtype)

    return score_mod


def modulation_for(normalizer: Normalizer, ctx: AttentionContext | None, b_size: int) -> Callable:
    """``mod(b, q_idx, kv_idx)``: a softmax normalizer's `Normalizer.kernel_modulation`,
    ``floor + (1 - floor) exp(-decay |q_pos - k_pos|)``, at the context's ``[B, N]`` positions."""
    form = normalizer.kernel_modulation() if normalizer.walk is Walk.SOFTMAX else None
    if FUSED_NORMALIZER not in normalizer.fused_in or form is None:
        raise ValueError(f"the flex backend cannot run {normalizer.name}'s normalizer; use backend='blockwise' or "
                         "'eager'")
    if ctx is None or ctx.q_pos.dim() != 2 or ctx.k_pos.dim() != 2:
        raise ValueError(f"{normalizer.name}: flex's modulation reads [B, N] positions from the context")
    qp = ctx.q_pos.to(torch.float32).expand(b_size, -1)
    kp = ctx.k_pos.to(torch.float32).expand(b_size, -1)
    decay, floor = float(form.decay), float(form.floor)

    def mod(b: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        return floor + (1.0 - floor) * torch.exp(-decay * (qp[b, qi] - kp[b, ki]).abs())

    return mod


# ------------------------------------------------------------------------------- masks
def mask_mod_for(mask: AttentionMask) -> tuple[Callable | None, bool]:
    """``(mask_mod, depends_on_batch)`` for an `AttentionMask` (None when all is allowed)."""
    if mask.is_trivial:
        return None, False
    fa = _flex_module()
    mods = []
    per_batch = False
    if mask.causal:
        off = mask.q_offset
        mods.append(lambda b, h, qi, ki: ki <= qi + off)
        if mask.window is not None:
            w = mask.window
            mods.append(lambda b, h, qi, ki: qi + off - ki < w)
        if mask.chunk is not None:
            c = mask.chunk
            mods.append(lambda b, h, qi, ki: (qi + off) // c == ki // c)
    if mask.q_segments is not None:
        qs = mask.q_segments
        ks = mask.k_segments if mask.k_segments is not None else mask.q_segments
        mods.append(lambda b, h, qi, ki: qs[b, qi] == ks[b, ki])
        per_batch = True
    if mask.k_valid is not None:
        kv = mask.k_valid
        mods.append(lambda b, h, qi, ki: kv[b, ki])
        per_batch = True
    return (mods[0] if len(mods) == 1 else fa.and_masks(*mods)), per_batch


def block_mask_for(mask: AttentionMask, batch: int, device: torch.device):
    mod, per_batch = mask_mod_for(mask)
    if mod is None:
        return None
    fa = _flex_module()
    return fa.create_block_mask(mod, batch if per_batch else None, None, mask.n_q, mask.n_k, device=device)


@functools.cache
def _compiled_flex():
    return torch.compile(_flex_module().flex_attention, dynamic=None)


def attend(q: Tensor, k: Tensor, v: Tensor, *, bias: Bias | None, mask: AttentionMask, scale: float,
           normalizer: Normalizer | None = None, ctx: AttentionContext | None = None) -> Tensor:
    if q.device.type != "cpu" and q.shape[-1] < MIN_COMPILED_HEAD_DIM:
        # `supports` sees the encoding's head_dim; an embedding-only encoding binds none
        raise ValueError(_small_head_dim(q.shape[-1]))
    if q.device.type == "cpu":
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *_bias_tensors(bias))):
            raise ValueError("flex attention has no backward on CPU; use backend='sdpa' or 'eager' to train, "
                             "or run under torch.no_grad()")
        q, k, v = q.detach(), k.detach(), v.detach()  # flex refuses CPU inputs that require grad
    fa = _flex_module()
    b, h = q.shape[0], q.shape[1]
    modulation = modulation_for(normalizer, ctx, b) if normalizer is not None else None
    score_mod = score_mod_for(bias, b, h, modulation)
    block_mask = block_mask_for(mask, b, q.device)
    gqa = k.shape[1] != h
    dtype = q.dtype
    k, v = k.to(dtype), v.to(dtype)
    if q.device.type == "cpu":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return fa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                     enable_gqa=gqa)
    return _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa)
