"""Every decoder-only architecture of transformers' causal-LM mapping, tried with the Hugging Face
adapter on a tiny random config built locally (no weights downloaded).

``python benchmarks/hf_archs.py`` tries them all and writes ``docs/reference/hf-architectures.md``;
``tests/test_hf_architectures.py`` runs the same `trial` on every architecture, asserts that each
one works or is refused, and compares the page with the outcome.

An architecture *works* when, on its tiny model:

- injecting its own rope law (its ``rope_parameters``; for a model whose layers differ, its own
  per-layer schedule, `adapters.hf.model_schedule`) reproduces its logits (rotary models);
- after injecting each relative encoding (rope, alibi, fire, nope), the logits do not change when
  every position shifts by a constant (nothing absolute left behind); a model whose own layers
  depend on absolute positions by design (kept as the layer does it) moves them by at most twice
  what its own schedule moves them (``shift_own``);
- posenc's fused attention with a zero bias (alibi with zero slopes) equals the model's own
  attention with its positions neutralized (``nope``), on weights scaled so that the logits reach
  the model's softcap and its score scaling matters;
- cached greedy ``generate()`` (batch 2, row 1 left-padded) equals a full forward, for alibi and
  (rotary models) rope.

It is *refused* when ``inject`` raises `ArchitectureRefused` (the reason is the table's), and
*skipped* when it cannot be built tiny here or is not a decoder-only model (the reason is given).
"""

from __future__ import annotations

import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 64
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 64, "vocab_size": VOCAB, "max_position_embeddings": 64, "head_dim": 16}
#: (name pattern, cap) for config integers that size experts, ranks and feed-forward widths
SHRINK = [(re.compile(r".*(experts_per_tok|top_?k|num_experts_per).*"), 2),
          (re.compile(r".*(num_experts|n_routed_experts|num_local_experts|n_experts|moe_num_experts).*"), 4),
          (re.compile(r".*(n_shared_experts|num_shared_experts).*"), 1),
          (re.compile(r".*intermediate_size.*|.*ffn_dim.*|.*ffn_hidden.*|n_inner"), 64),
          (re.compile(r".*_rank$"), 16), (re.compile(r"n_group|topk_group|num_expert_group"), 1)]
PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "hf-architectures.md"
SHIFT = 7
SOFTCAP = 1.0  # a small cap, reached by the scaled logits


@dataclass
class Outcome:
    """One architecture: ``status`` works / refused / skipped, ``detail`` the reason or what it has."""

    arch: str
    status: str
    detail: str
    numbers: dict[str, float]


#: layer-pattern fields of hybrid (attention + state-space / recurrent) stacks, for two layers
HYBRID = {"attn_layer_indices": [1], "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
          "expert_layer_offset": 1}


