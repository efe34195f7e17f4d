"""A per-layer schedule as the config keys transformers reads.

`schedule_config` turns the layers of a model built with a `LayerSchedule` (each attention module's
injected encoding and window, in model order) into the keys a transformers config of one model type
reads:

| model type | keys |
|---|---|
| ``llama`` | ``rope_parameters`` (one law, ``partial_rotary_factor`` inside it) |
| ``smollm3`` | ``no_rope_layers`` (1 = rope, 0 = NoPE), ``layer_types``, ``use_sliding_window``, ``sliding_window``, ``rope_parameters`` |
| ``phi3`` | ``rope_parameters`` (one law, ``partial_rotary_factor`` inside it), ``sliding_window`` (every layer's) |
| ``gemma3_text`` | ``layer_types`` (``"sliding_attention"`` / ``"full_attention"``), ``sliding_window``, ``rope_parameters`` per layer type (``{"sliding_attention": {...}, "full_attention": {...}}``) |
| ``llama4_text`` | ``no_rope_layers``, ``layer_types`` (``"chunked_attention"`` / ``"full_attention"``), ``attention_chunk_size``, ``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``, ``rope_parameters`` (interleaved pairs) |

A schedule no key of that model type expresses (a NoPE layer in llama or gemma3, two rope laws in
layers of one type, two windows, a chunk, a bias or normalizer encoding, a rope law transformers
lacks such as p-RoPE with ``p < 1``) raises a ``ValueError`` that says which layer and why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from posenc_lightning.encodings.base import Encoding

__all__ = ["MODEL_TYPES", "ScheduleExportError", "layers_of", "schedule_config"]

MODEL_TYPES = ("llama", "smollm3", "gemma3_text", "phi3", "llama4_text")
# model types whose attention rotates only the first partial_rotary_factor of each head's channels;
# llama, smollm3 and gemma3 rotate every channel (their default law ignores the key)
PARTIAL_ROTARY = ("phi3",)
# the rope_type values a model type's config validates (absent: every transformers law)
ROPE_TYPES = {"phi3": ("default", "longrope")}
SLIDING, FULL, CHUNKED = "sliding_attention", "full_attention", "chunked_attention"
#: how a model type pairs the rotated channels (absent: "half")
LAYOUTS = {"llama4_text": "interleaved"}

Layer = tuple[Encoding | None, int | None, int | None]  # (encoding, window, chunk)


class ScheduleExportError(ValueError):
    """A schedule that no config key of the asked model type expresses."""


def layers_of(module: nn.Module) -> list[Layer]:
    """Each attention layer of ``module`` (modules inheriting `PosEncAttentionMixin`, in model order)
    as ``(encoding or None, window, chunk)``.

    Args:
        module: a model `inject` gave a schedule (TinyGPT, or any module with mixin attention).

    Returns:
        One entry per attention layer.

    Raises:
        ValueError: ``module`` has no attention module inheriting `PosEncAttentionMixin`.
    """
    from posenc_lightning.inject import find_mixin_modules

    attn, _ = find_mixin_modules(module)
    if not attn:
        raise ValueError(f"layers_of: {type(module).__name__} has no attention module inheriting "
                         f"PosEncAttentionMixin; inject a schedule into a model built from it")
    return [(getattr(m, "posenc", None), getattr(m, "posenc_window", None), getattr(m, "posenc_chunk", None))
            for m in attn]


def _rope_law(enc: Encoding | None, i: int, model_type: str) -> tuple[dict[str, Any], int | None] | None:
    """Layer ``i``'s ``(rope_parameters, max_position_embeddings or None)``; None for a NoPE layer;
    raises for what no law expresses."""
    if enc is None or not enc.stages:
        return None
    if enc.stages != frozenset({"rotate"}):
        raise ScheduleExportError(f"layer {i}: {enc.name} acts at stages {sorted(enc.stages)}; a {model_type} "
                                  f"config expresses only rotary laws and NoPE (export it with export_pretrained's "
                                  f"posenc_lightning format instead)")
    layout = LAYOUTS.get(model_type, "half")
    law = enc.to_rope_parameters(layout)
    if law is None:
        if getattr(enc, "layout", layout) != layout and enc.to_rope_parameters(enc.layout) is not None:
            raise ScheduleExportError(f"layer {i}: {enc.name} rotates {enc.layout} pairs; a {model_type} model "
                                      f"rotates {layout} pairs (build the schedule with layout={layout!r})")
        raise ScheduleExportError(f"layer {i}: {enc.name} ({enc.config()}) is no transformers rope law "
                                  f"(p-RoPE with p < 1 and learned rotations have none); "
                                  f"no rope_parameters expresses it")
    params = dict(law[0])
    allowed = ROPE_TYPES.get(model_type)
    if allowed is not None and params["rope_type"] not in allowed:
        raise ScheduleExportError(f"layer {i}: {enc.name} is rope_type {params['rope_type']!r}; a {model_type} "
                                  f"config accepts only {allowed} (export to llama, smollm3 or gemma3_text)")
    if params.get("partial_rotary_factor", 1.0) != 1.0 and model_type not in PARTIAL_ROTARY:
        raise ScheduleExportError(f"layer {i}: partial_rotary_factor={params['partial_rotary_factor']}: a "
                                  f"{model_type} model rotates every channel of a head; export to one of "
                                  f"{PARTIAL_ROTARY}, whose attention reads it")
    return params, (None if law[1] is None else int(law[1]))


def _one(values: dict[int, Any], what: str, model_type: str) -> Any:
    """The one value every listed layer shares, or a refusal naming the first two that differ."""
    items = list(values.items())
    for i, v in items[1:]:
        if v != items[0][1]:
            raise ScheduleExportError(f"layers {items[0][0]} and {i} have different {what} ({items[0][1]!r} vs "
                                      f"{v!r}); a {model_type} config has one {what} for them")
    return items[0][1] if items else None


def _max_pos(n: int | None) -> dict[str, int]:
    """``max_position_embeddings`` where a law (yarn, longrope, dynamic) fixes what transformers must see."""
    return {} if n is None else {"max_position_embeddings": n}


def schedule_config(layers: Sequence[Layer] | nn.Module, model_type: str) -> dict[str, Any]:
    """The transformers config keys of ``model_type`` that express a per-layer schedule.

    Args:
        layers: ``(encoding or None, window, chunk)`` per attention layer, or a module to read them
            from (`layers_of`).
        model_type: one of `MODEL_TYPES` (transformers' ``config.model_type``).

    Returns:
        The keys to pass to ``AutoConfig.for_model(model_type, **keys)`` (or set on a config):
        ``rope_parameters`` (and ``max_position_embeddings`` where the law fixes it);
        ``no_rope_layers`` and ``use_sliding_window`` for smollm3; ``layer_types`` and
        ``sliding_window`` for smollm3 and gemma3_text.

    Raises:
        ScheduleExportError: the schedule is not expressible in ``model_type``'s config (the message
            names the layer and the reason).
        ValueError: ``model_type`` is not one of `MODEL_TYPES`.

    Examples:
        >>> from posenc_lightning import inject
        >>> from posenc_lightning.encodings.presets import build_preset
        >>> from posenc_lightning.models import TinyGPT
        >>> m = TinyGPT(d_model=32, n_layers=4, n_heads=2, encoding=None)
        >>> _ = inject(m, build_preset("smollm3_nope"))
        >>> schedule_config(m, "smollm3")["no_rope_layers"]
        [1, 1, 1, 0]
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"schedule_config: model_type={model_type!r} is not one of {MODEL_TYPES}; export to "
                         f"the one whose config has the keys your schedule needs")
    if isinstance(layers, nn.Module):
        layers = layers_of(layers)
    if not layers:
        raise ValueError("schedule_config: layers is empty; give one (encoding, window, chunk) per layer")
    if model_type == "llama4_text":
        return _llama4(layers)
    for i, (_, _, chunk) in enumerate(layers):
        if chunk is not None:
            raise ScheduleExportError(f"layer {i}: chunked attention (chunk={chunk}) has no key in a {model_type} "
                                      f"config (export to llama4_text, whose attention_chunk_size it is)")
    found = [_rope_law(enc, i, model_type) for i, (enc, _, _) in enumerate(layers)]
    laws = [None if f is None else f[0] for f in found]
    max_pos = _one({i: f[1] for i, f in enumerate(found) if f is not None and f[1] is not None},
                   "max_position_embeddings", model_type)
    windows = {i: w for i, (_, w, _) in enumerate(layers) if w is not None}
    nope = [i for i, law in enumerate(laws) if law is None]
    types = [SLIDING if w is not None else FULL for _, w, _ in layers]
    if model_type in ("llama", "phi3"):
        if nope:
            raise ScheduleExportError(f"layers {nope} are NoPE; a {model_type} config rotates every layer "
                                      f"(export to smollm3, whose no_rope_layers says which do not)")
        out = {"rope_parameters": _one(dict(enumerate(laws)), "rope_parameters", model_type), **_max_pos(max_pos)}
        if not windows:
            return out
        if model_type == "llama":
            raise ScheduleExportError(f"layers {sorted(windows)} have a sliding window; a llama config has none "
                                      f"(export to smollm3 or gemma3_text)")
        if len(windows) != len(layers):
            raise ScheduleExportError(f"layers {sorted(windows)} of {len(layers)} have a sliding window; a phi3 "
                                      f"config's sliding_window is every layer's (export to smollm3 or gemma3_text)")
        return {**out, "sliding_window": _one(windows, "sliding_window", model_type)}
    window = _one(windows, "sliding_window", model_type)
    out: dict[str, Any] = {"layer_types": types, "sliding_window": window, **_max_pos(max_pos)}
    if model_type == "smollm3":
        roped = {i: law for i, law in enumerate(laws) if law is not None}
        out.update(no_rope_layers=[int(law is not None) for law in laws], use_sliding_window=window is not None)
        if roped:  # every layer NoPE: no law to write, transformers' default is never used
            out["rope_parameters"] = _one(roped, "rope_parameters", model_type)
        return out
    if nope:  # gemma3_text
        raise ScheduleExportError(f"layers {nope} are NoPE; a gemma3_text config rotates every layer "
                                  f"(export to smollm3, whose no_rope_layers says which do not)")
    per_type = {}
    for t in (SLIDING, FULL):
        of_type = {i: law for i, law in enumerate(laws) if types[i] == t}
        per_type[t] = _one(of_type, f"rope_parameters of its {t} layers", model_type) if of_type else None
    # transformers fills a type no layer has with its own default law; name the other type's to keep it inert
    filler = per_type[SLIDING] or per_type[FULL]
    out["rope_parameters"] = {t: dict(per_type[t] or filler) for t in (SLIDING, FULL)}
    if window is None:
        out.pop("sliding_window")  # gemma3_text's default window stays; no layer is sliding
    return out


