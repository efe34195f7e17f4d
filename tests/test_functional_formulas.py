"""Formulas of the foundation encodings against their papers and trusted implementations."""

import math

import pytest
import torch

from posenc_lightning.functional import (
    alibi_slopes,
    apply_rotary,
    rope_cos_sin,
    rope_inv_freq,
    sinusoidal_table,
    t5_relative_position_bucket,
)


def test_sinusoidal_table_matches_vaswani_formula():
    d = 16
    pos = torch.arange(50)
    pe = sinusoidal_table(pos, d)
    for p in (0, 1, 7, 49):
        for i in range(d // 2):
            w = p / 10000 ** (2 * i / d)
            assert pe[p, 2 * i].item() == pytest.approx(math.sin(w), abs=1e-6)
            assert pe[p, 2 * i + 1].item() == pytest.approx(math.cos(w), abs=1e-6)
    assert pe[0, 0::2].abs().max() == 0 and torch.all(pe[0, 1::2] == 1)


def _paper_slopes(n):
    """Press et al.: geometric sequence from 2^(-8/n); other n interleave from 2n (reference code)."""
    def pow2(n):
        return [2 ** (-8 * (i + 1) / n) for i in range(n)]
    if n & (n - 1) == 0:
        return pow2(n)
    c = 2 ** math.floor(math.log2(n))
    return pow2(c) + pow2(2 * c)[0::2][: n - c]


@pytest.mark.parametrize("n", range(1, 65))
def test_alibi_slopes_paper_definition(n):
    got = alibi_slopes(n)
    want = torch.tensor(_paper_slopes(n), dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_alibi_slopes_worked_example():
    # the paper: for 8 heads the slopes are 1/2, 1/4, ..., 1/256
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -i for i in range(1, 9)]))
    with pytest.raises(ValueError):
        alibi_slopes(0)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (16, 64), (8, 20)])
def test_t5_buckets_match_transformers(bidirectional, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-300, 301)[None, :] - torch.zeros(1, 1, dtype=torch.long)
    want = T5Attention._relative_position_bucket(rel, bidirectional=bidirectional,
                                                 num_buckets=num_buckets, max_distance=max_distance)
    got = t5_relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    assert torch.equal(got, want)


def test_rope_inv_freq_formula_and_hf():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    for d, base in ((64, 10000.0), (128, 500000.0)):
        ours = rope_inv_freq(d, base)
        paper = torch.tensor([base ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float32)
        torch.testing.assert_close(ours, paper, rtol=1e-6, atol=0)
        cfg = LlamaConfig(hidden_size=d * 4, num_attention_heads=4, head_dim=d,
                          rope_parameters={"rope_type": "default", "rope_theta": base})
        hf = LlamaRotaryEmbedding(cfg).inv_freq
        torch.testing.assert_close(ours, hf, rtol=1e-6, atol=0)


def test_apply_rotary_matches_hf_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = torch.randn(2, 3, 9, 32), torch.randn(2, 3, 9, 32)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [5, 9, 100, 3, 3, 0, 1, 2, 7]])
    cos, sin = rope_cos_sin(pos, rope_inv_freq(32))
    hq, hk = apply_rotary_pos_emb(q, k, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
    torch.testing.assert_close(apply_rotary(q, cos, sin, "half"), hq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_rotary(k, cos, sin, "half"), hk, rtol=1e-6, atol=1e-6)


def test_rope_layouts_equal_up_to_channel_permutation():
    d = 16
    x = torch.randn(1, 2, 5, d)
    cos, sin = rope_cos_sin(torch.arange(5)[None], rope_inv_freq(d))
    # interleaved pair (2i, 2i+1) <-> half-split pair (i, i + d/2)
    perm = torch.stack((torch.arange(d // 2), torch.arange(d // 2) + d // 2), -1).flatten()
    half = apply_rotary(x, cos, sin, "half")
    inter = apply_rotary(x[..., perm], cos, sin, "interleaved")
    torch.testing.assert_close(inter, half[..., perm])


def test_rope_scores_depend_only_on_relative_distance():
    d = 32
    q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    f = rope_inv_freq(d, dtype=torch.float64)

    def score(m, n):
        cq, sq = rope_cos_sin(torch.tensor([[m]]), f)
        ck, sk = rope_cos_sin(torch.tensor([[n]]), f)
        rq = apply_rotary(q.view(1, 1, 1, d), cq, sq)
        rk = apply_rotary(k.view(1, 1, 1, d), ck, sk)
        return (rq * rk).sum().item()

    for delta in (0, 1, 5, 37):
        vals = [score(m + delta, m) for m in (0, 3, 100, 2047)]
        assert max(vals) - min(vals) < 1e-9
    assert abs(score(10, 0) - score(0, 10)) > 1e-6  # but not symmetric in general


def test_partial_rotary_leaves_tail_channels():
    x = torch.randn(1, 1, 4, 16)
    cos, sin = rope_cos_sin(torch.arange(4)[None], rope_inv_freq(8))
    y = apply_rotary(x, cos, sin)
    assert torch.equal(y[..., 8:], x[..., 8:]) and not torch.allclose(y[..., :8], x[..., :8])


def test_sinusoidal_encoding_scales_embeddings_by_sqrt_d_as_the_paper():
    from posenc_lightning import build_encoding

    enc = build_encoding("sinusoidal").bind(d_model=16)
    h = torch.randn(1, 5, 16)
    pos = torch.arange(5)[None]
    torch.testing.assert_close(enc.embed(h, pos), h * 4.0 + sinusoidal_table(pos, 16))
    plain = build_encoding("sinusoidal", scale_input=False).bind(d_model=16)
    torch.testing.assert_close(plain.embed(h, pos), h + sinusoidal_table(pos, 16))
