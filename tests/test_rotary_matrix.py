"""liere and comrope: the RoPE equation R(x)^T R(y) = R(y - x), orthogonality, gradients."""

from __future__ import annotations

import pytest
import torch

from posenc_lightning.encodings import build_encoding
from posenc_lightning.inject import inject
from tests.helpers import Attn, qkv

D = 16
COMMUTING = [("comrope", {"variant": "ap", "n_axes": 2, "block_size": 4}),
             ("comrope", {"variant": "ld", "n_axes": 2, "block_size": 4}),
             ("comrope", {"variant": "ap", "n_axes": 3, "block_size": 4}),
             ("comrope", {"variant": "ld", "n_axes": 1, "block_size": 8}),
             ("liere", {"n_axes": 1})]  # one generator always commutes with itself


def _points(n_axes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-30, 30, (1, 6, n_axes), generator=g)
    y = torch.randint(-30, 30, (1, 6, n_axes), generator=g)
    return x, y


def _rel_error(enc, x, y) -> float:
    r = enc.rotation_matrix
    lhs = r(x).transpose(-1, -2) @ r(y)
    return (lhs - r(y - x)).abs().max().item()


def _perturb(enc) -> None:
    """Move every parameter away from its initial value (the property must hold for any value)."""
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.3 * torch.randn_like(p))


@pytest.mark.parametrize("name,cfg", COMMUTING)
def test_relative_property_holds(name, cfg):
    enc = build_encoding(name, **cfg).bind(n_heads=2, head_dim=D)
    _perturb(enc)
    for seed in range(3):
        x, y = _points(enc.n_axes, seed)
        assert _rel_error(enc, x, y) < 1e-4
    # R is orthogonal
    r = enc.rotation_matrix(x)
    torch.testing.assert_close(r.transpose(-1, -2) @ r, torch.eye(D).expand_as(r), rtol=0, atol=1e-4)


@pytest.mark.parametrize("block_size", [None, 8])
def test_relative_property_fails_for_liere_with_two_axes(block_size):
    """LieRE's generators are free: for 2-D positions they do not commute, and
    R(x)^T R(y) != R(y - x); the commutator is what is missing."""
    enc = build_encoding("liere", n_axes=2, block_size=block_size).bind(n_heads=2, head_dim=D)
    gens = enc.generators()
    a, b = gens[0], gens[1]
    commutator = a @ b - b @ a
    assert commutator.abs().max() > 1e-3
    x, y = _points(2, 0)
    assert _rel_error(enc, x, y) > 1e-2
    # still orthogonal (a rotation), just not relative
    r = enc.rotation_matrix(x)
    torch.testing.assert_close(r.transpose(-1, -2) @ r, torch.eye(D).expand_as(r), rtol=0, atol=1e-4)
    # and the comrope generators for the same positions do commute
    com = build_encoding("comrope", n_axes=2, block_size=4).bind(n_heads=2, head_dim=D).generators()
    assert (com[0] @ com[1] - com[1] @ com[0]).abs().max() < 1e-6


@pytest.mark.parametrize("name,cfg", COMMUTING + [("liere", {"n_axes": 2})])
def test_attention_logits_follow_rotation_and_gradients_flow(name, cfg):
    layer = Attn(n_heads=2, head_dim=D)
    inject(layer, name, backend="eager", **cfg)
    enc = layer.posenc
    q, k, v = qkv(b=1, h=2, n=5, d=D, grad=True)
    n_axes = enc.n_axes
    pos = torch.randint(0, 20, (1, 5, n_axes)) if n_axes > 1 else torch.arange(5)[None] * 3
    from posenc_lightning.encodings.base import AttentionContext

    qr, _kr = enc.rotate(q, k, AttentionContext(pos, pos, True))
    r = enc.rotation_matrix(pos)[:, None]  # [B, 1, N, D, D]
    torch.testing.assert_close(qr, (r @ q[..., None])[..., 0], rtol=1e-5, atol=1e-5)
    out = layer(q, k, v, positions=pos)
    out.square().sum().backward()
    grads = [p.grad for p in enc.parameters()]
    assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    assert q.grad is not None and k.grad is not None


def test_comrope_ap_blocks_belong_to_one_axis():
    enc = build_encoding("comrope", variant="ap", n_axes=2, block_size=4).bind(n_heads=1, head_dim=D)
    gens = enc.generators()  # [2 axes, 4 blocks, 4, 4]
    nonzero = gens.abs().sum((-1, -2)) > 0
    assert nonzero.tolist() == [[True, False, True, False], [False, True, False, True]]


def test_matrix_rotary_bad_input():
    with pytest.raises(ValueError, match="positions \\[B, N, 2\\]"):
        build_encoding("comrope", n_axes=2, block_size=4).bind(n_heads=1, head_dim=D).rotation_blocks(
            torch.arange(4)[None])
    with pytest.raises(ValueError, match="multiple of block_size"):
        build_encoding("liere", block_size=6).bind(n_heads=1, head_dim=D)
    with pytest.raises(ValueError, match="variant"):
        build_encoding("comrope", variant="xy")
