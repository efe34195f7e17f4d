"""``posenc check-serving``: what transformers, vLLM, SGLang and llama.cpp compute from an exported
directory, against the trained model.

`export_facts` reads the directory (config.json, the posenc side file); `check_rules` applies the
rule table (`posenc_lightning.models.serving_rules.RULES`) at each engine's version; `compare_transformers`
loads the directory with the installed transformers and compares its logits, full forward and
KV-cached decoding, with a reference model (the trained one, or posenc's reading of the directory).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posenc_lightning.models.serving_rules import PINNED, RULES, Rule, in_range

#: what makes a directory divergent in `compare_transformers`
TOLERANCE = 1e-4
#: what ``posenc export --format gguf`` writes beside the GGUF file: its name, the llama.cpp version
#: that converted it, the keys posenc added
GGUF_MANIFEST = "posenc_gguf.json"


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor ``0.1 mscale ln(s) + 1`` (1 for ``s <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def export_facts(path: str) -> dict[str, Any]:
    """What the engines read from an exported directory.

    Args:
        path: a directory written by ``posenc export`` (or any ``save_pretrained`` directory).

    Returns:
        ``format`` (``transformers``, ``remote-code`` or ``posenc``), ``model_type``, ``encoding``,
        ``score_level``, ``rope_type``, ``fields`` (the rope parameters set), ``factor``, ``original``,
        ``max_position_embeddings``, ``extended``, and YaRN's ``yarn_default``, ``hf_attention``,
        ``attention_differs``, ``attn_ratio``; ``vllm_twice``; ``layer_types`` (per-layer-type attention);
        ``posenc_gguf`` (``posenc export --format gguf`` wrote a GGUF file here, `GGUF_MANIFEST`).

    Raises:
        ValueError: ``path`` has no config.json.
    """
    from posenc_lightning.encodings.registry import describe

    d = Path(path)
    if not (d / "config.json").is_file():
        raise ValueError(f"check-serving: {path} has no config.json; give a directory written by posenc export")
    cfg = json.loads((d / "config.json").read_text())
    spec = json.loads((d / "posenc_lightning.json").read_text()) if (d / "posenc_lightning.json").is_file() else None
    fmt = "remote-code" if "auto_map" in cfg and "posenc" in cfg else "posenc" if spec else "transformers"
    encoding = cfg["posenc"]["encoding"] if fmt == "remote-code" else spec["encoding"] if spec else None
    families = {name: family for name, family, _ in describe()}
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    max_pos = int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or 0)
    factor = float(rope.get("factor") or 1.0)
    original = int(rope.get("original_max_position_embeddings") or max_pos)
    facts: dict[str, Any] = {
        "format": fmt, "model_type": cfg.get("model_type"), "encoding": encoding,
        "score_level": families.get(encoding) in ("bias", "normalize"),
        "rope_type": rope_type, "rope_theta": float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        "fields": frozenset(k for k, v in rope.items() if v is not None), "factor": factor, "original": original,
        "max_position_embeddings": max_pos, "extended": factor > 1 and max_pos >= factor * original > original,
        "vllm_twice": int(max_pos * factor), "gguf_arch": str(cfg.get("model_type", "")).removeprefix("posenc_"),
        "layer_types": bool(cfg.get("layer_types")), "posenc_gguf": (d / GGUF_MANIFEST).is_file()}
    # YaRN's attention factor as transformers computes it (_compute_yarn_parameters) and as vLLM and
    # llama.cpp do (0.1 ln(s) + 1 times their own multiplier, attn_factor / --yarn-attn-factor)
    default = _yarn_mscale(factor)
    if rope.get("attention_factor") is not None:
        hf = float(rope["attention_factor"])
    elif rope.get("mscale") and rope.get("mscale_all_dim"):
        hf = _yarn_mscale(factor, float(rope["mscale"])) / _yarn_mscale(factor, float(rope["mscale_all_dim"]))
    else:
        hf = default
    # vLLM's get_rope reads attn_factor, a multiplier of its own 0.1 ln(s) + 1: the whole dict with it
    vllm_rope = {k: v for k, v in rope.items() if v is not None and k not in ("mscale", "mscale_all_dim",
                                                                             "attention_factor")}
    facts.update(yarn_default=default, hf_attention=hf, attention_differs=abs(hf - default) > 1e-6,
                 attn_ratio=hf / default, vllm_rope=json.dumps({**vllm_rope, "attn_factor": round(hf / default, 6)}))
    return facts


def applies(rule: Rule, facts: dict[str, Any]) -> bool:
    """Whether every condition of ``rule.when`` holds for ``facts`` (a set-valued fact must contain a
    listed value, any other fact must equal one)."""
    for key, values in rule.when:
        have = facts.get(key)
        ok = any(v in have for v in values) if isinstance(have, frozenset) else have in values
        if not ok:
            return False
    return True


@dataclass(frozen=True)
class Finding:
    """A rule that applies to the export at an engine's version, its messages filled in."""

    engine: str
    version: str
    what: str
    computes: str
    override: str
    source: str
    refuses: bool


