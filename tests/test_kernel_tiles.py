"""`fused_attention(tiles=...)`: the tile sizes a caller gives replace the pinned ones
(`block_config`) for each kernel kind (the tile ablation of benchmarks/gpu_perf.py), and the
result is the formula's whatever the tiles (TRITON_INTERPRET=1, set by conftest). Against an eager
float64 reference written from the formula: softmax(q' k'^T / sqrt(d) - m |i - j|) v with q', k'
rotated at positions that are not arange, N not a multiple of any tile; forward and backward."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from posenc_lightning.functional.rope import rope_cos_sin, rope_inv_freq
from posenc_lightning.kernels import fused
from posenc_lightning.kernels.fused import RotaryTables, fused_attention


@pytest.fixture(autouse=True)
def _fast_interpreter(monkeypatch):
    import triton.runtime.interpreter as ti

    monkeypatch.setattr(ti.interpreter_builder, "options", ti.InterpreterOptions(sanitize_overflow=False))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, half layout: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _reference(q, k, v, pos, slope):
    n, d = q.shape[2], q.shape[3]
    cos, sin = rope_cos_sin(pos[0], rope_inv_freq(d).double())
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    dist = (pos[0][:, None] - pos[0][None, :]).abs().double()
    z = q @ k.transpose(-1, -2) / d ** 0.5 - slope[:, None, None] * dist
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.softmax(z.masked_fill(~causal, float("-inf")), -1) @ v


TILES = {"fwd": {"BM": 32, "BN": 16, "num_warps": 1, "num_stages": 1},
         "bwd_dkdv": {"BM": 16, "BN": 32, "num_warps": 1, "num_stages": 1},
         "bwd_dq": {"BM": 32, "BN": 32, "num_warps": 1, "num_stages": 1}}


def test_given_tiles_are_the_ones_launched_and_the_result_is_the_formula(monkeypatch):
    g = torch.Generator().manual_seed(3)
    b, h, n, d = 1, 2, 37, 16
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    pos = torch.randint(0, 90, (1, n), generator=g).sort(-1).values  # increasing, not arange, repeats allowed
    slope = torch.rand(h, generator=g, dtype=torch.float64) * 0.3
    cos, sin = rope_cos_sin(torch.arange(90), rope_inv_freq(d))  # one row per position, gathered at pos
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    launched: list[tuple[int, int]] = []
    real = fused._launch

    def record(kernel, grid, args, flags, cfg):  # the real launch, its tiles noted
        launched.append((cfg["BM"], cfg["BN"]))
        return real(kernel, grid, args, flags, cfg)

    monkeypatch.setattr(fused, "_launch", record)
    out = fused_attention(*leaves, rotary=RotaryTables(cos, sin, pos, cos, sin, pos), slopes=slope.float(),
                          bias_q_pos=pos, bias_k_pos=pos, tiles=TILES)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, leaves, dout.float())
    assert launched == [(32, 16), (16, 32), (32, 32)]  # fwd, dK/dV, dQ
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*ref_leaves, pos, slope)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout)
    assert (out.double() - ref).abs().max() < 1e-5 * ref.abs().max()
    for name, got, want in zip("qkv", grads, ref_grads):
        assert (got.double() - want).abs().max() < 2e-5 * want.abs().max(), name


@pytest.mark.parametrize("tiles, match", [({"fwd": {"BM": 32, "BN": 16}}, "exactly"),
                                          ({"fdw": TILES["fwd"]}, "kernel kind"),
                                          ({"fwd": {**TILES["fwd"], "BM": 24}}, "powers of two")])
def test_bad_tiles_name_the_fix(tiles, match):
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match=match):
        fused_attention(q, q, q, tiles=tiles)
