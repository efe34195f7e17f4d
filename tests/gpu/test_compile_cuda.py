"""``torch.compile`` (inductor, code generated for the GPU) of TinyGPT and of a tiny transformers
Llama with an injected encoding, on CUDA: no graph break (``torch._dynamo.explain`` counts them,
and ``fullgraph=True`` refuses one) and the compiled loss and gradients equal eager's."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.gpu import GPU

pytestmark = GPU

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CUDA = torch.device("cuda")
ENCODINGS = ("rope", "alibi", "fire", "fox", "sba")
IDS = torch.randint(1, 64, (2, 100), generator=torch.Generator().manual_seed(3))  # 100: no tile multiple


def _breaks(fn, *args) -> tuple[int, list[str]]:
    import torch._dynamo as dynamo

    dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ex = dynamo.explain(fn)(*args)
    return ex.graph_break_count, [str(b.reason).splitlines()[0] for b in ex.break_reasons]


def _compiled_equals_eager(model: torch.nn.Module, loss) -> None:
    """The loss and every gradient of ``model`` through ``torch.compile(fullgraph=True)`` (inductor)
    equal eager's, in float32 on CUDA."""
    import torch._dynamo as dynamo

    ids = IDS.to(CUDA)
    ref = loss(ids)
    ref.backward()
    g_ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    dynamo.reset()
    out = torch.compile(loss, fullgraph=True)(ids)
    out.backward()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    g = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(g) == set(g_ref)
    for n, want in g_ref.items():
        torch.testing.assert_close(g[n], want, rtol=1e-3, atol=1e-5, msg=lambda s, n=n: f"{n}: {s}")


def _tinygpt(name: str, backend: str):
    from posenc_lightning.inject import inject
    from posenc_lightning.models.tinygpt import TinyGPT

    torch.manual_seed(0)
    m = TinyGPT(d_model=64, n_layers=2, n_heads=2, max_seq_len=128, encoding=None).to(CUDA)
    inject(m, name, backend=backend)  # on the device, where backend="triton" runs
    return m


def _lm_loss(model):
    import torch.nn.functional as F

    def loss(ids):
        logits = model(ids)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    return loss


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("name", ENCODINGS)
def test_tinygpt_compiles_on_cuda_without_a_break_and_equals_eager(name, backend):
    m = _tinygpt(name, backend)
    breaks, reasons = _breaks(m, IDS.to(CUDA))
    assert breaks == 0, reasons
    if backend == "triton" and name not in ("fire", "sba"):
        return  # inductor around the kernels: one bias and one normalizer keep the compile time short
    _compiled_equals_eager(m, _lm_loss(m))


def _llama(name: str):
    transformers = pytest.importorskip("transformers")
    from benchmarks.hf_matrix import config
    from posenc_lightning import inject

    cfg = transformers.LlamaConfig(**{k: v for k, v in config("llama").items() if k != "model_type"})
    cfg.max_position_embeddings, cfg.num_key_value_heads = 128, cfg.num_attention_heads
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg)
    inject(m, name)
    return m.to(CUDA)


@pytest.mark.parametrize("name", ["rope", "alibi", "fire", "fox"])
def test_llama_with_an_injected_encoding_compiles_on_cuda_and_equals_eager(name):
    m = _llama(name)
    breaks, reasons = _breaks(lambda ids: m(ids).logits, IDS.to(CUDA))
    assert breaks == 0, reasons
    if name in ("rope", "fire"):  # inductor for a rotary and a learned bias; the others traced above
        _compiled_equals_eager(m, lambda ids: m(ids, labels=ids, use_cache=False).loss)
