"""The conformance matrix on the GPU: every registered encoding x every backend that claims CUDA
(sdpa, blockwise, flex, triton) x {fp32, bf16} x {arange, offset, packed, decode, padding},
forward and backward (gradients to q, k, v, hidden and every encoding parameter), against the
eager float64 reference computed on CPU (tests/test_conformance.py, whose tolerances apply).

The shape is B=2, N=150 with 4 query heads over 2 kv heads of 32: 150 divides none of the GPU
tiles (32 and 64 rows) and spans several, so the kernels' tile loops, masks and partial tiles all
run, with grouped-query attention. An encoding that declares it cannot take it (per-head
parameters need as many kv heads as query heads; learned's 64-row table) takes the first of
`SHAPES` it can. A backend that refuses a case on CUDA (``supports``: flex takes head_dim >= 16
only) is skipped with its reason.
"""

from __future__ import annotations

import re

import pytest
import torch

from posenc_lightning.attention.backends import flex, get_backend
from posenc_lightning.encodings.registry import available_encodings
from tests.conformance import SCENARIOS, Inputs, build_layer, run_case
from tests.gpu import GPU
from tests.test_conformance import DECLARED_LIMITS, DTYPES, _compare, _reference, _tol

pytestmark = GPU

CUDA = torch.device("cuda")
CUDA_BACKENDS = ("sdpa", "blockwise", "flex", "triton")
GPU_DTYPES = ("fp32", "bf16")
#: (batch, length, (query heads, kv heads, head_dim)), in the order an encoding tries them
SHAPES = ((2, 150, (4, 2, 32)), (2, 150, (4, 4, 32)), (2, 13, (2, 2, 8)))


def _to_cuda(x):
    return x.to(CUDA) if isinstance(x, torch.Tensor) else x


def _first_shape_taken(name: str, scenario: str, dtype: str):
    """The reference of the first of `SHAPES` the encoding takes, and that shape."""
    for b, n, heads in SHAPES:
        try:
            return _reference(name, scenario, dtype, b, n, heads), heads
        except ValueError as e:
            if not any(re.search(p, str(e)) for p in DECLARED_LIMITS):
                raise
            last = e
    pytest.skip(f"{name} cannot take any of the shapes: {last}")


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("name", available_encodings())
def test_cuda_backend_equals_eager_reference(name, backend, dtype, scenario):
    (enc, state, x, args, ref), heads = _first_shape_taken(name, scenario, dtype)
    why = get_backend(backend).supports(enc, CUDA, True)
    if why is None and backend == "flex" and heads[2] < flex.MIN_COMPILED_HEAD_DIM:  # embedding-only: no head_dim bound
        why = flex._small_head_dim(heads[2])  # what the call would raise
    if why is not None:
        pytest.skip(f"{backend} cannot run {name} on cuda: {why}")
    # injected on CPU (where `inject` checks the backend against the module's device), then moved
    layer = build_layer(name, "eager", DTYPES[dtype], heads, state).to(CUDA)
    layer.posenc_backend = backend
    xs = Inputs(*(t.to(CUDA) for t in (x.q, x.k, x.v, x.hidden, x.cotangent)))
    got = run_case(layer, xs, {k: _to_cuda(v) for k, v in args.items()}, grad=True)
    assert got[0].device.type == CUDA.type
    _compare([None if g is None else g.cpu() for g in got], ref, _tol(name, dtype),
             f"{name}/{backend}/{dtype}/{scenario} heads {heads} on cuda")
