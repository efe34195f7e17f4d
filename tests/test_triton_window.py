"""A causal sliding window inside the Triton kernels (TRITON_INTERPRET=1): query ``i`` (index
``i + q_offset`` among the keys) sees key ``j`` iff ``0 <= i + q_offset - j < W``
(`AttentionMask.window`). Forward and every gradient (q, k, v, ALiBi slopes, a relative table,
decays, a dense bias) against a float64 reference written from the formulas, for W = 1, 5, 19 (no
divisor of the tiles) and W >= N, with KV-cache offsets, packed documents, padding, grouped kv
heads, rotary and stick-breaking, on N that no tile size divides; the key tiles below the window
are never read (the O(N W) loop bound); windowed ALiBi and FIRE through the triton backend equal
the eager masked reference; KV-cache decoding with a window equals the full forward."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from posenc_lightning import LayerKVCache, inject
from posenc_lightning.attention.backends.eager import repeat_kv
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import DecayBias, LinearBias, RelativeBias
from posenc_lightning.functional.rope import apply_rotary_reference, rope_cos_sin, rope_inv_freq
from posenc_lightning.kernels import fused
from posenc_lightning.kernels.fused import RotaryTables, fused_attention
from tests.helpers import Attn, fast_triton_interpreter

D = 16
F64 = torch.float64


@pytest.fixture(autouse=True)
def _fast_interpreter(monkeypatch):
    fast_triton_interpreter(monkeypatch)
    yield


# ----------------------------------------------------------------------------- the reference
def reference(q, k, v, *, window, scale, q_offset=0, rot=None, q_seg=None, k_seg=None, k_valid=None,
              slopes=None, table=None, bq=None, bk=None, c_q=None, c_k=None, dense=None, sb=False,
              attend_current=False):
    """Softmax (or stick-breaking, Tan et al. 2024: ``log A_ij = z_ij - sum_{k >= j visible}
    softplus(z_ik)``) of ``q k^T scale + bias`` under the causal mask with the window, in float64."""
    if rot is not None:
        cq, sq, ck, sk, layout = rot
        q, k = apply_rotary_reference(q, cq, sq, layout), apply_rotary_reference(k, ck, sk, layout)
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    z = q @ k.transpose(-1, -2) * scale
    if slopes is not None:
        z = z + LinearBias(slopes, bq, bk).materialize()
    if table is not None:
        z = z + RelativeBias(table, bq, bk).materialize()
    if c_q is not None:
        z = z + DecayBias(c_q, c_k).materialize()
    if dense is not None:
        z = z + dense
    nq, nk = q.shape[2], k.shape[2]
    m = AttentionMask(True, q_offset, nq, nk, q_seg, k_seg, k_valid, window=window).materialize(q.device)
    if sb:
        if not attend_current:
            m = m & (torch.arange(nk)[None, :] < torch.arange(nq)[:, None] + q_offset)
        m = m.expand_as(z)
        sp = torch.where(m, F.softplus(z), torch.zeros((), dtype=z.dtype))
        tail = sp.flip(-1).cumsum(-1).flip(-1)
        w = torch.where(m, (z - tail).exp(), torch.zeros((), dtype=z.dtype))
    else:
        w = torch.nan_to_num(torch.softmax(z.masked_fill(~m, float("-inf")), -1), nan=0.0)
    return w @ v


# ----------------------------------------------------------------------------- the cases
#: name -> (Nq, Nk, H, Hkv, features); Nq < Nk: the queries are the last Nq (a KV-cache offset)
FEATURES = {
    "plain": (53, 53, 2, 2, set()),
    "offset_gqa_alibi": (21, 70, 2, 1, {"slopes"}),
    "packed_rope_table": (61, 61, 2, 2, {"segments", "rope", "table"}),
    "padding_decay_dense": (45, 45, 2, 1, {"k_valid", "decay", "dense"}),
    "sb_packed_rope_alibi": (53, 53, 2, 1, {"sb", "segments", "rope", "slopes"}),
    "sb_current_offset_table": (30, 67, 2, 2, {"sb", "attend_current", "table", "dense"}),
}
WINDOWS = [1, 5, 19, 300]  # 19 divides no tile; 300 >= N: the plain causal mask


def make_case(name: str, seed: int) -> dict:
    nq, nk, h, hkv, feats = FEATURES[name]
    g = torch.Generator().manual_seed(seed)
    b = 2
    case: dict = {"q": torch.randn(b, h, nq, D, generator=g, dtype=F64),
                  "k": torch.randn(b, hkv, nk, D, generator=g, dtype=F64),
                  "v": torch.randn(b, hkv, nk, D, generator=g, dtype=F64), "q_offset": nk - nq, "scale": D ** -0.5,
                  "sb": "sb" in feats, "attend_current": "attend_current" in feats, "q_seg": None, "k_seg": None,
                  "k_valid": None}
    kpos = torch.arange(nk).expand(b, nk) + torch.tensor([[0], [7]])  # not an arange from 0 in row 1
    if "segments" in feats:  # packed documents, positions restarting in each
        seg = torch.zeros(b, nk, dtype=torch.long)
        seg[0, 20:] += 1
        seg[0, 41:] += 1
        seg[1, 9:] += 1
        case["q_seg"], case["k_seg"] = seg[:, nk - nq:], seg
        first = torch.cummax(torch.where(torch.cat([torch.ones(b, 1, dtype=torch.bool), seg[:, 1:] != seg[:, :-1]], 1),
                                         torch.arange(nk).expand(b, nk), torch.zeros(b, nk, dtype=torch.long)), 1).values
        kpos = torch.arange(nk).expand(b, nk) - first
    if "k_valid" in feats:
        case["k_valid"] = torch.rand(b, nk, generator=g) > 0.25
    qpos = kpos[:, nk - nq:]
    case["qpos"], case["kpos"] = qpos, kpos
    if "rope" in feats:
        inv = rope_inv_freq(D, 500.0)
        rows = torch.arange(int(kpos.max()) + 1)
        c, s = rope_cos_sin(rows, inv, 1.1)  # float32 tables: the kernels read these values
        case["rot"] = RotaryTables(c, s, qpos, c, s, kpos, "interleaved")
        case["rot_ref"] = (c.double()[qpos], s.double()[qpos], c.double()[kpos], s.double()[kpos], "interleaved")
    if "slopes" in feats:
        case["slopes"] = torch.rand(h, generator=g, dtype=F64) * 0.5 + 0.1
    if "table" in feats:
        case["table"] = torch.randn(h, 2 * 8 + 1, generator=g, dtype=F64)
    if "decay" in feats:
        c = F.logsigmoid(torch.randn(b, h, nk, generator=g, dtype=F64) + 2).cumsum(-1)
        case["c_q"], case["c_k"] = c[..., nk - nq:].contiguous(), c
    if "dense" in feats:
        case["dense"] = torch.randn(1, h, nq, nk, generator=g, dtype=F64)
    return case


LEAVES = ("q", "k", "v", "slopes", "table", "c_q", "c_k", "dense")


def run_both(case: dict, window: int, blocks: tuple[int, int]):
    """(triton output and gradients, reference output and gradients), by leaf name."""
    leaves = {n: case[n].clone().requires_grad_(True) for n in LEAVES if n in case}
    ref_leaves = {n: t.detach().clone().requires_grad_(True) for n, t in leaves.items()}
    common = {"q_offset": case["q_offset"], "k_valid": case["k_valid"]}
    old = fused.INTERPRET_BLOCKS
    fused.INTERPRET_BLOCKS = blocks
    try:
        out = fused_attention(leaves["q"], leaves["k"], leaves["v"], scale=case["scale"], window=window,
                              rotary=case.get("rot"), q_segments=case["q_seg"], k_segments=case["k_seg"],
                              slopes=leaves.get("slopes"), table=leaves.get("table"), bias_q_pos=case["qpos"],
                              bias_k_pos=case["kpos"], c_q=leaves.get("c_q"), c_k=leaves.get("c_k"),
                              dense=leaves.get("dense"), stick_breaking=case["sb"],
                              attend_current=case["attend_current"], **common)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
        grads = torch.autograd.grad(out, list(leaves.values()), dout)
    finally:
        fused.INTERPRET_BLOCKS = old
    ref = reference(ref_leaves["q"], ref_leaves["k"], ref_leaves["v"], window=window, scale=case["scale"],
                    rot=case.get("rot_ref"), q_seg=case["q_seg"], k_seg=case["k_seg"], slopes=ref_leaves.get("slopes"),
                    table=ref_leaves.get("table"), bq=case["qpos"], bk=case["kpos"], c_q=ref_leaves.get("c_q"),
                    c_k=ref_leaves.get("c_k"), dense=ref_leaves.get("dense"), sb=case["sb"],
                    attend_current=case["attend_current"], **common)
    ref_grads = torch.autograd.grad(ref, list(ref_leaves.values()), dout)
    return out, dict(zip(leaves, grads)), ref, dict(zip(leaves, ref_grads))


#: float64 inputs: the kernels' bias terms round at ~1e-7 of the largest value (the same without a
#: window), far below any masking error (a key of the wrong side of the edge moves a row by ~1e-1)
TOL = {"out": 1e-6, "q": 1e-6, "k": 1e-6, "v": 1e-6, "c_q": 1e-6, "c_k": 1e-6, "dense": 1e-6, "slopes": 5e-6,
       "table": 5e-6}


def _close(got, want, what, tol=1e-9):
    err = (got - want).abs().max().item() if got.numel() else 0.0
    bound = tol * max(1.0, want.abs().max().item())
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", list(FEATURES))
def test_window_equals_reference(name, window):
    i = list(FEATURES).index(name) + WINDOWS.index(window)
    blocks = [(16, 16), (32, 16), (16, 32)][i % 3]
    case = make_case(name, seed=i)
    out, grads, ref, ref_grads = run_both(case, window, blocks)
    _close(out, ref, "forward", TOL["out"])
    for n in grads:
        _close(grads[n], ref_grads[n], f"d{n}", TOL[n])
    # the window hides something (but at W >= N): the test compares what a window changes (far
    # above the tolerance; stick-breaking's far weights are small, hence not 1e-3)
    if window < case["k"].shape[2]:
        full = reference(*(case[n] for n in ("q", "k", "v")), window=None, scale=case["scale"],
                         rot=case.get("rot_ref"), q_seg=case["q_seg"], k_seg=case["k_seg"], k_valid=case["k_valid"],
                         q_offset=case["q_offset"], slopes=case.get("slopes"), table=case.get("table"),
                         bq=case["qpos"], bk=case["kpos"], c_q=case.get("c_q"), c_k=case.get("c_k"),
                         dense=case.get("dense"), sb=case["sb"], attend_current=case["attend_current"])
        assert (full - ref.detach()).abs().max() > 1e-5


def test_window_rejects_a_non_causal_call():
    q = torch.randn(1, 1, 8, D)
    with pytest.raises(ValueError, match="causal"):
        fused_attention(q, q, q, causal=False, window=4)
    with pytest.raises(ValueError, match="positive integer"):
        fused_attention(q, q, q, window=0)


# ----------------------------------------------------------------------------- the loop bounds
@pytest.mark.parametrize("sb", [False, True])
@pytest.mark.parametrize("window,blocks", [(1, (16, 16)), (5, (16, 32)), (19, (32, 16)), (40, (16, 16))])
def test_key_tiles_below_the_window_are_never_read(sb, window, blocks):
    """The forward and dQ loops start at the first key tile the window reaches and the dK/dV loop
    ends at the last query tile that sees the key block: keys (and queries) outside those tiles are
    NaN here, and the outputs and gradients that do not depend on them are finite and equal to the
    reference on clean inputs. A loop over every tile (O(N^2)) would carry a NaN into them (0 * NaN
    in the products). Forward/dQ: one query block at a large offset (``Nq = BM``), so the keys read
    are at most ``ceil((W + BM - 1) / BN) + 1`` tiles, whatever ``Nk``."""
    bm, bn = blocks
    g = torch.Generator().manual_seed(window)
    nq, q_offset = bm, 300
    nk = nq + q_offset
    q = torch.randn(1, 2, nq, D, generator=g, dtype=F64)
    k, v = (torch.randn(1, 1, nk, D, generator=g, dtype=F64) for _ in range(2))
    first = max(q_offset - window + 1, 0) // bn * bn  # the first key tile the window reaches
    assert first >= 8 * bn  # most tiles are below it
    kn, vn = k.clone(), v.clone()
    kn[:, :, :first] = float("nan")
    vn[:, :, :first] = float("nan")
    old = fused.INTERPRET_BLOCKS
    fused.INTERPRET_BLOCKS = blocks
    try:
        leaves = [t.clone().requires_grad_() for t in (q, kn, vn)]
        out = fused_attention(*leaves, q_offset=q_offset, window=window, stick_breaking=sb)
        dout = torch.randn(out.shape, generator=g, dtype=F64)
        dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    finally:
        fused.INTERPRET_BLOCKS = old
    clean = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference(*clean, window=window, scale=D ** -0.5, q_offset=q_offset, sb=sb)
    rq, rk, rv = torch.autograd.grad(ref, clean, dout)
    _close(out, ref, "forward")
    _close(dq, rq, "dq")
    _close(dk[:, :, first:], rk[:, :, first:], "dk")
    _close(dv[:, :, first:], rv[:, :, first:], "dv")
    assert (dk[:, :, :first] == 0).all() and (dv[:, :, :first] == 0).all()  # never visited: zeros


@pytest.mark.parametrize("sb", [False, True])
@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the forward of the NaN queries
@pytest.mark.parametrize("window,blocks", [(5, (16, 16)), (19, (32, 16))])
def test_query_tiles_past_the_window_are_never_read_by_dkdv(sb, window, blocks):
    """dK/dV of key block 0: queries past the last tile whose rows see it are NaN (q and dO); its
    gradients stay finite and equal to the reference (the query loop ends there)."""
    bm, bn = blocks
    g = torch.Generator().manual_seed(window)
    n = 150
    q, k, v = (torch.randn(1, 1, n, D, generator=g, dtype=F64) for _ in range(3))
    dout = torch.randn(1, 1, n, D, generator=g, dtype=F64)
    last = math.ceil((bn - 1 + window) / bm) * bm  # query tiles from here on see no key of block 0
    assert last <= n - 2 * bm
    qn, dn = q.clone(), dout.clone()
    qn[:, :, last:] = float("nan")
    dn[:, :, last:] = float("nan")
    old = fused.INTERPRET_BLOCKS
    fused.INTERPRET_BLOCKS = blocks
    try:
        leaves = [t.clone().requires_grad_() for t in (qn, k, v)]
        out = fused_attention(*leaves, window=window, stick_breaking=sb)
        _, dk, dv = torch.autograd.grad(out, leaves, dn)
    finally:
        fused.INTERPRET_BLOCKS = old
    clean = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference(*clean, window=window, scale=D ** -0.5, sb=sb)
    _, rk, rv = torch.autograd.grad(ref, clean, dout)
    _close(dk[:, :, :bn], rk[:, :, :bn], "dk of key block 0")
    _close(dv[:, :, :bn], rv[:, :, :bn], "dv of key block 0")


# ----------------------------------------------------------------------------- through the backend
def _positions(b: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.cumsum(torch.randint(1, 4, (b, n), generator=g), 1) + torch.tensor([[0], [17]])


@pytest.mark.parametrize("name", ["alibi", "fire", "rope"])
def test_kv_cache_decode_with_a_window_on_triton(name):
    """The triton backend at decode gets the whole cache with ``q_offset`` = its length and the
    window: each step sees its last W keys, so the steps equal one full forward (eager reference)."""
    cfg = {"init_L": 40.0, "init_c": 0.5} if name == "fire" else {}
    n, window, h = 40, 8, 2
    layers = []
    for backend in ("triton", "eager"):
        torch.manual_seed(0)
        m = Attn(n_heads=h, head_dim=D)
        inject(m, name, backend=backend, **cfg)
        m.posenc_window = window
        layers.append(m)
    q, k, v = (torch.randn(1, h, n, D) for _ in range(3))
    with torch.no_grad():
        full = layers[1](q, k, v)
        cache = LayerKVCache()
        steps = [layers[0](q[:, :, :19], k[:, :, :19], v[:, :, :19], cache=cache)]
        for t in range(19, n):
            steps.append(layers[0](q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(steps, 2), full, rtol=1e-5, atol=1e-5)
