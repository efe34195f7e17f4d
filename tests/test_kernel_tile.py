"""A second parametric bias in the Triton kernels with no edit to them (issue 29): a bias kind
defined here, ``a[h] log(1 + |i - j|) + b[h] sqrt(|i - j|)``, brings its own ``@triton.jit`` tile and gradient
(`TileBias`) through `fold_into`; the softmax and stick-breaking kernels evaluate it per tile and
reduce its parameter gradients per program, equal to eager attention on the dense formula,
forward and backward (TRITON_INTERPRET=1). Its example tile, registered here
(`register_tile_kind`, issue 46), is in the kernels' resource report with no edit to the package."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl

from posenc_lightning.attention.backends import eager
from posenc_lightning.attention.backends import triton as triton_backend
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext, Bias, DenseBias, KernelBias
from posenc_lightning.encodings.bias import TileBias, register_tile_kind
from posenc_lightning.encodings.registry import build_encoding
from tests.helpers import fast_triton_interpreter

H, D = 2, 16


@pytest.fixture(autouse=True)
def _fast_interpreter(monkeypatch):
    fast_triton_interpreter(monkeypatch)
    yield


@triton.jit
def _log_tile(h, qp, kp, P, W, H, eps, BM: tl.constexpr, BN: tl.constexpr, ACC: tl.constexpr):
    """``a[h] log(1 + |i - j|) + b[h] sqrt(|i - j|)``, ``P = [a (H), b (H)]``."""
    dist = tl.abs(qp[:, None] - kp[None, :])
    return tl.load(P + h).to(ACC) * tl.log(1.0 + dist) + tl.load(P + H + h).to(ACC) * tl.sqrt(dist)


@triton.jit
def _log_grads(ds, h, qp, kp, ok, P, W, H, eps, GB: tl.constexpr, ACC: tl.constexpr):
    """``[sum ds log(1 + |i - j|), sum ds sqrt(|i - j|)]``: the gradients of ``a[h]``, ``b[h]``."""
    ds = tl.where(ok, ds, 0.0)
    dist = tl.abs(qp[:, None] - kp[None, :])
    offs = tl.arange(0, GB)
    da = tl.sum(tl.sum(ds * tl.log(1.0 + dist), 1), 0)
    db = tl.sum(tl.sum(ds * tl.sqrt(dist), 1), 0)
    return tl.where(offs == 0, da, tl.where(offs == 1, db, 0.0))


class _LogDistance(Bias):
    """``a[h] log(1 + |i - j|) + b[h] sqrt(|i - j|)`` at the tokens' positions: a new kind whose
    only Triton code is its tile, above."""

    fused_in = frozenset({"kernel"})

    def __init__(self, a, b, q_pos, k_pos):
        self.a, self.b, self.q_pos, self.k_pos = a, b, q_pos, k_pos

    def materialize(self):
        d = (self.q_pos[:, :, None] - self.k_pos[:, None, :]).float().abs()[:, None]
        return self.a[None, :, None, None] * d.log1p() + self.b[None, :, None, None] * d.sqrt()

    def rows(self, start, stop, k_stop):
        return _LogDistance(self.a, self.b, self.q_pos[:, start:stop], self.k_pos[:, :k_stop]).materialize()

    def fold_into(self, args: KernelBias) -> None:
        if args.tile is not None or not args.claim_positions(self.q_pos, self.k_pos):
            return super().fold_into(args)
        args.tile = _tile(self.a, self.b)


def _tile(a: torch.Tensor, b: torch.Tensor) -> TileBias:
    """The kind's tile from its parameters ``a``, ``b`` ``[H]``."""
    return TileBias(name="log_distance", params=torch.cat((a, b)), heads=a.shape[0], width=0, eps=0.0, grad_block=2,
                    value=_log_tile, grads=_log_grads, unpack=lambda per_head: torch.cat((per_head[:, 0], per_head[:, 1])))


@register_tile_kind("log_distance")
def _example_tile(n_heads: int) -> TileBias:
    """An example tile to compile the kernels with, registered in the kind's own file."""
    return _tile(torch.zeros(n_heads), torch.zeros(n_heads))


def _params(seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(H, generator=g) * 0.5).requires_grad_(), torch.randn(H, generator=g).requires_grad_()


@pytest.mark.parametrize("normalizer", ["softmax", "stick_breaking"])
def test_a_new_tile_bias_equals_eager_forward_and_backward(normalizer):
    g = torch.Generator().manual_seed(3)
    b, n, hkv = 2, 37, 1  # not a multiple of the 16 x 16 tiles; grouped kv heads
    pos = torch.arange(n).expand(b, n) + torch.tensor([[0], [5]])
    q = torch.randn(b, H, n, D, generator=g, requires_grad=True)
    k, v = (torch.randn(b, hkv, n, D, generator=g, requires_grad=True) for _ in range(2))
    a, c = _params(4)
    mask = AttentionMask(True, 0, n, n)
    sb = build_encoding("sba") if normalizer == "stick_breaking" else None
    ctx = AttentionContext(pos, pos)
    bias = _LogDistance(a, c, pos, pos)
    args = triton_backend.split_bias(bias, H)
    assert args.dense is None and args.tile.name == "log_distance"  # read in-kernel, not as N x N
    out = triton_backend.attend(q, k, v, bias=bias, mask=mask, scale=D ** -0.5,
                                normalizer=sb.normalize(ctx) if sb else None, ctx=ctx)
    ref = eager.attend(q, k, v, bias=DenseBias(bias.materialize()), mask=mask, scale=D ** -0.5,
                       normalizer=sb.normalize(ctx) if sb else None, ctx=ctx)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    dout = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, [q, k, v, a, c], dout)
    want = torch.autograd.grad(ref, [q, k, v, a, c], dout)
    assert want[3].abs().min() > 1e-3 and want[4].abs().min() > 1e-3  # every parameter learns here
    for i, (x, y) in enumerate(zip(got, want)):  # a parameter's gradient: float32 sums over B N^2 / 2 pairs
        tol = 3e-5 if i < 3 else 1e-4
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


def test_a_tile_kind_registered_here_is_in_the_resource_report():
    """Registered in this file (`register_tile_kind`), with no edit to ``encodings/bias/__init__.py``,
    the kind is among the configurations the compile report runs: every attention kernel again with
    its example tile (``<kernel>_log_distance``), beside FIRE's, with the tile's own functions. (The
    report's compile for sm80/sm90, `tests/test_triton_compile.py`, runs in a
    subprocess that does not import this file.)"""
    from posenc_lightning.kernels import resource_report as report

    report.example_tiles.cache_clear()  # cached per process: a call before this file's import would miss it
    try:
        attn = [k for k in report.BASE_KINDS if k != "rotate"]
        kinds = [c[0] for c in report.configs(worst_only=True)]
        assert {f"{k}_{t}" for k in attn for t in ("log_distance", "fire")} <= set(kinds)
        assert sum(k.endswith("_log_distance") for k in kinds) == sum(k.endswith("_fire") for k in kinds) > 0
        tile = report.example_tiles()["log_distance"]  # what `launch_spec` compiles the kernels with
        assert tile.value is _log_tile and tile.grads is _log_grads and tile.heads == report._HEADS
    finally:
        report.example_tiles.cache_clear()
