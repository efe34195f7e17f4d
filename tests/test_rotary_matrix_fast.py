"""liere / comrope: the eigenbasis path and the chunked matrix_exp path against the exact
``rotation_blocks`` reference (forward, q/k and parameter gradients), the RoPE equation on the
fast path, decoding, no per-token ``D x D`` matrices, compile-cleanliness, degenerate spectra."""

from __future__ import annotations

import copy

import pytest
import torch

from posenc_lightning.attention.kv_cache import LayerKVCache
from posenc_lightning.encodings import build_encoding
from posenc_lightning.encodings.base import AttentionContext
from posenc_lightning.inject import inject
from tests.helpers import Attn

D, H, HKV = 16, 2, 1
FAST = [("liere", {"n_axes": 1, "block_size": None}),
        ("liere", {"n_axes": 1, "block_size": 8}),
        ("comrope", {"variant": "ap", "n_axes": 1, "block_size": 4}),
        ("comrope", {"variant": "ap", "n_axes": 2, "block_size": 4}),
        ("comrope", {"variant": "ld", "n_axes": 1, "block_size": 8}),
        ("comrope", {"variant": "ld", "n_axes": 2, "block_size": 8})]
EXACT = [("liere", {"n_axes": 2, "block_size": None}), ("liere", {"n_axes": 2, "block_size": 8})]
#: |fast - reference| / scale: float64 measured <= 1e-13, float32 (vs the float64 reference) <= 3e-6
TOL = {torch.float64: 1e-11, torch.float32: 2e-5}
#: the float32 matrix_exp path (LieRE, 2 axes) is as accurate as float32 matrix_exp: measured <= 7.4e-5
TOL_EXACT_FP32 = 2e-4


def _encoding(name: str, cfg: dict, dtype: torch.dtype = torch.float64, seed: int = 0, perturb: bool = True):
    torch.manual_seed(seed)
    enc = build_encoding(name, **cfg).bind(n_heads=H, head_dim=D)
    if perturb:  # away from the initial values: the formulas must hold for any parameters
        with torch.no_grad():
            for p in enc.parameters():
                p.add_(0.3 * torch.randn_like(p))
    return enc.to(dtype)


