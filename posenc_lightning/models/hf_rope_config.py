"""The ``rope_parameters`` a transformers config needs to compute what the encodings injected into
one of its models compute (`export_pretrained`'s plain-transformers form).

A model's config keeps its own shape: one law, or one per layer type (Gemma 3, Ergo, Beam: a type
whose entry is None rotates nothing). Each rotating layer's encoding must be a transformers law in
the model's own channel pairing (`RotaryEncoding.to_rope_parameters`), the layers of one type must
agree, and a layer the model leaves without positions (NoPE, Llama 4's temperature-only layers)
must still hold exactly what the model's own schedule gives it, windows and chunks included. When
any of that fails there is no plain-transformers form (None), never an approximate one.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from posenc_lightning.adapters import hf as adapter
from posenc_lightning.encodings.base import Encoding

__all__ = ["rope_config"]

Law = tuple[dict[str, Any], int | None]


def _layout(hf: nn.Module) -> str:
    """The channel pairing of the model's own rotation (its stand-in keeps the model's ``form``)."""
    form = getattr(adapter.rotary_module(hf), "form", "half")
    return "half" if form in ("half", "half_cos_sin") else "interleaved"


def _layer_encodings(hf: nn.Module, layers: list[nn.Module], types: list[str | None]) -> list[Encoding | None]:
    table = adapter.rotary_module(hf)
    if isinstance(table, adapter.RotaryTable):
        return [table.encoding_for(t) for t in types]
    return [m.__dict__.get("posenc") or getattr(m, "posenc", None) for m in layers]


def _per_type(params: Any) -> bool:
    return isinstance(params, dict) and any(isinstance(v, dict) or v is None for v in params.values())


def _positionless_kept(hf: nn.Module, layers: list[nn.Module], encs: list[Encoding | None]) -> list[bool] | None:
    """Per layer whether the model's own layer has positions (None: an injected schedule changed a
    layer without positions, or a window or chunk, which the config cannot say)."""
    own = adapter.model_schedule(hf).resolve(len(layers), getattr(hf.config, "layer_types", None))
    out = []
    for m, enc, o in zip(layers, encs, own):
        if (getattr(m, "posenc_window", None), getattr(m, "posenc_chunk", None)) != (o.window, o.chunk):
            return None
        if o.encoding in adapter.POSITIONLESS:
            name = enc.name if enc is not None else "nope"
            if name != o.encoding or (enc is not None and enc.config() != o.config and name != "nope"):
                return None
        out.append(o.encoding not in adapter.POSITIONLESS)
    return out


def rope_config(hf: nn.Module, scheduled: bool) -> Law | None:
    """The ``rope_parameters`` (and ``max_position_embeddings`` where a law fixes it) for ``hf``.

    Args:
        hf: a transformers ``PreTrainedModel`` with an encoding injected (`posenc_lightning.inject`).
        scheduled: whether a layer schedule was injected (the model's layers differ).

    Returns:
        ``(rope_parameters, max_position_embeddings or None)`` in the shape of the model's own config,
        or None where no transformers law expresses what the layers compute.
    """
    cfg = hf.config
    layers = adapter.attention_modules(hf)
    types = list(getattr(cfg, "layer_types", None) or [None] * len(layers))
    encs = _layer_encodings(hf, layers, types)
    own = cfg.rope_parameters
    if scheduled:
        positional = _positionless_kept(hf, layers, encs)
        if positional is None:
            return None
    else:
        positional = [not (_per_type(own) and own.get(t) is None) for t in types]
    layout = _layout(hf)
    laws: dict[str | None, Law] = {}
    for enc, t, has in zip(encs, types, positional):
        if not has:
            continue
        law = None if enc is None or enc.stages != frozenset({"rotate"}) else enc.to_rope_parameters(layout)
        key = t if _per_type(own) else None
        if law is None or laws.setdefault(key, law) != law:
            return None
    if not laws:
        return None
    max_pos = {m for _, m in laws.values() if m is not None}
    if len(max_pos) > 1:
        return None
    if _per_type(own):
        params: dict[str, Any] = {t: (dict(laws[t][0]) if t in laws else (None if v is None else dict(v)))
                                  for t, v in own.items()}
    else:
        params = dict(laws[None][0])
    return params, (max_pos.pop() if max_pos else None)
