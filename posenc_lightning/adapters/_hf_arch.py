"""What the Hugging Face adapter knows about a model's architecture, found at inject.

`describe` reads a built transformers model and returns an `ArchInfo`: its self-attention modules,
its rotary module (probed: the cos/sin it returns must be transformers' RoPE table of its
``inv_freq`` in one of the forms transformers uses (`FORMS`), one per layer type where the rope parameters
are per layer type), its absolute position tables (``wpe``, ``embed_positions``,
``position_embeddings``, CTRL's ``pos_encoding`` buffer) and the score transforms its attention
passes to the attention function (Gemma 2's ``softcap``). Anything position- or score-related it
does not recognise raises `ArchitectureRefused` (a ValueError naming the architecture, what is
missing and the closest supported route): an unknown mechanism is a refusal, never a silent pass.
"""

from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

#: attribute names of position mechanisms (a module, parameter or buffer named so must be known)
POSITION_NAME = re.compile(r"(^|_)(pos|position|positions|positional|rotary|rope|alibi|wpe|sinusoidal)(_|$)", re.IGNORECASE)
#: class names of position mechanisms
POSITION_CLASS = re.compile(r"Rotary|Positional|PositionEmbedding|Alibi|Sinusoid", re.IGNORECASE)
#: keyword arguments of the attention-interface call the adapter handles (score transforms included)
KNOWN_CALL_KWARGS = frozenset({"scaling", "dropout", "sliding_window", "softcap", "position_ids", "is_causal",
                               "output_attentions", "attention_mask", "head_mask"})
#: score transforms the fused path applies (name in the call -> what it is)
SCORE_TRANSFORMS = {"softcap": "attention logit softcapping"}
#: config fields that name a position or score mechanism, and whether the adapter handles them
HANDLED_CONFIG = frozenset({
    "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "rotary_pct", "rotary_emb_base",
    "max_position_embeddings", "n_positions", "attn_logit_softcapping", "final_logit_softcapping",
    "position_embedding_type", "rope_interleave", "use_rope", "rotary_dim", "rope_type",
    "original_max_position_embeddings", "mamba_chunk_size", "ssm_chunk_size", "linear_chunk_size", "chunk_size"})
MECHANISM_CONFIG = re.compile(r"alibi|softcap|no_rope|nope|chunk_size|temperature_tuning|position_bias|"
                              r"relative_attention|sinks|rope|rotary|position_embedding", re.IGNORECASE)


ADAPTED = "_posenc_hf_originals"  # set on a model while an encoding is injected (hf.restore clears it)
RECORD = "_posenc_hf_arch"  # the ArchInfo made at inject


#: model types tried and found to break under the adapter, for a cause not yet isolated to a rule above
NOT_YET_SUPPORTED = {
    "qwen3_5_text": "its rotary application (partial rotary on a hybrid linear/full-attention stack) fails "
                    "with posenc's tables (a shape mismatch in apply_rotary_pos_emb)",
    "qwen3_5_moe_text": "its rotary application (partial rotary on a hybrid linear/full-attention stack) fails "
                        "with posenc's tables (a shape mismatch in apply_rotary_pos_emb)",
}


class ArchitectureRefused(ValueError):
    """The adapter cannot put an encoding into this architecture without a silent wrong result."""


@dataclass
class RotaryInfo:
    """The model-level rotary module: ``form`` of what it returns (`FORMS`), ``dim`` rotated
    channels per head, ``thetas`` the RoPE base per layer type (key None: one table for every layer)."""

    module: nn.Module
    form: str
    dim: int
    thetas: dict[str | None, float | None]

    @property
    def layout(self) -> str:
        """The channel pairing of the rotation (``half``: i with i + R/2; ``interleaved``: 2i with 2i + 1)."""
        return "half" if self.form in ("half", "half_cos_sin") else "interleaved"

    @property
    def per_layer_type(self) -> bool:
        return None not in self.thetas


