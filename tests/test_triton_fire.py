"""FIRE inside the Triton kernels (TRITON_INTERPRET=1): the MLP evaluated per tile from the
positions and the threshold, its parameter gradients (c, L_multiplier, W1, b1, W2, b2) reduced
per tile, equal to eager attention on FIRE's dense formula (Li et al., 2024, eq. 3) forward and
backward, with queries past the threshold, offsets, packed and non-monotone positions, KV-cache
decoding, grouped kv heads and stick-breaking; and no N x N tensor on the way."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from posenc_lightning.attention.backends import eager
from posenc_lightning.attention.backends import triton as triton_backend
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext, DenseBias
from posenc_lightning.encodings.fire import FireBias
from posenc_lightning.encodings.fire.tile import fire_tile
from posenc_lightning.encodings.registry import build_encoding
from posenc_lightning.inject import inject
from posenc_lightning.kernels import fused
from posenc_lightning.kernels.fused import fused_attention
from tests.helpers import Attn, fast_triton_interpreter

H, D, W = 4, 16, 8
CFG = {"init_L": 8.0, "init_c": 0.3, "mlp_width": W}  # a small threshold: most queries are past it


@pytest.fixture(autouse=True)
def _fast_interpreter(monkeypatch):
    fast_triton_interpreter(monkeypatch)
    yield


def _fire(seed: int = 1, **cfg):
    """A bound FIRE with parameters moved off their init (every unit, c and L carry a gradient)."""
    torch.manual_seed(seed)
    enc = build_encoding("fire", **{**CFG, **cfg}).bind(n_heads=H)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return enc


def _check(got, want, tol, what):
    err = (got.double() - want.double()).abs().max().item()
    bound = tol * max(1.0, want.abs().max().item())
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"
    return err


def _layers(hkv: int):
    """Two identical layers with the same FIRE: triton, and eager on the dense formula."""
    layers = []
    for backend in ("triton", "eager"):
        m = Attn(n_heads=H, head_dim=D)
        inject(m, "fire", backend=backend, **CFG)
        layers.append(m)
    state = _fire().state_dict()
    for m in layers:
        m.encoding.load_state_dict(state)
    ref = layers[1].encoding
    ref.bias = lambda q, k, ctx: DenseBias(ref.bias_tensor(ctx.q_pos, ctx.k_pos))  # eq. 3 through nn.Sequential
    return layers


N = 53  # not a multiple of the 16 x 16 tiles
POSITIONS = {
    "arange": (torch.arange(N).expand(2, N), None),
    "offset": (torch.arange(N).expand(2, N) + torch.tensor([[3], [1000]]), None),
    "packed": (torch.cat([torch.arange(20), torch.arange(33)]).expand(2, N),
               torch.cat([torch.zeros(20), torch.ones(33)]).long().expand(2, N)),
    "non_monotone": (torch.randperm(3 * N, generator=torch.Generator().manual_seed(4))[:2 * N].view(2, N), None),
}


@pytest.mark.parametrize("hkv", [H, 1])
@pytest.mark.parametrize("layout", list(POSITIONS))
def test_fire_in_kernel_equals_eager_forward_and_backward(layout, hkv):
    pos, seg = POSITIONS[layout]
    tri, ref = _layers(hkv)
    assert type(tri.encoding.bias(None, None, AttentionContext(pos, pos))) is FireBias  # past L = 8
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, H, N, D, generator=g)
    k, v = torch.randn(2, hkv, N, D, generator=g), torch.randn(2, hkv, N, D, generator=g)
    dout = torch.randn(2, H, N, D, generator=g)
    res = []
    for m in (tri, ref):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = m(*ins, positions=pos, segment_ids=seg)
        params = [p for p in m.encoding.parameters() if p.requires_grad]
        res.append((out, torch.autograd.grad(out, ins + params, dout)))
    (out, grads), (out_ref, grads_ref) = res
    _check(out, out_ref, 1e-5, "out")
    names = ["q", "k", "v"] + [n for n, p in tri.encoding.named_parameters() if p.requires_grad]
    assert {"c", "L_multiplier", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"} <= set(names)
    for name, a, b in zip(names, grads, grads_ref):
        _check(a, b, 1e-5 if name in "qkv" else 3e-5, f"d{name}")
    assert grads_ref[names.index("L_multiplier")].abs().item() > 1e-4  # the threshold learns here


def test_kv_cache_decoding_equals_full_attention():
    from posenc_lightning.attention.kv_cache import LayerKVCache

    tri, ref = _layers(2)
    g = torch.Generator().manual_seed(5)
    n = 45
    q = torch.randn(1, H, n, D, generator=g)
    k, v = torch.randn(1, 2, n, D, generator=g), torch.randn(1, 2, n, D, generator=g)
    pos = torch.arange(n)[None] + 7
    full = ref(q, k, v, positions=pos)
    cache = LayerKVCache()
    steps = [tri(q[:, :, :40], k[:, :, :40], v[:, :, :40], positions=pos[:, :40], cache=cache)]
    for i in range(40, n):
        steps.append(tri(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], positions=pos[:, i:i + 1],
                         cache=cache))
    _check(torch.cat(steps, 2), full, 1e-5, "decode")


def _bias_and_reference(enc, qp, kp):
    """FIRE's kind (for the kernels) and its dense formula (the reference), at these positions."""
    return FireBias(qp, kp, enc.c, enc.L_multiplier, enc.init_L, *enc.bias_params()[2:], eps=enc.eps), \
        enc.bias_tensor(qp, kp)


