"""Any encoding into a Hugging Face ``transformers`` causal LM, with no change to its code.

Built on transformers' own extension points (>= 5.0; checked on 5.23): the model-level rotary
module (``model.base_model.rotary_emb``), GPT-2's ``wpe``, ``AttentionInterface`` /
``AttentionMaskInterface`` and ``set_attn_implementation``. Two modes, chosen per encoding:

- **table** — a static rotary law (rope, pi, ntk, yarn, llama3, ...) on a RoPE model: the model's
  rotary module is replaced by one that returns this project's cos/sin (fp32 angles, partial
  rotary kept). Nothing else changes; the attention is the user's.
- **attention** — everything else (biases, normalizers, dynamic rotary laws, rotary on a model
  without RoPE): the model's own positions are neutralized (cos = 1, sin = 0; ``wpe`` = 0), so
  q/k (and cached keys) stay un-rotated, and every stage runs inside the attention function
  (`_hf_attention`). The encoding is a submodule of each attention module (``.posenc``): it is in
  ``state_dict``, the optimizer, checkpoints and DDP like any parameter of the model.

What a model has is read first (`_hf_arch.describe`): the form of its rotary module (half,
interleaved, GPT-J's (sin, cos) pairs; one table per layer type where the bases differ), its
absolute position tables (zeroed while an encoding is injected), the score transforms its attention
passes on (softcapping, kept on the fused path). Anything it does not recognise is refused at
inject with an `ArchitectureRefused` (a ValueError naming the architecture, what is missing and
the closest supported route).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from posenc_lightning.adapters import _hf_attention as attn
from posenc_lightning.adapters._hf_arch import (
    ADAPTED,
    ArchInfo,
    ArchitectureRefused,
    attention_modules,
    describe,
    own_schedule,
    refuse,
    rotary_owner,
)
from posenc_lightning.adapters._hf_modules import EmbeddingPositions, NoRotation, RotaryTable, zero_table_forward
from posenc_lightning.adapters._hf_schedule import LAYER_SWITCHES, POSITIONLESS, layer_config, model_schedule, with_law
from posenc_lightning.attention.backends import resolve_backend
from posenc_lightning.attention.mask import local_kinds
from posenc_lightning.encodings.base import Encoding
from posenc_lightning.encodings.registry import build_encoding
from posenc_lightning.encodings.schedule import LayerSchedule

MIN_VERSION = (5, 0)
ORIGINALS = ADAPTED
USER_KEYS = "_posenc_hf_user_keys"  # the arguments the user gave by name (`defaults_for`)


def require_transformers() -> None:
    """transformers >= 5.0 (``rope_parameters``, the attention and mask interfaces)."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) < MIN_VERSION:
        raise ValueError(f"posenc's Hugging Face adapter needs transformers >= {'.'.join(map(str, MIN_VERSION))} "
                         f"(found {transformers.__version__}): pip install 'transformers>=5,<6'")


def is_hf_model(module: nn.Module) -> bool:
    if "transformers" not in type(module).__module__ and not any(
            "transformers" in c.__module__ for c in type(module).__mro__):
        return False
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel)


def find_hf_models(model: nn.Module) -> list[nn.Module]:
    """The outermost ``PreTrainedModel``s at any depth of ``model``."""
    found: list[nn.Module] = []
    inner: set[int] = set()
    for m in model.modules():
        if id(m) in inner or not is_hf_model(m):
            continue
        found.append(m)
        inner.update(id(s) for s in m.modules())
    return found


