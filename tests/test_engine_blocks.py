"""The engine's backward by rows with whole-budget blocks (`blocks.backward_rows` with
``released``: more than one thread, the block's bias rows freed once added to its logits,
`BlockRows.release`): FIRE and a mixture (ALiBi + T5 + FIRE) through sdpa's rows form, forward and
every gradient against eager attention on the dense bias, at a length that no block size divides,
at arange and gapped positions, with grouped kv heads."""

import pytest
import torch

from posenc_lightning.attention.backends import eager, sdpa
from posenc_lightning.attention.backends.engine import blocks as _blocks
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext
from posenc_lightning.encodings.bias import DenseBias
from posenc_lightning.encodings.registry import build_encoding
from posenc_lightning.functional.tunables import Tunables

H, H_KV, D, N, B = 4, 2, 8, 37, 2
#: one row of logits, ``[B, H, 1, N]`` float32: a budget of 20 rows (37 = 20 + 17 whole, 16 + 16 + 5 halved)
ROW = 4 * B * H * N


def _positions(layout: str) -> torch.Tensor:
    if layout == "arange":
        return torch.arange(N)[None].expand(B, N)
    return torch.cumsum(torch.randint(1, 4, (B, N), generator=torch.Generator().manual_seed(0)), 1)


def _encoding(name: str):
    torch.manual_seed(0)
    if name == "mixture":
        enc = build_encoding("mixture", members=("alibi", "relative_bias", "fire"), member_cfgs={"fire": {"init_L": 4.0}})
    else:
        enc = build_encoding("fire", init_L=4.0)
    enc.bind(n_heads=H, head_dim=D, d_model=H * D)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return enc


def test_whole_budget_only_with_released_rows_and_threads():
    t = Tunables(bias_block_bytes=20 * ROW)
    assert _blocks.backward_rows(B, H, N, N, threads=2, tunables=t) == 16  # half the budget (at least min_rows)
    assert _blocks.backward_rows(B, H, N, N, released=True, threads=2, tunables=t) == 20
    assert _blocks.backward_rows(B, H, N, N, 0.75, released=True, threads=2, tunables=t) == 12  # a share: half
    assert _blocks.backward_rows(B, H, N, N, released=True, threads=1, tunables=t) == 16
    assert _blocks.backward_rows(B, H, N, N, released=True, tunables=t) == 16  # one thread unless told
    # a bias that asks for the forward's blocks (`Bias.forward_blocks`) gets the whole budget at one
    # thread too, only where its rows are released and take a full share
    assert _blocks.backward_rows(B, H, N, N, released=True, threads=1, forward_blocks=True, tunables=t) == 20
    assert _blocks.backward_rows(B, H, N, N, threads=1, forward_blocks=True, tunables=t) == 16
    assert _blocks.backward_rows(B, H, N, N, 0.75, released=True, forward_blocks=True, tunables=t) == 12


def test_only_fire_asks_for_the_forward_blocks():
    """FIRE's rows keep their selection from a forward block for the backward block of the same
    rows (`FireBias._memo`); other kinds keep the default (their blocks, and numbers, unchanged)."""
    from posenc_lightning.encodings.base import Bias
    from posenc_lightning.encodings.bias import LinearBias
    from posenc_lightning.encodings.fire import FireBias

    assert FireBias.forward_blocks is True
    assert Bias.forward_blocks.fget(None) is False  # the base's default
    assert "forward_blocks" not in vars(LinearBias)


@pytest.mark.parametrize("layout", ["arange", "gaps"])
@pytest.mark.parametrize("name", ["fire", "mixture"])
def test_whole_budget_blocks_equal_eager(name, layout, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    released = []
    release = _blocks.BlockRows.release
    monkeypatch.setattr(_blocks.BlockRows, "release", lambda self: released.append(self.shape[-2]) or release(self))
    enc = _encoding(name)
    pos = _positions(layout)
    ctx, mask = AttentionContext(pos, pos, True), AttentionMask(True, 0, N, N)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, N, D, generator=g, requires_grad=True)
    k, v = (torch.randn(B, H_KV, N, D, generator=g, requires_grad=True) for _ in range(2))
    params = list(enc.parameters())
    bias = enc.bias(q, k, ctx)
    out = sdpa.attend(q, k, v, bias=bias, mask=mask, scale=D ** -0.5, ctx=ctx,
                      tunables=Tunables(bias_block_bytes=20 * ROW))
    w = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad((out * w).sum(), [q, k, v, *params], allow_unused=True, retain_graph=True)
    assert released == [20, 17]  # the engine's own backward ran, in whole-budget blocks
    ref_out = eager.attend(q, k, v, bias=DenseBias(bias.materialize()), mask=mask, scale=D ** -0.5, ctx=ctx)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    ref = torch.autograd.grad((ref_out * w).sum(), [q, k, v, *params], allow_unused=True)
    for a, b in zip(got, ref):
        if b is None:
            assert a is None or not a.abs().max()
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("first, k0", [(5, 0), (5, 3), (-2, 0), (9, 0), (2, 6), (11, 4)])
def test_causal_triangle_of_a_block(first, k0):
    """`blocks.hide_after_diagonal`: ``-inf`` added exactly where key ``k0 + j`` is past row ``i``'s
    last key ``first + i`` (keys before the first row's last key untouched, a block with nothing
    hidden unchanged); the triangle built once per shape in ``hides``, and the same on reuse."""
    r, width = 4, 10
    t = torch.randn(2, r, width)
    hidden = (k0 + torch.arange(width))[None, :] > first + torch.arange(r)[:, None]
    hides: dict = {}
    for _ in range(2):
        got = _blocks.hide_after_diagonal(t.clone(), first, k0, hides)
        torch.testing.assert_close(got, t.masked_fill(hidden, float("-inf")), rtol=0, atol=0)
    assert len(hides) == (1 if hidden.any() else 0)
