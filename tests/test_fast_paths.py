"""Fast paths (issue 8) against the plain formulas they replace, forward and backward."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from posenc_lightning.functional.rope import apply_rotary, apply_rotary_reference, rope_cos_sin, rope_inv_freq


def _qk_like(b: int, h: int, n: int, d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q as the models make it: a strided view of a fused projection, [B, H, N, D]."""
    fused = torch.randn(b, n, 3 * h * d, dtype=dtype)
    return fused[..., h * d: 2 * h * d].view(b, n, h, d).transpose(1, 2)


POSITIONS = {
    "arange": torch.arange(13)[None].expand(2, 13),
    "offset": torch.arange(1000, 1013)[None].expand(2, 13),
    "packed": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4]] * 2),
}


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("pos", list(POSITIONS))
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_apply_rotary_fast_equals_formula_fwd_bwd(layout, pos, partial):
    d, h = 32, 3
    r = int(d * partial)
    cos, sin = rope_cos_sin(POSITIONS[pos], rope_inv_freq(r, 500.0))
    x = _qk_like(2, h, 13, d).requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = apply_rotary(x, cos, sin, layout), apply_rotary_reference(x_ref, cos, sin, layout)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    if partial < 1:
        assert torch.equal(y[..., r:], x[..., r:])


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_apply_rotary_dtypes_and_per_head_tables(layout):
    d, h = 16, 2
    pos = POSITIONS["packed"]
    inv = torch.stack([rope_inv_freq(d, 100.0), rope_inv_freq(d, 1e4)])  # per head [H, D/2]
    cos, sin = rope_cos_sin(pos, inv, attention_scaling=1.3)  # [B, H, N, D/2], mscale folded in
    assert cos.dim() == 4
    for dtype in (torch.bfloat16, torch.float64):
        x = _qk_like(2, h, 13, d, dtype)
        y = apply_rotary(x, cos, sin, layout)
        ref = apply_rotary_reference(x, cos, sin, layout)
        assert y.dtype == dtype
        tol = 1e-12 if dtype == torch.float64 else 1e-2
        torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    # float64 end to end is exact math: the norm of each pair is scaled by exactly 1.3
    x = _qk_like(2, h, 13, d, torch.float64)
    cos, sin = rope_cos_sin(pos, inv.double(), attention_scaling=1.3)
    y = apply_rotary(x, cos, sin, layout)
    pair = (lambda t: t.unflatten(-1, (2, -1)).pow(2).sum(-2)) if layout == "half" else \
        (lambda t: t.unflatten(-1, (-1, 2)).pow(2).sum(-1))
    torch.testing.assert_close(pair(y), 1.3 ** 2 * pair(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_apply_rotary_gradcheck_incl_learned_frequencies(layout):
    """Exact gradients (float64 gradcheck, double backward too) for x and for cos/sin that
    require grad (learned frequencies take the autograd path)."""
    pos = POSITIONS["offset"][:1, :5]
    inv = rope_inv_freq(8, dtype=torch.float64).requires_grad_(True)
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True)

    def f(x, inv):
        c, s = rope_cos_sin(pos, inv)
        return apply_rotary(x, c, s, layout)

    assert torch.autograd.gradcheck(f, (x, inv))
    c, s = rope_cos_sin(pos, inv.detach())
    assert torch.autograd.gradgradcheck(lambda x: apply_rotary(x, c, s, layout), (x,))


def test_apply_rotary_odd_storage_offset_interleaved():
    """A view at an odd storage offset cannot be viewed as complex: falls back to a copy."""
    buf = torch.randn(1 + 2 * 5 * 8)
    x = buf[1:].view(1, 2, 5, 8)
    cos, sin = rope_cos_sin(torch.arange(5)[None], rope_inv_freq(8))
    torch.testing.assert_close(apply_rotary(x, cos, sin, "interleaved"),
                               apply_rotary_reference(x, cos, sin, "interleaved"), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# sdpa with a bias: Toeplitz view (i - j kinds at arange positions) and blockwise rows
# ---------------------------------------------------------------------------------------------
from posenc_lightning.attention.backends import eager, sdpa
from posenc_lightning.attention.backends.sdpa.rows import RowsAttention
from posenc_lightning.attention.backends.sdpa.toeplitz import toeplitz_template
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import (
    AttentionContext,
    BiasSum,
    DecayBias,
    DenseBias,
    LinearBias,
    RelativeBias,
    span,
)
from posenc_lightning.functional.alibi import alibi_slopes
from posenc_lightning.functional.tunables import Tunables


def _bias(kind: str, h: int, qp, kp, learned: bool = False):
    if kind == "linear":
        return LinearBias(alibi_slopes(h), qp, kp)
    table = torch.randn(h, 2 * 7 + 1, requires_grad=learned)
    rel = RelativeBias(table, qp, kp)
    return rel if kind == "relative" else BiasSum([rel, LinearBias(alibi_slopes(h), qp, kp)])


CASES = {  # name: (n_q, n_k, q positions, k positions, causal, q_offset, segments)
    "arange_causal": (300, 300, torch.arange(300), torch.arange(300), True, 0, None),
    "offset_arange": (300, 300, torch.arange(50, 350), torch.arange(50, 350), True, 0, None),
    "decode_cache": (37, 337, torch.arange(300, 337), torch.arange(337), True, 300, None),
    "bidirectional": (200, 200, torch.arange(200), torch.arange(200), False, 0, None),
    "packed": (300, 300, torch.cat([torch.arange(120), torch.arange(180)]),
               torch.cat([torch.arange(120), torch.arange(180)]), True, 0,
               torch.cat([torch.zeros(120), torch.ones(180)]).long()),
    "shuffled": (300, 300, torch.randperm(300), None, True, 0, None),
}


@pytest.mark.parametrize("kind", ["linear", "relative", "sum"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("learned", [False, True])
def test_sdpa_bias_fast_paths_equal_eager_fwd_bwd(kind, case, learned, monkeypatch):
    if learned and kind == "linear":
        pytest.skip("ALiBi slopes are fixed")
    tunables = Tunables(bias_block_bytes=4 * 64 * 4 * 400)  # force several blocks of rows
    n_q, n_k, qp, kp, causal, off, seg = CASES[case]
    kp = qp if kp is None else kp
    b, h, hkv, d = 2, 4, 2, 16
    qp, kp = qp[None].expand(b, -1), kp[None].expand(b, -1)
    bias = _bias(kind, h, qp, kp, learned)
    seg2 = None if seg is None else seg[None].expand(b, -1)
    mask = AttentionMask(causal, off, n_q, n_k, seg2, seg2)
    ctx = AttentionContext(qp, kp, causal)
    q = torch.randn(b, h, n_q, d, requires_grad=True)
    k, v = (torch.randn(b, hkv, n_k, d, requires_grad=True) for _ in range(2))
    outs, grads = [], []
    for backend in (sdpa, eager):
        given = {"tunables": tunables} if backend is sdpa else {}
        out = backend.attend(q, k, v, bias=bias, mask=mask, scale=d ** -0.5, ctx=ctx, **given)
        leaves = [q, k, v] + [p for p in (getattr(t, "table", None) for t in bias.terms)
                              if p is not None and p.requires_grad]
        outs.append(out)
        grads.append(torch.autograd.grad(out, leaves, torch.ones_like(out) / out.numel() ** 0.5))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1, rtol=1e-4, atol=1e-5)


def test_toeplitz_template_only_where_valid():
    h, n = 4, 64
    ar = torch.arange(n)[None].expand(2, n)
    mask = AttentionMask(True, 0, n, n)
    bias = _bias("sum", h, ar, ar)
    u = toeplitz_template(bias, mask, n, n, AttentionContext(ar, ar))
    assert u is not None and u.shape == (h, 2 * n - 1)
    # the template holds every diagonal of the bias: row i of the bias is u[:, n-1-i : 2n-1-i]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    dense = bias.materialize()[0].masked_fill(~causal, float("-inf"))
    for i in (0, 17, n - 1):
        torch.testing.assert_close(u[:, n - 1 - i: 2 * n - 1 - i], dense[:, i])
    perm = torch.randperm(n)[None].expand(2, n)
    assert toeplitz_template(_bias("linear", h, perm, perm), mask, n, n, AttentionContext(perm, perm)) is None
    c = torch.randn(2, h, n)
    assert toeplitz_template(DecayBias(c, c), mask, n, n, AttentionContext(ar, ar)) is None
    assert toeplitz_template(DenseBias(torch.randn(1, h, n, n)), mask, n, n, AttentionContext(ar, ar)) is None


def test_bias_rows_equal_materialize_slices():
    qp = torch.tensor([[3, 4, 5, 0, 1, 2, 9]])
    c = torch.randn(1, 2, 7)
    for bias in (_bias("sum", 2, qp, qp), DecayBias(c, c), DenseBias(torch.randn(1, 2, 7, 7))):
        torch.testing.assert_close(bias.rows(2, 5, 6), bias.materialize()[..., 2:5, :6])


def test_causal_alibi_as_key_channel_long_and_offset():
    """The extra-channel form of causal ALiBi (m_h j instead of -m_h |i - j|) at a long length and
    far-off positions, fwd and bwd, against the dense eager reference; where not valid it is not used."""
    b, h, n, d = 1, 2, 2048, 16
    pos = torch.arange(100_000, 100_000 + n)[None]
    bias = LinearBias(alibi_slopes(8)[:h] * 0 + torch.tensor([0.5, 1 / 256]), pos, pos)
    mask = AttentionMask(True, 0, n, n)
    ctx = AttentionContext(pos, pos, True)
    q = torch.randn(b, h, n, d, requires_grad=True)
    k, v = (torch.randn(b, 1, n, d, requires_grad=True) for _ in range(2))  # GQA
    assert bias.key_only(q.dtype, mask.is_plain_causal) is not None
    outs = [be.attend(q, k, v, bias=bias, mask=mask, scale=d ** -0.5, ctx=ctx) for be in (sdpa, eager)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    g = [torch.autograd.grad(o.square().sum(), (q, k, v)) for o in outs]
    for g0, g1 in zip(*g):
        torch.testing.assert_close(g0, g1, rtol=1e-3, atol=1e-4)
    # not valid: keys after queries in position, bf16, a KV-cache step, packed documents
    rev = pos.flip(-1)
    assert LinearBias(bias.slopes, rev, rev).key_only(q.dtype, True) is None
    assert bias.key_only(torch.bfloat16, True) is None
    assert bias.key_only(q.dtype, AttentionMask(True, 5, n, n + 5).is_plain_causal) is None
    seg = torch.zeros(1, n, dtype=torch.long)
    assert bias.key_only(q.dtype, AttentionMask(True, 0, n, n, seg, seg).is_plain_causal) is None


@pytest.mark.parametrize("case", ["arange_causal", "decode_cache", "bidirectional", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decay_bias_as_key_channel_equals_eager_fwd_bwd(case, dtype):
    """FoX's ``c_i - c_j`` as one extra q/k channel (softmax drops the per-row ``c_i``): same
    outputs and gradients (q, k, v, c_k; c_q's is 0) as the dense bias, GQA keys, any mask."""
    n_q, n_k, _qp, _kp, causal, off, seg = CASES[case]
    b, h, hkv, d = 2, 4, 2, 16
    # cumulative log forget gates: decreasing, hundreds in size, as FoX makes them
    c = torch.cumsum(torch.nn.functional.logsigmoid(torch.randn(b, h, n_k, dtype=dtype) + 1), -1)
    c = c.requires_grad_(True)
    seg2 = None if seg is None else seg[None].expand(b, -1)
    mask = AttentionMask(causal, off, n_q, n_k, seg2, seg2)
    q = torch.randn(b, h, n_q, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, hkv, n_k, d, dtype=dtype, requires_grad=True) for _ in range(2))
    assert DecayBias(c[..., off:], c).key_only(q.dtype, mask.is_plain_causal) is not None

    def reference():  # the formula in float64: softmax(q k^T s + c_i - c_j) v
        q64, k64, v64, c64 = (t.double() for t in (q, k, v, c))
        k64, v64 = (t.repeat_interleave(h // hkv, dim=1) for t in (k64, v64))
        logits = q64 @ k64.transpose(-1, -2) * d ** -0.5 + c64[..., n_k - n_q:, None] - c64[..., None, :]
        allowed = mask.materialize(q.device)
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        return torch.softmax(logits, -1) @ v64

    outs, grads = [], []
    for f in (lambda: sdpa.attend(q, k, v, bias=DecayBias(c[..., n_k - n_q:], c), mask=mask, scale=d ** -0.5),
              reference):
        out = f()
        outs.append(out)
        grads.append(torch.autograd.grad(out, (q, k, v, c), torch.ones_like(out) / out.numel() ** 0.5))
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(outs[0], outs[1].to(dtype), rtol=tol, atol=tol)
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1.to(dtype), rtol=tol, atol=tol)
    assert DecayBias(c, c).key_only(torch.bfloat16, True) is None  # bf16 cannot hold c


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_key_only_bias_on_the_cpu_flash_kernel(monkeypatch, dtype):
    """Causal ALiBi (fixed slopes) and FoX with gates that need no gradient reduce to a key-only
    bias, given to SDPA's CPU flash kernel as a broadcast mask with its causal flag (no copies
    of q/k): same outputs and q/k/v gradients as the float64 formula, batch 2, far-off
    positions. Learned slopes / c that need a gradient, and grouped kv heads, keep the
    extra-channel form."""
    b, h, n, d = 2, 4, 300, 16
    used = []
    orig = sdpa._attend_key_bias
    monkeypatch.setattr(sdpa, "_attend_key_bias", lambda *a: (used.append(1), orig(*a))[1])
    pos = torch.arange(50_000, 50_000 + n)[None].expand(b, -1)
    mask, ctx = AttentionMask(True, 0, n, n), AttentionContext(pos, pos, True)
    slopes = alibi_slopes(h)
    c = torch.cumsum(torch.nn.functional.logsigmoid(torch.randn(b, h, n, dtype=dtype) + 1), -1)
    q, k, v = (torch.randn(b, h, n, d, dtype=dtype, requires_grad=True) for _ in range(3))
    i = torch.arange(n)
    for bias, dense in ((LinearBias(slopes, pos, pos), -slopes.double()[:, None, None] * (i[:, None] - i).abs()),
                        (DecayBias(c, c), c.double()[..., :, None] - c.double()[..., None, :])):
        out = sdpa.attend(q, k, v, bias=bias, mask=mask, scale=d ** -0.5, ctx=ctx)
        logits = (q.double() @ k.double().transpose(-1, -2)) * d ** -0.5 + dense
        ref = torch.softmax(logits.masked_fill(i[None, :] > i[:, None], float("-inf")), -1) @ v.double()
        tol = 1e-9 if dtype == torch.float64 else 2e-5
        torch.testing.assert_close(out, ref.to(dtype), rtol=tol, atol=tol)
        g = torch.randn_like(out)
        for g0, g1 in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g.double())):
            torch.testing.assert_close(g0, g1.to(dtype), rtol=10 * tol, atol=10 * tol)
    assert used == [1, 1]
    assert not sdpa._key_mask_works(q, k, c.requires_grad_(True))  # c's gradient: the channel form
    assert not sdpa._key_mask_works(q, k[:, :2], slopes)  # grouped kv heads
    with torch.no_grad():
        assert sdpa._key_mask_works(q, k, c)


def test_learned_toeplitz_backward_and_flush_state(monkeypatch):
    """A learned ``f(i - j)`` table at arange positions runs SDPA's kernel forward and its own
    backward (`_ToeplitzAttention`), equal to eager; flush-to-zero is off again after backward."""
    n, h, d = 301, 4, 16
    tunables = Tunables(bias_block_bytes=2 * 4 * 2 * h * n * 40)  # 40-row backward blocks
    assert sdpa.backward_rows(2, h, n, n, tunables=tunables) == 40
    pos = torch.arange(n)[None].expand(2, n)
    table = torch.randn(h, 2 * 9 + 1, requires_grad=True)
    bias = RelativeBias(table, pos, pos)
    mask, ctx = AttentionMask(True, 0, n, n), AttentionContext(pos, pos, True)
    q, k, v = (torch.randn(2, h, n, d, requires_grad=True) for _ in range(3))
    res = []
    for flush in (True, False):
        out = sdpa.attend(q, k, v, bias=bias, mask=mask, scale=d ** -0.5, ctx=ctx,
                          tunables=replace(tunables, flush_denormals=flush))
        node = out.grad_fn if not flush else out.grad_fn.next_functions[0][0]
        assert "ToeplitzAttention" in type(node).__name__
        res.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v, table))))
        # a denormal survives, i.e. flush-to-zero is off again
        assert torch.tensor(1e-39) * torch.tensor(1.0) != 0
    # a gradient to the table only skips the q/k/v node that turns flush-to-zero off: the end
    # of the backward pass turns it off
    out = sdpa.attend(q, k, v, bias=bias, mask=mask, scale=d ** -0.5, ctx=ctx, tunables=tunables)
    (g_table,) = torch.autograd.grad(out.square().sum(), (table,))
    assert torch.tensor(1e-39) * torch.tensor(1.0) != 0
    torch.testing.assert_close(g_table, res[-1][-1], rtol=1e-5, atol=1e-5)
    ref_out = eager.attend(q, k, v, bias=bias, mask=mask, scale=d ** -0.5, ctx=ctx)
    ref = (ref_out, *torch.autograd.grad(ref_out.square().sum(), (q, k, v, table)))
    for got in res:
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["sinusoidal", "learned"])
@pytest.mark.parametrize("pos", list(POSITIONS))
def test_absolute_embed_slice_equals_lookup_fwd_bwd(name, pos):
    """Stage 1 at ``a + arange(N)`` positions reads a slice of the table (one fused op); any
    other positions a gather: both equal ``sqrt(d) h + PE[pos]`` / ``h + P[pos]``."""
    from posenc_lightning.encodings import build_encoding
    from posenc_lightning.functional.positions import arange_offset
    from posenc_lightning.functional.sinusoidal import sinusoidal_table

    enc = build_encoding(name, **({"max_seq_len": 1100} if name == "learned" else {})).bind(d_model=16)
    positions = POSITIONS[pos]
    assert (arange_offset(positions) is not None) == (pos != "packed")
    h = torch.randn(2, 13, 16, requires_grad=True)
    out = enc.embed(h, positions)
    if name == "sinusoidal":
        ref = h * 4.0 + sinusoidal_table(positions, 16)
    else:
        ref = h + enc.table.detach()[positions]
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    if name == "learned":
        g = torch.randn_like(out)
        (gt,) = torch.autograd.grad(out, enc.table, g)
        expected = torch.zeros_like(enc.table).index_put_((positions.flatten(),), g.flatten(0, 1), accumulate=True)
        torch.testing.assert_close(gt, expected)


