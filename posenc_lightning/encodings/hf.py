"""Build the rotary encoding that matches a Hugging Face ``rope_parameters`` / ``rope_scaling`` dict."""

from __future__ import annotations

from typing import Any

from posenc_lightning.encodings.rope import RoPE, RotaryEncoding
from posenc_lightning.encodings.rope_scaling import DynamicNTK, Llama3, LongRoPE, PositionInterpolation, YaRN

__all__ = ["from_hf"]

_SUPPORTED = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def from_hf(rope_parameters: dict[str, Any] | None, head_dim: int, max_position_embeddings: int,
            original_max_position_embeddings: int | None = None) -> RotaryEncoding:
    """The encoding with the same ``inv_freq`` and attention scaling as HF's ``ROPE_INIT_FUNCTIONS``.

    Args:
        rope_parameters: the config's ``rope_parameters`` (transformers >= 5) or ``rope_scaling``
            (older, with ``type``); ``rope_theta`` and ``partial_rotary_factor`` are read from it.
        head_dim: the attention head size.
        max_position_embeddings: ``config.max_position_embeddings``.
        original_max_position_embeddings: a top-level ``config.original_max_position_embeddings``
            (Phi-3 keeps it outside the dict; it wins over the dict's value, as in HF).

    Returns:
        An encoding already bound to ``head_dim`` (``frequencies()`` works at once).
    """
    p = dict(rope_parameters or {})
    rope_type = p.get("rope_type", p.get("type", "default"))
    theta = float(p.get("rope_theta", p.get("theta", 10000.0)))
    common: dict[str, Any] = {"theta": theta, "partial_rotary_factor": float(p.get("partial_rotary_factor", 1.0))}
    original = original_max_position_embeddings or p.get("original_max_position_embeddings") or max_position_embeddings
    original = int(original)

    def need(key: str) -> Any:
        if p.get(key) is None:
            raise ValueError(f"from_hf: rope_type {rope_type!r} needs {key!r} in rope_parameters (got {sorted(p)})")
        return p[key]

    enc: RotaryEncoding
    if rope_type == "default":
        enc = RoPE(**common)
    elif rope_type == "linear":
        enc = PositionInterpolation(factor=float(need("factor")), original_max_position_embeddings=original, **common)
    elif rope_type == "dynamic":
        # HF's dynamic law measures lengths against config.max_position_embeddings
        enc = DynamicNTK(factor=float(need("factor")), original_max_position_embeddings=int(max_position_embeddings),
                         **common)
    elif rope_type == "yarn":
        factor = p.get("factor")
        factor = max_position_embeddings / original if factor is None else float(factor)
        enc = YaRN(factor=factor, original_max_position_embeddings=original, beta_fast=p.get("beta_fast") or 32.0,
                   beta_slow=p.get("beta_slow") or 1.0, mscale=p.get("mscale"), mscale_all_dim=p.get("mscale_all_dim"),
                   attention_factor=p.get("attention_factor"), truncate=p.get("truncate", True), **common)
    elif rope_type == "longrope":
        enc = LongRoPE(factor=p.get("factor"), short_factor=list(need("short_factor")),
                       long_factor=list(need("long_factor")), original_max_position_embeddings=original,
                       max_position_embeddings=int(max_position_embeddings),
                       attention_factor=p.get("attention_factor"), **common)
    elif rope_type == "llama3":
        enc = Llama3(factor=float(need("factor")), original_max_position_embeddings=original,
                     low_freq_factor=float(need("low_freq_factor")), high_freq_factor=float(need("high_freq_factor")),
                     **common)
    else:
        raise ValueError(f"from_hf: rope_type {rope_type!r} is not supported; supported: {', '.join(_SUPPORTED)}")
    return enc.bind(head_dim=int(head_dim))
