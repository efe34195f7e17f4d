"""FIRE's MLP is piecewise linear in its scalar input (Li et al., 2024, eq. 3: ``f_theta`` a ReLU MLP):
over a block's range of ``x`` a unit is skipped (off throughout), folded into one affine term (on
throughout) or evaluated per element (it straddles its kink). The piecewise evaluation
(`functional.fire.fire_mlp_blocks`, and FIRE's fast rows `fire_rows`, by key and by distance,
which select the units per group of keys) equals the dense MLP in float64, forward and in every
gradient: ``x``, ``w1``, ``b1``, ``w2``, ``b2``, ``c``, a learnable threshold ``L``, and q, k, v through
attention; random weights, blocks where every unit straddles, where none does, and ranges whose
ends or interior hit a unit's kink exactly (``relu'(0) = 0`` as torch)."""

import copy

import pytest
import torch

from posenc_lightning import inject
from posenc_lightning.encodings.base import AttentionContext, DenseBias
from posenc_lightning.encodings.fire import FireBias
from posenc_lightning.encodings.fire.rows import fire_rows
from posenc_lightning.functional.fire import (
    fire_mlp_blocks,
    fire_mlp_fold,
    fire_mlp_reference,
    fire_unit_states,
)
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.tunables import Tunables
from tests.helpers import Attn

F64 = torch.float64
W, H = 32, 4  # the paper's width (32 hidden units); heads


def _weights(regime: str, seed: int, kinks: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``[w1, b1, w2, b2]`` (float64 leaves): ``random``; ``inside``: every kink ``-b1/w1`` in
    ``(0.05, 0.95)``; ``outside``: every kink away from ``[0, 1]`` (past 3 or below -1); ``kinks``:
    random, with unit ``u``'s kink exactly at ``kinks[u]`` (``b1 = -(w1 x0)``: ``w1 x0 + b1 = 0`` in
    floating point) and a unit with ``w1 = 0``, ``b1 = 0`` (at its kink everywhere)."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(W, generator=g, dtype=F64)
    w1 = w1 + w1.sign() * 0.1  # no w1 near 0 (a kink far away) unless asked
    b1 = torch.randn(W, generator=g, dtype=F64)
    if regime == "inside":
        b1 = -w1 * (0.05 + 0.9 * torch.rand(W, generator=g, dtype=F64))
    elif regime == "outside":
        far = torch.where(torch.rand(W, generator=g, dtype=F64) < 0.5, 3 + torch.rand(W, generator=g, dtype=F64),
                          -1 - torch.rand(W, generator=g, dtype=F64))
        b1 = -w1 * far
    elif regime == "kinks":
        b1[:kinks.numel()] = -(w1[:kinks.numel()] * kinks)
        w1[-1], b1[-1] = 0.0, 0.0
    w2 = torch.randn(H, W, generator=g, dtype=F64) / W ** 0.5
    b2 = torch.randn(H, generator=g, dtype=F64)
    return [t.requires_grad_() for t in (w1, b1, w2, b2)]


def _assert_grads(got: tuple, want: tuple, rtol: float = 1e-9) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max() <= rtol * (1 + b.abs().max()), (a, b)


