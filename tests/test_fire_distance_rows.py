"""FIRE's rows by distance (`by_distance._FireDiagonalRows`, at known ``start + arange`` positions):
long rows past ``L`` with the paper's width, blocks that do not divide the length, keys beyond the
queries (negative distances: a unit switching on both sides of distance 0), against the float64
formula forward and in every parameter; the runs of switching units (`by_distance._merge_spans`);
a mixture's distance-only terms taken into FIRE's rows (`FireTableSum`), end to end through sdpa."""

import copy

import pytest
import torch

from posenc_lightning import build_encoding
from posenc_lightning.attention.backends import eager, sdpa
from posenc_lightning.attention.backends.engine import blocks as _blocks
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext
from posenc_lightning.encodings.bias import DenseBias
from posenc_lightning.encodings.fire import FireBias, native
from posenc_lightning.encodings.fire import by_distance as bdist
from posenc_lightning.encodings.fire.bias import FireTableSum
from posenc_lightning.encodings.fire.layouts import distance_layout
from posenc_lightning.functional.tunables import Tunables


def _fire(width: int = 32, init_l: float = 64.0, seed: int = 0):
    torch.manual_seed(seed)
    enc = build_encoding("fire", init_L=init_l, init_c=0.1, mlp_width=width).bind(n_heads=4)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return enc


@pytest.mark.parametrize("offset", [0, 1000])
def test_long_rows_by_distance_equal_the_formula(offset):
    enc = _fire()
    n = 700
    qp = (torch.arange(n) + offset)[None]
    kp = (torch.arange(n + 5) + offset - 3)[None]  # 3 keys before the queries, 2 after the last one
    bias = enc.bias(None, None, AttentionContext(qp, kp, q_start=offset, k_start=offset - 3))
    assert type(bias) is FireBias and bias.q_start == offset
    exact = copy.deepcopy(enc).double()
    leaves, exact_leaves = list(enc.bias_params()), list(exact.bias_params())
    full, full64 = enc.bias_tensor(qp, kp), exact.bias_tensor(qp, kp)
    for s, e, ke in [(0, 97, 100), (97, 394, 400), (600, 700, 705), (350, 351, 705)]:
        new = bias.rows(s, e, ke)
        torch.testing.assert_close(new, full[..., s:e, :ke], rtol=1e-5, atol=1e-6)
        g = torch.randn_like(full64[..., s:e, :ke])
        got = torch.autograd.grad((new * g.float()).sum(), leaves)
        want = torch.autograd.grad((full64[..., s:e, :ke] * g).sum(), exact_leaves, retain_graph=True)
        for a, b in zip(got, want):
            # float32 sums over up to 300 x 400 elements a head against float64 (1.25e-5 relative seen)
            assert (a.double() - b).abs().max() <= 1e-4 * b.abs().max() + 1e-4, (a, b)


def test_spans_merge_into_disjoint_runs():
    # overlapping spans share a run over their union; a unit with two spans in it is listed once
    runs = bdist._merge_spans([[0, 0, 4], [1, 2, 6], [0, 5, 7], [2, 9, 10]], rows=8, group=1, slack=0)
    assert runs == [([0, 1], 0, 7), ([2], 9, 10)]
    # a disjoint span joins within the slack
    assert bdist._merge_spans([[0, 0, 4], [2, 9, 10]], rows=8, group=1, slack=10**9) == [([0, 2], 0, 10)]
    assert bdist._merge_spans([], rows=8, group=1, slack=0) == []