def _positions(kind: str, n_axes: int, b: int = 2, n: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    idx = torch.arange(n).expand(b, n)
    if kind == "offset":
        p = idx + torch.tensor([37, 5])[:b, None]
    elif kind == "packed":  # two documents per row, positions restart at 0
        p = torch.where(idx < 4, idx, idx - 4)
    elif kind == "float":
        p = idx * 0.75 + torch.rand(b, n, generator=g, dtype=torch.float64) * 3
    else:
        p = torch.randint(-40, 300, (b, n), generator=g)  # unsorted, repeated, negative
    if n_axes == 1:
        return p
    return torch.stack([p * (a + 1) - a for a in range(n_axes)], -1)


def _reference_rotate(m, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``exp(sum_a x_a A_a) x`` per token from the exact `rotation_blocks` (matrix_exp)."""
    rot = m.rotation_blocks(pos)  # [B, N, K, b, b]
    k, b = rot.shape[-3], rot.shape[-1]
    return torch.einsum("bnkij,bhnkj->bhnki", rot, x.double().unflatten(-1, (k, b))).flatten(-2)


def _run(enc, pos_q, pos_k, dtype, reference: bool):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, H, pos_q.shape[1], D, generator=g, dtype=torch.float64)
    k = torch.randn(2, HKV, pos_k.shape[1], D, generator=g, dtype=torch.float64)
    cq, ck = torch.randn(q.shape, generator=g, dtype=torch.float64), torch.randn(k.shape, generator=g, dtype=torch.float64)
    q, k = q.to(dtype).requires_grad_(), k.to(dtype).requires_grad_()
    if reference:  # in float64, from the same parameter values
        m = copy.deepcopy(enc).double()
        qr, kr = _reference_rotate(m, q, pos_q), _reference_rotate(m, k, pos_k)
        params = list(m.parameters())
    else:
        qr, kr = enc.rotate(q, k, AttentionContext(pos_q, pos_k, True))
        params = list(enc.parameters())
    loss = (qr.double() * cq).sum() + (kr.double() * ck).sum()
    grads = torch.autograd.grad(loss, [q, k, *params])
    return [qr.detach().double(), kr.detach().double(), *(t.double() for t in grads)]


def _assert_close_scaled(got: list, ref: list, tol: float) -> float:
    worst = 0.0
    for i, (a, r) in enumerate(zip(got, ref)):
        a, r = a.detach().double(), r.detach().double()
        err = ((a - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
        worst = max(worst, err)
        assert err <= tol, f"tensor {i} (0: q, 1: k, 2: dq, 3: dk, 4+: parameters): relative error {err:.2e}"
    return worst


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("kind", ["offset", "packed", "float", "random"])
@pytest.mark.parametrize("name,cfg", FAST + EXACT, ids=lambda v: v if isinstance(v, str) else
                         "-".join(f"{k}{v}" for k, v in v.items()))
def test_rotate_equals_matrix_exp_reference(name, cfg, kind, dtype):
    enc = _encoding(name, cfg, dtype)
    assert enc.fast_path == ((name, cfg) in FAST)
    enc.exact_chunk_elems = 3 * 4 * 16 * 16  # the exact path: several chunks of 3 tokens
    pos = _positions(kind, enc.n_axes)
    ref = _run(enc, pos, pos, torch.float64, reference=True)
    tol = TOL_EXACT_FP32 if dtype == torch.float32 and not enc.fast_path else TOL[dtype]
    err = _assert_close_scaled(_run(enc, pos, pos, dtype, reference=False), ref, tol)
    print(f"max relative error {err:.2e}")


@pytest.mark.parametrize("name,cfg", FAST[:1] + FAST[3:4])
def test_distinct_query_and_key_positions(name, cfg):
    """Queries after cached keys (decoding): q and k at different positions."""
    enc = _encoding(name, cfg)
    pos_k = _positions("offset", enc.n_axes, n=9)
    pos_q = pos_k[:, -2:] + 1
    ref = _run(enc, pos_q, pos_k, torch.float64, reference=True)
    _assert_close_scaled(_run(enc, pos_q, pos_k, torch.float64, reference=False), ref, TOL[torch.float64])


@pytest.mark.parametrize("name,cfg", [FAST[0], EXACT[1]])
def test_positions_expanded_over_the_batch(name, cfg):
    """One row of positions expanded over the batch (the mixin's default) gives what the same
    positions materialized per row give; the matrix_exp path computes the row once."""
    enc = _encoding(name, cfg)
    enc.exact_chunk_elems = 3 * 4 * 16 * 16
    row = _positions("random", enc.n_axes, b=1)
    expanded = row.expand(2, *row.shape[1:])
    _assert_close_scaled(_run(enc, expanded, expanded, torch.float64, False),
                         _run(enc, expanded.clone(), expanded.clone(), torch.float64, True), 1e-11)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name,cfg", FAST)
def test_gradients_at_init_and_after_perturbation(name, cfg, seed):
    """The eigen-decomposition's backward (1 / (mu_i - mu_j) terms) gives the matrix_exp
    gradients of the generator weights, at the initial parameters and at perturbed ones."""
    for perturb in (False, True):
        enc = _encoding(name, cfg, seed=seed, perturb=perturb)
        pos = _positions("random", enc.n_axes)
        got, ref = _run(enc, pos, pos, torch.float64, False), _run(enc, pos, pos, torch.float64, True)
        _assert_close_scaled(got[4:], ref[4:], 1e-10)


@pytest.mark.parametrize("name,cfg", [c for c in FAST if c[0] == "comrope"])
def test_relative_property_on_the_fast_path(name, cfg):
    """ComRoPE: <R(x) q, R(y) k> = <q, R(y - x) k> with the rotated q, k from `rotate`."""
    enc = _encoding(name, cfg)
    x, y = _positions("random", enc.n_axes), _positions("float", enc.n_axes)
    q, k = torch.randn(2, 1, 9, D, dtype=torch.float64), torch.randn(2, 1, 9, D, dtype=torch.float64)
    qr, _ = enc.rotate(q, q, AttentionContext(x, x, True))
    kr, _ = enc.rotate(k, k, AttentionContext(y, y, True))
    lhs = (qr * kr).sum(-1)
    rel = enc.rotation_matrix(y - x)[:, None]  # [B, 1, N, D, D]
    rhs = (q * (rel @ k[..., None])[..., 0]).sum(-1)
    torch.testing.assert_close(lhs, rhs, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name,cfg", [FAST[0], FAST[3], EXACT[1]])
def test_decode_with_kv_cache_equals_full_sequence(name, cfg):
    """Through the attention mixin: prefill then single tokens with a KV cache, forward and the
    gradients to q, k, v and the encoding's parameters, equal one call on the whole sequence."""
    torch.manual_seed(0)
    layer = Attn(n_heads=H, head_dim=D)
    inject(layer, name, backend="eager", **cfg)
    layer.double()
    n = 8
    pos = _positions("offset", layer.posenc.n_axes, n=n)
    q, k, v = (torch.randn(2, H, n, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    params = list(layer.posenc.parameters())

    def run(decode: bool):
        if not decode:
            out = layer(q, k, v, positions=pos)
        else:
            cache, outs = LayerKVCache(), []
            for lo, hi in [(0, 5), (5, 6), (6, 7), (7, 8)]:
                outs.append(layer(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], positions=pos[:, lo:hi], cache=cache))
            out = torch.cat(outs, 2)
        return [out, *torch.autograd.grad(out.square().sum(), [q, k, v, *params])]

    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def _saved_sizes(fn) -> list[int]:
    sizes: list[int] = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def _largest_allocation(fn) -> int:
    """Bytes of the largest single allocation while ``fn`` runs (the profiler's allocator events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("name,cfg", [("liere", {}), ("comrope", {"variant": "ap"}), ("comrope", {"variant": "ld"}),
                                      ("liere", {"n_axes": 2, "block_size": 8})])
def test_no_per_token_matrices(name, cfg):
    """Neither forward nor backward allocates ``[B, N, K, b, b]`` (4 MiB here for a dense block,
    1 MiB for blocks of 8, q is 128 KiB), and autograd keeps nothing larger than q: the eigenbasis
    path saves q, k, the ``D x D`` basis and ``[B, N, D/2]`` cos/sin; matrix_exp, chunks of tokens."""
    torch.manual_seed(0)
    b, n, d = 1, 1024, 32
    enc = build_encoding(name, **cfg).bind(n_heads=1, head_dim=d)
    enc.exact_chunk_elems = 1 << 12  # matrix_exp's workspace is ~20x its output: 16 tokens per chunk
    n_axes = enc.n_axes
    pos = torch.arange(n).expand(b, n) if n_axes == 1 else torch.stack([torch.arange(n) // 32, torch.arange(n) % 32],
                                                                         -1).expand(b, n, 2)
    q, k = torch.randn(b, 1, n, d, requires_grad=True), torch.randn(b, 1, n, d, requires_grad=True)
    per_token = b * n * enc.n_blocks * enc.block_size ** 2

    def step():
        qr, kr = enc.rotate(q, k, AttentionContext(pos, pos, True))
        (qr.sum() + kr.square().sum()).backward()

    assert max(_saved_sizes(step)) <= q.numel() < per_token
    largest = _largest_allocation(step)
    print(f"largest allocation {largest} bytes; q {4 * q.numel()}, per-token matrices {4 * per_token}")
    assert largest <= (4 * q.numel() if enc.fast_path else 4 * per_token // 2)
    assert 4 * q.numel() <= 4 * per_token // 8


def test_attention_keeps_the_rotated_q_and_k():
    """A learned rotation is a per-token change of basis on either path (eigenbasis or
    matrix_exp): attention keeps the rotated q and k for backward (`cheap_rotation` False), so a
    step rotates once forward and once inverse, never again for a saved-tensor recompute."""
    for name, cfg in [("comrope", {}), ("comrope", {"variant": "ld"}), ("liere", {}), ("liere", {"n_axes": 2}),
                      ("comrope", {"exact": True})]:
        enc = build_encoding(name, **cfg).bind(n_heads=H, head_dim=D)
        assert not enc.cheap_rotation, (name, cfg)
    assert build_encoding("comrope").bind(n_heads=H, head_dim=D).fast_path  # the eigenbasis path included


COMPILED = [FAST[0], FAST[3], FAST[5], EXACT[1]]


@pytest.mark.parametrize("name,cfg", COMPILED)
def test_rotate_is_compile_clean(name, cfg):
    """No graph break, and ``torch.compile(fullgraph=True)`` equals eager forward and backward."""
    enc = _encoding(name, cfg, torch.float32)
    enc.exact_chunk_elems = 4 * 16 * 16  # the chunked, checkpointed matrix_exp path too

    def f(q, k, pos):
        return enc.rotate(q, k, AttentionContext(pos, pos, True))

    pos = _positions("random", enc.n_axes)
    q, k = torch.randn(2, H, 9, D), torch.randn(2, HKV, 9, D)
    assert torch._dynamo.explain(f)(q, k, pos).graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (f, compiled):
        qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
        qr, kr = fn(qq, kk, pos)
        grads = torch.autograd.grad(qr.square().sum() + (kr * 1.5).sum(), [qq, kk, *enc.parameters()])
        results.append([qr, kr, *grads])
    _assert_close_scaled(*results, 1e-6)  # float32 roundings differ: measured <= 2e-7


@pytest.mark.parametrize("name,cfg", [FAST[0], FAST[3]])
def test_attention_layer_compiles_without_breaks_from_the_rotation(name, cfg):
    """The layer (sdpa backend, rotation recomputed in backward) compiled equals eager; its graph
    breaks (backend resolution in the mixin) come from none of the rotation's code."""
    torch.manual_seed(0)
    layer = Attn(n_heads=H, head_dim=D)
    inject(layer, name, backend="sdpa", **cfg)
    pos = _positions("offset", layer.posenc.n_axes)
    q, k, v = (torch.randn(2, H, 9, D) for _ in range(3))
    explained = torch._dynamo.explain(layer)(q, k, v, positions=pos)
    where = " ".join(str(r) for r in explained.break_reasons)
    assert "rope_matrix.py" not in where and "lie_rotary.py" not in where
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager")
    results = []
    for fn in (layer, compiled):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*ins, positions=pos)
        results.append([out, *torch.autograd.grad(out.square().sum(), [*ins, *layer.posenc.parameters()])])
    _assert_close_scaled(*results, 1e-5)  # float32 roundings differ: measured <= 1.1e-6


def test_degenerate_spectrum_uses_matrix_exp_until_it_is_not():
    """A zero (or repeated-eigenvalue) generator has no unique eigenbasis and an undefined
    eigen-gradient: `check_spectrum` (at build, load_state_dict, train()/eval()) picks matrix_exp,
    whose gradients stay exact; loading distinct generators switches back."""
    enc = build_encoding("comrope", variant="ld", block_size=4).bind(n_heads=H, head_dim=D).double()
    good = copy.deepcopy(enc.state_dict())
    with torch.no_grad():
        enc.weight.zero_()
    assert enc.fast_path  # decided at a host-read point, not by rotate()
    enc.train()
    assert not enc.fast_path and enc.spectral_gap() == 0.0
    pos = _positions("random", 1)
    got, ref = _run(enc, pos, pos, torch.float64, False), _run(enc, pos, pos, torch.float64, True)
    assert all(torch.isfinite(t).all() for t in got)
    _assert_close_scaled(got[:4], ref[:4], 1e-12)
    torch.testing.assert_close(got[4], ref[4], rtol=0, atol=1e-10)  # nonzero: matrix_exp's gradient at A = 0
    assert got[4].abs().max() > 1e-3
    enc.load_state_dict(good)
    assert enc.fast_path
    with torch.no_grad():  # repeated eigenvalues: a block [[J, 0], [0, J]]
        j = torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=torch.float64)
        enc.weight.copy_(torch.block_diag(j, j).expand_as(enc.weight))
    enc.eval()
    assert not enc.fast_path


@pytest.mark.parametrize("delta", [1e-2, 1e-4])
def test_near_degenerate_spectrum_gradient_error_follows_eps_over_gap(delta):
    """Two planes with frequencies ``mu`` and ``mu (1 + delta)`` in a random basis: the eigen-
    gradient divides by their gap, so its error is ~eps / delta: float64 within 1e-14 / delta,
    float32 within 1e-6 / delta (`MIN_RELATIVE_GAP`). Measured: float64 8e-16 / delta, float32
    1.4e-7 / delta (which includes rounding the generator itself to float32)."""
    enc = build_encoding("comrope", variant="ld", block_size=4).bind(n_heads=H, head_dim=D).double()
    g = torch.Generator().manual_seed(0)
    j = torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=torch.float64)
    with torch.no_grad():
        for i in range(enc.n_blocks):
            o, _ = torch.linalg.qr(torch.randn(4, 4, generator=g, dtype=torch.float64))
            mu = 0.3 * 10.0 ** -i
            enc.weight[i] = o @ torch.block_diag(mu * j, mu * (1 + delta) * j) @ o.T
    enc.check_spectrum()
    assert enc.fast_path and abs(enc.spectral_gap() - delta / (1 + delta)) < 1e-9
    pos = _positions("random", 1)
    ref = _run(enc, pos, pos, torch.float64, True)
    err64 = _assert_close_scaled(_run(enc, pos, pos, torch.float64, False), ref, 1e-14 / delta)
    err32 = _assert_close_scaled(_run(enc.float(), pos, pos, torch.float32, False), ref, 1e-6 / delta)
    print(f"gap {delta:g}: float64 {err64:.1e}, float32 {err32:.1e}")
