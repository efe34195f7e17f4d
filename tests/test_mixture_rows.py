"""`BiasSum` rows (a mixture's ALiBi + T5 + FIRE, with a rope term): the distance-only terms as
one table of distances, the others added in place. Rows, `rows_from` under ``torch.func.vjp``
(as sdpa's own backward) and the gradient of every input equal the sum of the members'
reference biases (`materialize` of each), forward and backward, at arange / offset / gapped /
packed positions, on blocks that do not divide the length."""

import pytest
import torch

from posenc_lightning.attention.backends import eager, sdpa
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext
from posenc_lightning.encodings.bias import BiasSum, LinearBias, RelativeBias
from posenc_lightning.encodings.fire import FireBias
from posenc_lightning.encodings.registry import build_encoding
from posenc_lightning.functional.tunables import Tunables

H, D, N = 4, 8, 37
BLOCKS = [(0, 5, 5), (5, 16, 16), (16, 37, 37), (30, 37, 37), (3, 9, 37), (9, 20, 2)]
POSITIONS = {
    "arange": torch.arange(N)[None].expand(2, N),
    "offset": torch.stack([torch.arange(N) + 7, torch.arange(N) + 7]),
    "gaps": torch.cumsum(torch.randint(1, 4, (2, N), generator=torch.Generator().manual_seed(0)), 1),
    "packed": torch.stack([torch.cat([torch.arange(20), torch.arange(17)]), torch.cat([torch.arange(9), torch.arange(28)])]),
}
MEMBERS = {
    "default": ("alibi", "relative_bias", "fire"),
    "rope": ("alibi", "relative_bias", "fire", "rope"),
    "alibi_fire": ("alibi", "fire"),
}


def _mixture(members, pos, seed=0):
    torch.manual_seed(seed)
    enc = build_encoding("mixture", members=members, member_cfgs={"fire": {"init_L": 4.0}})
    enc.bind(n_heads=H, head_dim=D, d_model=H * D)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    q, k = (torch.randn(2, H, N, D, requires_grad=True) for _ in range(2))
    bias = enc.bias(q, k, AttentionContext(pos, pos, True))
    return bias, [q, k, *enc.parameters()]


def _grads_by_rows_from(bias, leaves, block, g):
    """sdpa's own backward: the rows recomputed from detached windows, vjp to them, the window
    gradients accumulated into full-size ones and sent on to the leaves (the graph kept: the
    bias is differentiated once per block here)."""
    s, e, ke = block
    ins = bias.grad_inputs()
    windows = bias.input_windows(s, e, ke)
    views = [t.detach() if w is None else t.detach()[w] for t, w in zip(ins, windows)]
    rows, vjp = torch.func.vjp(lambda *v: bias.rows_from(s, e, ke, v), *views)
    acc = [torch.zeros_like(t) for t in ins]
    for a, w, gi in zip(acc, windows, vjp(g.sum(0, keepdim=True) if rows.shape[0] == 1 else g)):
        (a if w is None else a[w]).add_(gi)
    live = [(t, a) for t, a in zip(ins, acc) if t.requires_grad]
    return rows, torch.autograd.grad([t for t, _ in live], leaves, [a for _, a in live], allow_unused=True,
                                     retain_graph=True)


def _close(a, b):
    if a is None or b is None:
        assert a is None or not a.abs().any() if b is None else b is None or not b.abs().any()
        return
    torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5 * max(1.0, b.abs().max().item()))


@pytest.mark.parametrize("members", list(MEMBERS))
@pytest.mark.parametrize("layout", list(POSITIONS))
def test_rows_and_gradients_equal_the_members_references(members, layout):
    bias, leaves = _mixture(MEMBERS[members], POSITIONS[layout])
    assert isinstance(bias, BiasSum) and any(isinstance(p, FireBias) for p in bias.parts)
    assert bias._table is not None and bias._table.arange == (layout in ("arange", "offset"))
    ref = sum(p.materialize() for p in bias.parts)
    torch.testing.assert_close(bias.materialize(), ref)
    for block in BLOCKS:
        s, e, ke = block
        want = ref[..., s:e, :ke].expand(2, -1, -1, -1)
        g = torch.randn_like(want)
        ref_grads = torch.autograd.grad((want * g).sum(), leaves, allow_unused=True, retain_graph=True)
        with torch.no_grad():
            _close(bias.rows(s, e, ke).expand_as(want), want)
        rows = bias.rows(s, e, ke)  # with autograd (a checkpointed block)
        for a, b in zip(torch.autograd.grad((rows * g).sum(), leaves, allow_unused=True, retain_graph=True),
                        ref_grads):
            _close(a, b)
        rows, grads = _grads_by_rows_from(bias, leaves, block, g)
        _close(rows.expand_as(want), want)
        for a, b in zip(grads, ref_grads):
            _close(a, b)


def test_terms_that_cannot_be_tabled_are_summed_as_given():
    """Distance-only terms at other positions than the first one's, or spread too far, are
    rows of their own; the sum is the same."""
    pos = POSITIONS["arange"]
    table, slopes = torch.randn(H, 9, requires_grad=True), torch.rand(H, requires_grad=True)
    far = torch.arange(N)[None] * 1000
    for bias in (BiasSum([RelativeBias(table, pos, pos), LinearBias(slopes, pos + 3, pos)]),
                 BiasSum([RelativeBias(table, far, far), LinearBias(slopes, far, far)])):
        ref = sum(p.materialize() for p in bias.parts)
        for s, e, ke in BLOCKS:
            torch.testing.assert_close(bias.rows(s, e, ke), ref[..., s:e, :ke])
    assert len(BiasSum([RelativeBias(table, pos, pos), LinearBias(slopes, pos + 3, pos)])._table.terms) == 1
    assert BiasSum([RelativeBias(table, far, far), LinearBias(slopes, far, far)])._table is None


@pytest.mark.parametrize("layout", ["offset", "packed"])
def test_sdpa_blockwise_equals_eager(layout, monkeypatch):
    """End to end through sdpa's blocks (16 rows: 37 = 16 + 16 + 5) and own backward, against eager
    attention on the dense sum, with the packed documents' segment mask."""
    tunables = Tunables(bias_block_bytes=1)
    pos = POSITIONS[layout]
    seg = (pos[:, 1:] <= pos[:, :-1]).long().cumsum(1)
    seg = torch.cat([torch.zeros(2, 1, dtype=torch.long), seg], 1)
    mask, ctx = AttentionMask(True, 0, N, N, seg, seg), AttentionContext(pos, pos, True)
    bias, leaves = _mixture(MEMBERS["rope"], pos, seed=1)
    q, k = leaves[:2]
    v = torch.randn(2, H, N, D, requires_grad=True)
    out = sdpa.attend(q, k, v, bias=bias, mask=mask, scale=D ** -0.5, ctx=ctx, tunables=tunables)
    got = torch.autograd.grad(out.square().sum(), [v, *leaves], allow_unused=True, retain_graph=True)
    dense = bias.materialize()
    from posenc_lightning.encodings.bias import DenseBias

    ref = eager.attend(q, k, v, bias=DenseBias(dense), mask=mask, scale=D ** -0.5, ctx=ctx)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(got, torch.autograd.grad(ref.square().sum(), [v, *leaves], allow_unused=True)):
        _close(a, b)