def head_dim_of(m: nn.Module, config: Any) -> int:
    for attr in ("head_dim", "head_size"):
        if isinstance(getattr(m, attr, None), int):
            return int(getattr(m, attr))
    return int(config.hidden_size // config.num_attention_heads)


def rope_parameters(config: Any) -> dict[str, Any] | None:
    """The config's rope parameters; per layer type, the ones every layer type shares."""
    p = getattr(config, "rope_parameters", None)
    if not p:
        return None
    nested = [v for v in p.values() if isinstance(v, dict)]
    if not nested:
        return dict(p)
    return {k: v for k, v in nested[0].items() if k != "rope_theta" and all(n.get(k) == v for n in nested)}


def n_heads_of(m: nn.Module, config: Any) -> int:
    for attr in ("num_heads", "num_attention_heads", "n_heads"):
        if isinstance(getattr(m, attr, None), int):
            return int(getattr(m, attr))
    return int(config.num_attention_heads)


def rotary_module(hf: nn.Module) -> nn.Module | None:
    return getattr(rotary_owner(hf), "rotary_emb", None)


def model_defaults(hf: nn.Module, layered: bool = False) -> dict[str, Any]:
    """Encoding arguments the model implies, used when the user gave none: its RoPE base (left out
    where the base is per layer type: each layer type then gets its own) and layout, partial rotary
    fraction, and its training length as the original length of a scaling law (``layered``: for a
    per-layer schedule, `describe`)."""
    cfg = hf.config
    out: dict[str, Any] = {}
    p = rope_parameters(cfg) or {}
    if "rope_theta" in p:
        out["theta"] = float(p["rope_theta"])
    if p.get("partial_rotary_factor") is not None:
        out["partial_rotary_factor"] = float(p["partial_rotary_factor"])
    info = describe(hf, layered)
    if info.rotary is not None:  # the rotated channels as probed (HF rounds head_dim * factor down)
        out["layout"] = info.rotary.layout
        head_dim = head_dim_of(info.layers[0], cfg)
        if info.rotary.dim != head_dim:
            out["partial_rotary_factor"] = info.rotary.dim / head_dim
    n = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if isinstance(n, int):
        out["original_max_position_embeddings"] = int(p.get("original_max_position_embeddings") or n)
        out["max_seq_len"] = n
    return out


def defaults_for(hf: nn.Module, encoding_cls: type, cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` completed with `model_defaults` for the arguments ``encoding_cls`` takes.

    Raises:
        ArchitectureRefused: the model has a mechanism the adapter cannot carry (`describe`).
    """
    describe(hf)
    object.__setattr__(hf, USER_KEYS, frozenset(cfg))  # read (once) by the next `adapt`
    params = inspect.signature(encoding_cls.__init__).parameters
    out = dict(cfg)
    implied = model_defaults(hf)
    for key, value in implied.items():
        if key in params and key not in out:
            out[key] = value
    if "max_position_embeddings" in params and "max_position_embeddings" not in out and "factor" in out:
        base = out.get("original_max_position_embeddings", implied.get("original_max_position_embeddings"))
        if base is not None and out["factor"] is not None:
            out["max_position_embeddings"] = round(float(out["factor"]) * int(base))
    return out


# ------------------------------------------------------------------------------------------------
# the adapter
# ------------------------------------------------------------------------------------------------
def per_type_encodings(hf: nn.Module, info: ArchInfo, proto: Encoding, user_keys: frozenset[str] | None
                       ) -> dict[str, Encoding]:
    """One encoding per layer type where the model's RoPE base is per layer type and the user left
    ``theta`` to the model (an encoding given by name without ``theta``; the first type's is
    ``proto`` itself); ``{}`` otherwise."""
    if info.rotary is None or not info.rotary.per_layer_type or user_keys is None or "theta" in user_keys \
            or "theta" not in proto.config():
        return {}
    out: dict[str, Encoding] = {}
    for lt, theta in info.rotary.thetas.items():
        theta = float(theta if theta is not None else 10000.0)
        if out:
            out[lt] = type(proto)(**{**proto.config(), "theta": theta})
        else:  # proto's config leaves theta to the model: a checkpoint's reload does the same again
            proto.theta = theta
            proto.__dict__.get("_init_args", {}).pop("theta", None)
            out[lt] = proto
    return out


def uses_table(hf: nn.Module, enc: Encoding, info: ArchInfo | None = None) -> bool:
    """A static rotary law that transformers' own rotary module can carry (the model's layout, one
    table for all heads, the model's partial rotary fraction)."""
    from posenc_lightning.encodings.rope import RotaryEncoding

    info = info or describe(hf)
    if info.rotary is None or not isinstance(enc, RotaryEncoding) or enc.dynamic:
        return False
    # per-head laws (multiscale_rope) need n_heads to give their table
    enc.bind(head_dim=head_dim_of(info.layers[0], hf.config), n_heads=int(hf.config.num_attention_heads))
    if enc.stages != frozenset({"rotate"}) or enc.layout != info.rotary.layout or enc.frequencies_key(None) is None:
        return False
    if type(enc).rotate is not RotaryEncoding.rotate or type(enc).cos_sin is not RotaryEncoding.cos_sin:
        return False
    cos, _ = enc.cos_sin(torch.arange(2)[None])
    return cos.dim() == 3 and 2 * cos.shape[-1] == info.rotary.dim


def restore(hf: nn.Module) -> None:
    """Undo an earlier adaptation: the original rotary module, position tables and attention function."""
    orig = getattr(hf, ORIGINALS, None)
    if orig is None:
        return
    if "rotary_emb" in orig:
        rotary_owner(hf).rotary_emb = orig["rotary_emb"]
    if "wpe" in orig:
        hf.base_model.wpe = orig["wpe"]
    for table in orig.get("tables", []):
        del table.forward
    for owner, name, value in orig.get("buffers", []):
        with torch.no_grad():
            getattr(owner, name).copy_(value)
    for m, name, value in orig.get("layer_attrs", []):
        setattr(m, name, value)
    for m in attention_modules(hf):
        for h in getattr(m, "_posenc_hooks", []):
            h.remove()
        m._posenc_hooks = []
        for name in (attn.LOCAL, "posenc_window", "posenc_chunk"):
            m.__dict__.pop(name, None)
        if getattr(m, "posenc", None) is not None:
            del m.posenc
        m.posenc = None
    hf.set_attn_implementation(orig["attn_implementation"])
    object.__setattr__(hf, ORIGINALS, None)


def _neutralize_tables(hf: nn.Module, info: ArchInfo, orig: dict[str, Any]) -> None:
    """Absolute position tables other than GPT-2's ``wpe`` give zeros (`zero_table_forward`; buffers zeroed)."""
    orig["tables"] = [getattr(owner, name) for owner, name in info.tables
                      if not (owner is hf.base_model and name == "wpe")]
    for table in orig["tables"]:
        table.forward = functools.partial(zero_table_forward, table)
    orig["buffers"] = []
    for owner, name in info.buffers:
        buf = getattr(owner, name)
        orig["buffers"].append((owner, name, buf.detach().clone()))
        with torch.no_grad():
            buf.zero_()


def adapt(hf: nn.Module, proto: Encoding, backend: str, share_across_layers: bool,
          copy: Any) -> list[Encoding]:
    """Put ``proto`` into ``hf`` (after `restore`); returns the encodings placed (the first is ``proto``).

    Raises:
        ArchitectureRefused: what the model has that the adapter cannot carry (`describe`), or an
            encoding that needs posenc's fused attention on a model whose attention passes it
            something the fused attention does not apply (attention sinks, ...).
    """
    require_transformers()
    restore(hf)
    info = describe(hf)
    cfg = hf.config
    base = hf.base_model
    rotary = info.rotary.module if info.rotary is not None else None
    wpe = getattr(base, "wpe", None)
    impl = cfg._attn_implementation or "sdpa"
    orig: dict[str, Any] = {"attn_implementation": impl}
    if rotary is not None:
        orig["rotary_emb"] = rotary
    if isinstance(wpe, nn.Embedding):
        orig["wpe"] = wpe
    d_model = int(cfg.hidden_size)
    layers = info.layers
    stages = proto.stages
    if "embed" in stages and wpe is None:
        raise ValueError(f"{proto.name} adds positions to the token embeddings (stage 1); {type(hf).__name__} "
                         f"has no position-embedding table (wpe) to carry it. Use a rotary or bias encoding "
                         f"(e.g. 'rope', 'alibi', 'fire') on this model")
    attn_stages = stages & {"rotate", "bias", "normalize"}
    if attn_stages - {"rotate"} and info.fused_unsupported:
        raise refuse(hf, f"{proto.name} needs posenc's fused attention, which does not apply "
                     f"{', '.join(info.fused_unsupported.values())}",
                     "a rotary encoding (rope, yarn, llama3, ...), which keeps the model's own attention")
    heads = sorted({n_heads_of(m, cfg) for m in layers})
    if share_across_layers and len(heads) > 1 and attn_stages:
        raise refuse(hf, f"its layers have different head counts {heads}, which one shared encoding cannot serve",
                     "inject(model, ..., share_across_layers=False)")
    per_type = per_type_encodings(hf, info, proto, hf.__dict__.pop(USER_KEYS, None))
    encs: list[Encoding] = []
    if uses_table(hf, proto, info):
        for enc in per_type.values() or [proto]:
            enc.bind(head_dim=head_dim_of(layers[0], cfg), n_heads=int(cfg.num_attention_heads))
            enc.to(next(rotary.buffers()).device)
        base.rotary_emb = RotaryTable(proto, info.rotary.form, per_type)
        encs.append(proto)
    else:
        if rotary is not None:
            base.rotary_emb = NoRotation(info.rotary.dim, info.rotary.form, rotary)
        if wpe is not None:
            base.wpe = EmbeddingPositions(d_model, proto if "embed" in stages else None)
        placed: set[int] = set()
        for m in layers if attn_stages else []:
            kind = per_type[cfg.layer_types[m.layer_idx]] if per_type else proto
            enc = kind if (share_across_layers or id(kind) not in placed) else copy(kind)
            placed.add(id(kind))
            enc.bind(n_heads=n_heads_of(m, cfg), head_dim=head_dim_of(m, cfg), d_model=d_model)
            weight = next(m.parameters())
            enc.to(device=weight.device, dtype=weight.dtype if weight.is_floating_point() else None)
            resolve_backend(backend, enc, weight.device, requires_grad=False)
            m.posenc = enc
            m.posenc_backend = backend
            m._posenc_hooks = [m.register_forward_pre_hook(attn.record_call, with_kwargs=True)]
            encs.append(enc)
        if "embed" in stages:
            proto.bind(d_model=d_model)
            proto.to(device=base.wte.weight.device, dtype=base.wte.weight.dtype)
            base.wpe.posenc = proto
            if proto not in encs:
                encs.insert(0, proto)
        if attn_stages:
            name = attn.register(attn.FUSED if attn_stages - {"rotate"} else impl)
            hf.set_attn_implementation(name)
    _neutralize_tables(hf, info, orig)
    object.__setattr__(hf, ORIGINALS, orig)
    if proto in encs:
        encs.remove(proto)
    return [proto, *encs]


def adapt_schedule(hf: nn.Module, schedule: LayerSchedule, backend: str, share_across_layers: bool
                   ) -> list[Encoding]:
    """Put ``schedule`` into ``hf`` (after `hf.restore`); returns the encodings placed, layer 0's first.

    Raises:
        ArchitectureRefused: what the model has that the adapter cannot carry (`describe`).
        ValueError: a rule the model's layers cannot take (a stage-1 encoding, a rule out of range).
    """
    restore(hf)
    model_schedule(hf)  # read (and kept) while the model is its own: an export compares against it
    info = describe(hf, layered=True)
    implied = model_defaults(hf, layered=True)
    cfg = hf.config
    if getattr(hf.base_model, "wpe", None) is not None:
        raise refuse(hf, "a layer schedule is per layer, and its absolute position table (wpe) is not",
                     "one encoding for every layer: inject(model, 'alibi')")
    layers = info.layers
    specs = schedule.resolve(len(layers), getattr(cfg, "layer_types", None))
    orig: dict[str, Any] = {"attn_implementation": cfg._attn_implementation or "sdpa", "layer_attrs": []}
    if info.rotary is not None:
        orig["rotary_emb"] = info.rotary.module
        rotary_owner(hf).rotary_emb = NoRotation(info.rotary.dim, info.rotary.form, info.rotary.module)
    built: dict[Any, Encoding] = {}
    placed: list[Encoding] = []
    for i, (m, spec) in enumerate(zip(layers, specs)):
        config = layer_config(hf, implied, m, spec)
        key = (spec.encoding, repr(sorted(config.items())), n_heads_of(m, cfg), head_dim_of(m, cfg))
        enc = built.get(key) if share_across_layers else None
        if enc is None:
            enc = build_encoding(spec.encoding, **config)
            if "embed" in enc.stages:
                raise ValueError(f"layer {i}: {spec.encoding} adds positions to the embeddings (stage 1), which "
                                 f"is not per layer; schedule attention encodings only")
            enc.bind(n_heads=n_heads_of(m, cfg), head_dim=head_dim_of(m, cfg), d_model=int(cfg.hidden_size))
            weight = next(m.parameters())
            enc.to(device=weight.device, dtype=weight.dtype if weight.is_floating_point() else None)
            built[key] = enc
        resolve_backend(backend, enc, next(m.parameters()).device, False, local_kinds(spec.window, spec.chunk))
        m.posenc, m.posenc_backend = enc, backend
        m.__dict__[attn.LOCAL] = (spec.window, spec.chunk)
        m.posenc_window, m.posenc_chunk = spec.window, spec.chunk  # as on a mixin module (`inject`)
        m._posenc_hooks = [m.register_forward_pre_hook(attn.record_call, with_kwargs=True)]
        for name in LAYER_SWITCHES:
            if getattr(m, name, False):
                orig["layer_attrs"].append((m, name, getattr(m, name)))
                setattr(m, name, False)
        placed.append(enc)
    hf.set_attn_implementation(attn.register(attn.FUSED))
    _neutralize_tables(hf, info, orig)
    object.__setattr__(hf, ORIGINALS, orig)
    return placed


def switch_to_fused_attention(model: nn.Module) -> Callable[[], None] | None:
    """Make the Hugging Face models in ``model`` that carry an injected encoding run ``posenc_fused``
    (whose attention shards, given a 2-D padding mask) instead of a wrapped ``sdpa`` / ``eager`` (whose
    mask transformers builds for the shard alone): what context parallelism needs.

    Args:
        model: a module holding Hugging Face models (or one itself).

    Returns:
        A function undoing the switch, or None when no model was switched.
    """
    from posenc_lightning.attention.mixin import NO_ENCODING

    switched, plain = [], []
    for hf in find_hf_models(model):
        impl = hf.config._attn_implementation
        layers = attention_modules(hf)
        if impl == attn.FUSED or not any(getattr(m, "posenc", None) is not None for m in layers) and not any(
                getattr(m, "posenc", None) is not None for m in hf.modules()):
            continue
        for m in layers:  # rotation by the model's own rotary module (q, k arrive rotated): plain attention
            if getattr(m, "posenc", None) is None:
                object.__setattr__(m, "posenc", NO_ENCODING)  # an attribute, not a registered submodule
                plain.append((m, m.register_forward_pre_hook(attn.record_call, with_kwargs=True)))
        hf.set_attn_implementation(attn.register(attn.FUSED))
        switched.append((hf, impl))
    if not switched:
        return None

    def undo() -> None:
        for hf, impl in switched:
            hf.set_attn_implementation(impl)
        for m, hook in plain:
            m.__dict__.pop("posenc", None)
            hook.remove()

    return undo


__all__ = ["POSITIONLESS", "ArchInfo", "ArchitectureRefused", "EmbeddingPositions", "NoRotation", "RotaryTable", "adapt",
           "adapt_schedule", "attention_modules", "describe", "find_hf_models", "model_schedule", "own_schedule",
           "restore", "switch_to_fused_attention", "with_law"]