# ------------------------------------------------------------------------------- the formula
@pytest.mark.parametrize("block", [1, 7, 64, 1000])  # 200 columns: ragged blocks; one block for all
@pytest.mark.parametrize("regime", ["random", "inside", "outside", "kinks"])
def test_blocks_equal_the_dense_mlp(regime, block):
    g = torch.Generator().manual_seed(1)
    x = torch.rand(3, 200, generator=g, dtype=F64) * 1.2 - 0.1
    x[:, :50] = torch.rand(50, generator=g, dtype=F64)  # the first columns shared by the batch's rows
    kinks = torch.cat((x[0, 3:4], x[1, 60:61], x[:, :64].amax()[None], x[:, 64:128].amin()[None]))  # interior, ends
    w1, b1, w2, b2 = weights = _weights(regime, seed=2, kinks=kinks)
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = fire_mlp_blocks(xs, w1, b1, w2, b2, block)
    want = fire_mlp_reference(xr, w1, b1, w2, b2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    d = torch.randn(want.shape, generator=g, dtype=F64)
    _assert_grads(torch.autograd.grad((got * d).sum(), [xs, *weights]),
                  torch.autograd.grad((want * d).sum(), [xr, *weights]))
    # the regimes are what they claim over the whole range
    on, straddling = fire_unit_states(x.min(), x.max(), w1.detach(), b1.detach())
    if regime == "inside":
        assert straddling.all()
    if regime == "outside":
        assert not straddling.any() and on.any() and not on.all()
    if regime == "kinks":  # a block's end at a kink: pre-activation exactly 0 there
        assert (w1[2] * kinks[2] + b1[2]).item() == 0 and (w1[3] * kinks[3] + b1[3]).item() == 0


def test_states_and_fold_are_the_mlp_on_a_range():
    """On a range, the on units' ``a x + b`` (`fire_mlp_fold`) plus the straddling units equal the
    MLP; off and on are decided at the ends (``u <= 0`` at both: off, even touching 0)."""
    w1 = torch.tensor([1.0, -1.0, 2.0, 0.0, 0.0, 1.0], dtype=F64)
    b1 = torch.tensor([-0.5, 0.25, 1.0, 0.3, 0.0, -0.25], dtype=F64)  # kinks 0.5, 0.25, -0.5, none, everywhere, 0.25
    on, straddling = fire_unit_states(torch.tensor(0.25, dtype=F64), torch.tensor(0.5, dtype=F64), w1, b1)
    # unit 0: u = -0.25 .. 0 -> off (touches its kink at the end); unit 1: 0 .. -0.25 -> off;
    # unit 2: on; unit 3: constant 0.3 -> on; unit 4: constant 0 -> off; unit 5: 0 .. 0.25 -> straddles
    assert on.tolist() == [False, False, True, True, False, False]
    assert straddling.tolist() == [False, False, False, False, False, True]
    w2 = torch.randn(3, 6, dtype=F64)
    ab = fire_mlp_fold(on.to(F64), w1, b1, w2)
    x = torch.linspace(0.25, 0.5, 11, dtype=F64)
    folded = ab[:3, None] * x + ab[3:, None]
    torch.testing.assert_close(folded, w2[:, on] @ torch.relu(w1[on, None] * x + b1[on, None]), rtol=1e-14, atol=1e-14)
    with pytest.raises(ValueError, match="block"):
        fire_mlp_blocks(x[None], w1, b1, w2, torch.zeros(3, dtype=F64), 0)


# ------------------------------------------------------------------------------- the fast rows
POSITIONS = {
    # per-batch, not arange: strided, packed (a document restarting at 0), keys past the queries
    "packed": (torch.stack([torch.arange(120) * 2 + 5, torch.cat([torch.arange(47), torch.arange(73)])]),
               None),
    # start + arange, shared by the batch (rows by distance), 7 cached keys before the first query
    "offset": (torch.arange(120)[None] + 90, 90 - 7),
}


def _x(q_pos: torch.Tensor, k_pos: torch.Tensor, c: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    """FIRE's ``psi(i - j) / (psi(max(L, i)) + eps)`` straight from eq. 3 in float64 throughout
    (`fire_normalized_distance` takes positions and ``L`` in float32, so its ``L`` gradient would
    pass through float32); integer positions and ``L = 100.5`` are exact in both."""
    qp, kp = q_pos.to(F64), k_pos.to(F64)
    psi = lambda z: torch.log1p((c * z).abs())
    return psi(qp[:, :, None] - kp[:, None, :]) / (psi(torch.maximum(qp, thr.abs())[:, :, None]) + 1e-6)


def _keys(q_pos: torch.Tensor, start: int | None) -> torch.Tensor:
    if start is None:
        return torch.cat((q_pos, q_pos[:, :9] + 300), 1)  # keys beyond the queries: negative distances
    return torch.arange(start, int(q_pos[0, -1]) + 4)[None]  # and 3 past the last query


@pytest.mark.parametrize("group", [1, 5, 32, 10**4])  # keys per unit selection; 10**4: one group per block
@pytest.mark.parametrize("regime", ["random", "inside", "outside", "kinks"])
@pytest.mark.parametrize("layout", list(POSITIONS))
def test_fast_rows_equal_the_dense_formula(layout, regime, group):
    q_pos, start = POSITIONS[layout]
    k_pos = _keys(q_pos, start)
    c = torch.tensor([0.7], dtype=F64, requires_grad=True)
    thr = torch.tensor([100.5], dtype=F64, requires_grad=True)  # L inside the queries: rows on both sides
    with torch.no_grad():
        x = _x(q_pos, k_pos, c, thr)
    kinks = torch.cat((x[0, 40, 10:11], x[-1, 70, 33:34], x[0, 5:20].amax()[None], torch.zeros(1, dtype=F64)))
    w1, b1, w2, b2 = weights = _weights(regime, seed=3, kinks=kinks)
    leaves = [c, thr, *weights]
    shift = None if start is None else int(q_pos[0, 0]) - start
    want = fire_mlp_reference(_x(q_pos, k_pos, c, thr).flatten(1), w1, b1, w2, b2).unflatten(-1, x.shape[1:])
    tunables = Tunables(fire_column_group=group, fire_span_slack=0 if group == 5 else 32768)
    got = fire_rows(q_pos, k_pos, c, thr, w1, b1, w2, b2, 1e-6, shift, tunables=tunables)
    assert got.dtype == F64
    torch.testing.assert_close(got.expand_as(want), want, rtol=1e-10, atol=1e-10)
    with torch.no_grad():  # the forward the engine runs (by distance: no autograd Function)
        torch.testing.assert_close(fire_rows(q_pos, k_pos, c, thr, w1, b1, w2, b2, 1e-6, shift, tunables=tunables)
                                   .expand_as(want), want, rtol=1e-10, atol=1e-10)
    d = torch.randn(want.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    _assert_grads(torch.autograd.grad((got * d).sum(), leaves), torch.autograd.grad((want * d).sum(), leaves))
    if regime == "inside" and group == 10**4 and layout == "packed":  # one group: every unit straddles
        _, straddling = fire_unit_states(x.min(), x[x <= 1].max(), w1.detach(), b1.detach())
        assert straddling.all()


# ------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("regime", ["random", "inside", "outside"])
@pytest.mark.parametrize("layout", ["packed", "offset"])
def test_qkv_gradients_through_attention_equal_the_dense_bias(layout, regime, monkeypatch):
    """sdpa's blocks of 16 rows (its own backward, FIRE's rows and pullback by hand, groups of 5 keys)
    against eager attention on the dense formula, in float64: the output and the gradients of q, k,
    v and every FIRE parameter (``L``'s multiplier included)."""
    n, b, h, d = 70, 2, H, 8
    monkeypatch.setattr(Attn, "posenc_tunables", Tunables(bias_block_bytes=1, fire_column_group=5))
    attn = Attn(n_heads=h, head_dim=d)
    enc = inject(attn, "fire", backend="sdpa", init_L=20.0, init_c=0.3, mlp_width=W)
    enc.double()
    with torch.no_grad():
        for p, v in zip(enc.mlp.parameters(), _weights(regime, seed=5)):
            p.copy_(v.view_as(p))
        enc.L_multiplier.fill_(1.1)  # L = 22: rows on both sides
    if layout == "packed":
        pos = torch.cat([torch.arange(29) + 3, torch.arange(41)])[None].expand(b, -1)
        kw = {"positions": pos, "causal": True, "segment_ids": torch.cat([torch.zeros(29), torch.ones(41)]).long()
              [None].expand(b, -1)}
    else:
        kw = {"positions": (torch.arange(n) + 17)[None].expand(b, -1), "causal": True}
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=F64, requires_grad=True) for _ in range(3))
    leaves = [q, k, v] + [p for p in enc.parameters() if p.requires_grad]
    seen = []
    fast = enc.bias
    monkeypatch.setattr(enc, "bias", lambda *a: seen.append(fast(*a)) or seen[-1])
    out = attn(q, k, v, **kw)
    assert isinstance(seen[-1], FireBias) and seen[-1].tunables.fire_column_group == 5
    dout = torch.randn(out.shape, generator=g, dtype=F64)
    grads = torch.autograd.grad((out * dout).sum(), leaves)

    exact = copy.deepcopy(enc)
    monkeypatch.setattr(enc, "bias", lambda q_, k_, ctx: DenseBias(exact.bias_tensor(ctx.q_pos, ctx.k_pos).double()))
    attn.posenc_backend = "eager"
    want = attn(q, k, v, **kw)
    want_grads = torch.autograd.grad((want * dout).sum(), [q, k, v, *exact.parameters()])
    # the rows are float32 (`FireBias.rows_from`), as the dense formula's `bias_tensor`
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for a, w in zip(grads, want_grads, strict=True):
        assert (a - w).abs().max() <= 1e-5 * (1 + w.abs().max()), (a, w)


def test_the_context_gives_fire_its_tunables():
    pos = (torch.arange(30) + 4)[None]
    enc = inject(Attn(n_heads=H, head_dim=8), "fire", init_L=8.0)
    t = Tunables(fire_column_group=3)
    bias = enc.bias(None, None, AttentionContext(pos, pos, mode=Mode.now("cpu", t)))
    assert isinstance(bias, FireBias) and bias.tunables is t and bias.scaled(torch.tensor(0.5)).tunables is t