def test_blockwise_own_backward_with_dependent_inputs(monkeypatch):
    """A bias that can recompute its rows from stand-ins runs `_RowsAttention` (SDPA forward,
    its own backward), even when its inputs are computed from one another (a mixture's w and
    slopes * w) or are q and k themselves (CoPE): rows are recomputed from detached, windowed
    leaves, so every input gets its partial gradient and autograd sums the paths. Packed
    documents, GQA, a batch-1 dense term; gradients equal eager's on the materialized bias."""
    n_q, n_k, qp, _kp, causal, off, seg = CASES["packed"]
    qp, seg = qp[None].expand(2, -1), seg[None].expand(2, -1)
    mask, ctx = AttentionMask(causal, off, n_q, n_k, seg, seg), AttentionContext(qp, qp, causal)
    table, w = torch.randn(4, 15, requires_grad=True), torch.tensor(0.7, requires_grad=True)
    dense = torch.randn(1, 4, n_q, n_k, requires_grad=True)
    q = torch.randn(2, 4, n_q, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, n_k, 16, requires_grad=True) for _ in range(2))
    used = []
    orig = RowsAttention.apply
    monkeypatch.setattr(RowsAttention, "apply", lambda *a: (used.append(1), orig(*a))[1])

    def make_bias(q, k):
        def qk_rows(s, e, ke, q_rows, k_head):  # 0.1 * q_i . k_j (kv heads repeated), a q/k-dependent bias
            return 0.1 * q_rows @ k_head.repeat_interleave(2, 1).transpose(-1, -2)

        content = DenseBias.lazy(qk_rows, n_q, n_k, inputs=(q, k),
                                 window=lambda s, e, ke: (span(s, e, -2), span(0, ke, -2)))
        return (RelativeBias(table * w, qp, qp) + LinearBias(table[:, 0].abs() * w, qp, qp)
                + DenseBias(dense) + content)

    wanted = (q, k, v, table, w, dense)
    out = sdpa.attend(q, k, v, bias=make_bias(q, k), mask=mask, scale=0.25, ctx=ctx)
    got = torch.autograd.grad(out.square().sum(), wanted)
    assert used == [1]
    ref = eager.attend(q, k, v, bias=make_bias(q, k), mask=mask, scale=0.25, ctx=ctx)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for g0, g1 in zip(got, torch.autograd.grad(ref.square().sum(), wanted)):
        torch.testing.assert_close(g0, g1, rtol=1e-4, atol=1e-4)


