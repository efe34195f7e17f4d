"""Rotary variants: resonance_rope, multiscale_rope, xpos, rope_2d, clex, exposb (formulas and invariants)."""

from __future__ import annotations

import math

import pytest
import torch

from posenc_lightning.attention.kv_cache import LayerKVCache
from posenc_lightning.encodings import build_encoding
from posenc_lightning.encodings.base import AttentionContext
from posenc_lightning.functional.rope import rope_inv_freq
from posenc_lightning.functional.rope_scaling import ntk_inv_freq, yarn_inv_freq
from posenc_lightning.inject import inject
from tests.helpers import Attn, qkv


def ctx(qp, kp=None):
    return AttentionContext(qp, qp if kp is None else kp, True)


def logits(enc, q, k, qp, kp):
    qr, kr = enc.rotate(q, k, ctx(qp, kp))
    return qr.float() @ kr.float().transpose(-1, -2)


# ------------------------------------------------------------------ resonance
@pytest.mark.parametrize("factor", [1.0, 4.0, 16.0])
def test_resonance_wavelengths_are_integers(factor):
    enc = build_encoding("resonance_rope", factor=factor, original_max_position_embeddings=256).bind(head_dim=64)
    inv, scale = enc.frequencies()
    wl = 2 * math.pi / inv.double()
    torch.testing.assert_close(wl, wl.round(), rtol=1e-6, atol=0)
    base = yarn_inv_freq(64, 10000.0, factor, 256)  # Resonance YaRN = rounded YaRN
    want = 2 * math.pi / (2 * math.pi / base.double()).round()
    torch.testing.assert_close(inv.double(), want, rtol=1e-6, atol=0)
    assert scale == pytest.approx(0.1 * math.log(factor) + 1)
    # a feature with integer wavelength repeats exactly: cos at p and p + lambda agree
    lam = int(wl[3].round())
    c, _s = enc.cos_sin(torch.tensor([[5, 5 + lam]]).double())
    assert c[0, 0, 3].item() == pytest.approx(c[0, 1, 3].item(), abs=1e-6)  # fp32 inv_freq
    enc.set_scale(2.0)
    assert not torch.equal(enc.frequencies()[0], inv) or factor == 2.0


# ------------------------------------------------------------------ multiscale
def test_multiscale_per_head_frequencies_and_relative():
    enc = build_encoding("multiscale_rope", min_scale=1.0, max_scale=8.0).bind(n_heads=4, head_dim=16)
    inv, _ = enc.frequencies()
    scales = torch.tensor([1.0, 2.0, 4.0, 8.0])
    torch.testing.assert_close(inv, rope_inv_freq(16)[None] / scales[:, None], rtol=1e-6, atol=0)
    pos = torch.tensor([[3, 9, 40]])
    c, _s = enc.cos_sin(pos)  # the cached per-head table path
    ang = pos[0][None, :, None].float() * inv[:, None, :]
    torch.testing.assert_close(c[0], ang.cos(), rtol=1e-5, atol=1e-5)
    q, k, _ = qkv(b=1, h=4, n=3, d=16)
    torch.testing.assert_close(logits(enc, q, k, pos, pos), logits(enc, q, k, pos + 100, pos + 100),
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="n_kv_heads == n_heads"):
        enc.rotate(q, k[:, :2], ctx(pos))


# ------------------------------------------------------------------ xpos
def test_xpos_formula_and_relative():
    enc = build_encoding("xpos", scale_base=64.0).bind(n_heads=2, head_dim=16)
    q, k, _ = qkv(b=1, h=2, n=5, d=16)
    pos = torch.tensor([[0, 3, 7, 20, 50]])
    got = logits(enc, q, k, pos, pos)
    rope = build_encoding("rope").bind(n_heads=2, head_dim=16)
    qr, kr = rope.rotate(q, k, ctx(pos))
    zeta = (torch.arange(0, 16, 2) / 16 + 0.4) / 1.4  # Sun et al. eq. 10
    dist = (pos[0][:, None] - pos[0][None, :]).float()  # m - n
    scale = zeta[None, None, :] ** (dist[..., None] / 64.0)  # [Nq, Nk, 8]
    # q.k = sum_i (pair i of rope q . pair i of rope k) * zeta_i^((m - n)/B)
    pair = qr[..., None, :8] * kr[..., None, :, :8] + qr[..., None, 8:] * kr[..., None, :, 8:]
    want = (pair * scale).sum(-1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits(enc, q, k, pos + 1000, pos + 1000), got, rtol=1e-4, atol=1e-4)