@dataclass
class ArchInfo:
    """Everything position- or score-related the adapter found in one model (see the module doc)."""

    name: str
    layers: list[nn.Module]
    rotary: RotaryInfo | None
    tables: list[tuple[nn.Module, str]] = field(default_factory=list)  # (owner, attribute) of absolute tables
    buffers: list[tuple[nn.Module, str]] = field(default_factory=list)  # absolute tables held as buffers
    score_transforms: dict[str, str] = field(default_factory=dict)  # call kwarg -> what it is
    fused_unsupported: dict[str, str] = field(default_factory=dict)  # call kwarg -> why the fused path lacks it

    def summary(self) -> str:
        """One line for the architecture table."""
        parts = []
        if self.rotary is not None:
            kinds = "per layer type" if self.rotary.per_layer_type else "one table"
            form = self.rotary.form if self.rotary.form != "sin_cos_pairs" else "interleaved, (sin, cos) pairs"
            parts.append(f"rotary ({form}, {kinds})")
        parts += [f"absolute `{a}` neutralized" for _, a in self.tables + self.buffers]
        parts += [f"{what} kept" for what in self.score_transforms.values()]
        parts += [f"bias/normalizer encodings refused: {why}" for why in self.fused_unsupported.values()]
        return "; ".join(parts) or "no positions of its own"


def rotary_owner(hf: nn.Module) -> nn.Module:
    """The module holding the model-level ``rotary_emb``: ``hf.base_model``, or ``hf.model`` where the
    class's ``base_model_prefix`` names no attribute (Llama 4's text model: ``language_model``)."""
    for owner in (hf.base_model, getattr(hf, "model", None)):
        if isinstance(owner, nn.Module) and isinstance(getattr(owner, "rotary_emb", None), nn.Module):
            return owner
    return hf.base_model


def arch_name(hf: nn.Module) -> str:
    return f"{type(hf).__name__} (model_type {getattr(hf.config, 'model_type', '?')!r})"


def refuse(hf: nn.Module, missing: str, route: str) -> ArchitectureRefused:
    return ArchitectureRefused(f"{arch_name(hf)}: posenc's Hugging Face adapter cannot inject here: {missing}. "
                               f"Closest supported route: {route}")


# ------------------------------------------------------------------------------------------------
# attention modules and what they pass to the attention function
# ------------------------------------------------------------------------------------------------
def attention_modules(hf: nn.Module) -> list[nn.Module]:
    """Self-attention modules: the ones with a ``layer_idx`` and ``Attention`` in their class name."""
    out = []
    for m in hf.modules():
        if getattr(m, "layer_idx", None) is None or "Attention" not in type(m).__name__:
            continue
        if getattr(m, "is_cross_attention", False):
            continue
        out.append(m)
    return out


def _interface_call(cls: type) -> str | None:
    """The text of the ``attention_interface(...)`` call in ``cls.forward``, or None without one."""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None
    start = src.find("attention_interface(")
    if start < 0 or "ALL_ATTENTION_FUNCTIONS" not in inspect.getsource(sys.modules[cls.__module__]):
        return None
    open_at = start + len("attention_interface")
    depth, end = 0, len(src)
    for end in range(open_at, len(src)):
        depth += {"(": 1, ")": -1}.get(src[end], 0)
        if depth == 0:
            break
    return src[open_at + 1:end]


def call_kwargs(call: str) -> dict[str, str]:
    """Keyword arguments of a call's top-level arguments: name -> the expression's text."""
    depth, out, token = 0, {}, ""
    for ch in call + ",":
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if depth == 0 and ch == ",":
            m = re.fullmatch(r"\s*(\w+)\s*=\s*(.*?)\s*", token, re.DOTALL)
            if m:
                out[m.group(1)] = m.group(2)
            token = ""
            continue
        token += ch
    return out


# ------------------------------------------------------------------------------------------------
# rotary
# ------------------------------------------------------------------------------------------------
def _rope_thetas(config: Any) -> dict[str | None, float | None]:
    p = getattr(config, "rope_parameters", None) or {}
    types = getattr(config, "layer_types", None)
    if types and all(isinstance(p.get(t), dict) or (t in p and p[t] is None) for t in set(types)) \
            and any(isinstance(p.get(t), dict) for t in set(types)):  # a type with None: its NoPE layers
        return {t: p[t].get("rope_theta") for t in sorted(set(types)) if isinstance(p[t], dict)}
    return {None: p.get("rope_theta")}


