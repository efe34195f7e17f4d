"""Flush-to-zero of denormals reaches every thread of PyTorch's intra-op pool.

``torch.set_flush_denormal`` sets a per-thread register: with two threads an elementwise op over
a large tensor is split between the caller and a pool thread, and only the caller's half would be
flushed. The biased and normalizer paths flush around their calls (`denormals`); these tests read
the flush off the numbers (a denormal times one is zero when flushed), never off timings."""

from __future__ import annotations

import pytest
import torch

from posenc_lightning.attention.backends.engine import denormals as _denormals
from posenc_lightning.functional.mode import Mode

DENORMAL = 1e-39  # below float32's smallest normal, 1.18e-38
N = 1 << 20  # far above PyTorch's grain size (32768): split across the threads


#: made with flush-to-zero off (converting 1e-39 under it gives 0)
_X = torch.full((N,), DENORMAL)
assert int(_X.count_nonzero()) == N


def _survivors() -> int:
    """How many of ``N`` denormal products survive (N: nothing flushed, 0: flushed everywhere)."""
    return int((_X * 1.0).count_nonzero())


@pytest.fixture
def two_threads():
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-to-zero")
    if _denormals._openmp_region() is None:
        pytest.skip("PyTorch's intra-op pool is not GNU OpenMP here: only the calling thread is set")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    # a pool thread created while the caller flushes inherits the setting: start from all off
    _denormals.set_flush_denormal(False)
    assert _survivors() == N
    yield
    torch.set_num_threads(before)
    _denormals.set_flush_denormal(False)


def test_plain_torch_setting_reaches_only_the_calling_thread(two_threads):
    """The premise: ``torch.set_flush_denormal`` alone leaves the pool thread's half unflushed."""
    torch.set_flush_denormal(True)
    try:
        assert 0 < _survivors() < N
    finally:
        torch.set_flush_denormal(False)


def test_flush_context_reaches_every_thread_and_is_undone(two_threads):
    assert _survivors() == N
    with _denormals._flush_denormals(Mode.now("cpu")):
        assert _survivors() == 0
    assert _survivors() == N


def test_backward_flushes_every_thread_and_restores(two_threads):
    """Between `_DenormalsOnForBackward` and `_DenormalsOffAfterBackward` (the span of an
    attention's backward) the whole pool flushes; afterwards nothing does."""
    seen = []
    x = torch.randn(4, requires_grad=True)
    q, k, v = _denormals._DenormalsOffAfterBackward.apply(x, x * 2, x * 3)

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(_survivors())
            return g

    out = _denormals._DenormalsOnForBackward.apply(Probe.apply(q + k + v))
    out.sum().backward()
    assert seen == [0]
    assert _survivors() == N



def test_the_flush_goes_to_pytorchs_own_openmp_when_another_library_loaded_the_systems():
    """llama.cpp's ggml links the system's libgomp, PyTorch's wheel bundles its own: with both mapped
    (the system's first) the flush must run on PyTorch's team (its pool's threads), not the other."""
    torch_dir = "/env/site-packages/torch"
    ours, system = f"{torch_dir}/lib/libgomp.so.1", "/usr/lib/x86_64-linux-gnu/libgomp.so.1"
    assert _denormals.pytorch_libgomp([system, ours], torch_dir) == ours
    assert _denormals.pytorch_libgomp([ours, system], torch_dir) == ours
    assert _denormals.pytorch_libgomp([system], torch_dir) == system  # a wheel linking the system's
    assert _denormals.pytorch_libgomp(["/env/site-packages/torchvision/libgomp.so.1"], torch_dir) \
        == "/env/site-packages/torchvision/libgomp.so.1"  # not inside torch/, but the only one
    assert _denormals.pytorch_libgomp([], torch_dir) is None