def _llama4(layers: Sequence[Layer]) -> dict[str, Any]:
    """`schedule_config` for ``llama4_text``: RoPE layers (one law, adjacent pairs, chunked or not)
    and NoPE layers, all with the log-position query temperature (`log_temperature`, one
    ``floor_scale`` and ``attn_scale``) or none; no sliding window."""
    mt = "llama4_text"
    windows = [i for i, (_, w, _) in enumerate(layers) if w is not None]
    if windows:
        raise ScheduleExportError(f"layers {windows} have a sliding window; a {mt} config has none (its local "
                                  f"layers are chunked: give them a chunk)")
    temps = {i: (float(e.floor_scale), float(e.attn_scale)) for i, (e, _, _) in enumerate(layers)
             if e is not None and e.name == "log_temperature"}
    plain = [i for i, (e, _, _) in enumerate(layers) if e is None or e.name == "nope"]
    if temps and plain:
        raise ScheduleExportError(f"layers {sorted(temps)} carry the query temperature and layers {plain} are NoPE "
                                  f"without it; a {mt} config's attn_temperature_tuning is every NoPE layer's")
    found = [None if (e is None or i in temps) else _rope_law(e, i, mt) for i, (e, _, _) in enumerate(layers)]
    roped = {i: f[0] for i, f in enumerate(found) if f is not None}
    chunks = {i: c for i, (_, _, c) in enumerate(layers) if c is not None}
    nope_chunked = sorted(set(chunks) - set(roped))
    if nope_chunked:
        raise ScheduleExportError(f"layers {nope_chunked} are chunked NoPE layers; a {mt} config chunks only "
                                  f"its RoPE layers")
    max_pos = _one({i: f[1] for i, f in enumerate(found) if f is not None and f[1] is not None},
                   "max_position_embeddings", mt)
    out: dict[str, Any] = {
        "no_rope_layers": [int(f is not None) for f in found],
        "layer_types": [CHUNKED if i in chunks else FULL for i in range(len(layers))],
        "attention_chunk_size": _one(chunks, "attention_chunk_size", mt),
        "attn_temperature_tuning": bool(temps), **_max_pos(max_pos)}
    if temps:
        floor_scale, out["attn_scale"] = _one(temps, "query temperature (floor_scale, attn_scale)", mt)
        if not floor_scale.is_integer():
            raise ScheduleExportError(f"floor_scale={floor_scale}: a {mt} config's floor_scale is an integer "
                                      f"number of tokens")
        out["floor_scale"] = int(floor_scale)
    if roped:
        out["rope_parameters"] = _one(roped, "rope_parameters", mt)
    return out
