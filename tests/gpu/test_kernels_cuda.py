"""The Triton kernels compiled for the device (not the interpreter): every launch kernel of the
softmax and stick-breaking paths, forward and backward, ends with a compiled binary (``cubin`` on
NVIDIA, ``hsaco`` on ROCm) in its cache after a training step of rope, alibi, fox, fire and sba
through ``backend="triton"``. Their values are held to the eager reference in
test_conformance_cuda.py."""

from __future__ import annotations

import torch

from posenc_lightning.inject import inject
from tests.conformance import ConfLayer
from tests.gpu import GPU

pytestmark = GPU

CUDA = torch.device("cuda")


def _compiled_binaries(kernel) -> list[str]:
    """The binary kinds of every compiled variant of a ``triton.jit`` kernel, on any device."""
    out = []
    for cache in kernel.device_caches.values():
        for compiled in cache[0].values():
            out += [kind for kind in ("cubin", "hsaco") if kind in compiled.asm]
    return out


def test_the_triton_kernels_are_compiled_for_the_device():
    from triton.runtime.jit import JITFunction

    from posenc_lightning.kernels import softmax, stick_breaking
    from posenc_lightning.kernels.fused import interpreting

    assert not interpreting()
    launched = {"softmax fwd": softmax._fwd_kernel, "softmax bwd dk dv": softmax._bwd_dkdv_kernel,
                "softmax bwd dq": softmax._bwd_dq_kernel, "stick-breaking fwd": stick_breaking._sb_fwd_kernel,
                "stick-breaking bwd dq": stick_breaking._sb_bwd_kernel,
                "stick-breaking bwd dk dv": stick_breaking._sb_bwd_dkdv_kernel}
    assert all(type(k) is JITFunction for k in launched.values()), {n: type(k) for n, k in launched.items()}
    for name in ("rope", "alibi", "fox", "fire", "sba"):
        torch.manual_seed(0)
        m = ConfLayer(4, 64)
        inject(m, name)  # checked against the module's device: a layer without parameters is on CPU
        m.to(CUDA, torch.bfloat16)
        m.posenc_backend = "triton"
        q, k, v = (torch.randn(2, 4, 300, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        hidden = torch.randn(2, 300, 256, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
        out = m(q, k, v, hidden)
        out.float().sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    torch.cuda.synchronize()
    missing = [n for n, k in launched.items() if not _compiled_binaries(k)]
    assert not missing, f"no compiled binary for {missing}"
