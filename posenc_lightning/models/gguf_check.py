"""Before a GGUF conversion: does every rope field the trained model uses reach a GGUF key that
llama.cpp's loader reads for a LLaMA-architecture model?

Read from the llama.cpp source llama-cpp-python 0.3.36 vendors (``conversion/base.py`` writes the
keys, ``src/llama-model.cpp`` and ``src/models/llama.cpp`` read them, ``ggml/src/ggml.c`` floors and
ceils YaRN's correction range); nothing is converted or built here. `gguf_precheck` answers, field by
field, the key it becomes or why llama.cpp cannot express it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: rope_type -> the GGUF rope.scaling.type the converter writes (None: it writes none it could read)
SCALING_TYPES: dict[str, str | None] = {"default": "none", "linear": "linear", "yarn": "yarn",
                                        "longrope": "longrope (rope_factors_long/short tensors)",
                                        "llama3": "none (rope_freqs tensor)", "dynamic": None}

#: rope field -> (GGUF key, or None when the LLaMA loader reads none for it; the reason)
FIELDS: dict[str, tuple[str | None, str]] = {
    "rope_theta": ("{arch}.rope.freq_base", "read"),
    "factor": ("{arch}.rope.scaling.factor", "read"),
    "original_max_position_embeddings": ("{arch}.rope.scaling.original_context_length", "read"),
    "partial_rotary_factor": ("{arch}.rope.dimension_count", "read"),
    "short_factor": ("rope_factors_short", "a tensor"),
    "long_factor": ("rope_factors_long", "a tensor"),
    "low_freq_factor": ("rope_freqs", "folded into the llama3 frequency tensor"),
    "high_freq_factor": ("rope_freqs", "folded into the llama3 frequency tensor"),
    "truncate": ("(none)", "llama.cpp floors and ceils the correction range, as truncate=True"),
    "beta_fast": ("(none)", "the loader's default is 32 (no key is read for LLaMA)"),
    "beta_slow": ("(none)", "the loader's default is 1 (no key is read for LLaMA)"),
    "attention_factor": (None, "written as rope.scaling.yarn_attn_factor, which the LLaMA loader does not read"),
    "mscale": (None, "not written by the converter (yarn_log_multiplier is commented out), not read for LLaMA"),
    "mscale_all_dim": (None, "not written by the converter (yarn_log_multiplier is commented out), not read for LLaMA"),
}
#: the value llama.cpp assumes where it reads no key
DEFAULTS: dict[str, Any] = {"truncate": True, "beta_fast": 32.0, "beta_slow": 1.0}


@dataclass(frozen=True)
class FieldCheck:
    """One rope field: its value, the GGUF key it becomes (None: none), and why."""

    field: str
    value: Any
    key: str | None
    reason: str


def gguf_precheck(facts: dict[str, Any], rope_parameters: dict[str, Any]) -> list[FieldCheck]:
    """Each rope field of an export against llama.cpp's LLaMA loader.

    Args:
        facts: `posenc_lightning.models.serving.export_facts` of the export.
        rope_parameters: its config's ``rope_parameters``.

    Returns:
        One `FieldCheck` per field set (and one for the encoding when it acts on the scores); a
        ``key`` of None is what llama.cpp cannot express.
    """
    arch = facts["gguf_arch"]
    out = []
    if facts["encoding"] and facts["format"] != "transformers":
        out.append(FieldCheck("encoding", facts["encoding"], None,
                              "GGUF has no term for a posenc encoding: serve it with transformers"))
    rope_type = facts["rope_type"]
    scaling = SCALING_TYPES.get(rope_type)
    out.append(FieldCheck("rope_type", rope_type, None if scaling is None else f"{arch}.rope.scaling.type = {scaling}",
                          "read" if scaling is not None else f"the converter writes no scaling type for {rope_type!r}"))
    for name, value in sorted(rope_parameters.items()):
        if name in ("rope_type", "type") or value is None:
            continue
        key, reason = FIELDS.get(name, (None, "no GGUF key known for it"))
        if key is None and name in ("attention_factor", "mscale", "mscale_all_dim") and not facts["attention_differs"]:
            key, reason = "(none)", "equals llama.cpp's own 1 + 0.1 ln s"
        if name in DEFAULTS and value != DEFAULTS[name]:
            key, reason = None, f"{reason}; {value!r} differs from it"
        out.append(FieldCheck(name, value, key if key is None else key.format(arch=arch), reason))
    return out
