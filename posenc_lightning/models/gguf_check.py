"""Before a GGUF conversion: does every rope field the trained model uses reach a GGUF key that
llama.cpp's loader reads for a LLaMA-architecture model?

Read from the llama.cpp source llama-cpp-python 0.3.36 vendors (`SOURCES` names the file and function
of each fact). The converter (``convert_hf_to_gguf.py``) writes the keys in ``conversion/base.py``
``TextModel.set_gguf_parameters`` and, for LLaMA, ``conversion/llama.py`` ``LlamaModel``; the loader
reads them in ``src/llama-model.cpp`` ``llama_model_base::load_hparams`` and ``src/models/llama.cpp``
``llama_model_llama::load_arch_tensors``; ``src/llama-context.cpp`` (the ``llama_context``
constructor) and ``ggml/src/ggml.c`` / ``ggml-cpu/ops.cpp`` apply them.

`gguf_precheck` answers field by field: the key the field becomes, who writes it (the converter, or
posenc after converting: `WRITTEN_BY_POSENC`), or why llama.cpp cannot express it. Two keys the LLaMA
loader reads are not written by the converter for a LLaMA model: ``rope.scaling.attn_factor``
(YaRN's attention factor when it is not llama.cpp's own ``1 + 0.1 ln s``; LongRoPE's) and, for
LongRoPE, the ``rope_factors_long`` / ``rope_factors_short`` tensors and
``rope.scaling.original_context_length`` (the converter writes them for Phi-3 only,
``conversion/phi.py`` ``Phi3MiniModel.generate_extra_tensors``). ``posenc export --format gguf`` adds
them with llama.cpp's own gguf-py writer (`gguf_additions`); a directory converted by the plain
converter lacks them (``posenc_keys=False``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: where each fact below was read (llama-cpp-python 0.3.36's vendored llama.cpp)
SOURCES: dict[str, str] = {
    "write": "conversion/base.py TextModel.set_gguf_parameters",
    "llama3": "conversion/llama.py LlamaModel.generate_extra_tensors (rope_freqs)",
    "n_rot": "conversion/llama.py LlamaModel.set_gguf_parameters (rope.dimension_count = head_dim); "
             "src/llama-model.cpp load_hparams (LLaMA: n_rot must equal the head size)",
    "read": "src/llama-model.cpp llama_model_base::load_hparams",
    "tensors": "src/models/llama.cpp llama_model_llama::load_arch_tensors; src/llama-model.cpp get_rope_factors",
    "yarn": "src/llama-context.cpp llama_context::llama_context (ext_factor 1, attn factor (1 + 0.1 ln s) x "
            "rope.scaling.attn_factor); ggml/src/ggml.c ggml_rope_yarn_corr_dims (floor/ceil)",
    "phi3": "conversion/phi.py Phi3MiniModel.generate_extra_tensors (written for Phi-3 only)",
}

#: rope_type -> the GGUF rope.scaling.type the converter writes (None: none llama.cpp could read)
SCALING_TYPES: dict[str, str | None] = {"default": "(not written: plain rope)", "linear": "linear", "yarn": "yarn",
                                        "longrope": "longrope", "llama3": "(not written: the rope_freqs tensor)",
                                        "dynamic": None}

#: rope_type -> the rope_parameters fields transformers reads for it (modeling_rope_utils); others are inert
LAW_FIELDS: dict[str, frozenset[str]] = {
    "default": frozenset({"rope_theta", "partial_rotary_factor"}),
    "linear": frozenset({"rope_theta", "partial_rotary_factor", "factor"}),
    "dynamic": frozenset({"rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings"}),
    "yarn": frozenset({"rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
                       "attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow", "truncate"}),
    "longrope": frozenset({"rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
                           "attention_factor", "short_factor", "long_factor"}),
    "llama3": frozenset({"rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
                         "low_freq_factor", "high_freq_factor"}),
}

_ATTN = "{arch}.rope.scaling.attn_factor"
_ORIG = "{arch}.rope.scaling.original_context_length"
#: (rope_type or "*", field) -> (GGUF key, or None when llama.cpp's LLaMA loader reads none for it;
#: the reason; the `SOURCES` entry)
FIELDS: dict[tuple[str, str], tuple[str | None, str, str]] = {
    ("*", "rope_theta"): ("{arch}.rope.freq_base", "read", "read"),
    ("linear", "factor"): ("{arch}.rope.scaling.factor", "read (freq_scale = 1/factor)", "read"),
    ("yarn", "factor"): ("{arch}.rope.scaling.factor", "read", "read"),
    ("yarn", "original_max_position_embeddings"): (_ORIG, "read (the correction range's length)", "read"),
    ("yarn", "truncate"): ("(none)", "llama.cpp floors and ceils the correction range, as truncate=True", "yarn"),
    ("yarn", "beta_fast"): ("(none)", "the loader's default is 32 (yarn_beta_fast is written, not read for LLaMA)",
                            "read"),
    ("yarn", "beta_slow"): ("(none)", "the loader's default is 1 (yarn_beta_slow is written, not read for LLaMA)",
                            "read"),
    ("yarn", "attention_factor"): (_ATTN, ("the converter writes rope.scaling.yarn_attn_factor, which the LLaMA "
                                          "loader does not read"), "yarn"),
    ("yarn", "mscale"): (_ATTN, "not written by the converter (yarn_log_multiplier is commented out)", "yarn"),
    ("yarn", "mscale_all_dim"): (_ATTN, "not written by the converter (yarn_log_multiplier is commented out)",
                                 "yarn"),
    ("llama3", "factor"): ("rope_freqs", "folded into the llama3 frequency tensor", "llama3"),
    ("llama3", "low_freq_factor"): ("rope_freqs", "folded into the llama3 frequency tensor", "llama3"),
    ("llama3", "high_freq_factor"): ("rope_freqs", "folded into the llama3 frequency tensor", "llama3"),
    ("llama3", "original_max_position_embeddings"): ("rope_freqs", "folded into the llama3 frequency tensor",
                                                     "llama3"),
    ("longrope", "short_factor"): ("rope_factors_short", ("a tensor the LLaMA loader reads for scaling type "
                                                         "longrope; the converter writes it for Phi-3 only"), "phi3"),
    ("longrope", "long_factor"): ("rope_factors_long", ("a tensor the LLaMA loader reads for scaling type "
                                                       "longrope; the converter writes it for Phi-3 only"), "phi3"),
    ("longrope", "original_max_position_embeddings"): (_ORIG, ("where llama.cpp switches short to long factors; "
                                                              "the converter writes it for yarn only"), "tensors"),
    ("longrope", "factor"): (_ATTN, "only through the attention factor sqrt(1 + ln s / ln L) (freq_scale stays 1)",
                             "phi3"),
    ("longrope", "attention_factor"): (_ATTN, "the converter writes it for Phi-3 only", "phi3"),
}
#: the keys and tensors the converter does not write for a LLaMA model, added by posenc export --format gguf
WRITTEN_BY_POSENC = frozenset({_ATTN, "rope_factors_short", "rope_factors_long"})
#: the value llama.cpp assumes where it reads no key
DEFAULTS: dict[str, Any] = {"truncate": True, "beta_fast": 32.0, "beta_slow": 1.0}


@dataclass(frozen=True)
class FieldCheck:
    """One rope field: its value, the GGUF key it becomes (None: none), why, and who writes the key
    (``converter``, ``posenc`` after converting, or ``-`` where no key is needed)."""

    field: str
    value: Any
    key: str | None
    reason: str
    writer: str = "converter"
    source: str = ""


def longrope_attention(rope: dict[str, Any], max_position_embeddings: int) -> float:
    """LongRoPE's cos/sin factor as transformers computes it (``_compute_longrope_parameters``):
    ``attention_factor``, else ``sqrt(1 + ln s / ln L)`` for ``s = factor`` (or max / original
    positions) above 1."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    original = int(rope["original_max_position_embeddings"])
    factor = float(rope.get("factor") or max_position_embeddings / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def gguf_precheck(facts: dict[str, Any], rope_parameters: dict[str, Any], posenc_keys: bool = False
                  ) -> list[FieldCheck]:
    """Each rope field of an export against llama.cpp's LLaMA loader.

    Args:
        facts: `posenc_lightning.models.serving.export_facts` of the export.
        rope_parameters: its config's ``rope_parameters``.
        posenc_keys: count the keys posenc adds after converting (`WRITTEN_BY_POSENC`, ``posenc
            export --format gguf``); False: what the plain converter's file holds.

    Returns:
        One `FieldCheck` per field set (and one for the encoding or architecture llama.cpp cannot
        run); a ``key`` of None is what llama.cpp cannot express.
    """
    arch = facts["gguf_arch"]
    out = []
    if facts["encoding"] and facts["format"] != "transformers":
        out.append(FieldCheck("encoding", facts["encoding"], None,
                              "GGUF has no term for a posenc encoding: serve it with transformers", "-"))
    if facts.get("model_type") != "llama":
        out.append(FieldCheck("model_type", facts.get("model_type"), None,
                              "this check covers llama.cpp's LLaMA loader only (model_type llama)", "-"))
    if any(isinstance(v, dict) for v in rope_parameters.values()) or facts.get("layer_types"):
        out.append(FieldCheck("rope_parameters", "per layer type", None,
                              "the LLaMA loader reads one rope law for every layer", "-"))
        return out
    rope_type = facts["rope_type"]
    scaling = SCALING_TYPES.get(rope_type)
    out.append(FieldCheck("rope_type", rope_type, None if scaling is None else f"{arch}.rope.scaling.type = {scaling}",
                          "read" if scaling is not None else f"the converter writes no scaling type for {rope_type!r}",
                          source=SOURCES["write"]))
    law = LAW_FIELDS.get(rope_type, frozenset())
    for name, value in sorted(rope_parameters.items()):
        if name in ("rope_type", "type") or value is None:
            continue
        out.append(_field(arch, rope_type, name, value, facts, name in law, posenc_keys))
    return out


def _field(arch: str, rope_type: str, name: str, value: Any, facts: dict[str, Any], used: bool,
           posenc_keys: bool) -> FieldCheck:
    if name == "partial_rotary_factor":
        if float(value) == 1.0:
            return FieldCheck(name, value, "(none)", "full rotation, as rope.dimension_count = head_dim", "-",
                              SOURCES["n_rot"])
        return FieldCheck(name, value, None, "the LLaMA converter writes rope.dimension_count = head_dim and the "
                                             "loader requires it: a partial rotation would be a full one", "-",
                          SOURCES["n_rot"])
    entry = FIELDS.get((rope_type, name)) or FIELDS.get(("*", name))
    if entry is None:
        if not used:
            return FieldCheck(name, value, "(none)", f"transformers' {rope_type!r} law does not read it", "-")
        return FieldCheck(name, value, None, "no GGUF key known for it")
    key, reason, source = entry
    key = key.format(arch=arch) if key else None
    if name in DEFAULTS:
        if value != DEFAULTS[name]:
            return FieldCheck(name, value, None, f"{reason}; {value!r} differs from it", "-", SOURCES[source])
        return FieldCheck(name, value, key, reason, "-", SOURCES[source])
    if rope_type == "yarn" and key == _ATTN.format(arch=arch) and not facts["attention_differs"]:
        return FieldCheck(name, value, "(none)", "equals llama.cpp's own 1 + 0.1 ln s", "-", SOURCES[source])
    writer = "posenc" if key in {k.format(arch=arch) for k in WRITTEN_BY_POSENC} or (
        rope_type == "longrope" and name == "original_max_position_embeddings") else "converter"
    if writer == "posenc" and not posenc_keys:
        return FieldCheck(name, value, None, f"{reason}; posenc export --format gguf writes {key}", writer,
                          SOURCES[source])
    return FieldCheck(name, value, key, reason, writer, SOURCES[source])


def gguf_additions(facts: dict[str, Any], rope_parameters: dict[str, Any]) -> dict[str, Any]:
    """The keys and tensors posenc adds to the converter's file (`WRITTEN_BY_POSENC`), in the
    ``gguf_tool.py add`` spec format: YaRN's attention factor over llama.cpp's own, and LongRoPE's
    factor tensors, attention factor and original length."""
    arch = facts["gguf_arch"]
    rope_type = facts["rope_type"]
    spec: dict[str, Any] = {"float32": {}, "uint32": {}, "tensors": {}}
    if rope_type == "yarn" and facts["attention_differs"]:
        spec["float32"][_ATTN.format(arch=arch)] = float(facts["attn_ratio"])
    if rope_type == "longrope":
        spec["float32"][_ATTN.format(arch=arch)] = longrope_attention(rope_parameters,
                                                                      int(facts["max_position_embeddings"]))
        spec["uint32"][_ORIG.format(arch=arch)] = int(rope_parameters["original_max_position_embeddings"])
        spec["tensors"]["rope_factors_long.weight"] = [float(x) for x in rope_parameters["long_factor"]]
        spec["tensors"]["rope_factors_short.weight"] = [float(x) for x in rope_parameters["short_factor"]]
    return spec
