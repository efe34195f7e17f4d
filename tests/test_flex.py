"""The flex backend equals eager for every bias kind (forward on CPU, where flex runs eagerly):
LinearBias, RelativeBias, DecayBias, DenseBias and sums; causal, non-causal, packed documents,
KV-cache offsets, padding and GQA, at lengths that do not divide flex's 128 block; and it is never
picked for a CPU backward."""

import pytest
import torch

from posenc_lightning import available_encodings, inject
from posenc_lightning.attention.backends import eager, flex, resolve_backend
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import BiasSum, DecayBias, DenseBias, LinearBias, RelativeBias
from posenc_lightning.encodings.registry import build_encoding
from posenc_lightning.models import TinyGPT
from tests.helpers import Attn

B, H, HKV, D = 2, 4, 2, 16


def _layout(kind, n):
    """(q_pos, k_pos, mask, segments) for a layout of n keys."""
    if kind == "causal":
        pos = torch.arange(n).expand(B, n) + torch.tensor([[0], [7]])
        return pos, pos, AttentionMask(True, 0, n, n)
    if kind == "non_causal":
        pos = torch.arange(n).expand(B, n)
        return pos, pos, AttentionMask(False, 0, n, n)
    if kind == "packed":  # three documents per row, positions restart at each
        cut = [n // 3, n // 3 + n // 4]
        seg = torch.zeros(B, n, dtype=torch.long)
        seg[:, cut[0]:] += 1
        seg[:, cut[1]:] += 1
        seg[1] = seg[1].flip(0).max() - seg[1].flip(0)
        pos = torch.stack([torch.cat([torch.arange(int((s == d).sum())) for d in s.unique()]) for s in seg])
        return pos, pos, AttentionMask(True, 0, n, n, seg, seg)
    if kind == "kv_cache":  # the last 5 queries against every cached key, positions offset
        k_pos = torch.arange(n).expand(B, n) + 3
        return k_pos[:, -5:], k_pos, AttentionMask(True, n - 5, 5, n)
    if kind == "padding":
        pos = torch.arange(n).expand(B, n)
        valid = torch.ones(B, n, dtype=torch.bool)
        valid[1, -4:] = False
        return pos, pos, AttentionMask(True, 0, n, n, k_valid=valid)
    raise AssertionError(kind)


def _bias(kind, q_pos, k_pos):
    nq, nk = q_pos.shape[1], k_pos.shape[1]
    if kind == "linear":
        return LinearBias(torch.rand(H), q_pos, k_pos)
    if kind == "relative":
        return RelativeBias(torch.randn(H, 2 * 9 + 1), q_pos, k_pos)
    if kind == "decay":
        c = -torch.rand(B, H, nk).cumsum(-1)
        return DecayBias(c[..., -nq:], c)
    if kind == "dense":
        return DenseBias(torch.randn(B, H, nq, nk))
    if kind == "dense_broadcast":
        return DenseBias(torch.randn(1, H, nq, nk))
    if kind == "sum":
        return BiasSum([_bias(k, q_pos, k_pos) for k in ("linear", "relative", "decay", "dense_broadcast")])
    if kind == "none":
        return None
    raise AssertionError(kind)


LAYOUTS = ["causal", "non_causal", "packed", "kv_cache", "padding"]
KINDS = ["none", "linear", "relative", "decay", "dense", "dense_broadcast", "sum"]
# every kind alone (packed documents, 133 keys: more than one 128 block and not a multiple), the
# sum of all kinds and no bias under every layout at 133 and 37 keys
GRID = sorted({(k, "packed", 133) for k in KINDS} | {(k, lay, n) for k in ("sum", "none") for lay in LAYOUTS
                                                     for n in (37, 133)})


@pytest.mark.parametrize("kind,layout,n", GRID)
def test_flex_equals_eager(kind, layout, n):
    q_pos, k_pos, mask = _layout(layout, n)
    bias = _bias(kind, q_pos, k_pos)
    q = torch.randn(B, H, q_pos.shape[1], D)
    k, v = torch.randn(B, HKV, n, D), torch.randn(B, HKV, n, D)
    ref = eager.attend(q, k, v, bias=bias, mask=mask, scale=D ** -0.5)
    out = flex.attend(q, k, v, bias=bias, mask=mask, scale=D ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-5)


# a relative table (fire), cached decay gates (fox), a mixture of kinds with a rotary member, a
# normalizer (refused) and a dynamic rotary (keys cached un-rotated)
MODEL_CASES = ["fire", "fox", "mixture", "sba", "dynamic_ntk"]


@pytest.mark.parametrize("name", [n for n in MODEL_CASES if n in available_encodings()])
def test_flex_equals_eager_in_tinygpt(name):
    model = TinyGPT(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=64, encoding=name).eval()
    enc = model.blocks[0].attn.posenc or model.embed.posenc or build_encoding("nope")
    if "normalize" in enc.stages:
        assert flex.supports(enc, torch.device("cpu"), False) is not None
        return
    with torch.no_grad():  # move learned parameters off their (often zero) init
        for p in enc.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randint(0, 256, (2, 21))
    seg = torch.tensor([[0] * 8 + [1] * 13, [0] * 21])
    pos = torch.stack([torch.cat([torch.arange(8), torch.arange(13)]), torch.arange(21) + 5])
    outs = {}
    with torch.no_grad():
        for backend in ("eager", "flex"):
            for blk in model.blocks:
                blk.attn.posenc_backend = backend
            cache = model.new_cache()
            outs[backend] = (model(x, positions=pos, segment_ids=seg),
                             torch.cat([model(x[:, :9], cache=cache), model(x[:, 9:], cache=cache)], 1))
    for a, b in zip(outs["eager"], outs["flex"]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_flex_is_never_picked_for_cpu_backward():
    cpu = torch.device("cpu")
    alibi = build_encoding("alibi").bind(n_heads=4, head_dim=16)
    assert "backward" in flex.supports(alibi, cpu, True)
    assert flex.supports(alibi, cpu, False) is None
    assert "softmax" in flex.supports(build_encoding("sba"), cpu, False)
    assert resolve_backend("auto", alibi, cpu, True).NAME != "flex"
    attn = Attn(n_heads=4, head_dim=16)
    inject(attn, "alibi", backend="flex")
    q, k, v = (torch.randn(1, 4, 9, 16, requires_grad=True) for _ in range(3))
    with pytest.raises(ValueError, match="'eager'"):
        attn(q, k, v)  # explicit flex + gradients on CPU: a clear error naming the alternatives
    with torch.no_grad():
        assert torch.isfinite(attn(q, k, v)).all()
    with pytest.raises(ValueError, match="cannot run encoding 'sba'"):
        inject(attn, "sba", backend="flex")
