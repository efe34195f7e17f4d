"""What each serving engine computes from an exported directory, as data: one `Rule` per known
divergence (or refusal), per engine and version range, with the override to pass.

A rule applies when every condition of its ``when`` holds for the export's facts
(`posenc_lightning.models.serving.export_facts`): a fact equal to one of the listed values, or, for a
set-valued fact (``fields``, the ``rope_parameters`` keys set to a value), containing the listed
key. Messages and overrides are ``str.format`` templates over the facts. Each rule names its source
(an issue or pull request); versions are ``[since, before)``, None for open.

Engines and the versions pinned by default (`PINNED`): transformers (installed here, also compared
numerically), vLLM, SGLang (from their documented config handling and the issues named: not run here)
and llama.cpp, versioned as the copy llama-cpp-python vendors (0.3.36: its ``conversion/base.py``,
``src/llama-model.cpp`` and ``src/llama-context.cpp`` read for these rules; not built or run here).
"""

from __future__ import annotations

from dataclasses import dataclass

#: the version each engine is checked at unless the caller names another
PINNED: dict[str, str] = {"transformers": "5.25.0", "vllm": "0.25.0", "sglang": "0.5.0", "llama.cpp": "0.3.36"}

#: what each engine reads from the directory (the guide's table; `posenc check-serving` prints it)
READS: dict[str, str] = {
    "transformers": "config.json rope_parameters (every rope_type), auto_map with trust_remote_code",
    "vllm": "config.json rope_parameters through get_rope (yarn: factor, beta_fast, beta_slow, attn_factor); "
            "max_position_embeddings for max_model_len; --model-impl transformers runs the modeling code "
            "with vLLM's attention",
    "sglang": "config.json through its own model classes; --model-impl transformers as vLLM's",
    "llama.cpp": "GGUF keys written by convert_hf_to_gguf.py: rope.freq_base, rope.scaling.type "
                 "(none, linear, yarn, longrope), rope.scaling.factor, rope.scaling.original_context_length, "
                 "rope.scaling.attn_factor, context_length; the rope_freqs (llama3) and rope_factors_long/short "
                 "(longrope) tensors",
}


@dataclass(frozen=True)
class Rule:
    """One known way an engine computes something else than the trained model.

    Attributes:
        engine: ``transformers``, ``vllm``, ``sglang`` or ``llama.cpp``.
        since, before: the versions it holds for, ``[since, before)`` (None: unbounded).
        when: ``(fact, values)`` pairs that must all hold (`posenc_lightning.models.serving.applies`).
        what: which quantity differs (rope law, attention factor, length limit, score-level encoding).
        computes: what the engine computes (a template over the facts).
        override: what to pass instead (a template over the facts).
        source: the issue or pull request that documents it.
        refuses: the engine refuses the directory (an error, not a silent divergence).
    """

    engine: str
    since: str | None
    before: str | None
    when: tuple[tuple[str, tuple[object, ...]], ...]
    what: str
    computes: str
    override: str
    source: str
    refuses: bool = False


