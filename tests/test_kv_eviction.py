"""A windowed or chunked layer's KV cache drops the keys no later query can see
(`LayerKVCache.drop`): decoding step by step equals the full forward, and the cache holds at most
the window (a chunk: the current chunk) however long the decoding runs."""

from __future__ import annotations

import pytest
import torch

from posenc_lightning import LayerKVCache, inject
from posenc_lightning.models import TinyGPT
from tests.helpers import Attn

H, D = 2, 16


@pytest.mark.parametrize("name", ["rope", "alibi", "fire", "cope", "sba", "relative_bias"])
@pytest.mark.parametrize("local,bound", [({"window": 6}, 6), ({"chunk": 8}, 8), ({"window": 5, "chunk": 8}, 8)])
def test_decoding_drops_what_no_query_sees_and_equals_the_full_forward(name, local, bound):
    torch.manual_seed(0)
    m = Attn(n_heads=H, head_dim=D)
    inject(m, name, backend="eager")
    m.posenc_window, m.posenc_chunk = local.get("window"), local.get("chunk")
    n, b = 41, 2
    q, k, v = (torch.randn(b, H, n, D, dtype=torch.float64) for _ in range(3))
    m.double()
    pad = torch.ones(b, n, dtype=torch.bool)
    pad[1, 2] = False  # a padding key (given for every key, the dropped ones included)
    with torch.no_grad():
        full = m(q, k, v, key_padding_mask=pad)
        cache = LayerKVCache()
        steps, t, held = [], 0, []
        for size in [4, 1, 3, 1, 1, 7] + [1] * n:  # steps of several tokens and of one
            if t >= n:
                break
            e = min(n, t + size)
            steps.append(m(q[:, :, t:e], k[:, :, t:e], v[:, :, t:e], cache=cache, key_padding_mask=pad[:, :e]))
            held.append(cache.length)
            t = e
    # float64 inputs; stick-breaking sums its softplus in float32 (errs ~2e-7): a wrong key set errs by O(1)
    torch.testing.assert_close(torch.cat(steps, 2), full, rtol=1e-6, atol=1e-6)
    assert cache.seen == n and cache.dropped > 0
    assert max(held[3:]) <= bound + 7  # after the 7-token step only what the window or chunk keeps
    assert held[-1] <= bound


def test_a_global_layer_and_per_token_state_keep_every_key():
    m = Attn(n_heads=H, head_dim=D)
    inject(m, "rope", backend="eager")
    q = torch.randn(1, H, 20, D)
    cache = LayerKVCache()
    with torch.no_grad():
        for t in range(20):
            m(q[:, :, t:t + 1], q[:, :, t:t + 1], q[:, :, t:t + 1], cache=cache)
    assert (cache.length, cache.dropped) == (20, 0)
    cache = LayerKVCache()
    cache.extra["state"] = torch.zeros(1, H, 20)  # indexed like the keys (FoX's gates): nothing dropped
    cache.k = torch.zeros(1, H, 20, D)
    assert cache.invisible(window=4, chunk=None) == 0


def test_tinygpt_generates_the_same_with_a_windowed_schedule_and_holds_the_window():
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=50, d_model=32, n_layers=4, n_heads=2, max_seq_len=128, encoding=None)
    inject(model, "rnope_swa", window=6, backend="eager")
    ids = torch.randint(0, 50, (2, 5))
    model.eval()
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=30)
        full = model.generate(ids, max_new_tokens=30, use_cache=False)
        cache = model.new_cache()
        model(cached[:, :-1], cache=cache)
    assert torch.equal(cached, full)
    # rope in a window of 6 keeps the 5 keys the next query sees beside itself; every 4th layer is global
    assert [c.length for c in cache.layers] == [5, 5, 5, 34]
    assert cache.length == 34