def test_blockwise_closure_bias_falls_back_to_checkpoints(monkeypatch):
    """A lazy bias that does not name its inputs cannot be recomputed from stand-ins: checkpointed
    blocks instead, gradients still reach what the closure reads."""
    n_q, n_k, qp, _kp, causal, off, _seg = CASES["packed"]
    mask, ctx = AttentionMask(causal, off, n_q, n_k), AttentionContext(qp[None], qp[None], causal)
    table = torch.randn(1, 4, n_q, n_k, requires_grad=True)
    q, k, v = (torch.randn(1, 4, n_q, 16, requires_grad=True) for _ in range(3))
    monkeypatch.setattr(RowsAttention, "apply", lambda *a: pytest.fail("own backward used"))
    bias = DenseBias.lazy(lambda s, e, ke: table[..., s:e, :ke] * 2, n_q, n_k)
    assert not bias.recomputable
    out = sdpa.attend(q, k, v, bias=bias, mask=mask, scale=0.25, ctx=ctx)
    ref = eager.attend(q, k, v, bias=DenseBias(table * 2), mask=mask, scale=0.25, ctx=ctx)
    for g0, g1 in zip(torch.autograd.grad(out.sum(), (q, table)), torch.autograd.grad(ref.sum(), (q, table))):
        torch.testing.assert_close(g0, g1, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["arange_causal", "decode_cache", "bidirectional"])
