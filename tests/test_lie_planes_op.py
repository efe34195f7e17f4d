"""liere / comrope (issue 45): the generators' planes through one operator each way
(``posenc::lie_planes`` and ``posenc::lie_planes_backward``, `autograd.lie.LiePlanes`). The rotation
``Q R(t F_a) Q^T`` they give (independent of the eigenvectors' phases) equals the float64
``matrix_exp`` of the blocks ``t c_ak skew(W_k)`` forward and backward, every input's gradient;
gradcheck in float64; the fake implementations give the real outputs' shapes, dtypes and strides,
so a compiled step traces one operator each way; differentiable once, and a second derivative
raises instead of coming out wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posenc_lightning.autograd import lie
from posenc_lightning.encodings.base import AttentionContext
from tests.test_rotary_matrix_fast import FAST, HKV, H, _encoding, _positions

#: (W's shape, c's shape): liere ``[1, K, b, b]`` with one axis (c None); per-block axis weights
#: ``[A, K]`` (comrope ap's mask, here any values); one weight per axis ``[A]`` (comrope ld)
CASES = [((1, 3, 6, 6), None), ((2, 8, 8), (3, 2)), ((3, 4, 4), (2,))]
#: the positions ``t`` of the rotations compared (not an arange, one negative)
TS = (0.7, -2.3, 5.0)


def _inputs(wshape: tuple, cshape: tuple | None, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(11)
    w = (0.5 * torch.randn(wshape, dtype=torch.float64, generator=g)).to(dtype).requires_grad_()
    c = None if cshape is None else (torch.randn(cshape, dtype=torch.float64, generator=g)).to(dtype).requires_grad_()
    return w, c


def _rotations(basis: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """``Q R(t F_a) Q^T`` ``[T, A, D, D]`` for t in `TS` (R in RoPE's half layout, planes ``j, j + D/2``)."""
    t = torch.tensor(TS, dtype=torch.float64)
    ang = t[:, None, None] * freq.reshape(freq.shape[0], -1)[None]  # [T, A, D/2]
    cos, sin = torch.diag_embed(ang.cos()), torch.diag_embed(ang.sin())
    r = torch.cat((torch.cat((cos, -sin), -1), torch.cat((sin, cos), -1)), -2)
    q = basis.to(torch.float64)
    return q @ r @ q.mT


def _reference(w: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
    """``blockdiag_k exp(t c_ak (W_k - W_k^T) / 2)`` ``[T, A, D, D]`` from ``matrix_exp`` in float64."""
    w64 = w.to(torch.float64).reshape(-1, w.shape[-1], w.shape[-1])
    p = 0.5 * (w64 - w64.mT)  # [K, b, b]
    k = p.shape[0]
    cc = torch.ones(1, k, dtype=torch.float64) if c is None else c.to(torch.float64).reshape(c.shape[0], -1).expand(-1, k)
    t = torch.tensor(TS, dtype=torch.float64)
    blocks = torch.linalg.matrix_exp(t[:, None, None, None, None] * cc[None, :, :, None, None] * p)  # [T, A, K, b, b]
    return torch.stack([torch.stack([torch.block_diag(*blocks[i, a]) for a in range(cc.shape[0])])
                        for i in range(len(TS))])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("wshape,cshape", CASES)
def test_the_planes_rotate_as_matrix_exp_forward_and_backward(wshape, cshape, dtype):
    """Float64 to rounding; float32 weights and basis (the eigh still in float64) within 1e-6
    relative to the largest entry of each tensor (measured <= 2.2e-14 and 1.6e-7)."""
    w, c = _inputs(wshape, cshape, dtype)
    ins = [t for t in (w, c) if t is not None]
    basis, freq = lie.LiePlanes.apply(w, c, dtype, None)
    assert basis.dtype == dtype and freq.dtype == torch.float64
    assert freq.shape == (1 if c is None else c.shape[0], wshape[-3], wshape[-1] // 2)
    got = _rotations(basis, freq)
    ref_ins = [None if t is None else t.detach().double().requires_grad_() for t in (w, c)]
    want = _reference(*ref_ins)
    g = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    d_got = torch.autograd.grad((got * g).sum(), ins)
    d_want = torch.autograd.grad((want * g).sum(), [t for t in ref_ins if t is not None])
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for a, b in zip((got, *d_got), (want, *d_want)):
        assert a.shape == b.shape and a.dtype == (torch.float64 if a is got else dtype)
        assert ((a.double() - b).abs().max() / b.abs().max()).item() <= tol


@pytest.mark.parametrize("wshape,cshape", CASES)
def test_gradcheck_float64(wshape, cshape):
    """Finite differences of the rotations and of ``F`` (both phase-independent) through autograd."""
    w, c = _inputs(wshape, cshape)

    def f(*ins):
        basis, freq = lie.LiePlanes.apply(ins[0], ins[1] if len(ins) > 1 else None, torch.float64, None)
        return _rotations(basis, freq), freq

    assert torch.autograd.gradcheck(f, tuple(t for t in (w, c) if t is not None))


@pytest.mark.parametrize("wshape,cshape", CASES)
@pytest.mark.parametrize("need_c", [True, False])
def test_the_fakes_give_the_real_outputs_layout(wshape, cshape, need_c):
    """torch.library's checks (schema, fake against real, traced forward), and shapes, dtypes and
    strides of every output under a fake mode equal the real ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    w, c = (None if t is None else t.detach().float() for t in _inputs(wshape, cshape))
    utils = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(lie.lie_planes_op, (w, c, torch.float32), test_utils=utils)
    basis, freq, lam, u = lie.lie_planes_op(w, c, torch.float32)
    g = torch.Generator().manual_seed(3)
    gb, gf = torch.randn(basis.shape, generator=g), torch.randn(freq.shape, dtype=torch.float64, generator=g)
    bwd_args = (c, lam, u, gb, gf, w.dtype, w.dim() == 4, need_c)
    torch.library.opcheck(lie.lie_planes_backward_op, bwd_args, test_utils=utils)
    real = (basis, freq, lam, u, *lie.lie_planes_backward_op(*bwd_args))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in (w, c)]
        fb, ff, fl, fu = lie.lie_planes_op(*fake_args, torch.float32)
        fake_bwd = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in bwd_args]
        fake = (fb, ff, fl, fu, *lie.lie_planes_backward_op(*fake_bwd))
    assert real[-1].numel() == (c.numel() if need_c and c is not None else 0)
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


@pytest.mark.parametrize("name,cfg", [FAST[0], FAST[5]])
def test_a_traced_step_runs_the_planes_as_one_operator_each_way(name, cfg):
    """Compiled (fullgraph), the rotation's forward graph holds ``posenc::lie_planes`` and
    ``posenc::lie_rotate_pair`` once each, its backward graph their backward operators."""
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

    seen: dict[str, list[str]] = {}

    def backend(gm, inputs):
        def record(kind):
            def compiler(graph, _):
                seen[kind] = sorted(str(n.target) for n in graph.graph.nodes if str(n.target).startswith("posenc."))
                return make_boxed_func(graph.forward)
            return compiler
        return aot_module_simplified(gm, inputs, fw_compiler=record("fw"), bw_compiler=record("bw"))

    enc = _encoding(name, cfg, torch.float32)
    pos = _positions("random", enc.n_axes)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k: enc.rotate(q, k, AttentionContext(pos, pos, True)), fullgraph=True, backend=backend)
    q = torch.randn(2, H, 9, enc.head_dim, requires_grad=True)
    k = torch.randn(2, HKV, 9, enc.head_dim, requires_grad=True)
    qr, kr = f(q, k)
    (qr.square().sum() + kr.sum()).backward()
    torch._dynamo.reset()
    assert seen == {"fw": ["posenc.lie_planes.default", "posenc.lie_rotate_pair.default"],
                    "bw": ["posenc.lie_planes_backward.default", "posenc.lie_rotate_pair_backward.default"]}
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in enc.parameters() if p.requires_grad)


def test_a_second_derivative_raises():
    """The backward reads the forward's decomposition, outside the graph: its operator has no
    derivative, so a double backward raises (a hand-written Function would return a wrong one)."""
    w, c = _inputs(*CASES[1])
    basis, freq = lie.LiePlanes.apply(w, c, torch.float64, None)
    gw, = torch.autograd.grad(_rotations(basis, freq).square().sum(), w, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        torch.autograd.grad(gw.square().sum(), w)
