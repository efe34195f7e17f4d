"""Per-layer schedules in Hugging Face models: the model's own, read from its config, and a user's.

`model_schedule` reads what each layer of a transformers model does with positions, as a
`LayerSchedule` (one rule per distinct layer): RoPE with the rope parameters of the layer's type
(``rope_parameters[layer_type]``), NoPE where the layer rotates nothing (SmolLM3's and Llama 4's
``no_rope_layers``; a layer type whose ``rope_parameters`` are None, as Ergo's and Beam's full
layers; Cohere 2's full layers, which skip the rotation in code), Llama 4's query temperature on
its NoPE layers (``log_temperature``), the sliding window of a sliding layer (its module's
``sliding_window``) and Llama 4's chunks (``attention_chunk_size`` on its ``chunked_attention`` layers).

`adapt_schedule` puts a schedule into the model: the model's rotary module gives the identity
(`NoRotation`), each attention module gets its layer's encoding (``.posenc``) and its window and
chunk, and every layer runs posenc's fused attention, whose mask is the schedule's (the model's own
4-D mask is not built). What a layer does itself stays: its scaling, softcapping, attention sinks
(gpt-oss's ``s_aux``), q/k norms. What the schedule now carries is switched off in the layer
(Llama 4's own temperature, ``attn_temperature_tuning``) and switched back by `hf.restore`.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from posenc_lightning.adapters._hf_arch import ADAPTED, ArchInfo, describe
from posenc_lightning.encodings.hf import from_hf
from posenc_lightning.encodings.registry import encoding_class
from posenc_lightning.encodings.schedule import LayerSchedule, LayerSpec

#: model types whose full-attention layers skip the rotation in their attention code (no config field says so)
NOPE_FULL_LAYERS = frozenset({"cohere2"})
#: attributes of an attention module that apply what a schedule carries: switched off while one is injected
LAYER_SWITCHES = ("attn_temperature_tuning",)
#: the model's own schedule as `model_schedule` read it (an entry of the model's ``__dict__``)
OWN_SCHEDULE = "_posenc_own_schedule"
#: the encodings `_own_spec` gives a layer that has no positions of its own (`with_law` keeps them)
POSITIONLESS = frozenset({"nope", "log_temperature"})


def _layer_type(cfg: Any, m: nn.Module) -> str | None:
    types = getattr(cfg, "layer_types", None)
    return types[m.layer_idx] if types else None


def _rope_params(cfg: Any, layer_type: str | None) -> dict[str, Any] | None:
    p = getattr(cfg, "rope_parameters", None) or {}
    nested = any(isinstance(v, dict) or v is None for v in p.values()) and layer_type in p
    return p.get(layer_type) if nested else dict(p)


def _rotates(cfg: Any, info: ArchInfo, m: nn.Module, layer_type: str | None) -> bool:
    """Whether the model's own layer ``m`` rotates q and k."""
    if info.rotary is None:
        return False
    flags = getattr(cfg, "no_rope_layers", None)
    if flags:  # SmolLM3, Llama 4: 1 = RoPE, 0 = NoPE
        return bool(flags[m.layer_idx])
    if _rope_params(cfg, layer_type) is None:
        return False
    return not (cfg.model_type in NOPE_FULL_LAYERS and getattr(m, "sliding_window", None) is None)