@pytest.mark.parametrize("case", ["decode_offset", "stick_breaking", "float_positions", "below_threshold"])
def test_kernel_cases(case):
    """Straight through `fused_attention`: queries after cached keys (q_offset, grads too), the
    stick-breaking kernels, fractional positions, and every query below L (normalizer psi(L))."""
    enc = _fire(seed=3)
    g = torch.Generator().manual_seed(6)
    b, nk, nq, hkv = 2, 61, 61, 2
    kp = torch.arange(nk).expand(b, nk) + torch.tensor([[0], [9]])
    if case == "decode_offset":
        nq = 6
    if case == "float_positions":
        kp = kp * 0.37
    if case == "below_threshold":
        enc = _fire(seed=3, init_L=500.0)
    qp = kp[:, nk - nq:]
    q = torch.randn(b, H, nq, D, generator=g, requires_grad=True)
    k, v = (torch.randn(b, hkv, nk, D, generator=g, requires_grad=True) for _ in range(2))
    params = [p for p in enc.parameters() if p.requires_grad]
    fb, dense = _bias_and_reference(enc, qp, kp)
    sb = case == "stick_breaking"
    out = fused_attention(q, k, v, causal=True, q_offset=nk - nq, bias_q_pos=qp, bias_k_pos=kp,
                          tile=fb.kernel_tile(torch.float32), stick_breaking=sb)
    mask = AttentionMask(True, nk - nq, nq, nk)
    if sb:
        ref_enc = build_encoding("sba")
        ctx = AttentionContext(qp, kp)
        ref = eager.attend(q, k, v, bias=DenseBias(dense), mask=mask, scale=D ** -0.5,
                           normalizer=ref_enc.normalize(ctx), ctx=ctx)
    else:
        ref = eager.attend(q, k, v, bias=DenseBias(dense), mask=mask, scale=D ** -0.5)
    _check(out, ref, 1e-5, "out")
    dout = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, [q, k, v, *params], dout)
    want = torch.autograd.grad(ref, [q, k, v, *params], dout)
    for i, (a, b_) in enumerate(zip(got, want)):
        _check(a, b_, 1e-5 if i < 3 else 3e-5, f"grad {i}")


