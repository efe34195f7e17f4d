"""Lazy biases (FIRE's kind, CoPE, mixture): computed one block of query rows at a time, never
``H x N x N``; equal to the dense formulas forward and backward, and through the blockwise SDPA
backend equal to eager attention on the dense formula (offset positions, packed documents,
causal and not, lengths that are not a multiple of the block)."""

import pytest
import torch
from torch import nn

from posenc_lightning import inject
from posenc_lightning.encodings.base import AttentionContext, DenseBias, RelativeBias
from posenc_lightning.encodings.fire import FireBias
from posenc_lightning.encodings.fire.functions import fire_mlp
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.tunables import Tunables
from tests.helpers import Attn


# ------------------------------------------------------------------------------- DenseBias
def test_lazy_dense_bias_rows_equal_materialize():
    full = torch.randn(2, 3, 9, 13)
    calls = []

    def fn(s, e, ke):
        calls.append((s, e, ke))
        return full[..., s:e, :ke].double()  # any dtype in, float32 out

    lazy = DenseBias.lazy(fn, 9, 13)
    assert lazy.is_lazy and not DenseBias(full).is_lazy
    torch.testing.assert_close(lazy.materialize(), full)
    assert calls == [(0, 9, 13)]
    for s, e, ke in [(0, 4, 5), (4, 9, 13), (3, 4, 1), (8, 9, 9)]:
        r = lazy.rows(s, e, ke)
        assert r.dtype == torch.float32 and calls[-1] == (s, e, ke)  # only the rows asked for
        torch.testing.assert_close(r, lazy.materialize()[..., s:e, :ke])
        torch.testing.assert_close(DenseBias(full).rows(s, e, ke), r)
    torch.testing.assert_close((lazy + DenseBias(full)).rows(2, 5, 7), 2 * full[..., 2:5, :7])
    w = torch.tensor(0.3)
    s = lazy.scaled(w)
    assert s.is_lazy
    torch.testing.assert_close(s.rows(1, 6, 4), 0.3 * full[..., 1:6, :4])
    with pytest.raises(ValueError, match="DenseBias.lazy"):
        DenseBias()
    with pytest.raises(ValueError, match="DenseBias.lazy"):
        DenseBias(full, fn=fn, shape_qk=(9, 13))


# ------------------------------------------------------------------------------- fire_mlp
def _mlp(width, heads, dtype):
    mlp = nn.Sequential(nn.Linear(1, width), nn.ReLU(), nn.Linear(width, heads)).to(dtype)
    with torch.no_grad():
        w1, b1 = mlp[0].weight[:, 0], mlp[0].bias
        w1[0], b1[0] = 0.0, 0.7  # w1 = 0, always on: its w1 still gets a gradient
        w1[1], b1[1] = 0.0, -0.2  # w1 = 0, always off
        w1[2], b1[2] = 0.0, 0.0  # w1 = 0 at relu's kink: off (relu'(0) = 0)
        w1[3], b1[3] = 2.0, -0.5  # breakpoint 0.25, exactly representable: switches on
        w1[4], b1[4] = -4.0, 1.5  # breakpoint 0.375: switches off
        w1[5], b1[5] = 0.5, -0.125  # a second unit breaking at 0.25
        w1[6], b1[6] = 3.0, 2.0  # breakpoint -2/3 < min x: always on
        w1[7], b1[7] = -1.0, -3.0  # breakpoint -3: always off
    return mlp


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fire_mlp_equals_the_mlp_forward_and_backward(dtype):
    chunks = Tunables(fire_mlp_chunk=64)  # several chunks, a ragged last one
    torch.manual_seed(0)
    mlp = _mlp(12, 3, dtype)
    kinks = torch.tensor([0.25, 0.375, 0.0, 1.0, -0.5], dtype=dtype)  # at breakpoints and ends
    x = torch.cat([torch.rand(2, 150, dtype=dtype) * 1.5 - 0.5, kinks.expand(2, -1)], 1)
    x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = mlp(x_ref[..., None]).permute(0, 2, 1)  # [B, H, M]
    out = fire_mlp(x_new, mlp[0].weight[:, 0], mlp[0].bias, mlp[2].weight, mlp[2].bias, chunks)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out, ref, **tol)
    g = torch.randn_like(ref)
    leaves = list(mlp.parameters())
    g_ref = torch.autograd.grad((ref * g).sum(), [x_ref, *leaves])
    g_new = torch.autograd.grad((out * g).sum(), [x_new, *leaves])
    for a, b in zip(g_new, g_ref):
        torch.testing.assert_close(a, b, **tol)
    assert g_new[1][0, 0] != 0 and g_new[1][1, 0] == 0 and g_new[1][2, 0] == 0  # w1 of the w1 = 0 units
    # a range where every unit is on or off (no per-element hidden unit at all), and an empty x
    xs = torch.full((1, 5), 0.3, dtype=dtype)
    torch.testing.assert_close(fire_mlp(xs, mlp[0].weight[:, 0], mlp[0].bias, mlp[2].weight, mlp[2].bias),
                               mlp(xs[..., None]).permute(0, 2, 1), **tol)
    assert fire_mlp(x[:, :0], mlp[0].weight[:, 0], mlp[0].bias, mlp[2].weight, mlp[2].bias).shape == (2, 3, 0)