def _own_spec(hf: nn.Module, info: ArchInfo, m: nn.Module) -> LayerSpec:
    cfg = hf.config
    lt = _layer_type(cfg, m)
    window = getattr(m, "sliding_window", None)
    window = int(window) if isinstance(window, int) and not isinstance(window, bool) else None
    chunk = getattr(cfg, "attention_chunk_size", None) if lt == "chunked_attention" else None
    if _rotates(cfg, info, m, lt):
        head_dim = int(getattr(m, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        enc = from_hf(_rope_params(cfg, lt), head_dim, int(cfg.max_position_embeddings))
        config = {**enc.config(), "layout": info.rotary.layout}
        if info.rotary.dim != head_dim:
            config["partial_rotary_factor"] = info.rotary.dim / head_dim
        return LayerSpec(enc.name, config, window, chunk)
    if getattr(m, "attn_temperature_tuning", False):  # Llama 4's NoPE layers
        return LayerSpec("log_temperature", {"floor_scale": float(cfg.floor_scale), "attn_scale": float(cfg.attn_scale)},
                         window, chunk)
    return LayerSpec("nope", {}, window, chunk)


def model_schedule(hf: nn.Module) -> LayerSchedule:
    """The model's own per-layer schedule (see the module docstring).

    Args:
        hf: a transformers ``PreTrainedModel``; with an encoding injected, the schedule read before
            the first injection (read now if the model was never read clean).

    Returns:
        One rule per distinct layer spec, naming its layers by index, named ``"<model_type>_own"``.

    Raises:
        ArchitectureRefused: a mechanism the adapter cannot carry (`describe`).
        ValueError: an encoding is injected and the model's own schedule was never read.
    """
    if hf.__dict__.get(ADAPTED) is not None:
        if hf.__dict__.get(OWN_SCHEDULE) is not None:
            return hf.__dict__[OWN_SCHEDULE]
        raise ValueError(f"{type(hf).__name__}: an encoding is injected; model_schedule reads the model's own "
                         f"schedule: call posenc_lightning.adapters.hf.restore(model) first")
    info = describe(hf, layered=True)
    by_spec: dict[tuple, tuple[LayerSpec, list[int]]] = {}
    for i, m in enumerate(info.layers):
        spec = _own_spec(hf, info, m)
        by_spec.setdefault((spec.key(), spec.window, spec.chunk), (spec, []))[1].append(i)
    rules = [{"layers": idx, "encoding": s.encoding, "config": s.config, "window": s.window, "chunk": s.chunk}
             for s, idx in by_spec.values()]
    schedule = LayerSchedule(rules, name=f"{hf.config.model_type}_own")
    object.__setattr__(hf, OWN_SCHEDULE, schedule)  # read again while an encoding is injected
    return schedule


def with_law(hf: nn.Module, encoding: str, config: dict[str, Any]) -> LayerSchedule:
    """The model's own schedule with ``encoding`` in place of the positions of every layer that has
    them (its rotary layers: ``rope_parameters`` moves to a new law the way transformers applies
    it), and every layer without them (NoPE, Llama 4's temperature-only layers) kept as it is, with
    each layer's window and chunk. What `inject(model, name)` does on such a model.

    Args:
        hf: a transformers ``PreTrainedModel`` with its own per-layer schedule (`own_schedule`).
        encoding: the registered name put into the positional layers.
        config: its arguments; what the user leaves out the model implies per layer (`layer_config`).

    Returns:
        A `LayerSchedule` named ``"<model_type>_own+<encoding>"``.
    """
    own = model_schedule(hf)
    rules = []
    for rule in own.rules:
        spec = rule.spec
        if spec.encoding not in POSITIONLESS:
            spec = LayerSpec(encoding, dict(config), spec.window, spec.chunk)
        rules.append({"layers": rule.layers, "encoding": spec.encoding, "config": spec.config, "window": spec.window,
                      "chunk": spec.chunk})
    return LayerSchedule(rules, name=f"{own.name}+{encoding}")


def layer_config(hf: nn.Module, implied: dict[str, Any], m: nn.Module, spec: LayerSpec) -> dict[str, Any]:
    """``spec.config`` completed with what the model implies (``implied``: `hf.model_defaults`) for the
    arguments the encoding takes and the user left out, the RoPE base of the layer's type first."""
    params = inspect.signature(encoding_class(spec.encoding).__init__).parameters
    implied = dict(implied)
    p = _rope_params(hf.config, _layer_type(hf.config, m)) or {}
    if "rope_theta" in p:
        implied["theta"] = float(p["rope_theta"])
    return {**{k: v for k, v in implied.items() if k in params}, **spec.config}
