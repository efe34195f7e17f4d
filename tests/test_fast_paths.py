"""Fast paths (issue 8) against the plain formulas they replace, forward and backward."""

from __future__ import annotations

import pytest
import torch

from posenc_lightning.functional.rope import apply_rotary, apply_rotary_reference, rope_cos_sin, rope_inv_freq


def _qk_like(b: int, h: int, n: int, d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q as the models make it: a strided view of a fused projection, [B, H, N, D]."""
    fused = torch.randn(b, n, 3 * h * d, dtype=dtype)
    return fused[..., h * d: 2 * h * d].view(b, n, h, d).transpose(1, 2)


POSITIONS = {
    "arange": torch.arange(13)[None].expand(2, 13),
    "offset": torch.arange(1000, 1013)[None].expand(2, 13),
    "packed": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4]] * 2),
}


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("pos", list(POSITIONS))
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_apply_rotary_fast_equals_formula_fwd_bwd(layout, pos, partial):
    d, h = 32, 3
    r = int(d * partial)
    cos, sin = rope_cos_sin(POSITIONS[pos], rope_inv_freq(r, 500.0))
    x = _qk_like(2, h, 13, d).requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = apply_rotary(x, cos, sin, layout), apply_rotary_reference(x_ref, cos, sin, layout)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    if partial < 1:
        assert torch.equal(y[..., r:], x[..., r:])


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_apply_rotary_dtypes_and_per_head_tables(layout):
    d, h = 16, 2
    pos = POSITIONS["packed"]
    inv = torch.stack([rope_inv_freq(d, 100.0), rope_inv_freq(d, 1e4)])  # per head [H, D/2]
    cos, sin = rope_cos_sin(pos, inv, attention_scaling=1.3)  # [B, H, N, D/2], mscale folded in
    assert cos.dim() == 4
    for dtype in (torch.bfloat16, torch.float64):
        x = _qk_like(2, h, 13, d, dtype)
        y = apply_rotary(x, cos, sin, layout)
        ref = apply_rotary_reference(x, cos, sin, layout)
        assert y.dtype == dtype
        tol = 1e-12 if dtype == torch.float64 else 1e-2
        torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    # float64 end to end is exact math: the norm of each pair is scaled by exactly 1.3
    x = _qk_like(2, h, 13, d, torch.float64)
    cos, sin = rope_cos_sin(pos, inv.double(), attention_scaling=1.3)
    y = apply_rotary(x, cos, sin, layout)
    pair = (lambda t: t.unflatten(-1, (2, -1)).pow(2).sum(-2)) if layout == "half" else \
        (lambda t: t.unflatten(-1, (-1, 2)).pow(2).sum(-1))
    torch.testing.assert_close(pair(y), 1.3 ** 2 * pair(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_apply_rotary_gradcheck_incl_learned_frequencies(layout):
    """Exact gradients (float64 gradcheck, double backward too) for x and for cos/sin that
    require grad (learned frequencies take the autograd path)."""
    pos = POSITIONS["offset"][:1, :5]
    inv = rope_inv_freq(8, dtype=torch.float64).requires_grad_(True)
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True)

    def f(x, inv):
        c, s = rope_cos_sin(pos, inv)
        return apply_rotary(x, c, s, layout)

    assert torch.autograd.gradcheck(f, (x, inv))
    c, s = rope_cos_sin(pos, inv.detach())
    assert torch.autograd.gradgradcheck(lambda x: apply_rotary(x, c, s, layout), (x,))


def test_apply_rotary_odd_storage_offset_interleaved():
    """A view at an odd storage offset cannot be viewed as complex: falls back to a copy."""
    buf = torch.randn(1 + 2 * 5 * 8)
    x = buf[1:].view(1, 2, 5, 8)
    cos, sin = rope_cos_sin(torch.arange(5)[None], rope_inv_freq(8))
    torch.testing.assert_close(apply_rotary(x, cos, sin, "interleaved"),
                               apply_rotary_reference(x, cos, sin, "interleaved"), rtol=1e-6, atol=1e-6)
