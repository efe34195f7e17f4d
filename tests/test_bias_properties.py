"""Invariants of the bias / normalizer family: FoX is softmax with the dense D bias, stick-breaking
weights (sum <= 1, the product formula, +-50 logits), CoPE's positions, FIRE's length
generalization, hybrids' composition, KV caches and clear errors."""

import pytest
import torch

from posenc_lightning import inject
from posenc_lightning.attention.backends import resolve_backend
from posenc_lightning.encodings.base import AttentionContext, BiasSum, DecayBias, DenseBias, LinearBias, RelativeBias
from posenc_lightning.encodings.fire import FireBias
from posenc_lightning.encodings.registry import build_encoding
from posenc_lightning.functional.cope import cope_positions
from posenc_lightning.functional.stick_breaking import stick_breaking_mask, stick_breaking_weights
from posenc_lightning.models import TinyGPT
from tests.helpers import Attn

MINE = ["fire", "cope", "fox", "sba", "rse", "rope_alibi", "mixture"]


# ------------------------------------------------------------------------------------ FoX
@pytest.mark.parametrize("rope", [False, True])
def test_fox_is_softmax_with_dense_forget_bias(rope):
    b, h, n, d, dm = 2, 3, 13, 8, 12
    attn = Attn(n_heads=h, head_dim=d, d_model=dm)
    enc = inject(attn, "fox", backend="eager", rope=rope, gate_bias_init=2.0)
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    x = torch.randn(b, n, dm)
    out = attn(q, k, v, hidden=x)
    # the seed's multiplicative form: o_i = sum_j F_ij e^{q.k} v_j / sum_j F_ij e^{q.k},
    # F_ij = prod_{l=j+1}^{i} f_l with f = sigmoid(w.x + b), computed here by explicit products
    f = torch.sigmoid(x @ enc.gate.weight.t() + enc.gate.bias).transpose(1, 2).double()  # [B, H, N]
    F = torch.zeros(b, h, n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(i + 1):
            F[..., i, j] = f[..., j + 1:i + 1].prod(-1)
    if rope:
        pos = torch.arange(n).expand(b, n)
        q, k = enc.rope.rotate(q, k, AttentionContext(pos, pos))
    e = torch.exp((q.double() @ k.double().transpose(-1, -2)) * d ** -0.5)
    ref = (F * e) @ v.double() / (F * e).sum(-1, keepdim=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    # and the bias is exactly D = log F, as a DecayBias (O(N) cumulative sums)
    ctx = AttentionContext(torch.arange(n).expand(b, n), torch.arange(n).expand(b, n), hidden=x)
    bias = enc.bias(q, k, ctx)
    assert isinstance(bias, DecayBias) and bias.c_q.shape == (b, h, n)
    tri = torch.ones(n, n, dtype=torch.bool).tril()
    torch.testing.assert_close(bias.materialize().double()[..., tri], F.log()[..., tri], rtol=1e-5, atol=1e-5)


def test_fox_sdpa_equals_eager_forward_and_backward():
    b, h, n, d, dm = 2, 2, 11, 8, 16
    outs, grads = [], []
    for backend in ("eager", "sdpa"):
        torch.manual_seed(1)
        attn = Attn(n_heads=h, head_dim=d, d_model=dm)
        enc = inject(attn, "fox", backend=backend)
        q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
        x = torch.randn(b, n, dm, requires_grad=True)
        out = attn(q, k, v, hidden=x)
        out.square().sum().backward()
        outs.append(out)
        grads.append([t.grad for t in (q, k, v, x, enc.gate.weight, enc.gate.bias)])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------- stick-breaking
def _product_formula(logits, mask):
    """A_ij = beta_ij prod_{j<t<i, visible} (1 - beta_it), by explicit products (float64)."""
    beta = torch.sigmoid(logits.double())
    a = torch.zeros_like(beta)
    nk = logits.shape[-1]
    for j in range(nk):
        keep = (1 - beta[..., j + 1:]).masked_fill(~mask[..., j + 1:], 1.0).prod(-1)
        a[..., j] = beta[..., j] * keep
    return a.masked_fill(~mask, 0.0)


@pytest.mark.parametrize("attend_current", [False, True])
def test_sba_weights_match_product_formula_and_sum_to_at_most_one(attend_current):
    logits = 3 * torch.randn(2, 3, 9, 9)
    mask = stick_breaking_mask(9, 9, 0, attend_current)
    w = stick_breaking_weights(logits, mask)
    torch.testing.assert_close(w.double(), _product_formula(logits, mask.expand_as(logits)), rtol=1e-5, atol=1e-7)
    s = w.sum(-1)
    assert (s <= 1 + 1e-6).all() and (w >= 0).all()
    # the part of the stick left over is the product of every (1 - beta): nothing is created
    rest = (1 - torch.sigmoid(logits.double())).masked_fill(~mask, 1.0).prod(-1)
    torch.testing.assert_close(s.double() + rest, torch.ones_like(rest), rtol=0, atol=1e-6)


def test_sba_kv_cache_offset_and_packed_documents():
    logits = torch.randn(1, 2, 10, 10)
    full = stick_breaking_weights(logits, stick_breaking_mask(10, 10, 0))
    tail = stick_breaking_weights(logits[..., 6:, :], stick_breaking_mask(4, 10, 6))
    torch.testing.assert_close(tail, full[..., 6:, :])
    # two packed documents [0..3] [4..9]: the stick of doc 2 never reaches doc 1
    seg = torch.tensor([0] * 4 + [1] * 6)
    m = stick_breaking_mask(10, 10, 0) & (seg[:, None] == seg[None, :])
    w = stick_breaking_weights(logits, m)
    doc2 = stick_breaking_weights(logits[..., 4:, 4:], stick_breaking_mask(6, 6, 0))
    torch.testing.assert_close(w[..., 4:, 4:], doc2)
    assert (w[..., 4:, :4] == 0).all()


def test_sba_stable_for_logits_of_plus_minus_50():
    n = 12
    sign = torch.randint(0, 2, (2, 2, n, n)).float() * 2 - 1
    for logits in (50 * sign, torch.full((2, 2, n, n), 50.0), torch.full((2, 2, n, n), -50.0)):
        logits = logits.clone().requires_grad_()
        w = stick_breaking_weights(logits, stick_breaking_mask(n, n, 0))
        (w * torch.randn_like(w)).sum().backward()
        assert torch.isfinite(w).all() and torch.isfinite(logits.grad).all()
        assert (w.sum(-1) <= 1 + 1e-6).all()
    # all +50: the nearest earlier key takes the whole stick; all -50: almost nothing is taken
    w = stick_breaking_weights(torch.full((1, 1, n, n), 50.0), stick_breaking_mask(n, n, 0))[0, 0]
    torch.testing.assert_close(w.diagonal(-1), torch.ones(n - 1))
    w = stick_breaking_weights(torch.full((1, 1, n, n), -50.0), stick_breaking_mask(n, n, 0))
    assert w.max() < 1e-20
    # the same through attention with q.k/sqrt(d) = +-50, forward and backward
    attn = Attn(n_heads=2, head_dim=4)
    inject(attn, "sba")
    q = torch.randn(1, 2, n, 4)
    k = q * 0 + q[:, :, :1]
    q = (50 * 2 / (q * k).sum(-1, keepdim=True).abs() * q).requires_grad_()
    v = torch.randn(1, 2, n, 4, requires_grad=True)
    out = attn(q, k, v)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all() and torch.isfinite(v.grad).all()


def test_sba_refuses_non_causal_and_auto_uses_blockwise():
    attn = Attn(n_heads=2, head_dim=4)
    enc = inject(attn, "sba")
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    with pytest.raises(ValueError, match="causal"):
        attn(q, k, v, causal=False)
    assert resolve_backend("auto", enc, torch.device("cpu"), True).NAME == "blockwise"
    with pytest.raises(ValueError, match="blockwise"):
        inject(attn, "sba", backend="sdpa")


# ------------------------------------------------------------------------------------ CoPE
def test_cope_positions_monotone_and_integer_when_gates_are_one():
    n = 8
    gates = torch.rand(2, 3, n, n)
    p = cope_positions(gates)
    for i in range(n):
        row = p[..., i, :i + 1]
        assert (row[..., :-1] > row[..., 1:]).all()  # decreasing in j: counted from the query back
        torch.testing.assert_close(row[..., -1], gates[..., i, i])  # p_ii = g_ii
    ones = cope_positions(torch.ones(n, n))
    i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    torch.testing.assert_close(ones, torch.where(j <= i, i - j + 1, 0).float())
    # with cached keys first (offset 3) and non-causal: |i - j| + 1 on both sides
    torch.testing.assert_close(cope_positions(torch.ones(5, n), q_offset=3), ones[3:])
    torch.testing.assert_close(cope_positions(torch.ones(n, n), causal=False), ((i - j).abs() + 1).float())


def test_cope_encoding_counts_integers_when_gates_saturate():
    attn = Attn(n_heads=2, head_dim=8)
    enc = inject(attn, "cope")
    q = torch.ones(1, 2, 6, 8) * 10  # q.k / sqrt(d) = 283: every gate is 1.0 in float32
    pos = enc.positions(q, q.clone())
    i, j = torch.meshgrid(torch.arange(6), torch.arange(6), indexing="ij")
    torch.testing.assert_close(pos[0, 0], torch.where(j <= i, i - j + 1, 0).float())
    # then the bias is z_i[p] = q_i . e[i - j + 1] exactly, clamped at max_position - 1
    with torch.no_grad():
        enc.pos_emb.normal_()
    ctx = AttentionContext(torch.arange(6)[None], torch.arange(6)[None])
    bias = enc.bias(q, q.clone(), ctx).materialize()[0, 0]
    z = q[0, 0] @ enc.pos_emb[0]
    assert torch.allclose(bias[5, 2], z[5, 4]) and torch.allclose(bias[3, 3], z[3, 1])
    enc.max_position = 3  # the clamp: positions past max_position - 1 use e[max_position - 1]
    bias = enc.bias(q, q.clone(), ctx).materialize()[0, 0]
    assert torch.allclose(bias[5, 0], z[5, 2]) and torch.allclose(bias[5, 4], z[5, 2])


# ------------------------------------------------------------------------------------ FIRE
def test_fire_bias_beyond_training_length_stays_in_training_range():
    torch.manual_seed(3)
    enc = build_encoding("fire", init_L=32.0).bind(n_heads=4)
    with torch.no_grad():
        for p in enc.mlp.parameters():
            p.normal_()

    def causal_bias(n, queries=None):
        k_pos = torch.arange(n)[None]
        q_pos = k_pos if queries is None else torch.tensor(queries)[None]
        x = enc.normalized_distance(q_pos, k_pos)[0]
        tri = k_pos[0][None, :] <= q_pos[0][:, None]
        return x[tri], enc.bias_tensor(q_pos, k_pos)[0][:, tri]

    x_train, b_train = causal_bias(128)  # "training" length 128 > L = 32
    lo, hi = b_train.min(-1).values, b_train.max(-1).values
    assert x_train.min() == 0 and x_train.max() > 0.999
    span = hi - lo
    for n in (1024, 4096):
        x, b = causal_bias(n, [n - 1, n // 2, 200, 33] + torch.randint(0, n, (4,)).tolist())
        assert x.min() >= 0 and x.max() <= 1 + 1e-6  # psi(i-j)/psi(max(L,i)) stays in [0, 1]
        assert (b.min(-1).values >= lo - 0.02 * span).all() and (b.max(-1).values <= hi + 0.02 * span).all()
    # without the normalization the MLP input grows with the length and the bias leaves the range
    def raw(n):
        return enc.mlp(torch.log1p(enc.c * torch.arange(n, dtype=torch.float32))[:, None]).t()
    r_train, r_long = raw(128), raw(4096)
    out = (r_long.max(-1).values > r_train.max(-1).values + 0.5 * span) | \
          (r_long.min(-1).values < r_train.min(-1).values - 0.5 * span)
    assert out.any()


def test_fire_is_a_relative_table_below_the_threshold_and_its_own_kind_above():
    enc = build_encoding("fire", init_L=20.0).bind(n_heads=3)
    with torch.no_grad():
        for p in enc.mlp.parameters():
            p.normal_()
    cases = [(torch.arange(12)[None] + 3, torch.arange(12)[None] + 3, RelativeBias),  # offset, all < L
             (torch.arange(4)[None] + 9, torch.arange(13)[None], RelativeBias),  # KV cache: 4 new queries
             (torch.arange(30)[None], torch.arange(30)[None], FireBias),  # past L: normalizer psi(i)
             (torch.arange(12.0)[None], torch.arange(12.0)[None], FireBias)]  # float positions
    for qp, kp, kind in cases:
        bias = enc.bias(None, None, AttentionContext(qp, kp))
        assert type(bias) is kind
        torch.testing.assert_close(bias.materialize(), enc.bias_tensor(qp, kp), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------- hybrids
def test_hybrid_stages_and_mixture_weights():
    assert build_encoding("rope_alibi").stages == {"rotate", "bias"}
    assert build_encoding("fox").stages == {"bias"} and build_encoding("fox", rope=True).stages == {"bias", "rotate"}
    assert build_encoding("rse").stages == {"rotate", "bias", "normalize"}
    mix = build_encoding("mixture", members=("alibi", "fox")).bind(n_heads=2, head_dim=4, d_model=8)
    assert mix.stages == {"bias"} and mix.requires_hidden
    assert mix.members[1].gate is not None  # bind reached the members
    torch.testing.assert_close(mix.weights.sum(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="members must rotate or add a bias"):
        build_encoding("mixture", members=("alibi", "sinusoidal"))
    with pytest.raises(ValueError, match="Known encodings"):
        build_encoding("mixture", members=("alibi", "no_such"))


def test_scale_bias_keeps_the_kind():
    bq = torch.arange(5)[None]
    w = torch.tensor(0.3)
    kinds = [LinearBias(torch.rand(2), bq, bq), RelativeBias(torch.rand(2, 7), bq, bq),
             DecayBias(torch.rand(1, 2, 5), torch.rand(1, 2, 5)), DenseBias(torch.rand(1, 2, 5, 5))]
    for b in kinds + [BiasSum(kinds[:2])]:
        s = b.scaled(w)
        assert type(s) is type(b)
        torch.testing.assert_close(s.materialize(), 0.3 * b.materialize())


# ------------------------------------------------------------------------------ KV cache
@pytest.mark.parametrize("name", MINE)
def test_incremental_decoding_equals_full_forward(name):
    model = TinyGPT(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, encoding=name).eval()
    x = torch.randint(0, 256, (2, 15))
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache()
        parts = [model(x[:, :8], cache=cache), model(x[:, 8:11], cache=cache), model(x[:, 11:], cache=cache)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-5)
    if name == "fox":
        assert cache[0].extra["fox_cum_log_forget"].shape == (2, 4, 15)


# --------------------------------------------------------------- triton kernels (interpreted)
@pytest.mark.parametrize("name,cfg", [("rse", {}), ("sba", {}), ("rope_alibi", {}), ("fox", {"rope": True}),
                                      ("fire", {}), ("fire", {"init_L": 8.0}), ("mixture", {}),
                                      ("cope", {"max_position": 6, "per_head": True, "init_std": 0.5})])
def test_triton_backend_equals_eager_forward_and_backward(name, cfg):
    pytest.importorskip("triton")
    res = {}
    for backend in ("eager", "triton"):
        torch.manual_seed(1)
        attn = Attn(n_heads=2, head_dim=16, d_model=32)
        enc = inject(attn, name, backend=backend, **cfg)
        q, k, v = (torch.randn(1, 2, 19, 16, requires_grad=True) for _ in range(3))
        out = attn(q, k, v, positions=(torch.arange(19) + 4)[None], hidden=torch.randn(1, 19, 32))
        out.square().sum().backward()
        res[backend] = [out, q.grad, k.grad, v.grad] + [p.grad for p in enc.parameters()]
    for a, b in zip(res["eager"], res["triton"]):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4)