@pytest.mark.parametrize("form", ["lazy_inputs", "lazy_closure", "dense_tensor"])
def test_blockwise_causal_fills_only_the_diagonal_part(case, form, monkeypatch):
    """A purely causal mask is applied to the block's diagonal keys only (the keys before its
    first query are visible to all its rows): blocks of rows that do not divide n, a KV-cache
    offset, rows computed just now (written in place) or read from the bias's own tensor (left
    untouched); forward and backward equal eager's."""
    tunables = Tunables(bias_block_bytes=4 * 4 * 300 * 23)  # ~23-row blocks of 4 heads
    n_q, n_k, qp, _, causal, off, _ = CASES[case]
    mask, ctx = AttentionMask(causal, off, n_q, n_k), AttentionContext(qp[None], torch.arange(n_k)[None], causal)
    base = torch.randn(1, 4, n_q, n_k)
    table = base.clone().requires_grad_(True)
    q = torch.randn(1, 4, n_q, 16, requires_grad=True)
    k, v = (torch.randn(1, 4, n_k, 16, requires_grad=True) for _ in range(2))
    if form == "lazy_inputs":
        bias = DenseBias.lazy(lambda s, e, ke, t: t * 2, n_q, n_k, inputs=(table,),
                              window=lambda s, e, ke: ((Ellipsis, slice(s, e), slice(0, ke)),))
    elif form == "lazy_closure":
        bias = DenseBias.lazy(lambda s, e, ke: table[..., s:e, :ke] * 2, n_q, n_k)
    else:
        bias = DenseBias(table * 2)
    out = sdpa.attend(q, k, v, bias=bias, mask=mask, scale=0.25, ctx=ctx, tunables=tunables)
    ref = eager.attend(q, k, v, bias=DenseBias(table * 2), mask=mask, scale=0.25, ctx=ctx)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for g0, g1 in zip(torch.autograd.grad(out.square().sum(), (q, k, v, table)),
                      torch.autograd.grad(ref.square().sum(), (q, k, v, table))):
        torch.testing.assert_close(g0, g1, rtol=1e-4, atol=1e-5)
    assert torch.equal(table.detach(), base)  # no -inf written into the bias's own tensor