def test_xpos_kv_cache_matches_full():
    layer = Attn(n_heads=2, head_dim=16)
    inject(layer, "xpos", backend="eager", scale_base=32.0)
    q, k, v = qkv(b=1, h=2, n=12, d=16)
    cache = LayerKVCache()
    layer(q[:, :, :5], k[:, :, :5], v[:, :, :5], cache=cache)
    for t in range(5, 12):
        out = layer(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache=cache)
    torch.testing.assert_close(out[:, :, -1], layer(q, k, v)[:, :, -1], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ rope_2d
def test_rope_2d_axial_formula_and_grid_mapping():
    enc = build_encoding("rope_2d", theta=100.0, grid_width=4).bind(n_heads=2, head_dim=16)
    rc = torch.tensor([[[0, 0], [1, 3], [2, 1], [5, 2]]])
    c, s = enc.cos_sin(rc)
    f = 100.0 ** (-torch.arange(0, 8, 2) / 8)  # theta^(-4t/d), d = 16
    want = torch.cat((rc[0, :, :1] * f, rc[0, :, 1:] * f), -1)
    torch.testing.assert_close(c[0], want.cos(), rtol=1e-6, atol=1e-6)
    flat = rc[..., 0] * 4 + rc[..., 1]  # raster positions map to the same grid cells
    torch.testing.assert_close(enc.cos_sin(flat)[1], s)
    # relative in 2-D: a translation of the whole grid leaves the logits unchanged
    q, k, v = qkv(b=1, h=2, n=4, d=16)
    shift = torch.tensor([7, -3])
    torch.testing.assert_close(logits(enc, q, k, rc, rc), logits(enc, q, k, rc + shift, rc + shift),
                               rtol=1e-4, atol=1e-4)
    # through the mixin with [B, N, 2] positions
    layer = Attn(n_heads=2, head_dim=16)
    inject(layer, "rope_2d", backend="eager", grid_width=4)
    out2d = layer(q, k, v, positions=rc, causal=False)
    torch.testing.assert_close(out2d, layer(q, k, v, positions=flat, causal=False))
    with pytest.raises(ValueError, match="divisible by 4"):
        build_encoding("rope_2d").bind(n_heads=1, head_dim=6)


# ------------------------------------------------------------------ clex
def test_clex_untrained_is_ntk_with_alpha_2t_minus_1():
    enc = build_encoding("clex", original_max_position_embeddings=64).bind(n_heads=2, head_dim=32)
    for t in (1.0, 2.5, 8.0):
        enc.set_scale(t)
        inv, _ = enc.frequencies(64)
        torch.testing.assert_close(inv, ntk_inv_freq(32, 10000.0, 2 * t - 1), rtol=5e-5, atol=0)
    enc.set_scale(1.0)
    # the current length sets a floor on the scale: L = 4 x 64 -> t = 4
    torch.testing.assert_close(enc.frequencies(256)[0], ntk_inv_freq(32, 10000.0, 7.0), rtol=5e-5, atol=0)
    with pytest.raises(ValueError, match=">= 1"):
        enc.set_scale(0.5)


def test_clex_gradients_and_cache_invalidation():
    enc = build_encoding("clex", original_max_position_embeddings=8).bind(n_heads=2, head_dim=16)
    enc.set_scale(3.0)
    inv, _ = enc.frequencies(8)
    inv.sum().backward()
    assert enc.ode_down.grad.abs().sum() > 0  # W_down starts at 0, so only it gets a gradient at init
    with torch.no_grad():
        enc.ode_down.normal_(std=0.01)
    enc.zero_grad()
    enc.frequencies(8)[0].sum().backward()
    assert enc.ode_up.grad.abs().sum() > 0 and enc.ode_down.grad.abs().sum() > 0
    with torch.no_grad():  # inference: cached tables, keyed on scale and parameter versions
        pos = torch.arange(8)[None]
        a = enc.cos_sin(pos, 8)[1].clone()
        enc.set_scale(5.0)
        b = enc.cos_sin(pos, 8)[1].clone()
        assert not torch.allclose(a, b)
        enc.ode_down.mul_(2.0)
        c = enc.cos_sin(pos, 8)[1]
        torch.testing.assert_close(c, torch.sin(pos[..., None] * enc.frequencies(8)[0]))
        assert not torch.allclose(b, c)


@torch.no_grad()
def test_clex_kv_cache_past_training_length():
    layer = Attn(n_heads=2, head_dim=16)
    inject(layer, "clex", backend="eager", original_max_position_embeddings=8)
    with torch.no_grad():
        layer.posenc.ode_down.normal_(std=0.05)
    q, k, v = qkv(b=1, h=2, n=24, d=16)
    cache = LayerKVCache()
    layer(q[:, :, :4], k[:, :, :4], v[:, :, :4], cache=cache)
    for t in range(4, 24):
        out = layer(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache=cache)
    torch.testing.assert_close(out[:, :, -1], layer(q, k, v)[:, :, -1], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ exposb
def test_exposb_distance_modulation_matches_seed_table():
    """Seed 004, sec. 5.4: decay and modulation at distances 0, 5, 10, 50, 100, 500, 1000."""
    enc = build_encoding("exposb").bind(n_heads=2, head_dim=16)
    d = torch.tensor([[0, 5, 10, 50, 100, 500, 1000]])
    mod = enc.distance_modulation(torch.zeros(1, 1, dtype=torch.long), d)[0, 0, 0]
    decay = (mod - 0.7) / 0.3
    torch.testing.assert_close(decay, torch.tensor([1.00, 0.98, 0.95, 0.78, 0.61, 0.08, 0.007]), atol=0.006, rtol=0)
    torch.testing.assert_close(mod, torch.tensor([1.00, 0.99, 0.99, 0.93, 0.88, 0.72, 0.70]), atol=0.006, rtol=0)
    g = enc.band_pass()
    assert g.max().item() == pytest.approx(1.2) and g.argmax().item() == 4  # d_center = head_dim/4
    assert g.min().item() == pytest.approx(0.8, abs=0.01)


def _exposb_reference(x, pos):
    """apply_exposb of seed 004 sec. 5.2, transcribed."""
    d = x.shape[-1]
    inv_freq = torch.exp(-math.log(10000.0) * torch.arange(d // 2, dtype=torch.float64) * 2.0 / d)
    ang = pos.double()[:, None, :, None] * inv_freq
    boost = 1.0 + 0.2 * torch.exp(-pos.double() * 0.001)[:, None, :, None]
    cos, sin = ang.cos() * boost, ang.sin() * boost
    xe, xo = x.double()[..., ::2], x.double()[..., 1::2]
    out = torch.stack([xe * cos - xo * sin, xo * cos + xe * sin], -1).flatten(-2)
    dims = torch.arange(d, dtype=torch.float64)
    g = torch.exp(-((dims - d / 4) ** 2) / (2 * (d / 8) ** 2))
    return out * (0.8 + 0.4 * g)


def test_exposb_matches_seed_and_trains():
    layer = Attn(n_heads=2, head_dim=16)
    inject(layer, "exposb", backend="eager")
    enc = layer.posenc
    q, k, v = qkv(b=1, h=2, n=6, d=16, grad=True)
    pos = torch.tensor([[0, 1, 2, 300, 301, 2000]])
    qr, _kr = enc.rotate(q, k, ctx(pos))
    # fp32 angles at position 2000: ~2000 x 6e-8 rad
    torch.testing.assert_close(qr.double(), _exposb_reference(q, pos), rtol=0, atol=3e-4)
    # the whole attention: scores * (0.7 + 0.3 exp(-0.005 |m - n|)), causal softmax
    s = (_exposb_reference(q, pos) @ _exposb_reference(k, pos).transpose(-1, -2)) / 4.0
    dist = (pos[0][:, None] - pos[0][None, :]).abs().double()
    s = s * (0.7 + 0.3 * torch.exp(-0.005 * dist))
    s = s.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    want = torch.softmax(s, -1) @ v.double()
    out = layer(q, k, v, positions=pos)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=3e-4)
    out.square().sum().backward()
    assert enc.band_weights.grad.abs().sum() > 0 and enc.decay_rates.grad.abs().sum() > 0
