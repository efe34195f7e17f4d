"""The `triton` backend through the mixin (TRITON_INTERPRET=1): fused rotary (un-rotated q, k
plus tables), every bias kind, stick-breaking, KV-cache decoding and packed documents equal the
eager backend; dispatch rules (auto never picks triton on CPU; clear errors)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from posenc_lightning.attention.backends import resolve_backend
from posenc_lightning.attention.backends import triton as triton_backend
from posenc_lightning.encodings.registry import build_encoding
from posenc_lightning.inject import inject
from tests.helpers import Attn, fast_triton_interpreter


@pytest.fixture(autouse=True)
def _fast_interpreter(monkeypatch):
    fast_triton_interpreter(monkeypatch)
    yield


def _pair(name: str, **cfg):
    """Two identical attention layers with ``name`` injected: eager and triton."""
    layers = []
    for backend in ("eager", "triton"):
        torch.manual_seed(0)
        m = Attn(n_heads=2, head_dim=16, d_model=32)
        inject(m, name, backend=backend, **cfg)
        layers.append(m)
    layers[1].load_state_dict(layers[0].state_dict())
    return layers


def _compare(name, positions=None, segment_ids=None, n=21, hkv=2, **cfg):
    eager, tri = _pair(name, **cfg)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, n, 16, generator=g)
    k, v = torch.randn(2, hkv, n, 16, generator=g), torch.randn(2, hkv, n, 16, generator=g)
    hidden = torch.randn(2, n, 32, generator=g)
    outs, grads = [], []
    for m in (eager, tri):
        ins = [t.clone().requires_grad_() for t in (q, k, v, hidden)]
        out = m(*ins[:3], positions=positions, hidden=ins[3], segment_ids=segment_ids)
        params = [p for p in m.parameters() if p.requires_grad]
        gs = torch.autograd.grad(out, ins[:3] + params, torch.ones_like(out), allow_unused=True)
        outs.append(out)
        grads.append(gs)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    for i, (a, b) in enumerate(zip(grads[1], grads[0])):
        if b is None:
            assert a is None
            continue
        # q/k/v gradients sum a row of terms; an encoding parameter's gradient sums every (b, h, i, j)
        # term of the score gradient, in fp32 per-tile partial sums in the kernel: measured 1.3e-5 of
        # the largest component for rse's penalty (eager fp32 vs fp64: 1.5e-7), hence 3e-5 for them
        tol = 1e-5 if i < 3 else 3e-5
        torch.testing.assert_close(a, b, atol=tol * max(1.0, b.abs().max().item()), rtol=1e-5)


@pytest.mark.parametrize("name", ["nope", "rope", "alibi", "relative_bias", "fox", "sba", "rse", "yarn"])
def test_backend_equals_eager(name):
    _compare(name)


def test_rope_interleaved_partial_packed_and_non_monotone_positions():
    pos = torch.tensor([[3, 9, 1, 0, 7, 7, 2, 40, 5, 6, 11], [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]])
    seg = torch.tensor([[0] * 11, [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]])
    _compare("rope", positions=pos, segment_ids=seg, n=11, layout="interleaved", partial_rotary_factor=0.5)
    _compare("alibi", positions=pos + 1000, segment_ids=seg, n=11, hkv=1)


def test_rotary_is_fused_not_applied_by_the_mixin(monkeypatch):
    """With the triton backend the encoding's rotate() is never called: the kernel rotates."""
    m = Attn(n_heads=2, head_dim=16, d_model=32)
    enc = inject(m, "rope", backend="triton")
    assert enc.fused_rotary is enc
    called = []
    monkeypatch.setattr(type(enc), "rotate", lambda self, q, k, ctx: called.append(1) or (q, k))
    assert enc.fused_rotary is None  # an overridden rotate is not fused ...
    monkeypatch.undo()
    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))
    seen = {}
    real = triton_backend.attend

    def spy(q_, k_, v_, **kw):
        seen["q"], seen["rotary"] = q_, getattr(kw["ctx"], "rotary", None)
        return real(q_, k_, v_, **kw)

    monkeypatch.setattr(triton_backend, "attend", spy)
    m(q, k, v)
    assert seen["rotary"] is enc and torch.equal(seen["q"], q)  # ... and q arrives un-rotated


def test_kv_cache_decoding_equals_full_attention():
    from posenc_lightning.attention.kv_cache import LayerKVCache

    torch.manual_seed(0)
    m = Attn(n_heads=2, head_dim=16, d_model=32)
    inject(m, "rope", backend="triton")
    q, k, v = (torch.randn(1, 2, 9, 16) for _ in range(3))
    full = m(q, k, v)
    cache = LayerKVCache()
    steps = [m(q[:, :, :5], k[:, :, :5], v[:, :, :5], cache=cache)]
    for i in range(5, 9):
        steps.append(m(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache=cache))
    assert cache.rotated is False  # the fused path caches un-rotated keys
    torch.testing.assert_close(torch.cat(steps, 2), full, atol=1e-5, rtol=1e-5)


def test_tinygpt_trains_on_the_triton_backend():
    from posenc_lightning.models.tinygpt import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(d_model=32, n_layers=1, n_heads=2, max_seq_len=32, encoding="rope", backend="triton")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 256, (2, 17))
    losses = []
    for _ in range(3):
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_dispatch_rules(monkeypatch):
    enc = build_encoding("rope")
    assert resolve_backend("auto", enc, torch.device("cpu"), True).NAME != "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    why = triton_backend.supports(enc, torch.device("cpu"), False)
    assert why is not None and "CUDA" in why
    with pytest.raises(ValueError, match="backend 'triton' cannot run"):
        resolve_backend("triton", enc, torch.device("cpu"), False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_backend.supports(enc, torch.device("cpu"), True) is None
    assert triton_backend.supports(build_encoding("sba"), torch.device("cpu"), True) is None
