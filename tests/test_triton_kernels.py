"""Triton kernels (TRITON_INTERPRET=1, set by conftest) against an eager reference written from
the formulas: softmax attention with rotary at arbitrary positions, ALiBi / relative / decay /
dense biases, packed documents, padding, KV-cache offsets, grouped kv heads; stick-breaking in
log space. Forward and backward on >= 100 random cases, gradcheck in float64, and no N x N tensor.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from posenc_lightning.attention.backends.eager import repeat_kv
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import DecayBias, LinearBias, RelativeBias
from posenc_lightning.functional.rope import apply_rotary, rope_cos_sin, rope_inv_freq
from posenc_lightning.kernels import fused
from posenc_lightning.kernels.fused import RotaryTables, fused_attention, segments_from_cu_seqlens


@pytest.fixture(autouse=True)
def _fast_interpreter(monkeypatch):
    """The interpreter's int32-overflow sanitizer triples the cost of every integer op; the
    shapes here are tiny, so switch it off (the compile test covers the real targets)."""
    import triton.runtime.interpreter as ti

    monkeypatch.setattr(ti.interpreter_builder, "options", ti.InterpreterOptions(sanitize_overflow=False))
    yield


# ----------------------------------------------------------------------------- the reference
def reference(q, k, v, *, scale, causal=True, q_offset=0, rot=None, q_seg=None, k_seg=None, k_valid=None,
              slopes=None, table=None, bq=None, bk=None, c_q=None, c_k=None, dense=None, sb=False,
              attend_current=False, logits=None, round_to=None):
    """softmax(q k^T * scale + bias, masked) v, or stick-breaking weights, in float32 (float64
    inputs stay float64). ``rot``: (cos_q, sin_q, cos_k, sin_k, layout), cos/sin per token."""
    if rot is not None:  # rotated q, k are rounded to the input dtype, as apply_rotary does
        cq, sq, ck, sk, layout = rot
        q, k = apply_rotary(q, cq, sq, layout), apply_rotary(k, ck, sk, layout)
        if round_to is not None:
            q, k = q.to(round_to).to(q.dtype), k.to(round_to).to(k.dtype)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    z = q.to(acc) @ k.to(acc).transpose(-1, -2) * scale
    if slopes is not None:
        z = z + LinearBias(slopes, bq, bk).materialize().to(acc)
    if table is not None:
        z = z + RelativeBias(table, bq, bk).materialize().to(acc)
    if c_q is not None:
        z = z + DecayBias(c_q, c_k).materialize().to(acc)
    if dense is not None:
        z = z + dense.to(acc)
    if logits is not None:  # hand the logits out (to size the rounding of gradient sums)
        logits.append(z)
    nq, nk = q.shape[2], k.shape[2]
    m = AttentionMask(causal or sb, q_offset, nq, nk, q_seg, k_seg, k_valid).materialize(q.device)
    m = torch.ones(1, 1, nq, nk, dtype=torch.bool) if m is None else m
    if sb:  # Tan et al. 2024: log A_ij = z_ij - sum_{k >= j visible} softplus(z_ik)
        if not attend_current:
            m = m & (torch.arange(nk)[None, :] < torch.arange(nq)[:, None] + q_offset)
        m = m.expand_as(z)
        sp = torch.where(m, F.softplus(z, threshold=15.0), torch.zeros((), dtype=acc))
        tail = sp.flip(-1).cumsum(-1).flip(-1)
        w = torch.where(m, (z - tail).exp(), torch.zeros((), dtype=acc))
    else:
        w = torch.nan_to_num(torch.softmax(z.masked_fill(~m, float("-inf")), -1), nan=0.0)
    return (w @ v.to(acc)).to(q.dtype)


# ----------------------------------------------------------------------------- random cases
def make_case(seed: int) -> dict:
    r = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    n = r.choice([1, 17, 17, 33, 33, 100]) if seed % 25 else 257
    d = r.choice([16, 32, 64, 128])
    b, h = r.choice([1, 1, 2]) if n < 100 else 1, r.choice([1, 2])
    hkv = r.choice([1, h])
    dtype = torch.float16 if r.random() < 0.2 else torch.float32
    sb = r.random() < 0.3
    pos_kind = r.choice(["arange", "offset", "packed", "random", "cache"])
    nq = nk = n
    q_offset = 0
    pos = torch.arange(n).expand(b, n)
    q_seg = k_seg = None
    if pos_kind == "offset":
        pos = pos + r.randint(1, 5000)
    elif pos_kind == "random":  # non-monotone
        pos = torch.randint(0, 3 * n + 1, (b, n), generator=g)
    elif pos_kind == "packed":
        seg = torch.zeros(b, n, dtype=torch.long)
        for bi in range(b):
            cuts = sorted(r.sample(range(1, n), min(r.randint(0, 4), n - 1))) if n > 1 else []
            for c in cuts:
                seg[bi, c:] += 1
        q_seg = k_seg = seg
        starts = torch.cat([torch.zeros(b, 1, dtype=torch.long), (seg[:, 1:] != seg[:, :-1]).long()], 1)
        idx = torch.arange(n).expand(b, n)
        first = torch.cummax(torch.where(starts.bool(), idx, torch.zeros_like(idx)), 1).values
        pos = idx - first  # positions restart at every document
    elif pos_kind == "cache" and n > 1:
        nq = r.randint(1, n - 1)
        q_offset = nk - nq
    kpos = pos[:, :nk]
    qpos = pos[:, nk - nq:] if pos_kind == "cache" else pos
    k_valid = None
    if r.random() < 0.15 and nk > 1:
        k_valid = torch.rand(b, nk, generator=g) > 0.2
    # real data
    q = torch.randn(b, h, nq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, nk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, nk, d, generator=g).to(dtype)
    case = {"q": q, "k": k, "v": v, "causal": sb or r.random() < 0.6, "q_offset": q_offset, "q_seg": q_seg,
                "k_seg": k_seg, "k_valid": k_valid, "sb": sb, "attend_current": r.random() < 0.5, "dtype": dtype,
                "scale": d ** -0.5 * r.choice([1.0, 2.0]), "qpos": qpos, "kpos": kpos}
    if r.random() < 0.6:
        layout = r.choice(["half", "interleaved"])
        rdim = d if r.random() < 0.7 else d // 2
        inv = rope_inv_freq(rdim, r.choice([10000.0, 500.0]))
        mscale = r.choice([1.0, 1.2])
        mode = r.choice(["table", "table", "token"] + (["head"] if hkv == h else []))
        case["rot_ref"] = (*rope_cos_sin(qpos, inv, mscale), *rope_cos_sin(kpos, inv, mscale), layout)
        if mode == "token":
            cq, sq, ck, sk, _ = case["rot_ref"]
            iq, ik = torch.arange(nq).expand(b, nq), torch.arange(nk).expand(b, nk)
            case["rot"] = RotaryTables(cq, sq, iq, ck, sk, ik, layout)
        else:
            rows = torch.arange(int(max(qpos.max(), kpos.max())) + 1)
            if mode == "head":  # per-head frequencies [1, H, L, R/2]
                inv_h = inv[None] * torch.linspace(0.5, 1.5, h)[:, None]
                c, s = rope_cos_sin(rows[None], inv_h, mscale)
                case["rot_ref"] = (*rope_cos_sin(qpos, inv_h, mscale), *rope_cos_sin(kpos, inv_h, mscale), layout)
            else:
                c, s = rope_cos_sin(rows, inv, mscale)
            case["rot"] = RotaryTables(c, s, qpos, c, s, kpos, layout)
    wants = {x for x in ("slopes", "table", "decay", "dense") if r.random() < 0.3}
    if "slopes" in wants:
        case["slopes"] = torch.rand(h, generator=g) * 0.5
    if "table" in wants:
        rmax = r.choice([3, 8, 300])
        case["table"] = torch.randn(h, 2 * rmax + 1, generator=g)
    if "decay" in wants:
        logf = F.logsigmoid(torch.randn(b, h, nk, generator=g) + 2)
        c = logf.cumsum(-1)
        case["c_q"], case["c_k"] = c[..., nk - nq:].contiguous(), c
    if "dense" in wants:
        case["dense"] = torch.randn(r.choice([1, b]), h, nq, nk, generator=g)
    return case


BIAS_KEYS = ("slopes", "table", "c_q", "c_k", "dense")


def run_both(case: dict, blocks=(16, 16)):
    leaves = {n: case[n].clone().requires_grad_(True) for n in ("q", "k", "v") + BIAS_KEYS if n in case}
    ref_leaves = {n: t.detach().clone().requires_grad_(True) for n, t in leaves.items()}
    z: list = []
    common = {"scale": case["scale"], "causal": case["causal"], "q_offset": case["q_offset"], "k_valid": case["k_valid"],
                  "c_q": None, "c_k": None}
    old = fused.INTERPRET_BLOCKS
    fused.INTERPRET_BLOCKS = blocks
    try:
        out = fused_attention(
            leaves["q"], leaves["k"], leaves["v"], rotary=case.get("rot"), q_segments=case["q_seg"],
            k_segments=case["k_seg"], slopes=leaves.get("slopes"), table=leaves.get("table"),
            bias_q_pos=case["qpos"], bias_k_pos=case["kpos"], dense=leaves.get("dense"),
            stick_breaking=case["sb"], attend_current=case["attend_current"],
            **{**common, "c_q": leaves.get("c_q"), "c_k": leaves.get("c_k")})
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
        grads = torch.autograd.grad(out, list(leaves.values()), dout)
    finally:
        fused.INTERPRET_BLOCKS = old
    # the reference runs in float64 on the same (fp16-rounded) values
    f32 = {n: t.double() for n, t in ref_leaves.items()}
    rot = case.get("rot_ref")
    rot = None if rot is None else tuple(t.double() if torch.is_tensor(t) else t for t in rot)
    ref = reference(f32["q"], f32["k"], f32["v"], rot=rot, q_seg=case["q_seg"], k_seg=case["k_seg"],
                    slopes=f32.get("slopes"), table=f32.get("table"), bq=case["qpos"], bk=case["kpos"],
                    dense=f32.get("dense"), sb=case["sb"], attend_current=case["attend_current"], logits=z,
                    round_to=case["dtype"],
                    **{**common, "c_q": f32.get("c_q"), "c_k": f32.get("c_k")})
    *ref_grads, dz = torch.autograd.grad(ref, list(ref_leaves.values()) + z, dout.double())
    # the magnitude of the terms each bias gradient sums (float32 sums round relative to it)
    dist = (case["qpos"][:, None, :, None] - case["kpos"][:, None, None, :]).abs().double()
    mass = {"slopes": (dz.abs() * dist).sum((0, 2, 3)).max(), "table": dz.abs().sum((0, 2, 3)).max(),
            "c_q": dz.abs().sum(-1).max(), "c_k": dz.abs().sum(-2).max(), "dense": dz.abs().sum(0).max()}
    # dL/dc_q = sum_j dS_ij = dO_i . O_i - delta_i is 0 exactly (softmax ignores a per-row constant);
    # the kernels, as FlashAttention-2, take delta = dO . O from O written in the input dtype, so
    # their dc_q is the rounding of O (half an ulp, 2^-11 relative in fp16) times |dO| . |O|
    half_ulp = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}.get(case["dtype"], 0.0)
    mass["c_q_rounding"] = (dout.double().abs() * ref.detach().abs()).sum(-1).max() * half_ulp
    return out, ref, dict(zip(leaves, grads)), dict(zip(leaves, ref_grads)), mass


def assert_match(got, want, tol, what, mass=0.0, extra=0.0):
    """max |got - want| <= tol * max(1, max |want|) + 64 ulp(float32) * the L1 mass of the terms a
    bias gradient sums (float32 sums of N^2 terms round relative to sum |term|, not to the result)
    + ``extra`` (a rounding bound of its own, named where it is given)."""
    got, want = got.double(), want.double()
    bound = tol * max(1.0, want.abs().max().item()) + 64 * 2.0 ** -24 * float(mass) + float(extra)
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("seed", range(104))
def test_random_case_matches_reference(seed):
    case = make_case(seed)
    blocks = [(16, 16), (32, 16), (16, 32), (64, 64)][seed % 4] if case["q"].shape[2] < 200 else (64, 32)
    out, ref, grads, ref_grads, mass = run_both(case, blocks)
    tol = 2e-3 if case["dtype"] == torch.float16 else 1e-5
    assert out.dtype == case["dtype"] and out.shape == case["q"].shape
    assert torch.isfinite(out).all()
    assert_match(out, ref, tol, "forward")
    for name in grads:
        assert grads[name].shape == case[name].shape, name
        assert_match(grads[name], ref_grads[name], tol, f"d{name}", mass.get(name, 0.0),
                     mass["c_q_rounding"] if name == "c_q" else 0.0)


def test_cases_cover_the_matrix():
    """The random cases above include every feature (so the 104 cases are not all alike)."""
    cases = [make_case(s) for s in range(104)]
    assert {c["q"].shape[2] for c in cases} >= {1, 17, 33, 100, 257}
    assert {c["q"].shape[3] for c in cases} == {16, 32, 64, 128}
    assert any(c["sb"] for c in cases) and any(not c["sb"] and not c["causal"] for c in cases)
    for key in ("slopes", "table", "c_q", "dense", "rot"):
        assert sum(key in c for c in cases) >= 10, key
    assert sum(c["q_seg"] is not None for c in cases) >= 10
    assert sum(c["q_offset"] > 0 for c in cases) >= 5
    assert sum(c["dtype"] == torch.float16 for c in cases) >= 10
    assert sum(c["q"].shape[1] != c["k"].shape[1] for c in cases) >= 10
    assert sum(c.get("rot") is not None and c["rot"].layout == "interleaved" for c in cases) >= 5


@pytest.mark.parametrize("sb", [False, True])
def test_gradcheck_float64(sb):
    g = torch.Generator().manual_seed(3)
    b, h, n, d = 1, 2, 6, 16
    dd = {"dtype": torch.float64}
    q = torch.randn(b, h, n, d, generator=g, **dd).requires_grad_()
    k = torch.randn(b, 1, n, d, generator=g, **dd).requires_grad_()
    v = torch.randn(b, 1, n, d, generator=g, **dd).requires_grad_()
    slopes = torch.rand(h, generator=g, **dd).requires_grad_()
    table = torch.randn(h, 7, generator=g, **dd).requires_grad_()
    c = F.logsigmoid(torch.randn(b, h, n, generator=g, **dd)).cumsum(-1)
    c_q, c_k = c.clone().requires_grad_(), c.clone().requires_grad_()
    dense = torch.randn(1, h, n, n, generator=g, **dd).requires_grad_()
    pos = torch.tensor([[5, 1, 0, 7, 2, 2]])
    cos, sin = rope_cos_sin(torch.arange(8), rope_inv_freq(d, 100.0), 1.1)
    rot = RotaryTables(cos, sin, pos, cos, sin, pos, "interleaved")
    seg = torch.tensor([[0, 0, 0, 1, 1, 1]])

    def f(q, k, v, slopes, table, c_q, c_k, dense):
        return fused_attention(q, k, v, rotary=rot, q_segments=seg, slopes=slopes, table=table, bias_q_pos=pos,
                               bias_k_pos=pos, c_q=c_q, c_k=c_k, dense=dense, stick_breaking=sb, causal=True)

    # fast mode: a random projection of the Jacobian (each full column costs a kernel launch)
    assert torch.autograd.gradcheck(f, (q, k, v, slopes, table, c_q, c_k, dense), atol=1e-6, fast_mode=True)


def test_cu_seqlens_equals_segment_ids():
    cu = torch.tensor([0, 5, 6, 20])
    seg = segments_from_cu_seqlens(cu, 20)
    assert seg.tolist() == [[0] * 5 + [1] + [2] * 14]
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    a = fused_attention(q, k, v, cu_seqlens=cu)
    ref = reference(q, k, v, scale=0.25, q_seg=seg, k_seg=seg)
    torch.testing.assert_close(a, ref, atol=1e-5, rtol=1e-5)
    # documents do not see each other: changing document 0 leaves documents 1, 2 unchanged
    v2 = v.clone()
    v2[:, :, :5] += 1.0
    b = fused_attention(q, k, v2, cu_seqlens=cu)
    assert torch.equal(a[:, :, 5:], b[:, :, 5:]) and not torch.allclose(a[:, :, :5], b[:, :, :5])


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v = (torch.randn(1, 1, 17, 16, requires_grad=True) for _ in range(3))
    valid = torch.ones(1, 17, dtype=torch.bool)
    valid[0, :5] = False  # the first 5 queries (causal) see only padding
    out = fused_attention(q, k, v, k_valid=valid)
    assert torch.isfinite(out).all() and out[0, 0, :5].abs().max() == 0
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_stick_breaking_is_stable_for_large_logits():
    q = torch.randn(1, 1, 33, 16) * 30  # logits of several hundred
    k, v = torch.randn(1, 1, 33, 16) * 30, torch.randn(1, 1, 33, 16)
    out = fused_attention(q, k, v, stick_breaking=True)
    ref = reference(q, k, v, scale=0.25, sb=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_fused_path_never_allocates_n_by_n():
    """Every tensor created (torch ops, recorded by a dispatch mode) or handed to a kernel launch
    during forward + backward is O(N D), never N x N."""
    from torch.utils._python_dispatch import TorchDispatchMode

    n, d = 256, 16
    sizes: list[int] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    sizes.append(t.numel())
            return out

    launched: list[int] = []
    real = fused._launch

    def spy(kernel, grid, args, flags, cfg):
        launched.extend(a.numel() for a in args.values() if isinstance(a, torch.Tensor))
        return real(kernel, grid, args, flags, cfg)

    q, k, v = (torch.randn(1, 1, n, d, requires_grad=True) for _ in range(3))
    slopes, table = torch.rand(1, requires_grad=True), torch.randn(1, 33, requires_grad=True)
    c = torch.randn(1, 1, n).cumsum(-1).requires_grad_()
    cos, sin = rope_cos_sin(torch.arange(n), rope_inv_freq(d))
    pos = torch.arange(n)[None]
    rot = RotaryTables(cos, sin, pos, cos, sin, pos)
    fused._launch = spy
    fused.INTERPRET_BLOCKS = (64, 64)
    try:
        for sb in (False, True):
            with Record():
                out = fused_attention(q, k, v, rotary=rot, slopes=slopes, table=table, bias_q_pos=pos,
                                      bias_k_pos=pos, c_q=c, c_k=c, stick_breaking=sb)
                out.sum().backward()
    finally:
        fused._launch = real
        fused.INTERPRET_BLOCKS = (16, 16)
    assert sizes and launched
    # the largest are O(N x D) (q, k, v, their gradients, [N, BLOCK] interpreter copies), far below N x N
    assert max(sizes) < n * n // 3 and max(launched) < n * n // 3, (max(sizes), max(launched), n * n)


def test_bad_input_errors_name_the_fix():
    q = torch.randn(1, 3, 4, 16)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        fused_attention(q, torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16))
    with pytest.raises(ValueError, match="cast them first"):
        fused_attention(q.half(), q, q)
    with pytest.raises(ValueError, match=r"\[B,H,Nq,D\]"):
        fused_attention(q[0], q, q)


def test_positions_as_a_range_equal_loaded_positions():
    """``bias_q_start``/``bias_k_start`` (distances from the indices, nothing loaded) give what the
    same positions read from memory give, forward and backward (ALiBi slopes and a relative table)."""
    g = torch.Generator().manual_seed(7)
    n, nq = 37, 21
    q = torch.randn(1, 2, nq, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 1, n, 16, generator=g, requires_grad=True) for _ in range(2))
    slopes = torch.rand(2, generator=g).requires_grad_()
    table = torch.randn(2, 17, generator=g).requires_grad_()
    qpos, kpos = torch.arange(nq)[None] + 3 + n - nq, torch.arange(n)[None] + 3
    common = {"slopes": slopes, "table": table, "q_offset": n - nq, "bias_q_pos": qpos, "bias_k_pos": kpos}
    outs = [fused_attention(q, k, v, **common), fused_attention(q, k, v, **common, bias_q_start=3 + n - nq,
                                                                 bias_k_start=3)]
    dout = torch.randn(outs[0].shape, generator=g)
    grads = [torch.autograd.grad(o, (q, k, v, slopes, table), dout) for o in outs]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal,pos_kind", [(True, "offset"), (False, "arange"), (True, "cache")])
def test_t5_table_past_max_distance_equals_reference(causal, pos_kind):
    """T5's table (Raffel et al., 2020: distances past ``max_distance`` share the last bucket) with
    N = 75 (not a multiple of the 16 x 16 tiles) and ``max_distance`` 8: most tiles lie wholly past
    the clamp, where the kernels add one entry per head and sum its gradient in the program; the
    tiles on the diagonal band gather and scatter per score. Forward and every gradient, the
    bucket table's included, against the float64 reference from the formula."""
    from posenc_lightning.encodings.relative_bias import T5RelativeBias

    g = torch.Generator().manual_seed(11)
    n, h, d, rmax = 75, 2, 16, 8
    t5 = T5RelativeBias(num_buckets=8, max_distance=rmax, bidirectional=not causal)
    weights = torch.randn(8, h, generator=g)  # [buckets, H], as T5's nn.Embedding
    table = weights[t5.buckets()].t().contiguous()  # [H, 2R + 1], distance -R first
    assert torch.equal(table[:, -1], weights[t5.buckets()[-1]])  # the last bucket at i - j >= R
    nq, q_offset = (40, n - 40) if pos_kind == "cache" else (n, 0)
    kpos = torch.arange(n)[None] + (1000 if pos_kind == "offset" else 0)
    case = {"q": torch.randn(1, h, nq, d, generator=g), "k": torch.randn(1, 1, n, d, generator=g),
            "v": torch.randn(1, 1, n, d, generator=g), "table": table, "scale": d ** -0.5, "causal": causal,
            "q_offset": q_offset, "q_seg": None, "k_seg": None, "k_valid": None, "sb": False,
            "attend_current": False, "dtype": torch.float32, "qpos": kpos[:, n - nq:], "kpos": kpos}
    far = (case["qpos"][0, :, None] - kpos[0, None, :]).abs() >= rmax
    assert far.float().mean() > 0.7  # most scores past the clamp: whole tiles are
    out, ref, grads, ref_grads, mass = run_both(case, (16, 16))
    assert_match(out, ref, 1e-5, "forward")
    for name in ("q", "k", "v", "table"):
        assert_match(grads[name], ref_grads[name], 1e-5, f"d{name}", mass.get(name, 0.0))
    # the edge entries collect the far tiles' gradient: not zero, so the per-program sum is checked
    assert ref_grads["table"][:, -1].abs().min() > 1e-3