# ------------------------------------------------------------------------------- cope_lookup
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cope_lookup_equals_clamp_then_interpolate(dtype):
    from posenc_lightning.encodings.cope.rows import cope_lookup
    from posenc_lightning.functional.cope import cope_interpolate

    torch.manual_seed(3)
    z = torch.randn(2, 3, 5, 6, dtype=dtype)  # P = 6: positions clamp at 5
    pos = torch.rand(2, 3, 5, 40, dtype=dtype) * 8
    pos[..., :6] = torch.tensor([0.0, 1.0, 2.0, 5.0, 7.0, 4.5], dtype=dtype)  # whole, at and past the top
    z1, p1 = z.clone().requires_grad_(), pos.clone().requires_grad_()
    z2, p2 = z.clone().requires_grad_(), pos.clone().requires_grad_()
    ref = cope_interpolate(z1, p1.clamp(max=5))
    out = cope_lookup(z2, p2)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out, ref, **tol)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad((out * g).sum(), [z2, p2]), torch.autograd.grad((ref * g).sum(), [z1, p1])):
        torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(cope_lookup(z, pos, max_position=3), cope_interpolate(z, pos.clamp(max=2)), **tol)
    with pytest.raises(ValueError, match="max_position"):
        cope_lookup(z, pos, max_position=7)


# ------------------------------------------------------------------------------- bias level
def _trained_like(enc):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return enc