YARN = ("yarn",)
RULES: tuple[Rule, ...] = (
    # ---- vLLM ----
    Rule("vllm", None, "0.26.0", (("rope_type", YARN), ("fields", ("mscale_all_dim",)), ("attention_differs", (True,))),
         "attention factor",
         "cos/sin multiplier 0.1 ln(s) + 1 = {yarn_default:.4f}, ignoring mscale/mscale_all_dim "
         "(transformers: {hf_attention:.4f})",
         "--hf-overrides '{{\"rope_parameters\": {vllm_rope}}}'",
         "vllm-project/vllm#48621, fixed by #56446"),
    Rule("vllm", None, "0.26.0", (("rope_type", YARN), ("fields", ("attention_factor",)), ("attention_differs", (True,))),
         "attention factor",
         "drops attention_factor (get_rope reads attn_factor only): multiplier {yarn_default:.4f} "
         "(transformers: {hf_attention:.4f})",
         "--hf-overrides '{{\"rope_parameters\": {vllm_rope}}}'",
         "vllm-project/vllm#46280, #48351"),
    Rule("vllm", None, "0.26.0", (("rope_type", ("linear", "dynamic", "deepseek_yarn")), ("extended", (True,))),
         "length limit",
         "max_model_len = max_position_embeddings x factor = {vllm_twice}: the factor applied a second time "
         "to an already extended max_position_embeddings ({max_position_embeddings})",
         "--max-model-len {max_position_embeddings}", "vllm-project/vllm#56446, #53634"),
    Rule("vllm", None, "0.20.0", (("rope_type", ("dynamic",)),), "rope law",
         "dynamic NTK as one constant base theta (s^2 - s + 1)^(d/(d-2)) at every length (transformers: "
         "theta up to the original length, then the base of each length)",
         "serve with transformers, or export a static law (ntk with the serving length's factor)",
         "vllm-project/vllm#41236, fixed by #41277"),
    Rule("vllm", "0.20.0", None, (("rope_type", ("dynamic",)),), "rope law",
         "dynamic NTK as one constant base, that of max_model_len, at every length (transformers: theta up "
         "to the original length)",
         "serve with transformers, or export a static law (ntk with the serving length's factor)",
         "vllm-project/vllm#3488, #5093"),
    Rule("vllm", "0.7.0", "0.12.0", (("rope_type", ("longrope",)),), "rope law",
         "switches short/long factors at original_max_position_embeddings per batch: under concurrent "
         "requests the cached keys of a request were rotated with the other factors (corrupted KV cache)",
         "--max-num-seqs 1, or export with short_factor = long_factor", "vllm-project/vllm#27414, fixed by #27431"),
    Rule("vllm", "0.12.0", None, (("rope_type", ("longrope",)), ("extended", (True,))), "rope law",
         "picks short or long factors once, from max_model_len: long factors for every request, short ones "
         "included (transformers: short factors up to original_max_position_embeddings)",
         "--max-model-len {original} for short-context serving, or export with short_factor = long_factor",
         "vllm-project/vllm#27431"),
    Rule("vllm", None, None, (("score_level", (True,)),), "score-level encoding",
         "--model-impl transformers replaces the attention function: {encoding}'s score-level term is "
         "silently lost (q/k rotations would survive)",
         "serve with transformers (trust_remote_code=True); no vLLM flag keeps it",
         "vLLM Transformers backend docs (attention replaced by vLLM's)"),
    Rule("vllm", None, None, (("format", ("remote-code",)),), "architecture",
         "no native class for model_type {model_type}: refused unless --model-impl transformers, which "
         "drops the encoding (above)", "serve with transformers", "vLLM supported-models docs", refuses=True),
    # ---- SGLang ----
    Rule("sglang", None, None, (("score_level", (True,)),), "score-level encoding",
         "--model-impl transformers replaces the attention function (RadixAttention): {encoding}'s "
         "score-level term is silently lost (q/k rotations would survive)",
         "serve with transformers (trust_remote_code=True); no SGLang flag keeps it",
         "SGLang Transformers fallback docs"),
    Rule("sglang", None, None, (("format", ("remote-code",)),), "architecture",
         "no native class for model_type {model_type}: refused unless --model-impl transformers, which "
         "drops the encoding (above)", "serve with transformers", "SGLang supported-models docs", refuses=True),
    # ---- llama.cpp (as vendored by llama-cpp-python 0.3.36) ----
    Rule("llama.cpp", None, None, (("rope_type", YARN), ("attention_differs", (True,)), ("posenc_gguf", (False,))),
         "attention factor",
         "mscale = (1 + 0.1 ln s) x rope.scaling.attn_factor = {yarn_default:.4f} (transformers: "
         "{hf_attention:.4f}): the converter writes attention_factor as rope.scaling.yarn_attn_factor, which the "
         "LLaMA loader does not read, and leaves mscale_all_dim out; --yarn-attn-factor is overwritten for YaRN",
         "--override-kv {gguf_arch}.rope.scaling.attn_factor=float:{attn_ratio:.6g}, or posenc export --format gguf "
         "(writes that key)",
         "llama.cpp conversion/base.py, src/llama-context.cpp (llama_context constructor)"),
    Rule("llama.cpp", None, None, (("rope_type", ("dynamic",)),), "rope law",
         "the converter writes no scaling type for dynamic (HunYuan only): plain rope (theta {rope_theta:g})",
         "export a static law (ntk, yarn) for GGUF", "llama.cpp conversion/base.py"),
    Rule("llama.cpp", None, None, (("rope_type", ("longrope",)),), "rope law",
         "chooses long/short factors from the context size (-c > original), not the sequence: short requests "
         "under a long -c get the long factors",
         "-c {original} for short-context serving, or export with short_factor = long_factor",
         "llama.cpp src/llama-model.cpp (get_rope_factors); ggml-org/llama.cpp#24875"),
    Rule("llama.cpp", None, None, (("format", ("remote-code", "posenc")),), "score-level encoding",
         "the converter knows no {encoding} term: a remote-code architecture is refused; a posenc side file "
         "is silently left out", "serve with transformers", "llama.cpp convert_hf_to_gguf.py", refuses=True),
    # ---- transformers ----
    Rule("transformers", None, None, (("rope_type", ("dynamic",)),), "rope law",
         "dynamic NTK caches rotated keys: decoding past the original length keeps the prefix's keys at "
         "the old base (posenc caches un-rotated keys)",
         "re-encode the prompt at the final length, or export a static law (ntk)",
         "huggingface/transformers#25104"),
    Rule("transformers", None, None, (("rope_type", ("longrope",)), ("extended", (True,))), "rope law",
         "longrope switches short to long factors when the sequence passes {original} tokens; keys cached "
         "before keep the short factors", "re-encode the prompt at the final length, or export with "
         "short_factor = long_factor", "measured: posenc check-serving's cached decoding (transformers 5.25.0)"),
    Rule("transformers", None, None, (("format", ("posenc",)),), "score-level encoding",
         "AutoModelForCausalLM loads the weights without {encoding} (a posenc side file)",
         "posenc export --format remote-code, or posenc_lightning.load_pretrained", "posenc_lightning.json"),
)


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.25.0"`` -> ``(0, 25, 0)``; a build tag ``"b6000"`` -> ``(6000,)``."""
    parts = [p for p in version.lstrip("bv").replace("-", ".").split(".") if p.isdigit()]
    return tuple(int(p) for p in parts)


def in_range(version: str, since: str | None, before: str | None) -> bool:
    """``since <= version < before`` (None: unbounded)."""
    v = version_tuple(version)
    return (since is None or v >= version_tuple(since)) and (before is None or v < version_tuple(before))