@pytest.mark.parametrize("members", [("alibi", "relative_bias", "fire"), ("alibi", "fire")])
def test_mixture_table_in_fire_rows_end_to_end(members, monkeypatch):
    """sdpa's blocks of 16 rows (37 = 16 + 16 + 5) and its own backward, with the distance-only
    terms added inside FIRE's rows, against eager attention on the dense sum."""
    tunables = Tunables(bias_block_bytes=1)
    torch.manual_seed(1)
    h, d, n = 4, 8, 37
    enc = build_encoding("mixture", members=members, member_cfgs={"fire": {"init_L": 4.0}})
    enc.bind(n_heads=h, head_dim=d, d_model=h * d)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    pos = (torch.arange(n) + 7)[None].expand(2, n)
    q, k, v = (torch.randn(2, h, n, d, requires_grad=True) for _ in range(3))
    ctx = AttentionContext(pos, pos, True)
    bias = enc.bias(q, k, ctx)
    assert type(bias) is FireTableSum and bias._fire_term() is not None
    leaves = [q, k, v, *enc.parameters()]
    mask = AttentionMask(True, 0, n, n)
    out = sdpa.attend(q, k, v, bias=bias, mask=mask, scale=d ** -0.5, ctx=ctx, tunables=tunables)
    got = torch.autograd.grad(out.square().sum(), leaves, allow_unused=True, retain_graph=True)
    dense = sum(p.materialize() for p in bias.parts)
    ref = eager.attend(q, k, v, bias=DenseBias(dense), mask=mask, scale=d ** -0.5, ctx=ctx)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(got, torch.autograd.grad(ref.square().sum(), leaves, allow_unused=True)):
        if b is None:
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5 * max(1.0, b.abs().max().item()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradient_read_by_distance_equals_its_layout(dtype):
    """`by_distance._Diagonals` (a strided view of the gradient and its two end triangles, laid out
    together in a buffer kept between calls) against the whole gradient laid out by distance: the
    products and columns the backward reads, shapes in turn (the kept buffer reshaped and reused,
    its padding still zero), keys fewer than the rows, one row."""
    torch.manual_seed(0)
    for h, r, k in [(4, 5, 9), (4, 5, 9), (3, 7, 6), (2, 6, 4), (4, 1, 7), (2, 6, 5), (4, 5, 9)]:
        g = torch.randn(h, r, k + 3, dtype=dtype)[..., 1:k + 1]  # not contiguous, as a slice of dS
        dense = distance_layout(g.contiguous())  # [H, R, R + C - 1]
        gd = bdist._Diagonals(g)
        m = torch.randn(2, r, dtype=dtype)
        u = torch.randn(h, r + k - 1, dtype=dtype)
        torch.testing.assert_close(gd.matmul_left(m), m @ dense)
        torch.testing.assert_close(gd.row_dots(u), (dense * u[:, None]).sum((0, 2)))
        for a, z in [(0, r + k - 1), (0, 1), (r - 1, r + 1), (max(k - 1, 0), r + k - 1)]:
            torch.testing.assert_close(gd.columns(a, z), dense[..., a:z])


def test_float64_parameters_by_distance():
    """The rows by distance with float64 parameters (their folded units as ``A x + B`` on the
    formula's float32 ``x``, not the float32 path's ``B + (A p) / n``) against the formula."""
    enc = _fire().double()
    n = 300
    qp = (torch.arange(n) + 40)[None]
    bias = enc.bias(None, None, AttentionContext(qp, qp, q_start=40, k_start=40))
    assert type(bias) is FireBias
    leaves = list(enc.bias_params())
    full = enc.bias_tensor(qp, qp)
    for s, e in [(0, 77), (77, 300)]:
        new = bias.rows(s, e, e)
        assert new.dtype == torch.float32  # the rows, as every bias's, in float32
        torch.testing.assert_close(new, full[..., s:e, :e].float(), rtol=1e-5, atol=1e-6)
        g = torch.randn_like(full[..., s:e, :e])
        got = torch.autograd.grad((new.double() * g).sum(), leaves)
        want = torch.autograd.grad((full[..., s:e, :e] * g).sum(), leaves, retain_graph=True)
        for a, b in zip(got, want):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max() + 1e-4, (a, b)


def _mixture_bias(n: int, start: int, batch: int):
    enc = build_encoding("mixture", members=("alibi", "relative_bias", "fire"), member_cfgs={"fire": {"init_L": 40.0}})
    enc.bind(n_heads=4, head_dim=8, d_model=32)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    pos = (torch.arange(n) + start)[None].expand(batch, n)
    q = torch.zeros(batch, 4, n, 8)
    return enc.bias(q, q, AttentionContext(pos, pos, True, q_start=start, k_start=start))


def _bias_from(kind: str, n: int, start: int, batch: int = 1):
    """FIRE's bias at positions ``start + arange(n)`` (L 40): ``"scaled"`` times a learnable weight,
    ``"mixture"`` a mixture's (`FireTableSum`, rows for a batch of ``batch``)."""
    if kind == "mixture":
        bias = _mixture_bias(n, start, batch)
        assert type(bias) is FireTableSum and bias._fire_term() is not None
        return bias
    pos = (torch.arange(n) + start)[None]
    bias = _fire(init_l=40.0).bias(None, None, AttentionContext(pos, pos, True, q_start=start, k_start=start))
    return bias.scaled(torch.tensor(0.7, requires_grad=True)) if kind == "scaled" else bias


def _route(bias, native: bool):
    """``bias`` (FIRE's, or a sum holding it) with its FIRE rows by the compiled segment pass
    (`encodings.fire.segment_rows`) or by the torch path (`by_distance`)."""
    for part in getattr(bias, "parts", [bias]):
        if isinstance(part, FireBias):
            part.tunables = Tunables(fire_native=native)
    return bias


ROUTES = ["torch", pytest.param("native", marks=pytest.mark.skipif(not native.available(),
                                                                     reason="no C compiler here"))]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", ["fire", "scaled", "mixture"])
def test_rows_and_pullback_equal_autograd(kind, route, monkeypatch):
    """`HandRows.rows_and_pullback` (FIRE's rows and gradients with no autograd graph, the engine's
    backward blocks: `BlockRows.of` with grad mode off) against `rows_from` differentiated
    (grad mode on), rows and every input's gradient: blocks that do not divide the rows, keys
    beyond the rows, positions from 5 (not arange from 0), rows on both sides of L (40). The torch
    path computes the same arithmetic both ways (equal rows); the compiled segment pass (``A x +
    B`` of the segment) equals them to float32 rounding (a mixture's table keeps the torch path)."""
    torch.manual_seed(2)
    n, start = 90, 5
    bias = _route(_bias_from(kind, n, start, batch=2), route == "native")
    exact = route == "torch" or kind == "mixture"
    inputs = bias.grad_inputs()
    need = [t.requires_grad for t in inputs]
    for s, e, ke in [(0, 17, 17), (17, 50, 63), (33, 34, 34), (50, 90, 90)]:
        with torch.enable_grad():  # the autograd route
            ref = _blocks.BlockRows.of(bias, inputs, need, s, e, ke, False)
        with torch.no_grad(), monkeypatch.context() as m:
            m.setattr(_blocks, "block_vjp", None)  # the hook's route only
            got = _blocks.BlockRows.of(bias, inputs, need, s, e, ke, False)
        tol = 0 if exact else 1e-6 * float(ref.rows.abs().max())
        torch.testing.assert_close(got.rows, ref.rows, rtol=0, atol=tol)
        d = torch.randn(2 if kind == "mixture" else 1, 4, e - s, ke)
        acc_ref, acc_got = [torch.zeros_like(t) for t in inputs], [torch.zeros_like(t) for t in inputs]
        ref.backward(d, acc_ref.__getitem__)
        got.backward(d, acc_got.__getitem__)
        for a, b in zip(acc_got, acc_ref):  # the segment pass sums in another order: float32 apart
            torch.testing.assert_close(a, b, rtol=1e-5 if exact else 1e-4, atol=1e-6 if exact else 1e-5)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", ["fire", "float64", "mixture"])
def test_rows_without_grad_equal_the_function(kind, route):
    """With grad mode off (the engine's forward) `fire_rows` computes the rows by distance without
    the autograd Function (`by_distance._forward`, or the compiled segment pass): equal to the
    Function's rows (to float rounding for the segment pass), and to the formula; blocks that do
    not divide the rows, positions from 5, rows on both sides of L (40)."""
    torch.manual_seed(3)
    n, start = 90, 5
    if kind == "mixture":
        bias = _mixture_bias(n, start, batch=1)
        assert type(bias) is FireTableSum and bias._fire_term() is not None
        full = sum(p.materialize() for p in bias.parts)
    else:
        enc = _fire(init_l=40.0)
        enc = enc.double() if kind == "float64" else enc
        pos = (torch.arange(n) + start)[None]
        bias = enc.bias(None, None, AttentionContext(pos, pos, True, q_start=start, k_start=start))
        assert type(bias) is FireBias
        full = enc.bias_tensor(pos, pos).float()
    bias = _route(bias, route == "native")
    exact = route == "torch" or kind == "mixture"
    for s, e, ke in [(0, 17, 17), (17, 50, 63), (33, 34, 34), (50, 90, 90)]:
        with torch.enable_grad():
            ref = bias.rows(s, e, ke)
        assert ref.requires_grad
        with torch.no_grad():
            got = bias.rows(s, e, ke)
        tol = 0 if exact else (1e-14 if kind == "float64" else 1e-6) * float(ref.abs().max())
        torch.testing.assert_close(got, ref, rtol=0, atol=tol)
        torch.testing.assert_close(got, full[..., s:e, :ke].expand_as(got), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("last", [39, 40, 54])  # L = 40: the block's last query below it, at it (a tie), past it
def test_block_below_threshold_is_one_row(last):
    """A block whose queries are all below ``L`` computes one row of the distance layout and copies
    it (`by_distance._below`), its gradient the layout's column sums: rows and every parameter's
    gradient against the float64 formula, through the engine's hook and through autograd; a block
    whose last query is at ``L`` (a tie: ``max``'s gradient split) or past it takes the rows whole."""
    enc = _fire(init_l=40.0)
    with torch.no_grad():
        enc.L_multiplier.fill_(1.0)
    n, start = 60, 10
    pos = (torch.arange(n) + start)[None]
    bias = enc.bias(None, None, AttentionContext(pos, pos, True, q_start=start, k_start=start))
    assert type(bias) is FireBias
    exact = copy.deepcopy(enc).double()
    full64 = exact.bias_tensor(pos, pos)
    e = last - start + 1
    s, ke = e - 17, e + 4  # keys past the last query: negative distances too
    assert bdist._below(pos[:, s:e], bias.l_mult * bias.init_L) == (last < 40)
    ref = full64[..., s:e, :ke]
    g = torch.randn_like(ref)
    want = torch.autograd.grad((ref * g).sum(), list(exact.bias_params()))
    inputs = bias.grad_inputs()
    with torch.no_grad():
        block = _blocks.BlockRows.of(bias, inputs, [True] * len(inputs), s, e, ke, False)
    torch.testing.assert_close(block.rows, ref.float(), rtol=1e-5, atol=1e-6)
    acc = [torch.zeros_like(t) for t in inputs]
    block.backward(g.float(), acc.__getitem__)
    new = bias.rows(s, e, ke)
    got = torch.autograd.grad((new * g.float()).sum(), list(enc.bias_params()))
    for grads in (acc, got):
        for a, b in zip(grads, want):
            assert (a.double() - b).abs().max() <= 1e-5 * b.abs().max() + 1e-4, (a, b)


def test_selection_kept_between_forward_and_backward():
    """The engine's forward and backward blocks of the same rows share their selection (kept on
    the bias, `FireBias._memo`); an in-place change of a parameter in between is seen (its version)."""
    enc = _fire(init_l=40.0)
    n, start = 90, 5
    pos = (torch.arange(n) + start)[None]
    bias = _route(enc.bias(None, None, AttentionContext(pos, pos, True, q_start=start, k_start=start)), False)
    with torch.no_grad():
        first = bias.rows(20, 70, 70)
        assert len(bias._selections) == 1
        again = bias.rows(20, 70, 70)
        torch.testing.assert_close(again, first, rtol=0, atol=0)
        assert len(bias._selections) == 1
        enc.mlp[0].bias.add_(0.5)  # another selection
        changed = bias.rows(20, 70, 70)
        assert len(bias._selections) == 2
    torch.testing.assert_close(changed, enc.bias_tensor(pos, pos)[..., 20:70, :70], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["fire", "mixture"])
def test_causal_rows_exact_where_the_mask_shows_keys(kind, monkeypatch):
    """`HandRows.causal_rows` and `HandRows.rows_and_pullback` with ``diagonal`` (the engine's causal
    blocks, which mask the keys past it): the switching units' runs stop at the diagonal, so the rows equal
    `rows` wherever the mask shows a key and are finite where it hides one (and differ there: the
    skipped units); the pullback of a gradient that is 0 on the hidden keys equals the full
    rows'. Blocks that do not divide the rows, keys up to the last query and beyond it, rows on both
    sides of L (40), positions from 5, a mixture's table (not symmetric in the distance)."""
    torch.manual_seed(3)
    n, start = 90, 5
    bias = _route(_bias_from(kind, n, start), False)  # the torch path's runs (the segment pass has none)
    inputs = bias.grad_inputs()
    need = [t.requires_grad for t in inputs]
    differ = False
    for s, e, ke in [(0, 17, 17), (17, 50, 50), (33, 34, 34), (50, 90, 90), (20, 61, 80)]:
        shown = torch.arange(ke)[None, :] <= s + torch.arange(e - s)[:, None]  # diagonal s: key j <= s + r
        with torch.no_grad():
            full, part = bias.rows(s, e, ke), bias.hand_rows().causal_rows(s, e, ke, s)
        assert part.shape == full.shape and torch.isfinite(part).all()
        torch.testing.assert_close(part[..., shown], full[..., shown], rtol=0, atol=1e-6)
        differ |= bool((part[..., ~shown] != full[..., ~shown]).any())
        with torch.no_grad(), monkeypatch.context() as m:
            m.setattr(_blocks, "block_vjp", None)  # the hook's route only
            ref = _blocks.BlockRows.of(bias, inputs, need, s, e, ke, False)
            ref_rows = ref.rows.clone()  # hand rows are valid until the next call (`HandRows`)
            got = _blocks.BlockRows.of(bias, inputs, need, s, e, ke, False, diagonal=s)
        torch.testing.assert_close(got.rows[..., shown], ref_rows[..., shown], rtol=0, atol=1e-6)
        d = torch.randn(1, 4, e - s, ke) * shown
        acc_ref, acc_got = [torch.zeros_like(t) for t in inputs], [torch.zeros_like(t) for t in inputs]
        ref.backward(d, acc_ref.__getitem__)
        got.backward(d, acc_got.__getitem__)
        for a, b in zip(acc_got, acc_ref):  # sums over other run steps: float32 rounding apart
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert differ  # some unit switching about distance 0 was skipped on the hidden keys


@pytest.mark.parametrize("route", ROUTES)
def test_backward_takes_the_forward_blocks_and_their_selection(route, monkeypatch):
    """sdpa's own backward with FIRE (`Bias.forward_blocks`) takes the forward's blocks of rows at
    any thread count, so each backward block of the torch path finds its unit selection kept by
    the forward's block of the same rows (`FireBias._memo`): no selection is computed again (the
    segment pass selects none). The output and every gradient (q, k, v, each FIRE parameter) equal
    eager attention on the float64 formula, by either route; blocks that do not divide the
    queries, positions from 5, rows on both sides of L (40)."""
    torch.manual_seed(4)
    n, h, d, start = 150, 4, 8, 5
    enc = _fire(init_l=40.0)
    pos = (torch.arange(n) + start)[None]
    q, k, v = (torch.randn(1, h, n, d, requires_grad=True) for _ in range(3))
    tunables = Tunables(bias_block_bytes=60 * 4 * h * n)  # blocks of 60 rows: 0-60, 60-120, 120-150
    ctx = AttentionContext(pos, pos, True, q_start=start, k_start=start)
    calls = []
    select = bdist._diagonal_select
    monkeypatch.setattr(bdist, "_diagonal_select", lambda *a: calls.append(a) or select(*a))
    params = [p for p in enc.parameters() if p.requires_grad]
    bias = _route(enc.bias(q, k, ctx), route == "native")
    out = sdpa.attend(q, k, v, bias=bias, mask=AttentionMask(True, 0, n, n), scale=d ** -0.5, ctx=ctx,
                      tunables=tunables)
    forward = len(calls)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), [q, k, v, *params])
    # the backward computed no selection of its own
    assert (forward, len(calls)) == ((3, 3) if route == "torch" else (0, 0))

    exact = copy.deepcopy(enc).double()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    logits = q64 @ k64.mT * d ** -0.5 + exact.bias_tensor(pos, pos).double()
    logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    ref_out = logits.softmax(-1) @ v64
    ref = torch.autograd.grad((ref_out * g.double()).sum(), [q64, k64, v64, *exact.parameters()])
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, ref):
        assert (a.double() - b).abs().max() <= 1e-4 * b.abs().max() + 1e-5, (a, b)