def test_gradcheck_float64():
    enc = _fire(seed=7, init_L=3.0, mlp_width=4).double()
    g = torch.Generator().manual_seed(8)
    pos = torch.tensor([[5, 1, 0, 7, 2, 3]])
    q = torch.randn(1, H, 6, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 6, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    c, l_mult, w1, b1, w2, b2 = enc.bias_params()

    def f(q, k, v, c, l_mult, w1, b1, w2, b2):
        fb = FireBias(pos, pos, c, l_mult, enc.init_L, w1, b1, w2, b2, enc.eps)
        return fused_attention(q, k, v, bias_q_pos=pos, bias_k_pos=pos, tile=fb.kernel_tile(torch.float64),
                               causal=False)

    assert torch.autograd.gradcheck(f, (q, k, v, c, l_mult, w1, b1, w2, b2), atol=1e-6, fast_mode=True)


def test_fire_folds_into_the_kernel_arguments_not_a_dense_tensor():
    enc = _fire()
    pos = torch.arange(40)[None]
    bias = enc.bias(None, None, AttentionContext(pos, pos))
    args = triton_backend.split_bias(bias, H)
    assert args.dense is None and args.tile.value is fire_tile and args.q_pos is pos
    assert torch.equal(args.tile.params, bias.kernel_params(torch.float32))
    mixed = build_encoding("mixture", members=("alibi", "fire"), member_cfgs={"fire": CFG}).bind(n_heads=H)
    q = torch.zeros(1, H, 40, D)
    args = triton_backend.split_bias(mixed.bias(q, q, AttentionContext(pos, pos)), H)
    assert args.dense is None and args.tile.value is fire_tile and args.slopes is not None  # scaled: still FIRE


def test_the_fused_path_never_allocates_n_by_n(monkeypatch):
    """Every tensor a torch op creates (a dispatch mode records them) or that a kernel launch is
    handed, forward and backward through the triton backend, is far below ``B H N x N``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setattr(fused, "INTERPRET_BLOCKS", (64, 64))
    n, b = 256, 1
    sizes: list[int] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            sizes.extend(t.numel() for t in (out if isinstance(out, (tuple, list)) else [out])
                         if isinstance(t, torch.Tensor))
            return out

    launched: list[int] = []
    real = fused._launch

    def spy(kernel, grid, args, flags, cfg):
        launched.extend(a.numel() for a in args.values() if isinstance(a, torch.Tensor))
        return real(kernel, grid, args, flags, cfg)

    monkeypatch.setattr(fused, "_launch", spy)
    m = Attn(n_heads=1, head_dim=D)
    inject(m, "fire", backend="triton", **CFG)
    q, k, v = (torch.randn(b, 1, n, D, requires_grad=True) for _ in range(3))
    with Record():
        out = m(q, k, v)
        out.sum().backward()
    assert m.encoding.c.grad is not None and m.encoding.mlp[0].weight.grad.abs().sum() > 0
    assert max(sizes) < b * n * n // 3 and max(launched) < b * n * n // 3, (max(sizes), max(launched), n * n)


def test_score_term_and_rows_equal_the_dense_formula():
    """The flex form (one hidden unit at a time per (b, h, i, j)) and the rows of the SDPA path."""
    enc = _fire()
    qp = torch.tensor([[3, 9, 1, 0, 30, 7, 2], [40, 41, 42, 43, 44, 45, 46]])
    bias, dense = _bias_and_reference(enc, qp, qp)
    shape = (2, H, 7, 7)
    bb, hh, qi, ki = torch.meshgrid(*(torch.arange(s) for s in shape), indexing="ij")
    with torch.no_grad():
        torch.testing.assert_close(bias.score_term(2, H)(bb, hh, qi, ki), dense, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(bias.rows(2, 6, 5), dense[..., 2:6, :5], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(bias.scaled(torch.tensor(0.3)).materialize(), 0.3 * dense, rtol=1e-5, atol=1e-5)
    assert not bias.distance_only and bias.at(qp, qp) is None


@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_flex_and_sdpa_compute_fires_kind_as_eager_does(backend):
    """The other backends take FIRE's kind by ``score_mod`` (flex; forward on CPU) and by blocks
    of rows (sdpa, forward and backward), equal to eager on the dense formula."""
    pos, seg = POSITIONS["packed"]
    tri, ref = _layers(2)
    tri.posenc_backend = backend
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, H, N, D, generator=g)
    k, v = torch.randn(2, 2, N, D, generator=g), torch.randn(2, 2, N, D, generator=g)
    grad = backend == "sdpa"
    res = []
    for m in (tri, ref):
        with torch.set_grad_enabled(grad):
            ins = [t.clone().requires_grad_(grad) for t in (q, k, v)]
            out = m(*ins, positions=pos, segment_ids=seg)
            params = [p for p in m.encoding.parameters() if p.requires_grad]
            res.append((out, torch.autograd.grad(out.sum(), ins + params) if grad else ()))
    _check(res[0][0], res[1][0], 1e-5, "out")
    for i, (a, b_) in enumerate(zip(res[0][1], res[1][1])):
        _check(a, b_, 1e-5 if i < 3 else 3e-5, f"grad {i}")


def test_bf16_stays_within_bf16_rounding_of_the_float64_reference():
    """bf16 activations and parameters: positions, the MLP and every sum stay float32 in-kernel."""
    pos = POSITIONS["offset"][0]
    tri, ref = _layers(2)
    tri.to(torch.bfloat16)
    ref.double()
    with torch.no_grad():
        for p, p_ref in zip(tri.encoding.parameters(), ref.encoding.parameters()):
            p_ref.copy_(p.double())
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, N, D, generator=g).bfloat16() for h in (H, 2, 2))
    outs = []
    for m, dt in ((tri, torch.bfloat16), (ref, torch.float64)):
        ins = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        out = m(*ins, positions=pos)
        out.double().sum().backward()
        outs.append((out, [t.grad for t in ins] + [p.grad for p in m.encoding.parameters()]))
    _check(outs[0][0], outs[1][0], 4e-2 / 8, "out")  # ~2^-8 relative: a bf16 ulp or two
    for i, (a, b_) in enumerate(zip(outs[0][1], outs[1][1])):
        _check(a, b_, 4e-2, f"grad {i}")
