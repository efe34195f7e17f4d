"""`block_grad`: the blockwise attention gradient's pieces, where their eager shortcuts must hold.

A block's bias rows are differentiated through autograd (`block_vjp`), also inside a custom
operator's kernel, where the dispatcher runs with the autograd keys excluded (`opaque_op`'s
backward of rows); ``torch.func.vjp`` there cost about 1 ms per block.
"""

from __future__ import annotations

import pytest
import torch

from posenc_lightning.attention.backends.engine import block_grad as _block_grad
from posenc_lightning.attention.backends.engine.block_grad import attention_backward_by_blocks, block_vjp


def _rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.tanh(a[:, None] * b[None, :]).exp()


def _expected(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
    return torch.autograd.grad(_rows(a_, b_), (a_, b_), g)


@torch.library.custom_op("posenc_test::block_vjp_in_kernel", mutates_args=())
def _in_kernel(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    out, pullback = block_vjp(_rows, a, b)
    return [out, *pullback(g)]


def test_block_vjp_uses_autograd_inside_a_custom_operator(monkeypatch):
    a, b, g = torch.randn(5), torch.randn(7), torch.randn(5, 7)

    def no_transform(*args, **kwargs):
        raise AssertionError("torch.func.vjp called: autograd was not restored in the kernel")

    monkeypatch.setattr(torch.func, "vjp", no_transform)
    out, ga, gb = _in_kernel(a, b, g)
    ea, eb = _expected(a, b, g)
    torch.testing.assert_close(out, _rows(a, b))
    torch.testing.assert_close(ga, ea)
    torch.testing.assert_close(gb, eb)
    # the kernel's dispatch state is restored afterwards: autograd still excluded there, on outside
    assert _block_grad._autograd_records()


def test_block_vjp_zero_for_an_unused_primal():
    a, b = torch.randn(3), torch.randn(4)
    out, pullback = block_vjp(lambda x, y: x[:, None] * torch.ones(4), a, b)
    torch.testing.assert_close(out, a[:, None].expand(3, 4))
    ga, gb = pullback(torch.ones(3, 4))
    torch.testing.assert_close(ga, torch.full((3,), 4.0))
    torch.testing.assert_close(gb, torch.zeros(4))


@pytest.mark.parametrize("grad_mode", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rows", [7, 16, 40])
def test_backward_by_blocks_equals_autograd(causal, rows, grad_mode):
    """The blocks' buffers are reused from block to block (grad mode off, as in autograd's
    backward; with it on, a differentiated backward, new tensors): each block's gradient is still
    the softmax attention gradient, for blocks that do not divide N, GQA, transposed layouts."""
    torch.manual_seed(0)
    b, h, h_kv, n, d = 2, 4, 2, 37, 8
    q = torch.randn(b, n, h, d).transpose(1, 2)
    k, v = (torch.randn(b, n, h_kv, d).transpose(1, 2) for _ in range(2))
    bias = torch.randn(h, n, n)
    scale = d ** -0.5
    qr, kr, vr, br = (t.clone().requires_grad_() for t in (q, k, v, bias))
    s = qr @ kr.repeat_interleave(2, 1).transpose(-1, -2) * scale + br
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ vr.repeat_interleave(2, 1)
    d_out = torch.randn_like(out)
    eq, ek, ev, eb = torch.autograd.grad(out, (qr, kr, vr, br), d_out)
    got_bias = torch.zeros(h, n, n)

    def add_bias(start, stop, k_stop, s_blk):  # [B, H_kv, g, r, k_stop]
        s_blk += bias[:, start:stop, :k_stop].view(h_kv, 2, stop - start, k_stop)
        if causal:
            hidden = torch.arange(k_stop)[None, :] > torch.arange(start, stop)[:, None]
            s_blk.masked_fill_(hidden, float("-inf"))

    def on_ds(start, stop, k_stop, ds):
        got_bias[:, start:stop, :k_stop] += ds.sum(0).reshape(h, stop - start, k_stop)

    with torch.set_grad_enabled(grad_mode):
        assert _block_grad.Scratch((1,), torch.float32, q.device).eager is not grad_mode
        dq, dk, dv = attention_backward_by_blocks(q, k, v, out.detach(), d_out, scale=scale, causal=causal,
                                                  q_offset=0, rows=rows, add_bias=add_bias, on_ds=on_ds)
    for got, want in ((dq, eq), (dk, ek), (dv, ev), (got_bias, eb)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("spread", [1.0, 60.0])
def test_backward_by_blocks_from_the_log_sum_exp(causal, spread):
    """Given the forward's log-sum-exp, the weights are ``exp2`` of the logits in base 2
    (`block_grad.LOG2E`; ``add_bias`` adds the bias in those units): the same gradients as
    autograd's, for blocks that do not divide N, blocks run in two calls into shared
    accumulators (``blocks``), GQA, transposed layouts, and logits far below their row's maximum
    (``spread``: weights under float32's smallest normal, where ``exp`` takes a slow path). Against
    float64: the log-sum-exp is one rounded float32 per row, which the weights are not normalized
    against again (as in any flash backward), so the tolerance is relative to each gradient's scale."""
    torch.manual_seed(0)
    b, h, h_kv, n, d = 2, 4, 2, 37, 8
    q = torch.randn(b, n, h, d).transpose(1, 2)
    k, v = (torch.randn(b, n, h_kv, d).transpose(1, 2) for _ in range(2))
    bias = torch.randn(h, n, n) * spread
    scale = d ** -0.5
    qr, kr, vr, br = (t.double().requires_grad_() for t in (q, k, v, bias))
    s = qr @ kr.repeat_interleave(2, 1).transpose(-1, -2) * scale + br
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1).detach().float()
    out = torch.softmax(s, -1) @ vr.repeat_interleave(2, 1)
    d_out = torch.randn_like(out)
    eq, ek, ev, eb = torch.autograd.grad(out, (qr, kr, vr, br), d_out)
    out, d_out = out.detach().float(), d_out.float()
    got_bias = torch.zeros(h, n, n)

    def add_bias(start, stop, k_stop, s_blk):  # [B, H_kv, g, r, k_stop], in base 2
        s_blk += _block_grad.LOG2E * bias[:, start:stop, :k_stop].view(h_kv, 2, stop - start, k_stop)
        if causal:
            hidden = torch.arange(k_stop)[None, :] > torch.arange(start, stop)[:, None]
            s_blk.masked_fill_(hidden, float("-inf"))

    def on_ds(start, stop, k_stop, ds):
        got_bias[:, start:stop, :k_stop] += ds.sum(0).reshape(h, stop - start, k_stop)

    dq, dk, dv = (torch.zeros(t.shape) for t in (q, k, v))
    with torch.no_grad():
        for blocks in ([(0, 10), (10, 20)], [(20, 30), (30, n)]):
            attention_backward_by_blocks(q, k, v, out, d_out, scale=scale, causal=causal, q_offset=0,
                                         rows=10, add_bias=add_bias, on_ds=on_ds, dq=dq, dk=dk, dv=dv, lse=lse,
                                         blocks=blocks)
    for got, want in ((dq, eq), (dk, ek), (dv, ev), (got_bias, eb)):
        torch.testing.assert_close(got.double(), want, atol=2e-5 * want.abs().max().item(), rtol=0)
