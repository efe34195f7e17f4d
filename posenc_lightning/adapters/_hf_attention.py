"""The attention functions the Hugging Face adapter registers with transformers' ``AttentionInterface``.

transformers (>= 5) calls ``fn(module, query, key, value, attention_mask, scaling=, dropout=,
position_ids=, ...)`` with ``query [B, H, Nq, D]`` and ``key, value [B, Hkv, Nk, D]`` after its own
KV-cache update. With the model's own positions neutralized (RoPE's cos = 1, sin = 0; GPT-2's
``wpe`` = 0) q and k arrive un-rotated, so the cache holds un-rotated keys and every stage of the
injected encoding applies here, at the keys' true positions:

- query positions are transformers' ``position_ids`` (left padding included);
- key positions follow from the cache: a forward pre-hook on the attention module records how
  many tokens the layer had seen before this call (``Cache.get_seq_length``), so dynamic,
  sliding-window and static caches all give each key its token's position.

Two functions:

- ``posenc_wrap_<impl>`` (encodings that only rotate, or nothing at all): rotate q and k, then
  call the attention the user had chosen (``sdpa``, ``eager``, ``flex_attention``) with its own mask.
- ``posenc_fused`` (encodings with a bias or a normalizer): a posenc backend (`attention.backends`)
  that fuses the bias block by block; transformers builds no 4-D mask for it (the registered mask
  function hands the 2-D padding mask through), padding becomes segments (pads attend only pads,
  so no query row is empty) and a sliding window a lazy bias.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from posenc_lightning.adapters._hf_scores import softcapped_attend
from posenc_lightning.adapters._hf_sharded import sharded_hf_attention
from posenc_lightning.attention.backends import resolve_backend
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.attention.pipeline import context, run_stages
from posenc_lightning.encodings.base import Bias, DenseBias
from posenc_lightning.functional.mode import Mode
from posenc_lightning.parallel.group import CONTEXT_PARALLEL

FUSED = "posenc_fused"
WRAP_PREFIX = "posenc_wrap_"
LOCAL = "_posenc_local"  # (window, chunk) of a scheduled layer (`_hf_schedule`), set on its attention module


@dataclass
class LayerCall:
    """What the pre-hook saw for one call of an attention module."""

    hidden: Tensor | None
    cache: Any  # transformers Cache or None
    seen: int  # tokens this layer had cached before the call


def record_call(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook (``with_kwargs=True``) on each attention module: layer input and cache length."""
    from transformers.cache_utils import Cache

    hidden = args[0] if args else kwargs.get("hidden_states")
    cache = next((v for v in list(kwargs.values()) + list(args[1:]) if isinstance(v, Cache)), None)
    seen = int(cache.get_seq_length(module.layer_idx)) if cache is not None else 0
    module._posenc_call = LayerCall(hidden, cache, seen)


@dataclass
class Operands:
    """What the attention runs on: keys, values and their positions (``k_pos [B, Nk]``), the query
    positions (``q_pos [B, Nq]``), the tokens seen before this call and the token index of key 0
    (> 0 once a sliding window evicted keys)."""

    key: Tensor
    value: Tensor
    q_pos: Tensor
    k_pos: Tensor
    seen: int
    first: int


def operands(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, position_ids: Tensor | None
             ) -> Operands:
    """The one place where the keys, values and key positions every posenc attention path uses are
    formed (a context-parallel gather of them belongs here)."""
    call: LayerCall = module._posenc_call
    b, _, n_q, _ = query.shape
    n_k = key.shape[-2]
    if position_ids is None:
        q_pos = torch.arange(call.seen, call.seen + n_q, device=query.device).expand(b, n_q)
    else:
        q_pos = position_ids.to(query.device).expand(b, n_q)
    total = call.seen + n_q
    first = max(total - n_k, 0)
    if call.seen == 0 and n_k == n_q:
        return Operands(key, value, q_pos, q_pos, 0, 0)
    tok = torch.arange(first, first + n_k, device=query.device)
    k_pos = (q_pos[:, -1:] - (total - 1 - tok)).clamp_min(0)  # masked keys (pads, empty slots) only clamp
    return Operands(key, value, q_pos, k_pos, call.seen, first)


def _encoding(module: nn.Module) -> Any:
    enc = getattr(module, "posenc", None)
    if enc is None:
        raise ValueError(f"{type(module).__name__}: the config names a posenc attention implementation but no "
                         f"encoding is injected here (a model built from an injected model's config?): call "
                         f"posenc_lightning.inject(model, ...) on it, or model.set_attn_implementation('sdpa')")
    return enc


@dataclass
class CacheState:
    """An encoding's per-token state beside one layer's cached keys (``ctx.cache.extra``)."""

    extra: dict[str, Any] = field(default_factory=dict)


def _cache_state(module: nn.Module) -> CacheState | None:
    """Per-layer state an encoding keeps beside the keys (FoX's cumulative gates), held on the
    transformers cache object so that a new generation starts clean."""
    cache = module._posenc_call.cache
    if cache is None:
        return None
    store = cache.__dict__.setdefault("_posenc_state", {})
    return store.setdefault(module.layer_idx, CacheState())