#: what a rotary module may return: ``half`` (cos, sin) ``[..., R]`` as cat(t, t) (Llama);
#: ``interleaved`` (cos, sin) ``[..., R]`` as repeat_interleave(t, 2) (Cohere); ``sin_cos_pairs``
#: (sin, cos) ``[..., R/2]``, repeated by the model's rotate_every_two (GPT-J, CodeGen);
#: ``half_cos_sin`` (cos, sin) ``[..., R/2]`` applied to the two halves (gpt-oss); ``complex``
#: ``cos + i sin`` ``[..., R/2]`` multiplying channel pairs (2i, 2i + 1) as complex numbers (Llama 4)
FORMS = ("half", "interleaved", "sin_cos_pairs", "half_cos_sin", "complex")


def _matches(out: tuple[Tensor, Tensor] | Tensor, ang: Tensor, scale: float) -> str | None:
    ang = ang.cpu()
    if isinstance(out, Tensor):  # complex cos + i sin
        ref = torch.polar(torch.ones_like(ang), ang) * scale
        ok = out.is_complex() and out.shape == ref.shape and torch.allclose(out.cpu().to(ref.dtype), ref, atol=1e-5)
        return "complex" if ok else None
    a, b = (t.float().cpu() for t in out)
    for form in FORMS[:4]:
        if form == "sin_cos_pairs":
            ref_a, ref_b = ang.sin() * scale, ang.cos() * scale
        elif form == "half_cos_sin":
            ref_a, ref_b = ang.cos() * scale, ang.sin() * scale
        else:
            ref_a, ref_b = ang.cos() * scale, ang.sin() * scale
            arrange = (lambda t: torch.cat((t, t), -1)) if form == "half" else (lambda t: t.repeat_interleave(2, -1))
            ref_a, ref_b = arrange(ref_a), arrange(ref_b)
        if a.shape == ref_a.shape and b.shape == ref_b.shape and torch.allclose(a, ref_a, atol=1e-5) \
                and torch.allclose(b, ref_b, atol=1e-5):
            return form
    return None


def _needs_layer_type(rot: nn.Module) -> bool:
    param = inspect.signature(rot.forward).parameters.get("layer_type")
    return param is not None and param.default is inspect.Parameter.empty


def probe_rotary(hf: nn.Module, rot: nn.Module) -> RotaryInfo:
    """The form of ``rot``'s output (`FORMS`), checked against RoPE of its own ``inv_freq`` (or, for
    a module with a sin/cos table and no ``inv_freq``, of the frequencies its table gives at position
    1); refuses anything else."""
    thetas = _rope_thetas(hf.config)
    pos = torch.tensor([[0, 1, 5]])
    form, dim = None, 0
    for lt in thetas:
        prefix = f"{lt}_" if lt is not None else ""
        inv = getattr(rot, f"{prefix}inv_freq", None)
        buffers = list(rot.buffers())
        if not isinstance(inv, Tensor) and not buffers:
            raise refuse(hf, f"its rotary module {type(rot).__name__} has no `{prefix}inv_freq` or table "
                         f"(an unknown rotary mechanism)", "a model whose rotary module returns (cos, sin)")
        device = (inv if isinstance(inv, Tensor) else buffers[0]).device
        scale = float(getattr(rot, f"{prefix}attention_scaling", 1.0) or 1.0)
        x = torch.zeros(1, dtype=torch.float32, device=device)
        if lt is None and _needs_layer_type(rot):  # one table, a layer_type argument it does not use
            lt_arg = next(t for t in hf.config.layer_types if "attention" in str(t))
        else:
            lt_arg = lt
        try:
            out = rot(x, pos.to(device)) if lt_arg is None else rot(x, pos.to(device), lt_arg)
        except Exception as e:
            raise refuse(hf, f"its rotary module {type(rot).__name__} does not take (x, position_ids) ({e})",
                         "a model whose rotary module returns (cos, sin)") from e
        complex_table = isinstance(out, Tensor) and out.is_complex() and isinstance(inv, Tensor)
        if not complex_table and not (isinstance(out, tuple) and len(out) == 2
                                      and all(isinstance(t, Tensor) for t in out)):
            raise refuse(hf, f"its rotary module {type(rot).__name__} does not return (cos, sin) "
                         f"(got {type(out).__name__}, e.g. complex frequencies)", "rope on a Llama-style model")
        if not isinstance(inv, Tensor):  # a (sin, cos) table: the angles at position 1 are the frequencies
            inv = torch.atan2(out[0][0, 1].float(), out[1][0, 1].float())
        found = _matches(out, pos.to(device)[..., None].float() * inv.float(), scale)
        if found is None or form not in (None, found):
            raise refuse(hf, f"the output of its rotary module {type(rot).__name__} is not RoPE of its "
                         f"inv_freq in a known form ({', '.join(FORMS)})", "rope on a Llama-style model")
        form, dim = found, 2 * inv.numel()
    return RotaryInfo(rot, form or "half", dim, thetas)


