"""CoPE inside the Triton kernels (TRITON_INTERPRET=1, `kernels.cope`): the gates from the score
tile, the positions as each row's suffix sums over keys, the interpolated bias from ``Z = q E``,
equal to the float64 eager formula (Golovneva et al., 2024, eqs. 3-5: `functional.cope`, as
`CoPE.bias_tensor` computes it) plus masked softmax, forward and every gradient (q, k, v and the
position embeddings) with the clamp reached, cached keys, packed documents, padding, grouped kv
heads, per-head and shared tables, N off the tiles, head dims 16 and 32; through the triton backend
against the eager backend; and the kernels' compile report for sm80 and sm90 (no spills, no atomics).
The conformance scenarios run CoPE on the triton backend too (tests/test_conformance.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

pytest.importorskip("triton")

from posenc_lightning.functional.cope import cope_interpolate, cope_positions
from posenc_lightning.inject import inject
from posenc_lightning.kernels import fused
from posenc_lightning.kernels.gated_counts import gated_count_attention
from posenc_lightning.kernels.tile_table import COPE_CONFIGS
from tests.helpers import Attn, fast_triton_interpreter


@pytest.fixture(autouse=True)
def _fast_interpreter(monkeypatch):
    fast_triton_interpreter(monkeypatch)
    yield


def reference(q, k, v, emb, gate_scale, scale, q_offset, q_seg=None, k_seg=None, k_valid=None):
    """Float64 CoPE attention: eqs. 3-5 by `functional.cope` on the whole N x N, masked softmax.
    Returns the output and the unclamped positions."""
    q, k, v, emb = (t.double() for t in (q, k, v, emb))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.mT
    pos = cope_positions(torch.sigmoid(s * gate_scale), True, q_offset=q_offset)
    bias = cope_interpolate(q @ emb, pos.clamp(max=emb.shape[-1] - 1))
    nq, nk = s.shape[-2:]
    ok = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + q_offset
    ok = ok[None, None].expand(q.shape[0], 1, nq, nk)
    if q_seg is not None:
        ok = ok & (q_seg[:, None, :, None] == k_seg[:, None, None, :])
    if k_valid is not None:
        ok = ok & k_valid[:, None, None, :].bool()
    logits = (s * scale + bias).masked_fill(~ok, float("-inf"))
    return torch.softmax(logits, -1) @ v, pos


def _inputs(b, h, hkv, nq, nk, d, p, per_head, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, nk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, nk, d, generator=g).to(dtype)
    emb = (0.5 * torch.randn(h if per_head else 1, d, p, generator=g)).to(dtype)
    return q, k, v, emb


def _docs(b, n, lengths):
    """Document ids ``[b, n]``: contiguous documents of ``lengths[row % len]`` (the rest one more)."""
    out = torch.zeros(b, n, dtype=torch.long)
    for r in range(b):
        bounds = torch.tensor(lengths[r % len(lengths)]).cumsum(0)
        out[r] = (torch.arange(n)[:, None] >= bounds[None, :]).sum(-1)
    return out


# (name, B, H, Hkv, Nq, Nk, D, P, per_head, masks): Nq, Nk off the 16-row tiles; P small enough that
# far keys reach the clamp (asserted); a query at key Nk - Nq + i
CASES = [
    ("causal", 2, 2, 2, 37, 37, 16, 8, False, ()),
    ("cached_keys", 1, 2, 2, 29, 45, 32, 6, True, ()),
    ("segments", 2, 2, 1, 50, 50, 16, 8, True, ("segments",)),
    ("padding", 2, 2, 2, 41, 41, 16, 7, False, ("padding",)),
    ("gqa_all", 2, 4, 2, 33, 51, 32, 5, True, ("segments", "padding")),
]


def _masks(masks, b, nq, nk):
    out = {}
    if "segments" in masks:
        seg = _docs(b, nk, [[13, 20], [7, 30]])
        out["q_segments"], out["k_segments"] = seg[:, nk - nq:], seg
    if "padding" in masks:
        kv = torch.ones(b, nk, dtype=torch.bool)
        kv[-1, nk - nq - 3 if nk > nq else 1:][:3] = False  # a hole some queries see past
        kv[0, nk // 2] = False
        if nk > nq:
            kv[0, :3] = False  # left padding among the cached keys
        out["k_valid"] = kv
    return out


def _run(case, dtype, grad=True):
    _, b, h, hkv, nq, nk, d, p, per_head, masks = case
    q, k, v, emb = _inputs(b, h, hkv, nq, nk, d, p, per_head, dtype)
    kw = _masks(masks, b, nq, nk)
    gs, scale, off = d ** -0.5, 0.7 * d ** -0.5, nk - nq
    ref_in = [t.double().requires_grad_(grad) for t in (q, k, v, emb)]
    ref, pos = reference(*ref_in, gs, scale, off, kw.get("q_segments"), kw.get("k_segments"), kw.get("k_valid"))
    assert pos.max() > p - 1 > pos.min(), "the clamp is reached by some pairs and not others"
    ins = [t.clone().requires_grad_(grad) for t in (q, k, v, emb)]
    out = gated_count_attention(*ins, gate_scale=gs, scale=scale, q_offset=off, **kw)
    if not grad:
        return [out], [ref]
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = [out, *torch.autograd.grad(out, ins, cot.to(dtype))]
    want = [ref, *torch.autograd.grad(ref, ref_in, cot)]
    return got, want


def _compare(got, want, tol, what):
    errs = []
    for name, a, r in zip(["out", "dq", "dk", "dv", "demb"], got, want):
        err = (a.double() - r).abs().max().item()
        bound = tol * max(1.0, r.abs().max().item())
        assert err <= bound, f"{what} {name}: max error {err:.3g} > {bound:.3g}"
        errs.append(err)
    return errs


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_equals_float64_reference_forward_and_backward(case, dtype, tol):
    got, want = _run(case, dtype)
    _compare(got, want, tol, f"{case[0]}/{dtype}")


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32)])
def test_other_tilings_give_the_same_gradients(blocks, monkeypatch):
    """Query and key blocks of different sizes: the carries per key block and the dK/dV kernel's
    first query block still line up."""
    monkeypatch.setattr(fused, "INTERPRET_BLOCKS", blocks)
    got, want = _run(CASES[-1], torch.float64)
    _compare(got, want, 1e-12, f"tiles {blocks}")


@pytest.mark.parametrize("case", [CASES[0], CASES[-1]], ids=["causal", "gqa_all"])
def test_bf16_forward(case):
    """bf16 q, k, v and table (the interpreter computes bf16 inputs in float32; compared with the
    float64 result of the same bf16-rounded numbers): about 2^-8 relative."""
    got, want = _run(case, torch.bfloat16, grad=False)
    _compare(got, want, 2e-2, f"{case[0]}/bf16")


def test_a_row_that_sees_no_key_gives_zeros_and_finite_gradients():
    q, k, v, emb = _inputs(1, 2, 2, 20, 20, 16, 6, False, torch.float64)
    kv = torch.ones(1, 20, dtype=torch.bool)
    kv[0, :2] = False  # queries 0 and 1 see only padding
    ins = [t.requires_grad_() for t in (q, k, v, emb)]
    out = gated_count_attention(*ins, gate_scale=0.25, q_offset=0, k_valid=kv)
    assert out[0, :, :2].abs().max() == 0
    grads = torch.autograd.grad(out.sum(), ins)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("per_head", [False, True])
def test_triton_backend_equals_eager_backend_for_the_encoding(per_head):
    """CoPE injected with backend='triton' (its bias kind's gated counts, `GatedCounts`) against
    backend='eager' (`CoPE.bias_tensor`), float64, cached keys and every parameter's gradient."""
    res = {}
    for backend in ("eager", "triton"):
        torch.manual_seed(1)
        attn = Attn(n_heads=2, head_dim=16, d_model=32).double()
        enc = inject(attn, "cope", backend=backend, max_position=5, per_head=per_head, init_std=0.5)
        attn.double()
        g = torch.Generator().manual_seed(2)
        q = torch.randn(1, 2, 21, 16, generator=g, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(1, 2, 21, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
        out = attn(q, k, v, hidden=torch.randn(1, 21, 32, generator=g, dtype=torch.float64))
        res[backend] = [out, *torch.autograd.grad(out.square().sum(), [q, k, v, *enc.parameters()])]
    for a, b in zip(res["eager"], res["triton"]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6 * max(1.0, a.abs().max().item()))


def test_the_backend_refuses_what_the_kernels_do_not_count():
    """Non-causal counts run both ways from the query: the kernels count causally only, and say so."""
    attn = Attn(n_heads=2, head_dim=16, d_model=32)
    inject(attn, "cope", backend="triton", max_position=5)
    q, k, v = (torch.randn(1, 2, 9, 16) for _ in range(3))
    with pytest.raises(ValueError, match="sdpa"):
        attn(q, k, v, causal=False)


def test_the_tile_table_shares_the_key_block():
    """The carries are stored per key block: the three kernels of an entry take the same BN."""
    for (arch, d, width, kind), cfg in COPE_CONFIGS.items():
        assert cfg[1] == COPE_CONFIGS[(arch, d, width, "cope_fwd")][1], (arch, d, width, kind)


def test_compile_report_sm80_sm90_no_spills_no_atomics():
    """Every CoPE kernel at its pinned tiles (fp16/fp32, head dims 64 and 128), packed documents and
    padding on, compiled for sm80 and sm90: 0 bytes spilled and no global atomic in the PTX
    (``atom``/``red``: dZ is summed per row in registers); recorded in
    benchmarks/results/cope_compile_report-cpu-20261206.txt."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        r = subprocess.run([sys.executable, "-m", "posenc_lightning.kernels.cope_report", "--check", "--json", path],
                           capture_output=True, text=True, env=env, timeout=1500, check=False)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        with open(path) as f:
            rows = json.load(f)
    assert len(rows) == 3 * 4 * 2 and {r["target"] for r in rows} == {"sm80", "sm90"}
    for r in rows:
        what = (r["kernel"], r["head_dim"], r["dtype"], r["target"])
        assert r["ok"] and r["spill_stores"] == 0 and r["spill_loads"] == 0, (what, r)
        assert r["atomics"] == 0 and r["tf32"] == 0, what
        assert r["mma"] > 0 or r["dtype"] == "float32", what  # tensor-core products for fp16


def test_a_sum_with_other_kinds_is_refused_up_front():
    """A mixture summing CoPE with ALiBi: the CoPE kernels take no other term, so the backend
    refuses the encoding (before any N x N tensor), naming sdpa."""
    from posenc_lightning.attention.backends import triton as triton_backend
    from posenc_lightning.encodings.registry import build_encoding

    enc = build_encoding("mixture", members=("alibi", "cope")).bind(n_heads=2, head_dim=16, d_model=32)
    why = triton_backend.supports(enc, torch.device("cuda"), True)
    assert why is not None and "CoPEBias" in why and "sdpa" in why
    assert triton_backend.supports(build_encoding("cope").bind(n_heads=2, head_dim=16, d_model=32),
                                   torch.device("cuda"), True) is None


def test_a_scaled_bias_is_still_counted_in_the_kernels():
    """``w * bias`` keeps its kind (the table scaled by ``w``): the kernels give softmax of
    ``scale q.k + w z[p]``, with ``w``'s gradient, equal to the float64 rows times ``w``."""
    from posenc_lightning.encodings.base import AttentionContext, KernelBias
    from posenc_lightning.encodings.registry import build_encoding

    enc = build_encoding("cope", max_position=5, init_std=0.5).bind(n_heads=2, head_dim=16, d_model=32).double()
    q, k, v, _ = _inputs(1, 2, 2, 23, 23, 16, 5, False, torch.float64, seed=3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    w = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
    bias = enc.bias(q, k, AttentionContext(torch.arange(23)[None], torch.arange(23)[None])).scaled(w)
    args = KernelBias()
    bias.fold_into(args)
    c = args.counted
    assert c is not None and args.dense is None
    out = gated_count_attention(q, k, v, c.table, gate_scale=c.gate_scale, q_offset=c.q_offset)
    causal = torch.ones(23, 23, dtype=torch.bool).tril()
    logits = (q @ k.mT * 16 ** -0.5 + bias.materialize().double()).masked_fill(~causal, float("-inf"))
    ref = torch.softmax(logits, -1) @ v
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    got = [out, *torch.autograd.grad(out, (q, k, v, w, enc.pos_emb), cot)]
    want = [ref, *torch.autograd.grad(ref, (q, k, v, w, enc.pos_emb), cot)]
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-6 * max(1.0, r.abs().max().item()))  # rows: float32
