"""FIRE's compiled segment pass (`encodings.fire.native`, `segment_rows`): the MLP as ``A x + B`` per
segment of its sorted breakpoints equals the MLP; a block's rows and every gradient (c, L, w1, b1,
w2, b2) equal the float64 formula differentiated by autograd, for blocks below L, across it and past
it, with keys beyond the queries and a causal ``last``; where the library cannot be built (no
compiler, ``POSENC_NATIVE=0``) FIRE keeps the torch path, with the same rows."""

from __future__ import annotations

import logging

import pytest
import torch

from posenc_lightning import build_encoding
from posenc_lightning.encodings.base import AttentionContext
from posenc_lightning.encodings.fire import native, segment_rows
from posenc_lightning.functional.fire import fire_mlp_reference

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler here: FIRE keeps its torch path")


def _params(width: int = 32, heads: int = 4, seed: int = 0, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(width, generator=g, dtype=dtype)
    w1[3] = 0.0  # a constant unit: no breakpoint
    b1 = torch.randn(width, generator=g, dtype=dtype)
    w2 = torch.randn(heads, width, generator=g, dtype=dtype)
    b2 = torch.randn(heads, generator=g, dtype=dtype)
    return w1, b1, w2, b2


def test_segments_are_the_mlp():
    w1, b1, w2, b2 = _params()
    seg = native.Segments.of(w1, b1, w2, b2)
    assert seg.tau.numel() == 31 and bool((seg.tau[1:] >= seg.tau[:-1]).all())
    x = torch.cat((torch.linspace(-40, 40, 5001, dtype=torch.float64), seg.tau + 1e-9, seg.tau - 1e-9))
    s = torch.searchsorted(seg.tau, x)  # the number of breakpoints below x
    got = seg.a[:, s] * x + seg.b[:, s]
    torch.testing.assert_close(got, fire_mlp_reference(x[None], w1, b1, w2, b2)[0], rtol=1e-12, atol=1e-12)


def _reference(c, thr, w1, b1, w2, b2, qp, kp, eps):
    """The block's rows by the formula in float64: ``f(psi(i - j) / (psi(max(L, i)) + eps))``."""
    i, j = qp.double(), kp.double()
    psi = torch.log1p((c * (i[:, :, None] - j[:, None, :])).abs())
    x = psi / (torch.log1p((c * torch.maximum(i, thr.abs())[:, :, None]).abs()) + eps)
    return fire_mlp_reference(x.flatten(1), w1, b1, w2, b2).unflatten(-1, x.shape[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("start,rows,keys,causal", [(0, 37, 37, True), (30, 29, 79, False), (100, 64, 164, True),
                                                    (3, 5, 200, False), (700, 23, 723, True)])
def test_rows_and_gradients_equal_the_float64_formula(dtype, start, rows, keys, causal):
    """L = 40: the first block below it, the others across or past it; keys past the last query
    (negative distances) where not causal; with ``causal`` the gradient is 0 past each row's
    diagonal and the pullback reads nothing there (``last``)."""
    w1, b1, w2, b2 = (t.requires_grad_() for t in _params(heads=4, seed=start))
    c = torch.tensor([0.1], dtype=torch.float64, requires_grad=True)
    thr = torch.tensor([40.0], dtype=torch.float64, requires_grad=True)
    eps = 1e-6
    qp, kp = torch.arange(start, start + rows)[None], torch.arange(keys)[None]
    ref = _reference(c, thr, w1, b1, w2, b2, qp, kp, eps)
    last = rows - 1 + start if causal else None  # the distance layout's column R - 1 - r + j, j <= start + r
    leaves = [c, thr, w1, b1, w2, b2]
    low = [t.detach().to(dtype) for t in leaves]
    got = segment_rows.rows_and_pullback(*low[:2], *low[2:], None, qp, kp, eps, start, True, last)
    assert got is not None
    out, pullback = got
    shown = torch.ones(rows, keys, dtype=torch.bool)
    if causal:
        shown = torch.arange(keys)[None, :] <= start + torch.arange(rows)[:, None]
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(out.double()[..., shown], ref[..., shown], rtol=tol, atol=tol * float(ref.abs().max()))
    g = torch.randn(1, 4, rows, keys, dtype=torch.float64) * shown
    want = torch.autograd.grad((ref * g).sum(), leaves)
    grads = pullback(g.to(dtype))
    assert grads[-1] is None  # no table
    for name, a, b in zip(["c", "L", "w1", "b1", "w2", "b2"], grads, want):
        err = float((a.double().reshape(b.shape) - b).abs().max())
        assert err <= (1e-10 if dtype == torch.float64 else 1e-4) * (float(b.abs().max()) + 1), (name, err)


def test_fire_takes_the_compiled_pass_and_matches_the_torch_path():
    """Through `FireBias` at ``start + arange`` positions: the segment pass by default, the torch
    path with ``fire_native`` off; the same rows either way (float32 rounding)."""
    from posenc_lightning.functional.tunables import Tunables

    enc = build_encoding("fire", init_L=40.0).bind(n_heads=4)
    pos = (torch.arange(90) + 5)[None]
    bias = enc.bias(None, None, AttentionContext(pos, pos, True, q_start=5, k_start=5))
    calls = []
    rows = native.rows
    native_rows = lambda *a: calls.append(1) or rows(*a)
    with torch.no_grad(), pytest.MonkeyPatch.context() as m:
        m.setattr(native, "rows", native_rows)
        fast = bias.rows(20, 70, 70).clone()
        assert calls
        bias.tunables = Tunables(fire_native=False)
        calls.clear()
        slow = bias.rows(20, 70, 70)
        assert not calls
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-6 * float(slow.abs().max()))


def test_no_library_keeps_the_torch_path(tmp_path, monkeypatch, caplog):
    """``POSENC_NATIVE=0``, or a compiler that fails: `available` is False (the failure logged once)
    and FIRE's rows come from the torch path, the same values."""
    enc = build_encoding("fire", init_L=40.0).bind(n_heads=4)
    pos = (torch.arange(60) + 5)[None]
    with torch.no_grad():
        want = enc.bias(None, None, AttentionContext(pos, pos, True, q_start=5, k_start=5)).rows(10, 60, 60).clone()
    try:
        native._library.cache_clear()
        monkeypatch.setenv("POSENC_NATIVE", "0")
        assert not native.available()
        native._library.cache_clear()
        monkeypatch.delenv("POSENC_NATIVE")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there yet
        monkeypatch.setenv("CC", "false")  # a compiler that fails
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            assert not native.available()
        assert "torch path" in caplog.text
        assert not list(tmp_path.rglob("*.so"))
        with torch.no_grad():
            got = enc.bias(None, None, AttentionContext(pos, pos, True, q_start=5, k_start=5)).rows(10, 60, 60)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * float(want.abs().max()))
    finally:
        native._library.cache_clear()
    monkeypatch.undo()
    assert native.available()
