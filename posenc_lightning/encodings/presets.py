"""Named layer schedules of published models and papers (`LayerSchedule`s by name).

``inject(model, "irope")``, ``PosEncCallback("irope", config={"chunk": 64})`` and
``posenc train --encoding irope`` build them with `build_preset`; their arguments are keywords
(the window sizes default to the source's, far longer than a small test model's context).
Layers are counted as the sources count them: ``"every 4"`` is the 4th, 8th, ... layer
(`posenc_lightning.encodings.schedule`).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any

from posenc_lightning.encodings.schedule import LayerSchedule

__all__ = ["PRESETS", "available_presets", "build_preset", "preset"]

#: preset name -> the function that builds its schedule
PRESETS: dict[str, Callable[..., LayerSchedule]] = {}


def preset(name: str) -> Callable[[Callable[..., LayerSchedule]], Callable[..., LayerSchedule]]:
    """Register a function returning a `LayerSchedule` as the preset ``name``.

    Args:
        name: the preset's name.

    Returns:
        The decorator.
    """

    def deco(fn: Callable[..., LayerSchedule]) -> Callable[..., LayerSchedule]:
        if name in PRESETS:
            raise ValueError(f"preset {name!r} is registered twice")
        PRESETS[name] = fn
        return fn

    return deco


def available_presets() -> list[str]:
    """The preset names.

    Returns:
        The names, sorted.
    """
    return sorted(PRESETS)


def build_preset(name: str, **cfg: Any) -> LayerSchedule:
    """The schedule of preset ``name`` with its keyword arguments ``cfg``.

    Args:
        name: a preset's name (`available_presets`).
        **cfg: the preset's keyword arguments (its window sizes, bases, interval).

    Returns:
        The schedule, named ``name``.

    Raises:
        ValueError: an unknown preset (the message lists the known ones).
        TypeError: an argument the preset does not take.
    """
    fn = PRESETS.get(name)
    if fn is None:
        close = difflib.get_close_matches(name, list(PRESETS), n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"Unknown preset {name!r}.{hint} Known presets: {', '.join(available_presets())}.")
    params = inspect.signature(fn).parameters
    unknown = sorted(set(cfg) - set(params))
    if unknown:
        raise TypeError(f"preset {name}: unknown argument(s) {unknown}; it takes {list(params)}")
    schedule = fn(**cfg)
    schedule.name = name
    return schedule


@preset("rnope_swa")
def rnope_swa(window: int = 4096, theta: float = 10000.0, interval: int = 4) -> LayerSchedule:
    """RNoPE-SWA (Yang et al., Cohere, 2025, "Rope to Nope and Back Again: A New Hybrid Attention
    Strategy"): RoPE layers with a sliding window, and every ``interval``-th layer global attention
    with no positional encoding (the paper's 3:1 interleaving, window 4096).

    Args:
        window: the RoPE layers' sliding window (tokens).
        theta: RoPE's base.
        interval: every ``interval``-th layer is a global NoPE layer.
    """
    return LayerSchedule([{"layers": f"every {interval}", "encoding": "nope"},
                          {"layers": "rest", "encoding": "rope", "config": {"theta": theta}, "window": window}])


@preset("irope")
def irope(chunk: int = 8192, theta: float = 500000.0, interval: int = 4, floor_scale: float = 8192.0,
          attn_scale: float = 0.1, layout: str = "interleaved") -> LayerSchedule:
    """iRoPE of Llama 4 (Meta, Llama 4 model card, 2025; transformers' ``Llama4TextConfig``:
    ``attention_chunk_size`` 8192, ``no_rope_layers`` every 4th, ``attn_temperature_tuning`` with
    ``floor_scale`` 8192 and ``attn_scale`` 0.1, ``rope_theta`` 500000): chunked local attention with
    RoPE, and every ``interval``-th layer global attention without RoPE whose queries carry the
    log-position temperature (`log_temperature`).

    Args:
        chunk: the RoPE layers' attention chunk (tokens).
        theta: RoPE's base.
        interval: every ``interval``-th layer is a global NoPE layer.
        floor_scale, attn_scale: the NoPE layers' query temperature.
        layout: RoPE's channel pairs; Llama 4 rotates adjacent (``"interleaved"``) pairs, so a model
            trained with this preset exports to ``llama4_text`` (`models.hf_schedule`).
    """
    return LayerSchedule([
        {"layers": f"every {interval}", "encoding": "log_temperature",
         "config": {"floor_scale": floor_scale, "attn_scale": attn_scale}},
        {"layers": "rest", "encoding": "rope", "config": {"theta": theta, "layout": layout}, "chunk": chunk}])


@preset("smollm3_nope")
def smollm3_nope(theta: float = 10000.0, interval: int = 4) -> LayerSchedule:
    """SmolLM3's NoPE interleaving (Hugging Face, SmolLM3 model card, 2025; transformers'
    ``SmolLM3Config.no_rope_layer_interval`` 4): every ``interval``-th layer has no positional
    encoding, the others RoPE; all layers global.

    Args:
        theta: RoPE's base (SmolLM3 trains with larger ones; 10000 suits short contexts).
        interval: every ``interval``-th layer is a NoPE layer.
    """
    return LayerSchedule([{"layers": f"every {interval}", "encoding": "nope"},
                          {"layers": "rest", "encoding": "rope", "config": {"theta": theta}}])


@preset("gemma3_local_global")
def gemma3_local_global(window: int = 1024, local_theta: float = 10000.0, global_theta: float = 1000000.0,
                        interval: int = 6) -> LayerSchedule:
    """Gemma 3's local and global layers (Gemma Team, 2025, "Gemma 3 Technical Report", sec. 2:
    5 local sliding-window layers of 1024 tokens with RoPE base 10k for each global layer with base 1M;
    transformers' ``sliding_window_pattern`` 6).

    Args:
        window: the local layers' sliding window (tokens).
        local_theta, global_theta: RoPE's base in the local and the global layers.
        interval: every ``interval``-th layer is global.
    """
    return LayerSchedule([
        {"layers": f"every {interval}", "encoding": "rope", "config": {"theta": global_theta}},
        {"layers": "rest", "encoding": "rope", "config": {"theta": local_theta}, "window": window}])


@preset("p_rope")
def p_rope(p: float = 0.75, theta: float = 10000.0) -> LayerSchedule:
    """p-RoPE in every layer (Barbero et al., ICLR 2025, "Round and Round We Go! What makes Rotary
    Positional Encodings useful?", sec. 6: keep the fraction p of RoPE's highest frequencies and
    drop the lowest; 0.75 among the paper's best). It is RoPE's ``p`` argument (`RoPE`).

    Args:
        p: the kept fraction of the highest frequencies.
        theta: RoPE's base.
    """
    return LayerSchedule([{"layers": "rest", "encoding": "rope", "config": {"theta": theta, "p": p}}])