def two_kinds(types: list[str]) -> list[str]:
    """Two layers of a per-layer kind list: one other kind, then an attention kind (full preferred)."""
    kinds = list(dict.fromkeys(types))
    if len(kinds) == 1:
        return kinds * 2
    attn = sorted((k for k in kinds if "attention" in str(k)), key=lambda k: "full" not in str(k))
    other = [k for k in kinds if k not in attn[:1]]
    return [other[0], attn[0]] if attn else kinds[:2]


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str) -> Any:
    """``AutoConfig.for_model(model_type)`` shrunk: 2 layers, hidden 64, 4 heads, vocab 64, small experts."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    for key, value in SMALL.items():
        if hasattr(cfg, key) or key in getattr(cfg, "attribute_map", {}):
            try:
                setattr(cfg, key, value)
            except (AttributeError, ValueError, TypeError):
                pass
    for key, value in list(vars(cfg).items()):
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if key.endswith("token_id") and value >= VOCAB:
            setattr(cfg, key, 0)
            continue
        for pattern, cap in SHRINK:
            if pattern.fullmatch(key) and value > cap:
                setattr(cfg, key, cap)
                break
    if hasattr(cfg, "qk_rope_head_dim"):  # latent attention: q/k heads are a nope and a rope slice
        cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.head_dim = 8, 8, 16, 8
    if hasattr(cfg, "mamba_d_ssm"):  # hybrid attention / state-space layers: a small state
        cfg.mamba_d_ssm, cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, cfg.mamba_chunk_size = 32, 4, 8, 8, 16
    if isinstance(getattr(cfg, "rotary_dim", None), int):
        cfg.rotary_dim = 8
    for key, value in HYBRID.items():  # hybrid stacks: the second of the two layers attends
        if getattr(cfg, key, None) is not None:
            setattr(cfg, key, value)
    for key in ("layer_types", "layers_block_type", "block_types"):
        types = vars(cfg).get(key)
        if isinstance(types, list) and len(types) > 2:
            setattr(cfg, key, two_kinds(types))
    if getattr(cfg, "attn_logit_softcapping", None):
        cfg.attn_logit_softcapping = SOFTCAP
    if getattr(cfg, "sliding_window", None):
        cfg.sliding_window = 8
    cfg.tie_word_embeddings = False
    return cfg


def build(model_type: str, seed: int = 0, config: dict[str, Any] | None = None) -> Any:
    """The tiny model (eval mode) or a string saying why it cannot be built here; ``config``: fields
    set on the tiny config (a variant of the architecture)."""
    from transformers import AutoModelForCausalLM

    try:
        cfg = tiny_config(model_type)
        for key, value in (config or {}).items():
            setattr(cfg, key, value)
    except Exception as e:  # noqa: BLE001 - the reason goes to the table
        return f"does not build or run tiny here: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    if getattr(cfg, "is_encoder_decoder", False):
        return "encoder-decoder"
    if set(getattr(cfg, "sub_configs", None) or ()) - {"attn_config", "ffn_config"}:
        return (f"composite model (sub-configs {', '.join(sorted(cfg.sub_configs))}; a text model is tried "
                f"under its own model_type)")
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():
            model(torch.randint(1, VOCAB, (1, 6)))
    except Exception as e:  # noqa: BLE001 - the reason goes to the table
        return f"does not build or run tiny here: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    if any(getattr(m, "is_causal", True) is False for m in model.modules() if "Attention" in type(m).__name__):
        return "not decoder-only: bidirectional (encoder) attention with a causal-LM head"
    return model


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def _logits(model: Any, ids: torch.Tensor, shift: int = 0) -> torch.Tensor:
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1) + shift
    with torch.no_grad():
        return model(ids, position_ids=pos).logits.float()


def _generate_error(model: Any) -> float:
    from benchmarks.hf_matrix import generate_error

    ids, mask = _ids()
    ids = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        return generate_error(model, ids, mask, prompt=ids.shape[1])


def _scale_attention(model: Any, factor: float) -> None:
    """Larger q.k (every weight matrix of the attention modules times ``factor``)."""
    from posenc_lightning.adapters._hf_arch import attention_modules

    with torch.no_grad():
        for m in attention_modules(model):
            for p in m.parameters():
                if p.dim() == 2:
                    p.mul_(factor)


def _own_rope(model: Any) -> Any:
    """The model's own rope law as a posenc encoding (per layer type: 'rope' with each type's base)."""
    from posenc_lightning.adapters._hf_arch import attention_modules
    from posenc_lightning.adapters.hf import head_dim_of
    from posenc_lightning.encodings.hf import from_hf

    info = _describe(model)
    params = dict(getattr(model.config, "rope_parameters", None) or {})
    if info.rotary.per_layer_type or params.get("rope_type", "default") == "default":
        return "rope", {}
    head_dim = head_dim_of(attention_modules(model)[0], model.config)
    return from_hf(params, head_dim, int(model.config.max_position_embeddings)), {}


def _describe(model: Any) -> Any:
    from posenc_lightning.adapters._hf_arch import describe

    return describe(model)


def describe_layered(model: Any) -> Any:
    """`describe` of a model with its own per-layer schedule (`adapters.hf.own_schedule`)."""
    from posenc_lightning.adapters._hf_arch import describe

    return describe(model, layered=True)


def trial(model_type: str, config: dict[str, Any] | None = None) -> Outcome:
    """Build ``model_type`` tiny (``config``: fields set on its config) and check every invariant of the
    module docstring (or the refusal)."""
    from posenc_lightning import inject
    from posenc_lightning.adapters._hf_arch import ArchitectureRefused

    warnings.filterwarnings("ignore")
    model = build(model_type, config=config)
    if isinstance(model, str):
        return Outcome(model_type, "skipped", model, {})
    from posenc_lightning.adapters.hf import model_schedule, own_schedule

    layered = own_schedule(model)  # its layers differ: an encoding by name goes through its schedule
    try:
        info = _describe(model) if layered is None else describe_layered(model)
    except ArchitectureRefused as e:
        return Outcome(model_type, "refused", str(e).split(": ", 1)[1], {})
    ids, _ = _ids()
    original = _logits(model, ids)
    nums: dict[str, float] = {}
    names = ["rope", "alibi", "fire", "nope"]
    refused: list[str] = []
    if info.rotary is not None:
        enc, cfg = (model_schedule(model), {}) if layered else _own_rope(model)
        inject(model, enc, **cfg)
        nums["own_rope"] = (_logits(model, ids) - original).abs().max().item()
        if layered:  # what its own layers do with absolute positions (kept): the shift checks' floor
            nums["shift_own"] = (_logits(model, ids, SHIFT) - _logits(model, ids)).abs().max().item()
        nums["gen_rope"] = _generate_error(model)
    for name in names:
        try:
            inject(model, name)
        except ArchitectureRefused as e:
            refused.append(f"{name}: {str(e).split(': ', 2)[-1]}")
            continue
        nums[f"shift_{name}"] = (_logits(model, ids, SHIFT) - _logits(model, ids)).abs().max().item()
        if name == "alibi":
            nums["gen_alibi"] = _generate_error(model)
    if "alibi" not in " ".join(refused):
        _scale_attention(model, 10.0)
        inject(model, "nope")
        own = _logits(model, ids)
        inject(model, "alibi")
        for m in info.layers:
            if m.posenc.name == "alibi":  # a model's NoPE layers stay NoPE (`adapters.hf.with_law`)
                m.posenc.slopes.zero_()
        nums["zero_bias"] = (_logits(model, ids) - own).abs().max().item()
        nums["logit_range"] = own.abs().max().item()
    detail = info.summary() + (f"; per layer: {layered}, so an encoding by name takes the place of the "
                               f"positions of the layers that have them" if layered else "")
    detail += "; " + "; ".join(refused) if refused else ""
    return Outcome(model_type, "works", detail, nums)


def violations(o: Outcome) -> list[str]:
    """Invariants an outcome breaks (empty: it works as the table says)."""
    tol = {"own_rope": 5e-4}  # fp32 angles computed in another order (bases up to 5e6)
    # a model's own absolute dependence (Beam's NoPE layers scale queries by (1 + (pos + 1) / 2048)^0.1
    # themselves, kept as the layer does it) bounds how far any encoding's logits may move under a shift
    floor = 2 * o.numbers.get("shift_own", 0.0)
    return [f"{k}={v:.3g}" for k, v in o.numbers.items() if k not in ("logit_range", "shift_own")
            and not v < tol.get(k, 1e-4) + (floor if k.startswith("shift_") else 0.0)]


def markdown(outcomes: list[Outcome]) -> str:
    """The page: counts, then one row per architecture."""
    import transformers

    count = {s: sum(o.status == s for o in outcomes) for s in ("works", "refused", "skipped")}
    lines = ["# Hugging Face architectures", "",
             (f"Every model type of transformers {transformers.__version__}'s `MODEL_FOR_CAUSAL_LM_MAPPING`, tried "
             "on a tiny random config with `posenc_lightning.inject` (generated by `python benchmarks/hf_archs.py`, "
             "checked by `tests/test_hf_architectures.py`; the invariants are in the script's docstring)."), "",
             (f"{len(outcomes)} model types: {count['works']} work, {count['refused']} are refused at inject "
             f"(a ValueError naming what is missing and the closest route), {count['skipped']} skipped."), "",
             ("*works*: injecting the model's own rope law reproduces its logits; after rope, alibi, fire or nope "
             "the logits do not change when every position shifts by a constant; posenc's fused attention with "
             "a zero bias equals the model's own attention with its positions neutralized (logits large enough "
             "for softcapping to matter); cached greedy `generate()` equals a full forward. A model that works "
             "may still refuse some encodings, named in its row. *refused*: `inject` raises "
             "`ArchitectureRefused` (a `ValueError`) with the reason shown. *skipped*: not decoder-only, or "
             "not buildable from a shrunk default config here (the error shown)."), "",
             "| model type | outcome | what the adapter found / why |", "|---|---|---|"]
    for o in outcomes:
        detail = o.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {o.arch} | {o.status} | {detail} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    torch.set_num_threads(1)
    outcomes = []
    for mt in model_types():
        o = trial(mt)
        outcomes.append(o)
        print(f"{mt:28s} {o.status:8s} {violations(o) or ''} {o.detail[:100]}", flush=True)
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(markdown(outcomes))


if __name__ == "__main__":
    main()
