"""CoPE's fast rows (`cope_causal_rows`, the clamped keys skipped by `CoPE.clamped_keys`; on each
row's band, `cope_band_rows`, where the keys before it are clamped) equal
the paper's formula written plainly (eqs. 3-5, float64), forward and backward (q, k, e), directly
and through the blockwise SDPA backend: cached keys (query offset), GQA, shared and per-head
tables, lengths that are not a multiple of the blocks, whole positions, bf16 inputs."""

import pytest
import torch

from posenc_lightning import build_encoding, inject
from posenc_lightning.encodings.base import AttentionContext, DenseBias
from posenc_lightning.encodings.cope import encoding as ecope
from posenc_lightning.encodings.cope import rows as rcope
from posenc_lightning.functional import cope as fcope
from posenc_lightning.functional.tunables import Tunables
from tests.helpers import Attn


def paper_bias(q, k, emb, max_position, q_offset):
    """``z_i[p_ij]``: g = sigmoid(q.k / sqrt(d)) for keys up to the query, p_ij = sum_{t=j..i} g_it
    clamped to P - 1, z_i[p] = q_i . e[p] interpolated between floor(p) and ceil(p)."""
    q, k, emb = q.double(), k.double(), emb.double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    nq, nk = q.shape[-2], k.shape[-2]
    seen = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + q_offset  # key t visible to query i
    g = torch.sigmoid(q @ k.mT / q.shape[-1] ** 0.5) * seen
    after = torch.arange(nk)[:, None] >= torch.arange(nk)[None, :]  # [t, j]: t >= j
    p = (g @ after.double()).clamp(max=max_position - 1)
    z = q @ emb
    lo, hi, w = p.floor(), p.ceil(), p - p.floor()
    return (1 - w) * z.gather(-1, lo.long()) + w * z.gather(-1, hi.long())


def cope(per_head, heads=4, d=8, max_position=6):
    enc = build_encoding("cope", max_position=max_position, per_head=per_head, init_std=0.5)
    return enc.bind(n_heads=heads, head_dim=d)


