"""Rotary on the SDPA path (issue 45): q and k rotated together by one operator
(`autograd.rotary.RotaryPair`, ``posenc::rotate_pair``), its backward the inverse rotation of dq and
dk; the Triton launch it makes on CUDA (run here under ``TRITON_INTERPRET=1``) equals the torch math;
every rotary encoding's rotation equals the plain formula forward and backward at positions that are
not an arange, with sizes that divide no block; and one attention forward+backward dispatches at
most 8 operators more than ``nope``'s (each is a launch on CUDA; +91 to +405 before). liere and
comrope meet it with trainable generators: q and k through one operator each way
(``posenc::lie_rotate_pair``, applied once: attention keeps the rotated q and k), the generators'
planes too (``posenc::lie_planes``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.threads import dispatched_ops
from posenc_lightning.attention.backends import resolve_backend
from posenc_lightning.autograd import rotary
from posenc_lightning.autograd.rotary import RotaryPair, rotate_into
from posenc_lightning.encodings.base import AttentionContext
from posenc_lightning.encodings.registry import build_encoding
from posenc_lightning.functional.rope import apply_rotary_reference
from posenc_lightning.inject import inject
from tests.helpers import Attn

H, D = 2, 24
#: the rotary encodings that take the SDPA path, with the configurations that change the rotation
SDPA_ROTARY = {
    "rope": {}, "rope_interleaved": {"layout": "interleaved"}, "rope_partial": {"partial_rotary_factor": 0.5},
    "pi": {}, "ntk": {}, "dynamic_ntk": {}, "yarn": {}, "llama3": {}, "long_rope": {}, "resonance_rope": {},
    "multiscale_rope": {}, "xpos": {}, "rope_2d": {},
}
#: left out of the +8 bound, and why:
#: - clex: its frequencies come out of a learned ODE and carry a gradient: one shared solve per
#:   step and the frequencies' gradient are bounded at rope + 20 in tests/test_clex_cache.py;
#: - exposb: its stage 4 replaces softmax, so it runs on the blockwise backend, not SDPA.
EXCLUDED = ("clex", "exposb")
#: the learned rotations, trainable: q and k through ``posenc::lie_rotate_pair`` (forward, then its
#: backward; the rotated q and k are kept), the generators' planes through ``posenc::lie_planes``
#: and its backward
MATRIX_ROTARY = ("liere", "comrope")
#: operators one attention forward+backward may dispatch beyond ``nope``'s
EXTRA = 8


def _name(case: str) -> str:
    return case.split("_interleaved")[0].split("_partial")[0]


def _step(case: str | None, n: int = 67, cfg: dict | None = None):
    """One attention forward+backward on q, k, v views of one projection output (as a model has
    them), warmed once."""
    torch.manual_seed(0)
    m = Attn(n_heads=H, head_dim=D)
    if case is not None:
        inject(m, _name(case), **(SDPA_ROTARY.get(case, {}) if cfg is None else cfg))
    x = torch.randn(1, n, 3 * H * D, requires_grad=True)

    def step():
        q, k, v = x.view(1, n, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        m(q, k, v).sum().backward()

    step()
    return m, step


@pytest.mark.parametrize("case", [*SDPA_ROTARY, *MATRIX_ROTARY])
def test_one_attention_step_dispatches_at_most_8_operators_more_than_nope(case):
    nope = sum(dispatched_ops(_step(None)[1]).values())
    m, step = _step(case)
    assert resolve_backend("auto", m.encoding, torch.device("cpu"), True).NAME == "sdpa"
    ops = dispatched_ops(step)
    assert sum(ops.values()) <= nope + EXTRA, (case, sum(ops.values()) - nope, ops)
    if case in MATRIX_ROTARY:  # the planes once each way (eigh inside), the rotation as rope's
        assert any(p.requires_grad for p in m.posenc.parameters())
        assert ops["posenc::lie_planes"] == 1 and ops["posenc::lie_planes_backward"] == 1
        assert ops["posenc::lie_rotate_pair"] == 1 and ops["posenc::lie_rotate_pair_backward"] == 1
        assert ops["aten::_linalg_eigh"] == 0
        return
    # one rotation of q and k forward, once again for the saved-tensor recompute, one inverse in backward
    assert ops["posenc::rotate_pair"] == 3


@pytest.mark.parametrize("name,cfg", [("liere", {}), ("liere", {"block_size": 8}), ("comrope", {"variant": "ap"}),
                                      ("comrope", {"variant": "ld"})])
def test_matrix_rotaries_dispatch_two_operators_for_their_generators_whatever_n(name, cfg):
    """Per step, N-independent: the per-token part (one operator each way for q and k: forward and
    backward; attention keeps the rotated q and k, `MatrixRotary.cheap_rotation`) is what frozen
    generators dispatch; trainable ones add the planes' two operators (one batched eigh inside the
    forward's) and autograd's accumulation into each trainable parameter's ``grad`` (one ``add_``
    each): liere and comrope ap (one parameter) at nope + 5, comrope ld (``weight`` and
    ``axis_weight``) at nope + 6."""
    nope = sum(dispatched_ops(_step(None)[1]).values())
    counts = []
    for n in (67, 131):
        m, step = _step(name, n, cfg)
        ops = dispatched_ops(step)
        counts.append(sum(ops.values()) - nope)
        assert ops["posenc::lie_planes"] == 1 and ops["posenc::lie_planes_backward"] == 1
        assert ops["posenc::lie_rotate_pair"] == 1 and ops["posenc::lie_rotate_pair_backward"] == 1
        assert ops["aten::_linalg_eigh"] == 0  # inside the planes' operator only
    assert counts[0] == counts[1], counts
    leaves = sum(p.requires_grad for p in m.posenc.parameters())
    m.posenc.requires_grad_(False)
    step()  # the planes of frozen generators, computed once
    ops = dispatched_ops(step)
    frozen = sum(ops.values()) - nope
    assert frozen <= EXTRA and ops["posenc::lie_planes"] == 0, (frozen, ops)
    assert counts[0] == frozen + 2 + leaves, (counts[0], frozen, leaves)
    assert counts[0] <= EXTRA


# ----------------------------------------------------------------------------- the operator
def _tables(shape_b, heads, n, half, dtype, g):
    c = torch.randn(shape_b, heads, n, half, dtype=dtype, generator=g)
    return c, torch.randn(shape_b, heads, n, half, dtype=dtype, generator=g)


def _pair_inputs(dtype, rotary_dim, per_head, g):
    b, hk, nq, nk = 2, 3, 13, 9  # no size a power of two; q transposed (a projection's layout)
    q = torch.randn(b, nq, H * 0 + 3, D, dtype=dtype, generator=g).transpose(1, 2)
    k = torch.randn(b, hk, nk, D, dtype=dtype, generator=g)
    tdt = torch.float64 if dtype == torch.float64 else torch.float32
    cq, sq = _tables(1, 1, nq, rotary_dim // 2, tdt, g)  # broadcast over batch and heads
    ck, sk = _tables(b, hk if per_head else 1, nk, rotary_dim // 2, tdt, g)
    return q, k, cq, sq, ck, sk


def _reference(x, c, s, interleaved, inverse):
    return apply_rotary_reference(x, c, -s if inverse else s, "interleaved" if interleaved else "half")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [D, 16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inverse", [False, True])
def test_the_torch_math_is_the_formula(dtype, rotary_dim, interleaved, inverse):
    g = torch.Generator().manual_seed(0)
    q, k, cq, sq, ck, sk = _pair_inputs(dtype, rotary_dim, True, g)
    for x, c, s in ((q, cq, sq), (k, ck, sk)):
        got = rotate_into(x, c, s, interleaved, inverse)
        want = _reference(x, c, s, interleaved, inverse)
        assert got.dtype == x.dtype and got.is_contiguous()
        tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rotary_dim", [D, 16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_the_triton_launch_equals_the_torch_math(dtype, rotary_dim, interleaved, inverse, per_head):
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton launch runs on CPU tensors only under TRITON_INTERPRET=1")
    from posenc_lightning.autograd import rotary_triton

    g = torch.Generator().manual_seed(1)
    q, k, cq, sq, ck, sk = _pair_inputs(dtype, rotary_dim, per_head, g)
    # 4 rows a program: 13 and 9 rows per head leave partial blocks
    got = rotary_triton.rotate_pair_triton(q, k, cq, sq, ck, sk, interleaved, inverse, block_rows=4)
    want = (rotate_into(q, cq, sq, interleaved, inverse), rotate_into(k, ck, sk, interleaved, inverse))
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous()
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_the_function_through_the_triton_launch_equals_the_formula_forward_and_backward(monkeypatch):
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton launch runs on CPU tensors only under TRITON_INTERPRET=1")
    monkeypatch.setattr(rotary, "_triton_ready", lambda x: True)  # the CUDA branch, on CPU tensors
    g = torch.Generator().manual_seed(2)
    q, k, cq, sq, ck, sk = _pair_inputs(torch.float64, 16, False, g)
    _check_function(q, k, cq, sq, ck, sk, True, 1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
def test_the_function_backward_is_the_inverse_rotation(interleaved):
    g = torch.Generator().manual_seed(3)
    q, k, cq, sq, ck, sk = _pair_inputs(torch.float64, 16, True, g)
    _check_function(q, k, cq, sq, ck, sk, interleaved, 1e-12)


def test_the_function_differentiates_twice():
    g = torch.Generator().manual_seed(5)
    q, k, cq, sq, ck, sk = _pair_inputs(torch.float64, 16, True, g)
    q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
    assert torch.autograd.gradgradcheck(lambda a, b: RotaryPair.apply(a, b, cq, sq, ck, sk, False), (q, k))


def _check_function(q, k, cq, sq, ck, sk, interleaved, tol):
    q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
    layout = "interleaved" if interleaved else "half"
    got = RotaryPair.apply(q, k, cq, sq, ck, sk, interleaved)
    want = (apply_rotary_reference(q, cq, sq, layout), apply_rotary_reference(k, ck, sk, layout))
    gq, gk = torch.randn_like(want[0]), torch.randn_like(want[1])
    d_got = torch.autograd.grad(got, (q, k), (gq, gk))
    d_want = torch.autograd.grad(want, (q, k), (gq, gk))
    for a, b in zip((*got, *d_got), (*want, *d_want)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- the encodings
@pytest.mark.parametrize("case", list(SDPA_ROTARY))
@pytest.mark.parametrize("positions", ["shuffled", "offset"])
def test_every_rotary_encoding_rotates_as_the_formula_forward_and_backward(case, positions):
    """`rotate` (one operator for q and k, cached tables at a known start) against the plain
    formula on the same tables, in float64; q and k at different positions and lengths."""
    enc = build_encoding(_name(case), **SDPA_ROTARY[case]).bind(n_heads=H, head_dim=D, d_model=H * D).double()
    g = torch.Generator().manual_seed(4)
    nq, nk = 19, 37
    if positions == "shuffled":
        q_pos = torch.randperm(50, generator=g)[:nq].expand(2, -1)
        k_pos, q_start, k_start = torch.randperm(50, generator=g)[:nk].expand(2, -1), None, None
    else:
        q_pos, k_pos, q_start, k_start = torch.arange(18, 18 + nq).expand(2, -1), torch.arange(nk).expand(2, -1), 18, 0
    q = torch.randn(2, H, nq, D, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, H, nk, D, dtype=torch.float64, generator=g, requires_grad=True)
    ctx = AttentionContext(q_pos, k_pos, True, q_start=q_start, k_start=k_start)
    for _ in range(2):  # the second call at a known start takes the cached tables
        got = enc.rotate(q, k, ctx)
        cq, sq, ck, sk = (t.double() for t in enc.rotation_tables(ctx))
        want = (apply_rotary_reference(q, cq, sq, enc.layout), apply_rotary_reference(k, ck, sk, enc.layout))
        gq, gk = torch.randn_like(q), torch.randn_like(k)
        d_got = torch.autograd.grad(got, (q, k), (gq, gk))
        d_want = torch.autograd.grad(want, (q, k), (gq, gk))
        for a, b in zip((*got, *d_got), (*want, *d_want)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert bool(enc._pair_tables) == (positions == "offset")


def test_cached_tables_follow_a_change_of_scale():
    enc = build_encoding("yarn", factor=2.0).bind(n_heads=H, head_dim=D, d_model=H * D)
    pos = torch.arange(40).expand(1, -1)
    ctx = AttentionContext(pos, pos, True, q_start=0, k_start=0)
    q = k = torch.randn(1, H, 40, D)
    before = enc.rotate(q, k, ctx)[0]
    enc.set_scale(4.0)
    after = enc.rotate(q, k, AttentionContext(pos, pos, True, q_start=0, k_start=0))[0]
    cq, sq, _, _ = enc.rotation_tables(ctx)
    torch.testing.assert_close(after, apply_rotary_reference(q, cq, sq, "half"))
    assert not torch.equal(before, after)