def check_rules(facts: dict[str, Any], versions: dict[str, str] | None = None) -> list[Finding]:
    """The rules of `RULES` that apply to ``facts`` at each engine's version.

    Args:
        facts: `export_facts`'s answer.
        versions: engine -> version (default: `PINNED`; engines left out keep theirs).

    Returns:
        The findings, in the table's order.
    """
    at = {**PINNED, **(versions or {})}
    out = []
    for rule in RULES:
        version = at[rule.engine]
        if in_range(version, rule.since, rule.before) and applies(rule, facts):
            out.append(Finding(rule.engine, version, rule.what, rule.computes.format(**facts),
                               rule.override.format(**facts), rule.source, rule.refuses))
    return out


def reference_model(path: str) -> nn.Module:
    """posenc's reading of an exported directory: the weights with the encoding posenc injects for it
    (a rope law from ``rope_parameters``, the remote-code encoding from ``config.json["posenc"]``, a
    side file's encoding), the model's own positions reset."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from posenc_lightning.adapters import hf as adapter
    from posenc_lightning.encodings.hf import from_hf
    from posenc_lightning.inject import inject
    from posenc_lightning.models.hf_export import load_pretrained

    d = Path(path)
    cfg = json.loads((d / "config.json").read_text())
    if "posenc" in cfg and "auto_map" in cfg:
        base = {k: v for k, v in cfg.items() if k not in ("auto_map", "posenc", "architectures", "model_type")}
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"].removeprefix("posenc_"), **base))
        inject(model, cfg["posenc"]["encoding"], share_across_layers=False, **cfg["posenc"]["config"])
        state = {}
        for f in sorted(d.glob("*.safetensors")):
            state.update(load_file(str(f)))
        model.load_state_dict(state, strict=False)
        return model.eval()
    model = load_pretrained(str(d)).eval()
    params = adapter.rope_parameters(model.config)
    if (d / "posenc_lightning.json").is_file() or not params or params.get("rope_type", "default") == "default":
        return model
    layer = adapter.attention_modules(model)[0]
    law = from_hf(params, adapter.head_dim_of(layer, model.config), int(model.config.max_position_embeddings),
                  getattr(model.config, "original_max_position_embeddings", None))
    inject(model, law)
    return model.eval()


def compare_transformers(path: str, reference: nn.Module, n_tokens: int | None = None, seed: int = 0
                         ) -> dict[str, float]:
    """Load ``path`` with the installed transformers (``trust_remote_code`` for remote code) and compare
    with ``reference`` on the same random tokens.

    Args:
        path: the exported directory.
        reference: the trained model (or `reference_model`): a Hugging Face model or a module holding one.
        n_tokens: the sequence length (default: twice the original length, at most 64 tokens).
        seed: the tokens' seed.

    Returns:
        ``{"full": max |logits - reference|, "cached": the same over KV-cached greedy decoding from a
        prompt inside the original length to the end}``.
    """
    from transformers import AutoModelForCausalLM

    from posenc_lightning.models.hf_export import _single_hf

    facts = export_facts(path)
    engine = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                  trust_remote_code=facts["format"] == "remote-code").eval()
    ref = _single_hf(reference)
    n = n_tokens or min(64, 2 * facts["original"])
    vocab = int(engine.config.vocab_size)
    ids = torch.randint(1, vocab, (1, n), generator=torch.Generator().manual_seed(seed))
    prompt = max(2, min(facts["original"] - 2, n // 2))
    with torch.no_grad():
        full = (engine(ids).logits - ref(ids).logits).abs().max().item()
        gen = engine.generate(ids[:, :prompt], attention_mask=torch.ones_like(ids[:, :prompt]), max_new_tokens=n - prompt,
                              do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        steps = torch.stack(gen.logits, 1)
        want = ref(gen.sequences).logits[:, prompt - 1:-1]
        cached = (steps - want).abs().max().item()
    return {"full": full, "cached": cached}