def _align_state(state: CacheState, name: str, cache_type: str, n_prev: int, keys_are_tokens: bool) -> None:
    """Keep the per-token state of the cached keys only: a sliding window evicted the oldest keys
    (cumulative quantities stay valid: only differences are read). A static cache's key buffer is
    longer than the tokens seen, which per-token state cannot follow."""
    if not keys_are_tokens:
        raise ValueError(f"{name} keeps per-token state beside the cached keys and needs a dynamic cache "
                         f"(DynamicCache, sliding windows included); got {cache_type}, whose keys are a "
                         f"fixed-size buffer: generate(..., cache_implementation='dynamic')")
    for key, value in list(state.extra.items()):
        if isinstance(value, Tensor) and value.shape[-1] > n_prev:
            state.extra[key] = value[..., value.shape[-1] - n_prev:]


def _original_function(module: nn.Module, impl: str) -> Callable[..., Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if impl == "eager":  # each model file has its own eager function
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is not None:
            return fn
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    return ALL_ATTENTION_FUNCTIONS[impl]


def wrap_function(impl: str) -> Callable[..., Any]:
    """``posenc_wrap_<impl>``: the encoding's rotation, then the user's attention ``impl``."""

    def posenc_wrap(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                    **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        enc = _encoding(module)
        if "rotate" in enc.stages:
            op = operands(module, query, key, value, kwargs.get("position_ids"))
            key, value = op.key, op.value
            query, key = enc.rotate(query, key, context(enc, None, op.q_pos, op.k_pos, module=module))
            query, key = query.to(value.dtype), key.to(value.dtype)
        return _original_function(module, impl)(module, query, key, value, attention_mask, **kwargs)

    posenc_wrap.__name__ = f"{WRAP_PREFIX}{impl}"
    return posenc_wrap


def pass_padding_mask(*, attention_mask: Tensor | None = None, **_: Any) -> Tensor | None:
    """The mask function of ``posenc_fused``: no ``[B, 1, Nq, Nk]`` mask, only the 2-D padding mask
    (bool ``[B, tokens so far]``), or None when nothing is padded."""
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask
    return None if bool(attention_mask.all()) else attention_mask


def _segments(padding: Tensor | None, q_pos: Tensor, seen: int, first: int, n_q: int, n_k: int
              ) -> tuple[Tensor | None, Tensor | None]:
    """Query and key segment ids: padding (pads attend only pads), or packed documents (positions
    restarting, when nothing is cached and nothing padded, as transformers detects them)."""
    if padding is not None:
        if padding.dim() != 2:
            raise ValueError(f"attention_mask: posenc's fused attention takes a 2-D padding mask [B, N], "
                             f"got shape {tuple(padding.shape)}")
        pad = padding.to(torch.long)
        tok = torch.arange(first, first + n_k, device=pad.device)
        k_seg = torch.zeros(pad.shape[0], n_k, dtype=torch.long, device=pad.device)
        inside = tok < pad.shape[1]
        k_seg[:, inside] = pad[:, tok[inside]]
        return pad[:, seen:seen + n_q], k_seg
    if seen == 0 and n_q == n_k and n_q > 1:
        restart = (q_pos[:, 1:] - q_pos[:, :-1]) != 1
        # a compiled graph cannot branch on the values: it keeps the segment ids (all 0 when nothing
        # is packed: the same attention), as transformers' own packed-sequence mask does when traced
        if Mode.tracing() or bool(restart.any()):
            seg = torch.nn.functional.pad(restart.long().cumsum(-1), (1, 0))
            return seg, seg
    return None, None


def _window_bias(window: int | None, seen: int, first: int, n_q: int, n_k: int, device: torch.device,
                 chunk: int | None = None, shift: Tensor | None = None) -> Bias:
    """``-inf`` where key token ``<=`` query token ``- window`` (Mistral's sliding window), or where
    the key token's ``chunk`` is not the query token's (Llama 4's chunks, counted from each row's first
    token after its ``shift [B]`` left pads, as transformers counts them), lazily by rows."""

    def rows(start: int, stop: int, k_stop: int) -> Tensor:
        qt = torch.arange(seen + start, seen + stop, device=device)[None, :, None]
        kt = torch.arange(first, first + k_stop, device=device)[None, None, :]
        out = torch.zeros(1 if shift is None else shift.shape[0], stop - start, k_stop, device=device)
        if chunk is not None:
            s = 0 if shift is None else shift.to(device)[:, None, None]
            out = out.masked_fill((qt - s) // chunk != (kt - s) // chunk, float("-inf"))
        if window is None:
            return out[:, None]
        return out.masked_fill(qt - kt >= window, float("-inf"))[:, None]

    return DenseBias.lazy(rows, n_q, n_k, inputs=(), window=lambda s, e, k: ())


def _check_sharded_scores(module: nn.Module, kwargs: dict[str, Any], n: int) -> None:
    """Refuse the score transforms the sharded path does not apply (softcapping, a window shorter
    than the ``n``-token sequence) rather than attend without them."""
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    missing = ["attention logit softcapping"] if kwargs.get("softcap") is not None else []
    if window is not None and n > int(window):
        missing.append(f"a sliding window of {int(window)} tokens (the sequence has {n})")
    if missing:
        raise ValueError(f"{type(module).__name__}: ContextParallel does not apply {' or '.join(missing)} yet; "
                         f"train this model without ContextParallel, or on sequences no longer than its window")


def fused_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any
                    ) -> tuple[Tensor, Tensor | None]:
    """``posenc_fused``: every stage of the encoding and a posenc backend."""
    enc = _encoding(module)
    call: LayerCall = module._posenc_call
    if dropout and module.training and not getattr(module, "_posenc_warned_dropout", False):
        warnings.warn(f"{type(module).__name__}: attention dropout ({dropout}) is not applied by posenc's "
                      f"fused attention (encoding {enc.name!r})", stacklevel=2)
        module._posenc_warned_dropout = True
    op = operands(module, query, key, value, kwargs.get("position_ids"))
    key, value, q_pos, k_pos, seen, first = op.key, op.value, op.q_pos, op.k_pos, op.seen, op.first
    n_q, n_k, d = query.shape[-2], key.shape[-2], query.shape[-1]
    group = getattr(module, CONTEXT_PARALLEL, None) if call.cache is None else None
    if group is not None:  # this rank's shard of the sequence (`posenc_lightning.parallel`)
        _check_sharded_scores(module, kwargs, n_q * group.size)
        return sharded_hf_attention(group, module, enc, query, key, value, attention_mask, q_pos, call.hidden,
                                    scaling), None
    state = _cache_state(module) if enc.keeps_cache_state else None  # the others keep nothing there
    if state is not None:
        _align_state(state, enc.name, type(call.cache).__name__, n_k - n_q, seen + n_q - first == n_k)
    causal = bool(getattr(module, "is_causal", True))
    requires_grad = torch.is_grad_enabled() and (query.requires_grad or any(p.requires_grad for p in enc.parameters()))
    # q and k are rotated before the backend (no in-kernel rotation: the adapter's recorded GPU runs)
    ctx = context(enc, None, q_pos, k_pos, causal=causal, hidden=call.hidden, cache=state, module=module)
    q_seg, k_seg = _segments(attention_mask, q_pos, seen, first, n_q, n_k)
    local = module.__dict__.get(LOCAL)
    if local is not None:  # a schedule's window and chunk (`_hf_schedule`), in place of the model's own
        window, chunk = local
        # the mask counts chunks by index; keys evicted off a chunk boundary, or left padding (chunks
        # start at a row's first token), shift that: by tokens then
        shift = None if attention_mask is None else (attention_mask.long().cumsum(-1) == 0).sum(-1)
        extra = (_window_bias(None, seen, first, n_q, n_k, query.device, chunk=chunk, shift=shift)
                 if chunk is not None and (first % chunk or shift is not None) else None)
        mask = AttentionMask(causal, seen - first, n_q, n_k, q_seg, k_seg, window=window,
                             chunk=None if extra is not None else chunk)
    else:
        # the call's own window (None on a model's full-attention layers) over the module's attribute
        window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
        extra = (_window_bias(int(window), seen, first, n_q, n_k, query.device)
                 if window is not None and seen + n_q - first > int(window) else None)
        mask = AttentionMask(causal, seen - first, n_q, n_k, q_seg, k_seg)
    backend = resolve_backend(getattr(module, "posenc_backend", "auto"), enc, query.device, requires_grad,
                              mask.local)
    scale = (scaling if scaling is not None else d ** -0.5) * enc.softmax_scale(d) * d ** 0.5
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    # the model's score transforms (softcapping, gpt-oss's sinks): only the dense reference applies them
    attend = None if softcap is None and sinks is None else functools.partial(
        softcapped_attend, softcap=None if softcap is None else float(softcap), sinks=sinks)
    out = run_stages(enc, backend, query, key, value, ctx, mask, scale, extra_bias=extra, attend=attend)
    return out.transpose(1, 2).contiguous().to(value.dtype), None


def register(impl: str) -> str:
    """Register ``posenc_fused`` (``impl == FUSED``) or ``posenc_wrap_<impl>`` with transformers'
    attention and mask interfaces; returns the name for ``set_attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if impl == FUSED:
        AttentionInterface.register(FUSED, fused_attention)
        AttentionMaskInterface.register(FUSED, pass_padding_mask)
        return FUSED
    name = WRAP_PREFIX + impl
    AttentionInterface.register(name, wrap_function(impl))
    mask_key = impl if impl in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping else "sdpa"
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[mask_key])
    return name


# registered on import: a model unpickled in another process (ddp_spawn, a DataLoader worker) or
# rebuilt from a checkpoint finds its attention function without a new inject()
for _impl in (FUSED, "sdpa", "eager", "flex_attention"):
    register(_impl)
