"""liere / comrope (issue 45): the rotation of q and k through one operator each way
(``posenc::lie_rotate_pair`` and its backward), whose Triton launches (run here under
``TRITON_INTERPRET=1``) equal the torch math forward and backward; the generators' planes
(`autograd.lie.LiePlanes`) equal the traceable formula; and the planes are shared between calls
until the generators change or their graph's backward has run."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.threads import dispatched_ops
from posenc_lightning.autograd import lie
from posenc_lightning.encodings.base import AttentionContext
from posenc_lightning.functional.lie_rotary import lie_planes, lie_planes_traceable
from tests.test_rotary_matrix_fast import FAST, TOL, _assert_close_scaled, _encoding, _positions, _run

D, H = 16, 2


def _interpret() -> None:
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton launch runs on CPU tensors only under TRITON_INTERPRET=1")


def _pair_inputs(dtype: torch.dtype, d: int, blocks: int, axes: int):
    """q token-major (a projection's layout), k contiguous, 13 and 21 tokens (no block divides
    them), q's integer positions one shuffled row expanded over the batch, k's float positions."""
    g = torch.Generator().manual_seed(0)
    b, hq, hk, nq, nk = 2, 3, 1, 13, 21
    q = torch.randn(b, nq, hq, d, dtype=dtype, generator=g).transpose(1, 2)
    k = torch.randn(b, hk, nk, d, dtype=dtype, generator=g)
    basis = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=g))[0].to(dtype)
    freq = torch.rand(axes, blocks, d // blocks // 2, dtype=torch.float64, generator=g)
    pq = torch.randperm(300, generator=g)[:nq * axes].view(1, nq, axes).expand(b, -1, -1) - 40
    pk = torch.randn(b, nk, axes, dtype=torch.float64, generator=g) * 50
    if axes == 1:
        pq, pk = pq[..., 0], pk[..., 0]
    return q, k, basis, freq, pq, pk


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("d,blocks,axes", [(16, 1, 1), (32, 4, 2), (96, 3, 1)])  # 96: padded to 128 channels
@pytest.mark.parametrize("need_params", [True, False])
def test_the_triton_launches_equal_the_torch_math(dtype, d, blocks, axes, need_params):
    _interpret()
    from posenc_lightning.autograd import lie_triton

    q, k, basis, freq, pq, pk = _pair_inputs(dtype, d, blocks, axes)
    want = lie.lie_rotate_pair_op(q, k, basis, freq, pq, pk)
    got = lie_triton.lie_pair_forward(q, k, lie._lie_out(q), lie._lie_out(k), basis, freq, pq, pk)
    g = torch.Generator().manual_seed(1)
    gq, gk = torch.randn(q.shape, dtype=dtype, generator=g), torch.randn(k.shape, dtype=dtype, generator=g)
    want_b = lie.lie_rotate_pair_backward_op(q, k, basis, freq, pq, pk, gq, gk, need_params)
    dq, dk = lie._lie_out(q), lie._lie_out(k)
    # two programs per tensor: each loops over several row blocks and adds its sums atomically
    db, df = lie_triton.lie_pair_backward(q, k, gq, gk, dq, dk, basis, freq, pq, pk, need_params, max_programs=2)
    tol = 1e-12 if dtype == torch.float64 else 2e-6  # relative to the largest entry; measured 6e-16, 7e-7
    for a, b in zip((*got, dq, dk, db, df), (*want, *want_b)):
        assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
        if b.numel():
            assert ((a - b).abs().max() / b.abs().max()).item() <= tol


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name,cfg", [FAST[0], FAST[1], FAST[3], FAST[5]])
def test_the_encodings_through_the_triton_launches_equal_matrix_exp(name, cfg, dtype, monkeypatch):
    """The CUDA branch on CPU tensors: q, k and every gradient (parameters included) against the
    float64 ``matrix_exp`` reference, at positions that are not an arange."""
    _interpret()
    monkeypatch.setattr(lie, "_triton_ready", lambda x, basis: True)
    enc = _encoding(name, cfg, dtype)
    pos = _positions("random", enc.n_axes)
    ref = _run(enc, pos, pos, torch.float64, reference=True)
    _assert_close_scaled(_run(enc, pos, pos, dtype, reference=False), ref, TOL[dtype])


@pytest.mark.parametrize("name,cfg", [FAST[0], FAST[1], FAST[3], FAST[5]])
def test_the_planes_equal_the_traceable_formula(name, cfg):
    """`LiePlanes` (strided views, hand-written backward) against `canonical_basis` with autograd's
    backward through it, forward and the gradients of every parameter, in float64."""
    enc = _encoding(name, cfg)
    w, c = enc.plane_inputs()
    ins = [t for t in (w, c) if t is not None and t.requires_grad]
    g = torch.Generator().manual_seed(2)
    outs = []
    for fn in (lie_planes, lie_planes_traceable):
        basis, freq = fn(w, c, torch.float64)
        gb = torch.randn(basis.shape, dtype=torch.float64, generator=g)
        gf = torch.randn(freq.shape, dtype=torch.float64, generator=g)
        g = torch.Generator().manual_seed(2)
        outs.append([basis, freq, *torch.autograd.grad((basis * gb).sum() + (freq * gf).sum(), ins)])
    assert len(outs[0]) == 2 + len(ins) and outs[0][1].shape == (enc.n_axes, enc.n_blocks, enc.block_size // 2)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- shared planes
def _rotate(enc, seed: int = 0, n: int = 11):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randperm(40, generator=g)[:n].expand(2, n)
    q = torch.randn(2, H, n, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, n, D, generator=g, dtype=torch.float64, requires_grad=True)
    qr, kr = enc.rotate(q, k, AttentionContext(pos, pos, True))
    return qr, kr, (qr * torch.cos(qr)).sum() + kr.square().sum()


def _eighs(fn) -> int:
    """The generators' decompositions ``fn`` runs: one batched eigh in each ``posenc::lie_planes``."""
    ops = dispatched_ops(fn)
    assert ops["aten::_linalg_eigh"] == 0  # none outside the operator
    return ops["posenc::lie_planes"]


