"""Architecture x encoding matrix of the Hugging Face adapter: tiny random configs of real
transformers architectures (built locally, no weights downloaded), every cell checked.

``python benchmarks/hf_matrix.py`` runs every cell, writes ``benchmarks/results/hf_matrix.md`` and
the table of ``docs/reference/hf-matrix.md``. ``tests/test_hf_matrix.py`` runs the same `check` on
every cell and asserts its numbers. `BREADTH` adds the families of issue 32 (Gemma 2's softcapping,
Gemma 3's per-layer-type rope, Cohere's interleaved layout, OPT's learned table, BLOOM's built-in
ALiBi: refused) with alibi, fire and yarn.

A cell checks, on the model with the encoding injected by `posenc_lightning.inject`:
forward finite and different from the original model; greedy ``generate()`` with the KV cache
(batch 2, row 1 left-padded) equal, step by step, to a full forward over the same tokens; the
backward reaching every encoding parameter; a ``Trainer.fit`` of `HFCausalLM` with
``PosEncCallback`` and its checkpoint reloaded by ``load_from_checkpoint`` giving identical logits.
"""

from __future__ import annotations

import copy
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB, PROMPT, NEW, PAD = 64, 20, 4, 3
#: model_type -> tiny config arguments (max_position_embeddings 16 < the 24 tokens checked, so the
#: dynamic laws switch; Mistral's window 12 is crossed)
ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "num_key_value_heads": 2},
    "mistral": {"model_type": "mistral", "num_key_value_heads": 2, "sliding_window": 12},
    "qwen2": {"model_type": "qwen2", "num_key_value_heads": 2},
    "gpt_neox": {"model_type": "gpt_neox", "rotary_pct": 0.25},
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 32, "n_inner": 64,
                 "bos_token_id": 0, "eos_token_id": 0},
    "phi": {"model_type": "phi", "partial_rotary_factor": 0.5},
}
#: families beyond the six (issue 32): score transforms, per-layer-type rope, the interleaved layout,
#: absolute tables outside ``wpe``, built-in ALiBi; checked with `BREADTH_ENCODINGS`
BREADTH: dict[str, dict[str, Any]] = {
    "gemma2": {"model_type": "gemma2", "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 12,
               "query_pre_attn_scalar": 16, "attn_logit_softcapping": 2.0},
    "gemma3_text": {"model_type": "gemma3_text", "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 12,
                    "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 16,
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}},
    "cohere": {"model_type": "cohere", "num_key_value_heads": 2},
    "opt": {"model_type": "opt", "ffn_dim": 64, "word_embed_proj_dim": 64, "max_position_embeddings": 32},
    "bloom": {"model_type": "bloom", "n_head": 4, "n_layer": 2},
}
BREADTH_ENCODINGS = ("alibi", "fire", "yarn")
#: architectures whose transformers class refuses sdpa
EAGER = ("gemma2", "bloom")
ARCH_CONFIGS = {**ARCHS, **BREADTH}
_COMMON = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 0}
ENCODINGS: dict[str, dict[str, Any]] = {
    "alibi": {}, "relative_bias": {}, "fire": {}, "fox": {}, "cope": {}, "sba": {}, "rope_alibi": {}, "nope": {},
    "yarn": {"factor": 4.0}, "dynamic_ntk": {"factor": 4.0}, "llama3": {"factor": 4.0}, "long_rope": {"factor": 4.0},
}
ROTARY = ("yarn", "dynamic_ntk", "llama3", "long_rope")


def config(arch: str) -> dict[str, Any]:
    """The `HFCausalLM` ``config`` dict of an architecture."""
    cfg = dict(ARCH_CONFIGS[arch])
    if arch != "gpt2":
        cfg = {**_COMMON, **cfg}
    return {"vocab_size": VOCAB, **cfg}


def cells() -> list[tuple[str, str]]:
    return [(a, e) for a in ARCHS for e in ENCODINGS]


def breadth_cells() -> list[tuple[str, str]]:
    """`BREADTH` x `BREADTH_ENCODINGS` (yarn where the model has a rotary module)."""
    return [(a, e) for a in BREADTH for e in BREADTH_ENCODINGS if e != "yarn" or a not in ("opt", "bloom")]


def build(arch: str, seed: int = 0):
    from posenc_lightning.models.hf import HFCausalLM

    torch.manual_seed(seed)
    impl = "eager" if arch in EAGER else "sdpa"
    return HFCausalLM(config=copy.deepcopy(config(arch)), attn_implementation=impl).eval()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, PROMPT), generator=g)
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[1, :PAD] = 0
    ids[1, :PAD] = 0
    return ids, mask


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp_min(0)


def generate_error(hf, ids: torch.Tensor, mask: torch.Tensor, prompt: int = PROMPT) -> float:
    """Largest |cached-decoding logits - full-forward logits| over the generated steps."""
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                      output_logits=True, return_dict_in_generate=True)
    err = 0.0
    for t, step_logits in enumerate(out.logits):
        m = torch.cat((mask, torch.ones(2, t, dtype=mask.dtype)), 1)
        full = hf(out.sequences[:, :prompt + t], attention_mask=m, position_ids=_positions(m), use_cache=False).logits
        err = max(err, (full[:, -1] - step_logits).abs().max().item())
    return err


