"""Every decoder-only architecture of transformers' causal-LM mapping works with the Hugging Face
adapter (its invariants hold) or is refused at inject: no silent outcome (`benchmarks.hf_archs`)."""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hf_archs import PAGE, Outcome, _scale_attention, build, markdown, model_types, trial, violations
from posenc_lightning import inject
from posenc_lightning.adapters._hf_arch import ArchitectureRefused, describe

warnings.filterwarnings("ignore")
SKIP_REASONS = ("encoder-decoder", "composite model", "does not build or run tiny here",
                "not decoder-only")


@functools.cache
def outcome(arch: str) -> Outcome:
    torch.manual_seed(0)
    return trial(arch)


@pytest.mark.parametrize("arch", model_types())
def test_works_or_is_refused(arch: str) -> None:
    o = outcome(arch)
    assert o.status in ("works", "refused", "skipped")
    if o.status == "skipped":
        assert o.detail.startswith(SKIP_REASONS), o.detail
    if o.status == "refused":
        assert "Closest supported route:" in o.detail
    assert not violations(o), f"{arch}: silently wrong: {violations(o)} ({o.detail})"
    if o.status == "works":
        assert {"shift_nope"} <= set(o.numbers) or "nope:" in o.detail


def test_page_is_the_generated_one() -> None:
    """docs/reference/hf-architectures.md is `markdown` of these outcomes (``python benchmarks/hf_archs.py``)."""
    assert PAGE.read_text() == markdown([outcome(a) for a in model_types()])


@pytest.mark.parametrize("arch,found", [("gemma2", "attention logit softcapping kept"),
                                        ("gemma3_text", "rotary (half, per layer type)"),
                                        ("cohere", "rotary (interleaved, one table)"),
                                        ("opt", "absolute `embed_positions` neutralized"),
                                        ("biogpt", "absolute `embed_positions` neutralized"),
                                        ("ctrl", "absolute `pos_encoding` neutralized")])
def test_the_families_of_the_issue_work(arch: str, found: str) -> None:
    o = outcome(arch)
    assert o.status == "works" and found in o.detail, o.detail
    assert o.numbers["shift_nope"] < 1e-4 and o.numbers["shift_alibi"] < 1e-4


@pytest.mark.parametrize("arch,why", [("bloom", "BloomAttention computes its scores itself"),
                                      ("mpt", "computes its scores itself"),
                                      ("deepseek_v3", "decoupled-rope"),
                                      ("kolibri1_1", "indexed sparse-attention layers")])
def test_the_refusals_of_the_issue_name_what_is_missing(arch: str, why: str) -> None:
    model = build(arch)
    with pytest.raises(ValueError, match="Closest supported route") as e:
        inject(model, "alibi")
    assert why in str(e.value) and arch in str(e.value)


def test_a_falcon_with_its_own_alibi_is_refused() -> None:
    """Falcon with ``alibi=True`` adds its ALiBi to the attention mask before the attention function:
    the adapter would read it as a mask, so it refuses the model rather than drop or double it."""
    from transformers import AutoModelForCausalLM

    from benchmarks.hf_archs import tiny_config

    cfg = tiny_config("falcon")
    cfg.alibi = True
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(ValueError, match="Closest supported route") as e:
        inject(model, "rope")
    assert "built-in ALiBi" in str(e.value) and "falcon" in str(e.value)


@pytest.mark.parametrize("variant", [{"new_decoder_architecture": True, "num_kv_heads": 2, "multi_query": False},
                                     {"multi_query": False, "parallel_attn": False}])
def test_falcons_grouped_and_sequential_variants_work(variant: dict) -> None:
    """Falcon's other attention layouts (grouped kv heads as Falcon-40B, one kv head per query head
    with sequential blocks): its own rope reproduced, the shifts invisible, a zero bias exact."""
    o = trial("falcon", config=variant)
    assert o.status == "works" and not violations(o), (o.detail, o.numbers)
    assert o.numbers["own_rope"] < 1e-5 and o.numbers["zero_bias"] < 1e-5


def test_softcapping_matters_in_the_zero_bias_check() -> None:
    """The zero-bias check of gemma2 runs with logits past its cap: without the cap they differ."""
    o = outcome("gemma2")
    assert o.numbers["zero_bias"] < 1e-4 and o.numbers["logit_range"] > 0
    model = build("gemma2")
    _scale_attention(model, 10.0)  # as in the trial
    ids = torch.randint(1, 64, (1, 10), generator=torch.Generator().manual_seed(0))
    inject(model, "alibi")
    for m in describe(model).layers:
        m.posenc.slopes.zero_()
        m.attn_logit_softcapping = 100.0 * m.attn_logit_softcapping
    with torch.no_grad():
        uncapped = model(ids).logits
        for m in describe(model).layers:
            m.attn_logit_softcapping = m.attn_logit_softcapping / 100.0
        capped = model(ids).logits
    assert (uncapped - capped).abs().max() > 1e-3


def test_an_unknown_position_mechanism_is_refused() -> None:
    model = build("llama")

    class Offset(torch.nn.Module):
        def forward(self, x, position_ids):
            return x

    model.model.pos_offset = Offset()
    with pytest.raises(ArchitectureRefused, match="unknown position module `model.pos_offset`"):
        inject(model, "alibi")
    del model.model.pos_offset

    class Rotary(torch.nn.Module):  # a rotary module whose table is not RoPE of its inv_freq
        def __init__(self, inner):
            super().__init__()
            self.inv_freq, self.inner = inner.inv_freq, inner

        def forward(self, x, position_ids):
            cos, sin = self.inner(x, 2 * position_ids)
            return cos, sin

    model.model.rotary_emb = Rotary(model.model.rotary_emb)
    with pytest.raises(ArchitectureRefused, match="not RoPE of its inv_freq"):
        inject(model, "rope")


@pytest.mark.parametrize("arch", ["cohere", "gptj", "gemma3_text"])
def test_a_dynamic_law_in_the_attention_equals_the_models_own_rope_inside_its_length(arch: str) -> None:
    """dynamic_ntk rotates q and k inside the attention function (the model's rotary module gives the
    identity); inside the original length it is plain rope, so the model's own logits come back: the
    layout (interleaved, GPT-J's pairs), the partial rotary dim and the per-layer-type bases follow the model."""
    model = build(arch)
    ids = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = model(ids).logits
    inject(model, "dynamic_ntk", factor=4.0)
    assert model.config._attn_implementation.startswith("posenc_wrap_")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, own, atol=1e-5, rtol=1e-5)


def test_readme_counts_are_the_pages() -> None:
    """The README's counts of working and refused architectures are the generated page's."""
    import re

    page = re.search(r"(\d+) model types: (\d+) work, (\d+) are refused", PAGE.read_text())
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    total, works, refused = page.groups()
    assert f"Of the {total} causal-LM model types" in readme
    assert f"{works} work and {refused} are refused" in readme