# ------------------------------------------------------------------------------------------------
# describe
# ------------------------------------------------------------------------------------------------
#: config fields of a per-layer schedule, carried by the schedule path (`_hf_schedule`)
SCHEDULE_CONFIG = frozenset({"no_rope_layers", "no_rope_layer_interval", "attention_chunk_size",
                             "attn_temperature_tuning", "floor_scale", "attn_scale", "use_sliding_window"})


#: the route a refusal of one encoding for every layer names on a model with its own per-layer schedule
SCHEDULE_ROUTE = ("a per-layer schedule: inject(model, posenc_lightning.adapters.hf.model_schedule(model)) keeps "
                  "the model's own, a LayerSchedule replaces it")


def own_schedule(hf: nn.Module) -> str | None:
    """What makes ``hf``'s layers differ in their positions (NoPE layers, chunks, a query temperature
    applied in its attention module), or None when one encoding can serve every layer."""
    cfg = hf.config
    params = getattr(cfg, "rope_parameters", None)
    unrotated = sorted(t for t, v in params.items() if v is None) if isinstance(params, dict) else []
    if unrotated and set(unrotated) <= set(getattr(cfg, "layer_types", None) or ()):
        return (f"its NoPE layers (layer types {', '.join(unrotated)}, whose rope_parameters are None) "
                f"rotate nothing while its other layers rotate")
    found = [k for k in ("no_rope_layers", "attention_chunk_size", "attn_temperature_tuning") if getattr(cfg, k, None)]
    if found:
        return (f"its NoPE layers / chunked attention / position-dependent query temperature ({', '.join(found)}) "
                f"are applied inside its attention module, outside the attention function")
    return None


def _known_refusals(hf: nn.Module, layered: bool = False) -> None:
    cfg = hf.config
    if getattr(cfg, "model_type", None) in NOT_YET_SUPPORTED:
        raise refuse(hf, NOT_YET_SUPPORTED[cfg.model_type], "'qwen3' (plain rope)")
    if getattr(cfg, "kv_lora_rank", None) or getattr(cfg, "qk_rope_head_dim", None):
        raise refuse(hf, "its multi-head latent attention rotates a separate decoupled-rope slice of q and k "
                     "(qk_rope_head_dim) that the attention function cannot tell apart",
                     "a Llama/Qwen-style model (rope laws, alibi, fire on full q/k)")
    if getattr(cfg, "index_topk", None) or getattr(cfg, "index_layers", None):
        raise refuse(hf, "its indexed sparse-attention layers choose each query's keys (index_topk) inside the "
                     "attention module, from a 4-D mask the fused path does not build",
                     "a model that rotates every layer (e.g. 'llama')")
    reason = own_schedule(hf)
    if reason is not None and not layered:
        raise refuse(hf, reason, SCHEDULE_ROUTE)
    for key, value in cfg.to_dict().items():
        if key in HANDLED_CONFIG or not MECHANISM_CONFIG.search(key) or not value or (layered and key in SCHEDULE_CONFIG):
            continue
        if key == "alibi" or (isinstance(value, dict) and value.get("alibi")):
            raise refuse(hf, "its built-in ALiBi is added inside its attention module", "a model without built-in "
                         "ALiBi (e.g. 'llama', 'gpt2') with posenc's 'alibi'")
        if isinstance(value, (dict, list)) and not any(MECHANISM_CONFIG.search(str(k)) for k in value):
            continue
        raise refuse(hf, f"config field {key}={value!r} names a position or score mechanism the adapter "
                     f"does not know", "a Llama-style model")
    pet = getattr(cfg, "position_embedding_type", "absolute")
    if pet not in (None, "absolute", "rope", "rotary"):
        raise refuse(hf, f"position_embedding_type={pet!r} is computed inside its attention module",
                     "position_embedding_type='absolute'")


