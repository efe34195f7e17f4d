"""A transformers model with an injected encoding compiles like the model itself: no graph break in
a training forward for every registered encoding (tiny random Llama, built locally), and
``torch.compile(fullgraph=True)`` equals eager, forward and gradients, for the bias encodings'
fused attention path, packed documents included (positions restarting)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hf_matrix import build, config
from posenc_lightning import inject
from posenc_lightning.encodings.registry import available_encodings, build_encoding

IDS = torch.randint(1, 64, (2, 20), generator=torch.Generator().manual_seed(3))
#: a dynamic rotary law's frequencies depend on the largest position, which transformers always
#: passes as a tensor (``position_ids``): one read per layer, as transformers' own dynamic rope
#: (docs/guides/compile.md, declared exceptions)
EXCEPTIONS = {n: "reads the largest position (dynamic law)" for n in ("dynamic_ntk", "long_rope", "clex")}


def _llama(name: str):
    """A tiny Llama (a GPT-2 for encodings that add positions to the embeddings, which need its
    ``wpe``); as many key heads as query heads (per-head encodings refuse GQA)."""
    if "embed" in build_encoding(name).stages:
        m = build("gpt2").model
    else:
        cfg = transformers.LlamaConfig(**{k: v for k, v in config("llama").items() if k != "model_type"})
        cfg.max_position_embeddings, cfg.num_key_value_heads = 64, cfg.num_attention_heads
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(cfg)
    inject(m, name)
    return m


@pytest.mark.parametrize("name", available_encodings())
def test_no_graph_break_in_a_training_forward(name):
    import torch._dynamo as dynamo

    if name in EXCEPTIONS:
        pytest.skip(EXCEPTIONS[name])
    m = _llama(name)
    dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ex = dynamo.explain(lambda ids: m(ids).logits)(IDS)  # (GPT-2's own loss function breaks)
    assert ex.graph_break_count == 0, [str(b.reason).splitlines()[0] for b in ex.break_reasons]


@pytest.mark.parametrize("name, packed", [("alibi", True), ("fire", True), ("fox", False), ("relative_bias", False),
                                          ("cope", True)])
def test_fullgraph_compile_equals_eager(name, packed):
    import torch._dynamo as dynamo

    m = _llama(name)
    # packed: two documents per row, positions restarting at 0 (attention stays inside each)
    pos = torch.cat((torch.arange(8), torch.arange(12)))[None].expand(2, -1) if packed else None

    def loss(ids):
        return m(ids, labels=ids, position_ids=pos, use_cache=False).loss

    ref = loss(IDS)
    ref.backward()
    g_ref = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    dynamo.reset()
    out = torch.compile(loss, fullgraph=True, backend="aot_eager")(IDS)
    out.backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    g = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    assert set(g) == set(g_ref)
    for n, want in g_ref.items():
        torch.testing.assert_close(g[n], want, rtol=1e-4, atol=1e-6, msg=lambda s, n=n: f"{n}: {s}")
    if packed:  # the packing is seen: a different loss than one document
        with torch.no_grad():
            assert not torch.allclose(m(IDS, labels=IDS, use_cache=False).loss, ref)
