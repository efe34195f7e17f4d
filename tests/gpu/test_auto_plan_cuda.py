"""The CUDA ``auto`` plan allocates no N x N tensor, checked on the CUDA caching allocator: for
every registered encoding, a forward and backward at N = 8192 (bf16) peaks at less than an eighth
of one float32 ``B x H x N x N`` tensor above what it started with, both with the shipped
`proven_on_gpu.PROVEN` table (SDPA, blockwise) and with every custom kernel proven (triton, flex)."""

from __future__ import annotations

import pytest
import torch

from posenc_lightning.attention.backends import proven, resolve_backend
from posenc_lightning.encodings import proven_on_gpu
from posenc_lightning.encodings.registry import available_encodings
from posenc_lightning.inject import inject
from tests.conformance import ConfLayer
from tests.gpu import GPU

pytestmark = GPU

CUDA = torch.device("cuda")
B, H, N, D = 1, 4, 8192, 64
N_BY_N_BYTES = B * H * N * N * 4  # 1 GiB


@pytest.mark.parametrize("table", ["shipped", "all_proven"])
@pytest.mark.parametrize("name", available_encodings())
def test_auto_on_cuda_peaks_far_below_one_n_by_n_tensor(name, table, monkeypatch):
    if table == "all_proven":
        monkeypatch.setattr(proven_on_gpu, "PROVEN", {(b, n): "test" for b in proven.CUSTOM_KERNELS
                                               for n in available_encodings()})
    torch.manual_seed(0)
    m = ConfLayer(H, D)
    m.max_seq_len = N  # a learned table long enough
    inject(m, name)
    m.to(CUDA, torch.bfloat16)
    g = torch.Generator(device=CUDA).manual_seed(1)
    q, k, v = (torch.randn(B, H, N, D, device=CUDA, dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    hidden = torch.randn(B, N, H * D, device=CUDA, dtype=torch.bfloat16, generator=g).requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = m(q, k, v, hidden)
    out.float().square().mean().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    enc = m.encoding
    chosen = resolve_backend("auto", enc, CUDA, True).NAME if enc is not None else "sdpa"
    assert torch.isfinite(out).all() and q.grad is not None
    assert peak < N_BY_N_BYTES // 8, f"{name} on {chosen}: peak {peak / 2**20:.0f} MiB"
