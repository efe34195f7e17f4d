"""Compile-clean: every registered encoding on its default backend traces with no graph break, in a
training forward and in a cached decode step, and ``torch.compile(fullgraph=True)`` equals eager
forward and backward (issue: compile-clean, sync-free, GPU-safe defaults).

``torch._dynamo.explain`` counts the graph breaks; ``aot_eager`` is the full dynamo + AOTAutograd
capture (forward and backward graphs) without code generation, so every encoding is checked in
seconds; inductor (code generation) is checked for the encodings the recorded CPU benchmark
compiles (`benchmarks/compile_step.py`).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from posenc_lightning.encodings.registry import available_encodings
from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables
from posenc_lightning.models.tinygpt import CausalSelfAttention, TinyGPT
from tests.helpers import PRESET_CASES, compiled_greedy

#: encodings that cannot be traced on their default backend, with the reason (also in docs/guides/compile.md);
#: none today
EXCEPTIONS: dict[str, str] = {}
#: None: nothing injected (plain SDPA attention); the presets' layer schedules at test sizes
ENCODINGS = [None, *available_encodings(), *PRESET_CASES]
N, PREFILL = 24, 20


def _model(name: str | None, **kw) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(d_model=32, n_layers=2, n_heads=2, max_seq_len=64, encoding=name,
                   encoding_cfg=PRESET_CASES.get(name), **kw)


def _explain(fn, *args):
    import torch._dynamo as dynamo

    dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ex = dynamo.explain(fn)(*args)
    return ex.graph_break_count, [str(b.reason).splitlines()[0] for b in ex.break_reasons]


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("name", ENCODINGS, ids=str)
def test_no_graph_break_in_training_forward(name):
    if name in EXCEPTIONS:
        pytest.skip(EXCEPTIONS[name])
    m = _model(name)
    x = torch.randint(0, 256, (2, N))
    breaks, reasons = _explain(m, x)
    assert breaks == 0, reasons


@pytest.mark.parametrize("name", ENCODINGS, ids=str)
def test_no_graph_break_in_cached_decode_step(name):
    if name in EXCEPTIONS:
        pytest.skip(EXCEPTIONS[name])
    m = _model(name)
    x = torch.randint(0, 256, (2, N))
    cache = m.new_cache()
    with torch.no_grad():
        m(x[:, :PREFILL], cache=cache)
        breaks, reasons = _explain(m, x[:, PREFILL:PREFILL + 1], None, cache)
    assert breaks == 0, reasons


def _grads(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _check_compiled_equals_eager(name: str | None, backend: str) -> None:
    import torch._dynamo as dynamo

    m = _model(name)
    x = torch.randint(0, 256, (2, N), generator=torch.Generator().manual_seed(1))
    ref = m(x)
    ref.square().mean().backward()
    g_ref = _grads(m)
    m.zero_grad(set_to_none=True)
    dynamo.reset()
    out = torch.compile(m, fullgraph=True, backend=backend)(x)
    out.square().mean().backward()
    g = _grads(m)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert set(g) == set(g_ref)  # every parameter that gets a gradient in eager gets one compiled
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-5, atol=1e-7, msg=lambda s, n=n: f"{n}: {s}")


@pytest.mark.parametrize("one_block", [True, False], ids=["one_block", "by_blocks"])
@pytest.mark.parametrize("name", ENCODINGS, ids=str)
def test_fullgraph_compile_equals_eager(name, one_block, monkeypatch):
    """In both compiled forms of a bias on CPU: a small attention as one traced block
    (`Tunables.compiled_one_block_bytes`, these sizes), and the forms a larger one takes."""
    if name in EXCEPTIONS:
        pytest.skip(EXCEPTIONS[name])
    assert 4 * 2 * 2 * N * N <= DEFAULT_TUNABLES.compiled_one_block_bytes  # these sizes are one block
    if not one_block:
        monkeypatch.setattr(CausalSelfAttention, "posenc_tunables", Tunables(compiled_one_block_bytes=0))
    _check_compiled_equals_eager(name, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rope", "alibi", "fire", "fox"])
def test_inductor_equals_eager(name):
    _check_compiled_equals_eager(name, "inductor")


def test_compiled_decoding_equals_eager():
    """Greedy decoding with the cache through a compiled forward equals eager decoding token by
    token (the cache's start is known, so rope reads its table; alibi the key-only form)."""
    for name in ("rope", "alibi"):
        m = _model(name)
        x = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
        assert torch.equal(compiled_greedy(m, x, 6), m.generate(x, 6)), name


def test_tinygpt_compile_flag_trains_like_eager():
    """``TinyGPT(compile=True)``: the same loss and gradients as eager, tables reserved for
    ``max_seq_len`` outside the graph, flush-to-zero of denormals on only around the compiled
    forward and its backward, nothing compiled pickled (DDP spawn / checkpoints)."""
    import pickle

    x = torch.randint(0, 256, (2, N), generator=torch.Generator().manual_seed(3))
    losses, grads = [], []
    for compile_ in (False, True):
        m = _model("rope", compile=compile_)
        loss = m(x).square().mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append(_grads(m))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-7)
        assert torch.tensor(1e-39) * torch.tensor(1.0) != 0  # flush-to-zero off again after backward
    enc = m.blocks[0].attn.posenc
    assert enc._cos.shape[-2] >= m.max_seq_len  # reserved before the compiled call
    assert "_compiled_fn" in m.__dict__ and "_compiled_fn" not in pickle.loads(pickle.dumps(m)).__dict__


def test_static_positions_need_no_host_read(monkeypatch):
    """The paths a compiled or GPU forward takes read no tensor value on the host: with host reads
    declared unavailable (`host_reads_ok` False, as under compile or on CUDA), training and cached
    decoding on default positions take the tables' slices, the key-only ALiBi form and static
    lengths, and never call ``item``, ``tolist``, ``int``/``float``/``bool`` of a tensor or
    ``torch.equal``."""
    import sys

    for mod in [m for k, m in sys.modules.items() if k.startswith("posenc_lightning") and m is not None]:
        if hasattr(mod, "host_reads_ok"):
            monkeypatch.setattr(mod, "host_reads_ok", lambda t: False)
    from posenc_lightning.functional.mode import Mode

    monkeypatch.setattr(Mode, "host_reads", property(lambda self: False))  # what a call's Mode says

    def read(*_a, **_k):
        raise AssertionError("a host read of a tensor value")

    for attr in ("item", "tolist", "__int__", "__float__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, attr, read)
    monkeypatch.setattr(torch, "equal", read)
    for name in ("rope", "alibi", "yarn", "dynamic_ntk", "long_rope", "sinusoidal", "learned", "fox",
                 "relative_bias", "rope_alibi", "sba", "rse", "clex", "xpos"):
        m = _model(name)
        with torch.no_grad():
            cache = m.new_cache()
            m(torch.randint(0, 256, (2, 10)), cache=cache)
            m(torch.randint(0, 256, (2, 1)), cache=cache)
        m(torch.randint(0, 256, (2, N))).sum().backward()