def test_fire_lazy_bias_equals_the_dense_formula():
    from posenc_lightning import build_encoding

    enc = _trained_like(build_encoding("fire", init_L=12.0, init_c=0.3, mlp_width=16).bind(n_heads=3))
    qp = torch.stack([torch.arange(40) + 7, torch.cat([torch.arange(15), torch.arange(25)])])  # offset; packed
    kp = qp
    bias = enc.bias(None, None, AttentionContext(qp, kp))
    assert type(bias) is FireBias  # queries past L: the MLP per (i, j), by rows here
    params = [p for p in enc.parameters() if p.requires_grad]
    for s, e, ke in [(0, 40, 40), (5, 23, 23), (23, 40, 31)]:
        new = bias.rows(s, e, ke)
        ref = enc.bias_tensor(qp, kp)[..., s:e, :ke]
        torch.testing.assert_close(new, ref, rtol=1e-5, atol=1e-6)
        g = torch.randn_like(ref)
        for a, b in zip(torch.autograd.grad((new * g).sum(), params), torch.autograd.grad((ref * g).sum(), params)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # float positions also take FIRE's kind; queries all below L on CPU stay a per-distance table
    assert type(enc.bias(None, None, AttentionContext(qp.float(), kp.float()))) is FireBias
    short = torch.arange(10)[None]
    assert type(enc.bias(None, None, AttentionContext(short, short))) is RelativeBias


@pytest.mark.parametrize("chunk", [1, 2**20])  # sub-blocks of one row (checkpointed), or none
@pytest.mark.parametrize("causal", [True, False])
def test_cope_lazy_bias_equals_the_dense_formula(causal, chunk):
    from posenc_lightning import build_encoding

    mode = Mode.now("cpu", Tunables(cope_chunk_bytes=chunk, cope_grad_chunk_bytes=chunk))
    enc = build_encoding("cope", max_position=5, per_head=True, init_std=0.5).bind(n_heads=2, head_dim=4)
    q = torch.randn(2, 2, 9, 4, requires_grad=True)
    k = torch.randn(2, 2, 14, 4, requires_grad=True)  # 5 cached keys first: query i at key i + 5
    bias = enc.bias(q, k, AttentionContext(None, None, causal, mode=mode))
    assert isinstance(bias, DenseBias) and bias.is_lazy
    leaves = [q, k, enc.pos_emb]
    for s, e, ke in [(0, 9, 14), (2, 6, 11), (6, 9, 14), (3, 7, 2)]:  # any k_stop, even inside the rows
        new = bias.rows(s, e, ke)
        ref = enc.bias_tensor(q, k, causal)[..., s:e, :ke]
        torch.testing.assert_close(new, ref, rtol=1e-5, atol=1e-6)
        g = torch.randn_like(ref)
        for a, b in zip(torch.autograd.grad((new * g).sum(), leaves), torch.autograd.grad((ref * g).sum(), leaves)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------- attention
N, B, H, D = 150, 2, 4, 8  # 150 rows: blocks of 64, 64, 22

ENCODINGS = {
    "fire": {"init_L": 10.0, "init_c": 0.3, "mlp_width": 8},
    "cope": {"max_position": 6, "per_head": True, "init_std": 0.5},
    "mixture": {"members": ("alibi", "fire", "rope"), "member_cfgs": {"fire": {"init_L": 10.0}},
                "init_weights": (0.2, -0.1, 0.3)},
}
LAYOUTS = {
    "offset_causal": (True, torch.stack([torch.arange(N) + 11, torch.arange(N)]), None),
    "packed_causal": (True, torch.cat([torch.arange(61), torch.arange(89)])[None].expand(B, -1),
                      torch.cat([torch.zeros(61), torch.ones(89)]).long()[None].expand(B, -1)),
    "offset_bidirectional": (False, torch.stack([torch.arange(N) + 3, torch.arange(N) + 40]), None),
}


def _dense_reference(enc, name):
    """The encoding's bias as its dense formula (the pre-lazy path) for eager attention."""
    if name == "fire":
        return lambda q, k, ctx: DenseBias(enc.bias_tensor(ctx.q_pos, ctx.k_pos))
    if name == "cope":
        return lambda q, k, ctx: DenseBias(enc.bias_tensor(q, k, ctx.causal))
    lazy = enc.bias
    return lambda q, k, ctx: DenseBias(lazy(q, k, ctx).materialize())


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(ENCODINGS))
def test_blockwise_sdpa_equals_eager_dense_formula_fwd_bwd(name, layout, monkeypatch):
    # the minimum block: 16 query rows; cope: sub-blocks of 10 rows
    rows10 = 4 * B * H * N * 10
    monkeypatch.setattr(Attn, "posenc_tunables", Tunables(bias_block_bytes=1, cope_chunk_bytes=rows10,
                                                          cope_grad_chunk_bytes=rows10))
    causal, pos, seg = LAYOUTS[layout]
    torch.manual_seed(2)
    attn = Attn(n_heads=H, head_dim=D)
    enc = _trained_like(inject(attn, name, backend="sdpa", **ENCODINGS[name]))
    hkv = 2 if name == "cope" else H  # grouped kv heads for the gates
    q = torch.randn(B, H, N, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, hkv, N, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    kw = {"positions": pos, "causal": causal, "segment_ids": seg}
    leaves = [q, k, v] + [p for p in enc.parameters() if p.requires_grad]

    # the blockwise backend asks the lazy bias for blocks of rows only
    requested, lazy_bias = [], enc.bias

    def spy(q_, k_, ctx):
        bias = lazy_bias(q_, k_, ctx)
        for t in bias.terms:
            if isinstance(t, DenseBias):
                assert t.is_lazy
                fn = t.fn
                t.fn = lambda s, e, ke, *ins, fn=fn: (requested.append(e - s), fn(s, e, ke, *ins))[1]
            elif isinstance(t, FireBias):
                fn = t.rows_from
                t.rows_from = lambda s, e, ke, views, fn=fn, **kw: (requested.append(e - s), fn(s, e, ke, views, **kw))[1]
        return bias

    monkeypatch.setattr(enc, "bias", spy)
    out = attn(q, k, v, **kw)
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), leaves)
    assert requested and max(requested) <= 64 and N not in requested

    monkeypatch.setattr(enc, "bias", _dense_reference(enc, name))
    attn.posenc_backend = "eager"
    ref = attn(q, k, v, **kw)
    ref_grads = torch.autograd.grad((ref * g).sum(), leaves)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5)