def _tables(hf: nn.Module, layers: list[nn.Module], rot: nn.Module | None
            ) -> tuple[list[tuple[nn.Module, str]], list[tuple[nn.Module, str]]]:
    """Absolute position tables (modules and buffers); refuses position mechanisms it does not know."""
    layer_ids = {id(m) for m in layers}
    tables: list[tuple[nn.Module, str]] = []
    buffers: list[tuple[nn.Module, str]] = []

    def walk(owner: nn.Module, prefix: str) -> None:
        for name, buf in owner.named_buffers(recurse=False):
            if POSITION_NAME.search(name) and buf is not None and buf.is_floating_point() and buf.dim() == 2:
                if id(owner) in layer_ids:
                    raise refuse(hf, f"its attention {type(owner).__name__} applies positions itself "
                                 f"(buffer `{prefix}{name}`)", "a model whose positions are a model-level module")
                buffers.append((owner, name))
        for name, child in owner.named_children():
            if child is rot:
                continue
            named = POSITION_NAME.search(name) or POSITION_CLASS.search(type(child).__name__)
            if named and id(child) not in layer_ids:
                inside = any(owner is m or any(owner is s for s in m.modules()) for m in layers)
                if inside or not _is_table(child):
                    raise refuse(hf, f"unknown position module `{prefix}{name}` ({type(child).__name__})",
                                 "a model whose positions are transformers' rotary module or an absolute table")
                tables.append((owner, name))
                continue
            walk(child, f"{prefix}{name}.")

    walk(hf, "")
    return tables, buffers


def _is_table(m: nn.Module) -> bool:
    """An absolute position table: an ``nn.Embedding`` (OPT's and BioGPT's subclasses with an offset included)."""
    return isinstance(m, nn.Embedding)


def describe(hf: nn.Module, layered: bool = False) -> ArchInfo:
    """`ArchInfo` of ``hf`` (a transformers ``PreTrainedModel``).

    While an encoding is injected, the record made at inject (of the model's own mechanisms).

    Args:
        hf: the model.
        layered: for a per-layer schedule (`_hf_schedule`): NoPE layers, chunks and the query
            temperature are the schedule's, not refused.

    Raises:
        ArchitectureRefused: a mechanism the adapter cannot carry or does not know.
    """
    if hf.__dict__.get(ADAPTED) is not None and hf.__dict__.get(RECORD) is not None:
        return hf.__dict__[RECORD]
    _known_refusals(hf, layered)
    layers = attention_modules(hf)
    if not layers:
        raise refuse(hf, "found no self-attention module with a layer_idx",
                     "transformers decoder models (Llama, Mistral, Qwen2, GPT-NeoX, GPT-2, Phi, ...)")
    transforms: dict[str, str] = {}
    fused_unsupported: dict[str, str] = {}
    for cls in {type(m) for m in layers}:
        call = _interface_call(cls)
        if call is None:
            raise refuse(hf, f"its attention {cls.__name__} computes its scores itself instead of calling "
                         f"transformers' attention interface (ALL_ATTENTION_FUNCTIONS)",
                         "a model whose attention calls the interface (Llama, Mistral, Qwen2, GPT-2, ...)")
        kwargs = call_kwargs(call)
        if re.search(r"layer_idx\s*\+", inspect.getsource(cls.forward)):
            raise refuse(hf, f"its attention {cls.__name__} runs more than once per token (looped layers with "
                         f"their own cache slots), so the cache length of a layer is not its own",
                         "a model whose layers run once (Llama, Qwen2, ...)")
        if kwargs.get("attention_mask", "attention_mask") != "attention_mask":
            fused_unsupported["attention_mask"] = f"a mask {cls.__name__} builds itself ({kwargs['attention_mask']})"
        for kw in set(kwargs) - KNOWN_CALL_KWARGS:
            if kw in ("position_bias", "indices"):
                raise refuse(hf, f"its attention {cls.__name__} passes `{kw}` (a built-in position bias or sparse "
                             f"index selection) to the attention function", "a model without one (e.g. 'llama')")
            fused_unsupported[kw] = f"`{kw}` passed to the attention function by {cls.__name__}"
        transforms.update({k: v for k, v in SCORE_TRANSFORMS.items() if k in kwargs})
    rot = getattr(rotary_owner(hf), "rotary_emb", None)
    rotary = probe_rotary(hf, rot) if rot is not None else None
    tables, buffers = _tables(hf, layers, rot)
    info = ArchInfo(arch_name(hf), layers, rotary, tables, buffers, transforms, fused_unsupported)
    object.__setattr__(hf, RECORD, info)
    return info
