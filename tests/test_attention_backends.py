"""The sdpa backend and the KV cache against the eager reference, for the foundation encodings."""

import pytest
import torch

from posenc_lightning import KVCache, LayerKVCache, inject
from posenc_lightning.models import TinyGPT
from tests.helpers import Attn, qkv

ATTN_ENCODINGS = ["nope", "rope", "alibi", "relative_bias"]


def _positions(kind, b, n):
    if kind == "arange":
        return None
    if kind == "offset":
        return torch.arange(n).expand(b, n) + torch.tensor([[7], [1000]])
    if kind == "packed":  # two documents per row, positions restart
        p = torch.cat((torch.arange(5), torch.arange(n - 5)))
        return p.expand(b, n)
    raise ValueError(kind)


@pytest.mark.parametrize("name", ATTN_ENCODINGS)
@pytest.mark.parametrize("pos_kind", ["arange", "offset", "packed"])
@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_equals_eager_forward_backward(name, pos_kind, causal):
    m_e, m_s = Attn(), Attn()
    enc = inject(m_e, name, backend="eager", bidirectional=True) if name == "relative_bias" else inject(m_e, name, backend="eager")
    m_s.posenc, m_s.posenc_backend = enc, "sdpa"
    b, n = 2, 13
    q, k, v = qkv(b, 4, n, 16, grad=True)
    pos = _positions(pos_kind, b, n)
    seg = torch.tensor([[0] * 5 + [1] * (n - 5)] * b) if pos_kind == "packed" else None
    outs, grads = [], []
    for m in (m_e, m_s):
        for t in (q, k, v):
            t.grad = None
        enc.zero_grad()
        o = m(q, k, v, positions=pos, causal=causal, segment_ids=seg)
        (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum().backward()
        outs.append(o.detach())
        grads.append([t.grad.clone() for t in (q, k, v)] + [p.grad.clone() for p in enc.parameters()])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for g_s, g_e in zip(grads[1], grads[0]):
        torch.testing.assert_close(g_s, g_e, rtol=1e-4, atol=1e-5)


def test_packed_documents_do_not_see_each_other():
    m = Attn()
    inject(m, "rope")
    q, k, v = qkv(1, 4, 10, 16)
    seg = torch.tensor([[0] * 4 + [1] * 6])
    pos = torch.cat((torch.arange(4), torch.arange(6)))[None]
    packed = m(q, k, v, positions=pos, segment_ids=seg)
    doc2 = m(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], positions=torch.arange(6)[None])
    torch.testing.assert_close(packed[:, :, 4:], doc2, rtol=1e-5, atol=1e-6)


def test_gqa_matches_repeated_heads():
    m = Attn(n_heads=4)
    inject(m, "alibi", backend="sdpa")
    q, k, v = qkv(2, 4, 9, 16, hkv=2)
    out = m(q, k, v)
    ref = m(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["nope", "rope", "alibi", "relative_bias", "sinusoidal", "learned"])
def test_kv_cache_decoding_equals_full_forward(name):
    torch.manual_seed(0)
    model = TinyGPT(d_model=32, n_layers=2, n_heads=2, max_seq_len=64, encoding=name).eval()
    x = torch.randint(0, 256, (2, 23))
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache()
        steps = [model(x[:, :9], cache=cache)]  # a prompt, then one token at a time
        for t in range(9, 23):
            steps.append(model(x[:, t:t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)
    assert cache.length == 23


def test_kv_cache_with_explicit_offsets_matches_full_forward():
    m = Attn()
    inject(m, "rope")
    q, k, v = qkv(1, 4, 12, 16)
    pos = torch.arange(100, 112)[None]
    full = m(q, k, v, positions=pos)
    cache = LayerKVCache()
    a = m(q[:, :, :7], k[:, :, :7], v[:, :, :7], positions=pos[:, :7], cache=cache)
    b = m(q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], positions=pos[:, 7:], cache=cache)
    torch.testing.assert_close(torch.cat((a, b), 2), full, rtol=1e-5, atol=1e-6)


def test_cache_stores_rotated_keys_for_static_encodings():
    m = Attn()
    inject(m, "rope")
    q, k, v = qkv(1, 4, 5, 16)
    cache = LayerKVCache()
    m(q, k, v, cache=cache)
    assert cache.rotated is True and not torch.allclose(cache.k, k)


def test_bf16_angles_are_fp32_at_large_positions():
    m = Attn(n_heads=1, head_dim=64)
    inject(m, "rope")
    q = torch.ones(1, 1, 2, 64, dtype=torch.bfloat16)
    pos = torch.tensor([[100_000, 100_001]])
    from posenc_lightning.encodings.base import AttentionContext

    rq, _ = m.posenc.rotate(q, q, AttentionContext(pos, pos))
    assert rq.dtype == torch.bfloat16
    assert not torch.equal(rq[0, 0, 0], rq[0, 0, 1])  # bf16 positions would collapse (100000 == 100001 in bf16)
    assert torch.tensor(100_000.0, dtype=torch.bfloat16) == torch.tensor(100_001.0, dtype=torch.bfloat16)
    cos, _ = m.posenc.cos_sin(pos)
    assert cos.dtype == torch.float32


def test_kvcache_object():
    c = KVCache(3)
    assert len(c) == 3 and c.length == 0 and c[0] is not c[1]
