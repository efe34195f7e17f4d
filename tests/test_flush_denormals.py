"""The public flush-to-zero helpers (`posenc_lightning.flush_denormals`, `call_flushing_denormals`):
on CPU a denormal product is flushed to zero inside them and kept outside; regions nest, and the
sdpa backend's own switches leave the setting on inside a region."""

from __future__ import annotations

import pytest
import torch

import posenc_lightning
from posenc_lightning import call_flushing_denormals, flush_denormals
from posenc_lightning.attention.backends import sdpa
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext, RelativeBias


def _flushed() -> bool:
    """Whether a denormal float32 product (1e-39 * 1) comes out as zero on this thread now."""
    return (torch.tensor(1e-39) * torch.tensor(1.0)).item() == 0.0


@pytest.fixture(autouse=True)
def _supported():
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-to-zero")


def test_a_denormal_product_is_flushed_inside_and_kept_outside():
    assert torch.tensor(1e-39).item() != 0.0  # 1e-39 is a denormal float32, not zero
    assert not _flushed()
    with flush_denormals() as supported:
        assert supported is True
        assert _flushed()
    assert not _flushed()
    assert posenc_lightning.flush_denormals is flush_denormals and "flush_denormals" in posenc_lightning.__all__


def test_regions_nest_and_an_error_turns_it_off():
    with flush_denormals():
        with flush_denormals():
            assert _flushed()
        assert _flushed()  # the inner exit leaves the outer region's setting
    assert not _flushed()
    with pytest.raises(RuntimeError, match="boom"), flush_denormals():
        raise RuntimeError("boom")
    assert not _flushed()


def _biased_attention(n: int = 33, h: int = 2, d: int = 8):
    pos = torch.arange(n)[None].expand(1, n)
    bias = RelativeBias(torch.randn(h, 2 * 5 + 1), pos, pos)
    q, k, v = (torch.randn(1, h, n, d, requires_grad=True) for _ in range(3))
    out = sdpa.attend(q, k, v, bias=bias, mask=AttentionMask(True, 0, n, n), scale=d ** -0.5,
                      ctx=AttentionContext(pos, pos, True))
    return out, (q, k, v)


def test_the_backends_switches_leave_a_region_flushing():
    """sdpa's biased call turns flush-to-zero on and, after its forward and its backward, back to
    the caller's setting: off outside a region, on inside one."""
    out, qkv = _biased_attention()
    out.square().sum().backward()
    assert not _flushed()
    with flush_denormals():
        out, qkv = _biased_attention()
        assert _flushed()
        out.square().sum().backward()
        assert _flushed()
        assert all(t.grad is not None for t in qkv)
    assert not _flushed()


def test_call_flushing_denormals_flushes_the_call_and_its_backward():
    seen: dict[str, bool] = {}
    x = torch.randn(4, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        seen["forward"] = _flushed()
        return t * 2.0

    out = call_flushing_denormals(fn, x)
    seen["between"] = _flushed()
    x.register_hook(lambda g: seen.__setitem__("backward", _flushed()))
    out.sum().backward()
    assert seen == {"forward": True, "between": False, "backward": True}
    assert not _flushed()  # the end of the backward pass turns it off
    torch.testing.assert_close(x.grad, torch.full((4,), 2.0))
