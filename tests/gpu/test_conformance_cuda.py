"""The conformance matrix on the GPU: every registered encoding x every backend that claims CUDA
(sdpa, blockwise, flex, triton) x {fp32, bf16} x {arange, offset, packed, decode, padding} x two
shapes, forward and backward (gradients to q, k, v, hidden and every encoding parameter), against
the eager float64 reference computed on CPU (tests/test_conformance.py, whose tolerances apply).

Shapes: the CPU matrix's (B=2, N=13, 2 heads of 8) and a grouped-query one (B=2, N=150, 4 query
heads over 2 kv heads of 32): neither length divides the GPU tiles (32 and 64 rows), and the
second spans several tiles, so the kernels' tile loops, masks and partial tiles all run. A
backend that refuses a case on CUDA (``supports``: flex takes head_dim >= 16 only, so it runs the
second shape) is skipped with its reason; an encoding that
cannot take a shape (a declared limit: learned's 64-row table) is skipped with its ValueError.
"""

from __future__ import annotations

import re

import pytest
import torch

from posenc_lightning.attention.backends import get_backend
from posenc_lightning.encodings.registry import available_encodings
from tests.conformance import SCENARIOS, Inputs, build_layer, run_case
from tests.gpu import GPU
from tests.test_conformance import DECLARED_LIMITS, DTYPES, _compare, _reference, _tol

pytestmark = GPU

CUDA = torch.device("cuda")
CUDA_BACKENDS = ("sdpa", "blockwise", "flex", "triton")
GPU_DTYPES = ("fp32", "bf16")
#: (batch, length, (query heads, kv heads, head_dim))
SHAPES = {"small": (2, 13, (2, 2, 8)), "gqa150": (2, 150, (4, 2, 32))}


def _to_cuda(x):
    return x.to(CUDA) if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("name", available_encodings())
def test_cuda_backend_equals_eager_reference(name, backend, dtype, scenario, shape):
    b, n, heads = SHAPES[shape]
    try:
        enc, state, x, args, ref = _reference(name, scenario, dtype, b, n, heads)
    except ValueError as e:
        if any(re.search(p, str(e)) for p in DECLARED_LIMITS):
            pytest.skip(f"{name} cannot take this shape: {e}")
        raise
    why = get_backend(backend).supports(enc, CUDA, True)
    if why is not None:
        pytest.skip(f"{backend} cannot run {name} on cuda: {why}")
    # injected on CPU (where `inject` checks the backend against the module's device), then moved
    layer = build_layer(name, "eager", DTYPES[dtype], heads, state).to(CUDA)
    layer.posenc_backend = backend
    xs = Inputs(*(t.to(CUDA) for t in (x.q, x.k, x.v, x.hidden, x.cotangent)))
    got = run_case(layer, xs, {k: _to_cuda(v) for k, v in args.items()}, grad=True)
    assert got[0].device.type == CUDA.type
    _compare([None if g is None else g.cpu() for g in got], ref, _tol(name, dtype),
             f"{name}/{backend}/{dtype}/{scenario}/{shape} on cuda")