def test_an_optimizer_step_changes_the_planes():
    enc = _encoding("comrope", {"variant": "ld", "n_axes": 1, "block_size": 8})
    opt = torch.optim.SGD(enc.parameters(), lr=0.1)
    before, _, loss = _rotate(enc)
    loss.backward()
    opt.step()
    after = _rotate(enc)[0]
    fresh = _rotate(copy.deepcopy(enc))[0]  # a copy shares no planes
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, fresh, rtol=0, atol=0)


def test_planes_are_shared_by_the_calls_of_one_step_and_by_frozen_calls():
    """Two calls in one graph (layers sharing the encoding) decompose once and take the gradients
    of both; a second backward without a step decomposes again (the first graph is spent); frozen
    generators and calls without grad decompose once for all."""
    enc = _encoding("liere", {"n_axes": 1, "block_size": 8})
    ref = copy.deepcopy(enc)
    grads = []
    for m, shared in ((enc, True), (ref, False)):
        def two_calls(m=m, shared=shared):
            loss = _rotate(m, 0)[2]
            if not shared:
                m._planes = None
            loss = loss + _rotate(m, 1)[2]
            return torch.autograd.grad(loss, list(m.parameters()))
        eighs = _eighs(lambda: grads.append(two_calls()))
        assert eighs == (1 if shared else 2)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-13, atol=1e-13)
    assert _eighs(lambda: torch.autograd.grad(_rotate(enc)[2], list(enc.parameters()))) == 1  # not the spent graph
    with torch.no_grad():
        assert _eighs(lambda: _rotate(enc)) == 1 and _eighs(lambda: _rotate(enc, 3)) == 0
    enc.requires_grad_(False)
    assert _eighs(lambda: _rotate(enc)[2].backward()) == 0  # the no-grad planes serve frozen generators
    enc.requires_grad_(True)
    p = next(enc.parameters())
    before = _rotate(enc)[2]
    assert before.grad_fn is not None and torch.autograd.grad(before, p)[0].abs().max() > 0  # not the no-grad ones


def test_a_state_dict_load_changes_the_planes():
    enc = _encoding("comrope", {"variant": "ap", "n_axes": 1, "block_size": 4})
    other = _encoding("comrope", {"variant": "ap", "n_axes": 1, "block_size": 4}, seed=1)
    with torch.no_grad():
        _rotate(enc)
        enc.load_state_dict(other.state_dict())
        torch.testing.assert_close(_rotate(enc)[0], _rotate(other)[0], rtol=0, atol=0)


_COMPILE = """
import json, sys, torch
from posenc_lightning.autograd import lie_triton as lt
from posenc_lightning.kernels.resource_report import compile_launch

def spec(kernel, d, backward, need):
    def make(dtype):
        vals = {"A": 2, "MB": 4, "DOT": True, "BLOCK_T": 16, "BLOCK_M": d // 2, "BLOCK_A": 2,
                "BLOCK_J": lt.CHUNK, "EVEN": True, "NEED": need, "BLOCK_C": lt.DQ_ROWS[d] if need else d,
                "BM": 16, "BN": 0}
        for p in kernel.params:
            if p.name in vals:
                continue
            if p.name in ("FREQ", "DF"):
                vals[p.name] = torch.zeros(1, dtype=torch.float64)
            elif p.name in ("PQ", "PK"):
                vals[p.name] = torch.zeros(1, dtype=torch.int64)
            elif p.name in ("Q", "K", "QO", "KO", "GQ", "GK", "DQ", "DK", "BASIS", "DB"):
                vals[p.name] = torch.zeros(1, dtype=dtype)
            else:
                vals[p.name] = 64
        return kernel, vals, lt.WARPS[(backward, d)], 1
    return make

# bwd: the parameters take a gradient (dQ, dF sums); bwd_frozen: dx only
rows = [compile_launch(name, d, "float32", cc, spec(kernel, d, name != "fwd", name == "bwd"), ptxas=True)
        for name, kernel in (("fwd", lt._lie_forward_kernel), ("bwd", lt._lie_backward_kernel),
                             ("bwd_frozen", lt._lie_backward_kernel))
        for d in (32, 64, 128) for cc in (80, 90)]
print(json.dumps(rows))
"""


def test_the_launches_compile_for_sm80_and_sm90_without_spills():
    """Both kernels (the backward with and without the parameters' gradients) compile for real
    targets without a GPU (a subprocess: the interpreter is on here), within the targets' shared
    memory, and ptxas spills nothing at head sizes 32, 64 and 128 (float32)."""
    pytest.importorskip("triton")
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    r = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=1800,
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(rows) == 18 and all(row["ok"] for row in rows), [row for row in rows if not row["ok"]]
    spills = [(row["kernel"], row["head_dim"], row["target"], row["registers"], row["spill_stores"], row["spill_loads"])
              for row in rows]
    assert all(regs > 0 and st == 0 and ld == 0 for *_, regs, st, ld in spills), spills