def _fit_and_reload(arch: str, name: str, cfg: dict[str, Any], tmp: str) -> float:
    from lightning.pytorch import Trainer

    from posenc_lightning import PosEncCallback
    from posenc_lightning.models.hf import HFCausalLM

    module = build(arch)
    g = torch.Generator().manual_seed(2)
    data = [(x[:-1], x[1:]) for x in torch.randint(0, VOCAB, (4, 25), generator=g)]
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    trainer = Trainer(max_steps=2, callbacks=[PosEncCallback(name, **cfg)], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp)
    trainer.fit(module, loader)
    path = str(Path(tmp) / f"{arch}-{name}.ckpt")
    trainer.save_checkpoint(path)
    ids, mask = _inputs()
    module.eval()
    with torch.no_grad():
        before = module(ids, attention_mask=mask, positions=_positions(mask))
        again = HFCausalLM.load_from_checkpoint(path).eval()
        after = again(ids, attention_mask=mask, positions=_positions(mask))
    return (after - before).abs().max().item()


def check(arch: str, name: str, fit: bool = True) -> dict[str, Any]:
    """Every number of one cell (see the module docstring)."""
    from posenc_lightning import inject
    from posenc_lightning.adapters.hf import ArchitectureRefused

    cfg = ENCODINGS.get(name, {"factor": 4.0} if name == "yarn" else {})
    ids, mask = _inputs()
    module = build(arch).eval()
    hf = module.model
    with torch.no_grad():
        original = hf(ids).logits
    try:
        inject(module, name, **cfg)
    except ArchitectureRefused as e:
        return {"arch": arch, "encoding": name, "refused": str(e)}
    with torch.no_grad():
        logits = hf(ids).logits
        gen = generate_error(hf, ids, mask)
    params = {n: p for n, p in module.named_parameters() if "posenc" in n}
    hf.train()
    hf(ids, attention_mask=mask).logits.float().square().mean().backward()
    grads = {n: (p.grad is not None and bool(p.grad.isfinite().all()) and p.grad.abs().sum().item() > 0)
             for n, p in params.items()}
    out = {"arch": arch, "encoding": name, "mode": hf.config._attn_implementation,
           "rotary": type(getattr(hf.base_model, "rotary_emb", None)).__name__,
           "finite": bool(logits.isfinite().all()), "changed": (logits - original).abs().max().item(),
           "generate_err": gen, "n_params": len(params), "grads_ok": all(grads.values()), "grads": grads}
    if fit:
        with tempfile.TemporaryDirectory() as tmp:
            out["reload_err"] = _fit_and_reload(arch, name, cfg, tmp)
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """The docs table: one row per architecture, one column per encoding (blank: not a cell)."""
    archs, encs = list(ARCH_CONFIGS), list(ENCODINGS)
    by = {(r["arch"], r["encoding"]): r for r in rows}
    lines = ["| architecture | " + " | ".join(encs) + " |", "|---" * (len(encs) + 1) + "|"]
    for a in archs:
        cells_ = []
        for e in encs:
            r = by.get((a, e))
            if (a, e) not in set(cells()) | set(breadth_cells()):
                cells_.append("refused" if r is not None and r.get("refused") else "")
                continue
            if r is not None and r.get("refused"):
                cells_.append("refused")
                continue
            ok = r is not None and r["finite"] and r["changed"] > 1e-6 and r["generate_err"] < 1e-4 \
                and r["grads_ok"] and r.get("reload_err", 0.0) == 0.0
            cells_.append("✓" if ok else "✗")
        lines.append(f"| {a} | " + " | ".join(cells_) + " |")
    return "\n".join(lines)


PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "hf-matrix.md"


def page(table: str) -> str:
    """docs/reference/hf-matrix.md around the table."""
    return ("# Hugging Face adapter: architecture x encoding\n\n"
            "Each cell: `posenc_lightning.inject` on a tiny random config of the architecture; cached greedy "
            "`generate()` equals a full forward, the backward reaches every encoding parameter, `Trainer.fit` "
            "runs and its checkpoint reloads to identical logits (`benchmarks/hf_matrix.py`, checked by "
            "`tests/test_hf_matrix.py`). `refused`: `inject` raises a ValueError naming what is missing. Every "
            "other architecture of transformers: [hf-architectures.md](hf-architectures.md).\n\n" + table + "\n")


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rows = []
    for arch, name in cells() + breadth_cells():
        r = check(arch, name)
        rows.append(r)
        if r.get("refused"):
            print(f"{arch:9s} {name:14s} refused: {r['refused']}", flush=True)
            continue
        print(f"{arch:9s} {name:14s} {r['mode']:18s} changed={r['changed']:.3g} gen_err={r['generate_err']:.2g} "
              f"params={r['n_params']} grads_ok={r['grads_ok']} reload_err={r['reload_err']:.2g}", flush=True)
    table = markdown(rows)
    root = Path(__file__).resolve().parents[1]
    detail = [("| arch | encoding | mode | max change vs original | generate vs full forward | encoding params "
              "(grads) | checkpoint reload |"), "|---|---|---|---|---|---|---|"]
    detail += [f"| {r['arch']} | {r['encoding']} | {r['mode'] if r['mode'] != 'sdpa' else r['rotary']} | "
               f"{r['changed']:.3g} | {r['generate_err']:.2g} | {r['n_params']} ({'ok' if r['grads_ok'] else 'MISSING'}) | "
               f"{r['reload_err']:.2g} |" for r in rows if not r.get("refused")]
    out = root / "benchmarks" / "results" / "hf_matrix.md"
    out.write_text("# Hugging Face adapter: architecture x encoding\n\nCommand: `python benchmarks/hf_matrix.py` "
                   f"(torch {torch.__version__}, CPU, fp32).\n\n{table}\n\n" + "\n".join(detail) + "\n")
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(page(table))
    print(table)


if __name__ == "__main__":
    main()