def leaves(b, h, hkv, nq, nk, d, scale, dtype=torch.float32):
    torch.manual_seed(0)
    q = (scale * torch.randn(b, h, nq, d)).to(dtype).requires_grad_()
    k = (scale * torch.randn(b, hkv, nk, d)).to(dtype).requires_grad_()
    return q, k


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("hkv", [4, 2])  # GQA: two query heads per kv head
@pytest.mark.parametrize("max_position", [6, 80])  # most keys clamped (skipped), or none
@pytest.mark.parametrize("traced", [False, True])  # as under torch.compile: no values read on the host
def test_rows_equal_the_paper_formula(per_head, hkv, max_position, traced, monkeypatch):
    if traced:
        for module in (fcope, ecope):
            monkeypatch.setattr(module, "host_reads_ok", lambda t: False)
    enc = cope(per_head, max_position=max_position)
    q, k = leaves(2, 4, hkv, 37, 120, 8, 1.0)  # 83 cached keys: query i at key i + 83
    bias = enc.bias(q, k, AttentionContext(None, None, True))
    ref = paper_bias(q, k, enc.pos_emb, max_position, 83)
    grad = torch.randn_like(ref)
    want = torch.autograd.grad((ref * grad).sum(), [q, k, enc.pos_emb], retain_graph=True)
    clamped = []
    for s, e, ke in [(0, 37, 120), (0, 13, 96), (13, 30, 113), (30, 37, 120), (5, 9, 40)]:
        clamped.append(enc.clamped_keys(q[:, :, s:e], k[:, :, :max(ke, 83 + e)], 83 + s))
        rows = bias.rows(s, e, ke)  # float32 counts of up to 120 gates: ~1e-5 from float64's
        torch.testing.assert_close(rows.double(), ref[..., s:e, :ke], rtol=1e-4, atol=1e-4)
        with torch.no_grad():  # the inference route (written in place)
            torch.testing.assert_close(bias.rows(s, e, ke), rows)
        got = torch.autograd.grad((rows * grad[..., s:e, :ke]).sum(), [q, k, enc.pos_emb])
        part = torch.autograd.grad((ref[..., s:e, :ke] * grad[..., s:e, :ke]).sum(), [q, k, enc.pos_emb],
                                   retain_graph=True)
        for a, b in zip(got, part):
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-4)
    assert (max(clamped) > 0) == (max_position == 6 and not traced)  # 120 gates count to 5, not 79
    full = bias.materialize()
    torch.testing.assert_close(full.double(), ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(torch.autograd.grad((full * grad).sum(), [q, k, enc.pos_emb]), want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-4)


def test_whole_positions_match_the_eager_reference():
    """Saturated gates (exactly 1 in float32): every count is a whole number, where the
    interpolation's slope is 0 (ceil = floor) and all of the row's gradient goes to z[floor p]."""
    enc = cope(True)
    q = torch.full((1, 4, 9, 8), 3.0, requires_grad=True)
    k = torch.full((1, 4, 20, 8), 3.0, requires_grad=True)
    bias = enc.bias(q, k, AttentionContext(None, None, True))
    ref = enc.bias_tensor(q, k, True)
    grad = torch.randn_like(ref)
    for s, e in [(0, 4), (4, 9)]:
        rows = bias.rows(s, e, 11 + e)
        torch.testing.assert_close(rows, ref[..., s:e, :11 + e])
        got = torch.autograd.grad((rows * grad[..., s:e, :11 + e]).sum(), [q, k, enc.pos_emb])
        want = torch.autograd.grad((ref[..., s:e, :11 + e] * grad[..., s:e, :11 + e]).sum(), [q, k, enc.pos_emb],
                                   retain_graph=True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_head", [True, False])
def test_blockwise_attention_equals_eager_on_the_paper_formula(per_head, dtype, monkeypatch):
    tunables = Tunables(bias_block_bytes=1)  # the minimum blocks: 16 query rows, 12 in backward
    n, cached, h, hkv, d = 150, 7, 4, 2, 8
    attn = Attn(n_heads=h, head_dim=d)
    attn.posenc_tunables = tunables
    enc = inject(attn, "cope", backend="sdpa", max_position=6, per_head=per_head, init_std=0.5)
    q, k = leaves(2, h, hkv, n, n + cached, d, 2.0, dtype)
    v = torch.randn(2, hkv, n + cached, d).to(dtype).requires_grad_()
    kw = {"positions": torch.arange(n)[None].expand(2, -1) + cached, "causal": True}
    out = attn(q, k, v, **kw)
    g = torch.randn_like(out)
    params = [q, k, v, enc.pos_emb]
    grads = torch.autograd.grad((out * g).sum(), params)

    monkeypatch.setattr(enc, "bias", lambda q_, k_, ctx: DenseBias(paper_bias(q_, k_, enc.pos_emb, 6, cached)))
    if dtype == torch.float32:  # eager attention in float64
        attn.posenc_backend = "eager"
        q, k, v, g = (t.double() for t in (q, k, v, g))
    ref = attn(q, k, v, **kw)  # bf16: the same attention, only the bias is the dense formula's
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(out.double(), ref.double(), **tol)
    for a, b in zip(grads, torch.autograd.grad((ref * g).sum(), params)):
        torch.testing.assert_close(a.double(), b.double(), **tol)


@pytest.mark.parametrize("max_position", [6, 20])
def test_rows_from_the_clamp_search_equal_rows_counted_anew(max_position):
    """The rows take the gates and counts the clamp search computed over a wider window (a slice
    of them): the same rows and gradients as counting the rows' own keys anew, on long rows where
    most keys are clamped; the search's count (a binary search on the suffix sums) is the number
    of keys at the clamp in every row."""
    enc = cope(False, heads=2, d=8, max_position=max_position)
    q, k = leaves(1, 2, 2, 40, 300, 8, 1.0)  # 260 cached keys
    bias = enc.bias(q, k, AttentionContext(None, None, True))
    for s, e in [(0, 17), (17, 40)]:
        ke, off = 260 + e, 260 + s
        rows = bias.rows(s, e, ke)  # the window's search hands its counts to the rows
        j = enc.clamped_keys(q[:, :, s:e], k[:, :, :ke], off)
        assert j > 0
        anew = enc.bias_rows(q[:, :, s:e], k[:, :, j:ke], True, off, clamped=j)  # counted by the rows
        torch.testing.assert_close(rows, anew, rtol=1e-6, atol=1e-6)
        g = torch.randn_like(rows)
        got = torch.autograd.grad((rows * g).sum(), [q, k, enc.pos_emb])
        want = torch.autograd.grad((anew * g).sum(), [q, k, enc.pos_emb])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            _, suffix = fcope.cope_counts(q[:, :, s:e], k[:, :, :ke], enc.softmax_scale(8), off)
            top = max_position - 1
            assert fcope.cope_clamped_count(suffix, top) == int((suffix >= top).sum(-1).min()) == j


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("lead", [1, 9])
def test_band_rows_equal_the_paper_formula(per_head, hkv, lead):
    """Rows on each row's band of its last ``width + 1`` keys, from the band search (`CoPE._band`):
    every key before a row's band is clamped, and the narrowest such band is found; the rows equal
    the paper's formula, forward and backward, except at the keys after each query (hidden by the
    causal mask), which hold ``z_i[P - 1]``, as the keys before the band."""
    enc = cope(per_head, max_position=6)
    q, k = leaves(2, 4, hkv, 29, 150, 8, 1.0)  # 121 cached keys: query i at key 121 + i
    off, top = 121, 5
    width, counted = enc._band(q, k, off)
    assert 0 < width < off
    ref = paper_bias(q, k, enc.pos_emb, 6, off)
    with torch.no_grad():  # the paper's counts: clamped before each row's band, not all before a narrower one
        qd, kd = q.double(), k.double().repeat_interleave(4 // hkv, dim=1)
        g = torch.sigmoid(qd @ kd.mT / 8 ** 0.5) * (torch.arange(150)[None, :] <= torch.arange(29)[:, None] + off)
        p = g.flip(-1).cumsum(-1).flip(-1)
        first = off - width + torch.arange(29)  # each row's first band key
        before, at = (p.gather(-1, (first + i).expand(2, 4, 29)[..., None]) for i in (-1, 0))
        assert (before >= top - 1e-4).all() and (at < top + 1e-4).any()
    c = off - width
    z = q @ enc.pos_emb
    want = ref[..., c - lead:].clone()
    after = torch.arange(c - lead, 150)[None, :] > torch.arange(29)[:, None] + off
    want = torch.where(after, z[..., top:].expand_as(want).double(), want)
    scale = enc.softmax_scale(8)
    for found in (counted, None):  # the search's counts, or counted anew
        rows = rcope.cope_band_rows(q, k[:, :, c:], enc.pos_emb, scale, 6, width, lead, found)
        torch.testing.assert_close(rows.double(), want, rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            torch.testing.assert_close(rcope.cope_band_rows(q, k[:, :, c:], enc.pos_emb, scale, 6, width, lead), rows)
        grad = torch.randn_like(want)
        got = torch.autograd.grad((rows * grad).sum(), [q, k, enc.pos_emb])
        ref_g = torch.autograd.grad((want * grad.double()).sum(), [q, k, enc.pos_emb], retain_graph=True)
        for a, b in zip(got, ref_g):
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-4)
