"""Bad input at the attend / embed_positions boundary: a ValueError naming the argument, the
shape expected and the shape given (issue 16). The checks read shapes and dtypes only."""

import re

import pytest
import torch

from posenc_lightning import inject
from posenc_lightning.attention.kv_cache import LayerKVCache
from posenc_lightning.attention.validate import check_attend, check_embed
from posenc_lightning.models import TinyGPT
from tests.helpers import Attn

B, H, N, D = 2, 2, 8, 16


def layer(name="rope"):
    m = Attn(n_heads=H, head_dim=D, d_model=H * D)
    inject(m, name)
    return m


def qkv():
    return [torch.randn(B, H, N, D) for _ in range(3)]


def raises(arg, expected, got):
    """pytest.raises for a ValueError that names ``arg``, the expected and the given shape."""
    pat = re.escape(arg) + r".*" + re.escape(expected) + r".*" + re.escape(str(got))
    return pytest.raises(ValueError, match=pat)


@pytest.mark.parametrize("name", ["rope", "alibi", "fire", "relative_bias"])
def test_positions_length_mismatch_names_positions(name):
    m = layer(name)
    with raises("positions", f"[{B}, {N}]", (B, N - 1)):
        m(*qkv(), positions=torch.arange(N - 1).expand(B, -1))
    with raises("positions", f"[{B}, {N}]", (N + 2,)):
        m(*qkv(), positions=torch.arange(N + 2))


def test_positions_batch_dtype_rank_and_device():
    m = layer()
    with raises("positions", f"batch size {B}", (B + 1, N)):
        m(*qkv(), positions=torch.arange(N).expand(B + 1, -1))
    with raises("positions", "integer or floating dtype", (B, N)):
        m(*qkv(), positions=torch.ones(B, N, dtype=torch.bool))
    with raises("positions", "[B, N]", (B, N, 2)):  # 2-D positions for a 1-D encoding
        m(*qkv(), positions=torch.zeros(B, N, 2, dtype=torch.long))
    with raises("positions", f"[{B}, {N}]", (1, B, N, 1)):
        m(*qkv(), positions=torch.zeros(1, B, N, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="positions: expected a tensor on cpu.*meta"):
        m(*qkv(), positions=torch.arange(N, device="meta").expand(B, -1))


def test_valid_positions_forms_still_work():
    m = layer()
    q, k, v = qkv()
    ref = m(q, k, v)
    pos = torch.arange(N)
    for p in (pos, pos[None], pos.expand(B, -1), pos.float().expand(B, -1)):
        torch.testing.assert_close(m(q, k, v, positions=p), ref)
    grid = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(4), indexing="ij"), -1).reshape(1, N, 2)
    assert layer("rope_2d")(q, k, v, positions=grid.expand(B, -1, -1)).shape == q.shape


def test_hidden_shape():
    m = layer("fox")
    with raises("hidden", f"[{B}, {N}, {H * D}]", (B, N - 1, H * D)):
        m(*qkv(), hidden=torch.randn(B, N - 1, H * D))
    with raises("hidden", f"[{B}, {N}, {H * D}]", (B, N, H * D + 1)):
        m(*qkv(), hidden=torch.randn(B, N, H * D + 1))
    with raises("hidden", f"[{B}, {N}, {H * D}]", (N, H * D)):
        m(*qkv(), hidden=torch.randn(N, H * D))


def test_segment_ids_and_key_padding_mask():
    m = layer()
    with raises("segment_ids", f"[B, Nq] = [{B}, {N}]", (B, N + 1)):
        m(*qkv(), segment_ids=torch.zeros(B, N + 1, dtype=torch.long))
    with raises("segment_ids", "integer document ids", (B, N)):
        m(*qkv(), segment_ids=torch.zeros(B, N))
    with raises("key_padding_mask", f"bool [B, Nk] = [{B}, {N}]", (B, N - 1)):
        m(*qkv(), key_padding_mask=torch.ones(B, N - 1, dtype=torch.bool))
    with raises("key_padding_mask", f"bool [B, Nk] = [{B}, {N}]", (B, N)):
        m(*qkv(), key_padding_mask=torch.ones(B, N))
    cache = LayerKVCache()
    q, k, v = qkv()
    m(q, k, v, cache=cache)
    one = [t[:, :, :1] for t in qkv()]
    with raises("key_padding_mask", f"[{B}, {N + 1}]", (B, 1)):  # cached keys count
        m(*one, cache=cache, key_padding_mask=torch.ones(B, 1, dtype=torch.bool))
    out = m(*one, cache=cache, key_padding_mask=torch.ones(B, N + 1, dtype=torch.bool))
    assert out.shape == (B, H, 1, D)


def test_qkv_shapes():
    m = layer()
    q, k, v = qkv()
    with raises("q", "[B, H, Nq, D]", (H, N, D)):
        m(q[0], k, v)
    with raises("k", f"B = {B}", (1, H, N, D)):
        m(q, k[:1], v)
    with pytest.raises(ValueError, match=r"k, v: .*\(2, 2, 8, 16\).*\(2, 2, 7, 16\)"):
        m(q, k, v[:, :, :-1])


def test_embed_positions_checks():
    model = TinyGPT(d_model=16, n_layers=1, n_heads=2, max_seq_len=16, encoding="learned")
    h = torch.randn(B, N, 16)
    with raises("positions", f"[{B}, {N}]", (B, N + 1)):
        model.embed.embed_positions(h, torch.arange(N + 1).expand(B, -1))
    with raises("h", "d_model = 16", (B, N, 8)):
        model.embed.embed_positions(torch.randn(B, N, 8))
    with raises("positions", f"[{B}, {N}]", (B, N - 1)):
        model(torch.randint(0, 256, (B, N)), positions=torch.arange(N - 1).expand(B, -1))


def test_checks_read_no_values():
    """Shapes and dtypes only: the checks run on meta tensors (no data to read, no host sync)."""
    enc = layer("fox").posenc
    meta = {"device": "meta"}
    q, k, v = (torch.empty(B, H, N, D, **meta) for _ in range(3))
    good = {"positions": torch.empty(B, N, dtype=torch.long, **meta), "hidden": torch.empty(B, N, H * D, **meta),
            "cache": None, "segment_ids": torch.empty(B, N, dtype=torch.long, **meta),
            "key_padding_mask": torch.empty(B, N, dtype=torch.bool, **meta)}
    check_attend(enc, q, k, v, **good)
    check_embed(torch.empty(B, N, 16, **meta), good["positions"], 16)
    with raises("positions", f"[{B}, {N}]", (B, N + 1)):
        check_attend(enc, q, k, v, **{**good, "positions": torch.empty(B, N + 1, dtype=torch.long, **meta)})
