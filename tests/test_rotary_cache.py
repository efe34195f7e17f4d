"""Rotary KV-cache semantics (dynamic encodings cache un-rotated keys) and fp32 angle precision."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from posenc_lightning.attention.kv_cache import LayerKVCache
from posenc_lightning.attention.mixin import PosEncAttentionMixin
from posenc_lightning.encodings import build_encoding
from posenc_lightning.functional.rope import apply_rotary
from posenc_lightning.inject import inject

H, D, ORIG, TOTAL, PREFILL = 2, 16, 16, 40, 10


class OneLayer(nn.Module, PosEncAttentionMixin):
    def __init__(self) -> None:
        super().__init__()
        self.n_heads, self.head_dim = H, D


def _layer(name: str, **cfg) -> OneLayer:
    m = OneLayer()
    inject(m, name, backend="eager", **cfg)
    return m


DYNAMIC = {
    "dynamic_ntk": {"factor": 4.0, "original_max_position_embeddings": ORIG},
    "long_rope": {"factor": 4.0, "original_max_position_embeddings": ORIG, "max_position_embeddings": 64,
                  "long_factor": [1.0, 1.3, 2.0, 2.5, 3.0, 3.5, 4.0, 4.0]},
}


def _decode(layer: OneLayer, q, k, v) -> list[torch.Tensor]:
    """Prefill PREFILL tokens, then one token at a time; returns each new token's output."""
    cache = LayerKVCache()
    outs = [layer.attend(q[:, :, :PREFILL], k[:, :, :PREFILL], v[:, :, :PREFILL], cache=cache)[:, :, -1]]
    for t in range(PREFILL, TOTAL):
        outs.append(layer.attend(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache=cache)[:, :, -1])
    return outs


@pytest.mark.parametrize("name", list(DYNAMIC))
def test_decoding_past_switch_point_equals_full_forward(name):
    layer = _layer(name, **DYNAMIC[name])
    enc = layer.posenc
    assert enc.dynamic
    q, k, v = (torch.randn(1, H, TOTAL, D) for _ in range(3))
    # the frequencies really change across the switch point
    assert not torch.equal(enc.frequencies(ORIG)[0], enc.frequencies(TOTAL)[0])
    outs = _decode(layer, q, k, v)
    for n, out in zip(range(PREFILL, TOTAL + 1), outs):
        full = layer.attend(q[:, :, :n], k[:, :, :n], v[:, :, :n])[:, :, -1]
        torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)

    # caching *rotated* keys (what a static encoding does) is wrong past the switch point
    layer.posenc.dynamic = False
    stale = _decode(layer, q, k, v)[-1]
    full = layer.attend(q, k, v)[:, :, -1]
    assert (stale - full).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["rope", "pi", "yarn", "llama3", "ntk"])
def test_static_encodings_cache_rotated_keys_exactly(name):
    layer = _layer(name)
    assert not layer.posenc.dynamic
    q, k, v = (torch.randn(1, H, TOTAL, D) for _ in range(3))
    out = _decode(layer, q, k, v)[-1]
    torch.testing.assert_close(out, layer.attend(q, k, v)[:, :, -1], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ precision
@pytest.mark.parametrize("name", ["rope", "pi", "ntk", "dynamic_ntk", "yarn", "llama3", "long_rope", "xpos"])
def test_bf16_rotates_with_fp32_angles_at_100k(name):
    """Positions 100000 and 100001 are one number in bf16; the rotation must still tell them apart."""
    pos = torch.tensor([[100_000, 100_001, 100_002]])
    assert torch.unique(pos.bfloat16()).numel() == 1  # a bf16 angle pipeline would collapse them
    enc = build_encoding(name).bind(n_heads=1, head_dim=64)
    x = torch.randn(1, 1, 1, 64).expand(1, 1, 3, 64).contiguous()
    cos, _sin = enc.cos_sin(pos, seq_len=100_003)
    assert cos.dtype == torch.float32
    # the reference: the same frequencies, angles in float64
    inv, scale = enc.frequencies(100_003)
    ang = pos[..., None].double() * inv.double()
    torch.testing.assert_close(cos.double(), ang.cos() * scale, rtol=0, atol=2e-3)
    ctx = _ctx(pos)
    qr, _ = enc.rotate(x.bfloat16(), x.bfloat16(), ctx)
    assert qr.dtype == torch.bfloat16
    ref = apply_rotary(x.double(), (ang.cos() * scale), (ang.sin() * scale), enc.layout)
    if name == "xpos":
        ref = qr.double()  # xpos adds its own per-position scale; the angle part is checked above
    torch.testing.assert_close(qr.double(), ref, rtol=2e-2, atol=2e-2)
    # distinct positions stay distinct, by much more than bf16 resolution
    assert (qr[..., 0, :] - qr[..., 1, :]).abs().max() > 0.05
    assert (qr[..., 1, :] - qr[..., 2, :]).abs().max() > 0.05


def _ctx(pos):
    from posenc_lightning.encodings.base import AttentionContext

    return AttentionContext(pos, pos, True)
