"""Conformance, driven by the registries: every registered encoding x every attention backend
x {fp32, fp64, bf16} x {arange, offset, packed, decode, padding} equals the eager reference in
float64, forward and backward (gradients to q, k, v, hidden and every encoding parameter).

The reference is the eager backend in float64, run on the whole sequence (no cache), from the
tested dtype's inputs and parameters cast up (bf16 runs are compared with the float64 result
of the same bf16-rounded numbers). Eager itself is in the matrix: its bf16/fp32 runs and its
cached decoding are held to the same reference. A backend that cannot run a case says why
(``supports(encoding, device, requires_grad)``): the case is skipped with that reason; where
only the backward is refused (flex on CPU), the forward is still compared and the refusal
recorded (``record_property``). No case is skipped for any other reason.

Tolerances (``|x - ref| <= tol * scale``, ``scale`` = the largest magnitude of the reference
output, resp. of any reference gradient of the case: a gradient that is exactly 0 by symmetry,
such as FIRE's last bias under softmax, is held to the scale of the case, not to its own noise):

- fp64: ``1e-12``; measured <= 1e-15 on every fully float64 path (a few roundings over <= 64 keys).
- fp32, and fp64 for encodings that compute part of their work in float32 by design
  (`FP32_BY_DESIGN`): ``2e-5``; measured <= 1.4e-6 for outputs and q/k/v/hidden gradients,
  <= 1.3e-5 for an encoding parameter's gradient (a sum over every (b, h, i, j) score gradient,
  accumulated in float32 in a different order per backend: mixture's weights).
- bf16: ``4e-2`` (about 5 bf16 ulps, 2^-8 each); measured <= 1.2e-2 over every case: bf16 rounds
  q, k, v, the rotated q, k, the weights and the output, each ~2^-9 relative.

Size (B=2, N=13, 2 heads of 8; decode = prefill 11 + 2 single tokens; triton under
TRITON_INTERPRET=1 with 16 x 16 tiles): 27 encodings x 5 backends x 3 dtypes x 5 scenarios =
2025 cases: 1200 forward and backward, 375 forward only (flex on CPU: 25 encodings x 15), 450
skipped with the backend's reason (sba, rse replace softmax: sdpa and flex; exposb's modulated
softmax: sdpa; blockwise runs only sba, rse, exposb: 24 x 15; cope runs on triton by its own
kernels). Plus `test_randomized_shapes` (hypothesis,
derandomized: batch 1-2, N in 3..40 not a multiple of the 16-row tiles, grouped kv heads, offsets
up to 3000; 40 examples and 3 explicit ones that meet declared limits) and the refusal checks.
The blockwise backend's multi-tile cases (4 x 3 tiles) are in tests/test_blockwise_normalizers.py.
Measured: 3 min 9 s to 3 min 29 s wall (``OMP_NUM_THREADS=1 python -m pytest
tests/test_conformance.py -q --durations=10``, a shared 2-core machine); triton ~140 s of it
(its decode ~60 s), flex ~65 s (a dynamo trace per new score_mod), eager + sdpa ~10 s,
hypothesis ~15 s. With the blockwise backend in the matrix: 2 min 51 s wall on this machine
(1566 passed, 465 skipped; the blockwise cases ~5 s of it).
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from posenc_lightning.attention.backends import BACKENDS, get_backend
from posenc_lightning.attention.mixin import NO_ENCODING
from posenc_lightning.encodings.base import Encoding
from posenc_lightning.encodings.registry import available_encodings, encoding_class
from tests.conformance import SCENARIOS, Inputs, build_layer, make_inputs, run_case, scenario_args
from tests.helpers import fast_triton_interpreter

ENCODINGS = available_encodings()
DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}
B, N, HEADS = 2, 13, (2, 2, 8)  # (query heads, kv heads, head_dim)
CPU = torch.device("cpu")

TOL = {"fp64": 1e-12, "fp32": 2e-5, "bf16": 4e-2}
#: encodings whose float64 run is only float32-accurate, by design, and where
FP32_BY_DESIGN = {
    **{n: "bias kinds materialize in float32 (encodings/bias/)" for n in
       ("alibi", "relative_bias", "fire", "cope", "fox", "mixture", "rope_alibi", "rse", "path", "path_fox")},
    "sba": "stick-breaking sums softplus in float32 (functional/stick_breaking.py)",
    "rse": "bias and stick-breaking in float32",
    "exposb": "its boosted rotation and distance decay are float32 (encodings/exposb.py)",
    "xpos": "its scale zeta^(p / scale_base) is float32 (encodings/rope_variants.py)",
    "comrope": "the rotation matrices exp(sum_a x_a A_a) are float32 (encodings/rope_matrix.py)",
    "liere": "the rotation matrices exp(sum_a x_a A_a) are float32 (encodings/rope_matrix.py)",
}
#: ValueErrors an encoding raises for inputs it cannot take (the randomized shapes meet them)
DECLARED_LIMITS = (
    r"needs? n_kv_heads == n_heads",  # exposb, multiscale_rope: per-head parameters, per-head k
    r"beyond the learned table",  # learned: 64 rows, offsets beyond them
)


@pytest.fixture(autouse=True)
def _fast_interpreter(monkeypatch):
    fast_triton_interpreter(monkeypatch)
    yield


def _tol(name: str, dtype: str) -> float:
    return TOL["fp32"] if dtype == "fp64" and name in FP32_BY_DESIGN else TOL[dtype]


@functools.lru_cache(maxsize=64)
def _reference(name: str, scenario: str, dtype: str, b: int, n: int, heads: tuple[int, int, int],
               offset: int = 37) -> tuple[Encoding, dict, Inputs, dict, list]:
    """The eager layer's encoding and state in ``dtype``, the inputs, the scenario's arguments and
    the eager float64 whole-sequence result (output, gradients) for them."""
    dt = DTYPES[dtype]
    eager = build_layer(name, "eager", dt, heads)
    state = eager.state_dict()
    x = make_inputs(b, n, heads, dt)
    args = scenario_args(scenario, b, n, encoding_class(name).position_dims, offset=offset)
    full = {k: v for k, v in args.items() if k != "prefill"}
    ref = run_case(build_layer(name, "eager", torch.float64, heads, state), x.to(torch.float64), full, True)
    return eager.encoding or NO_ENCODING, state, x, args, ref


def _compare(got: list, ref: list, tol: float, what: str) -> None:
    out_scale = max(ref[0].abs().max().item(), 1e-30)
    torch.testing.assert_close(got[0].double(), ref[0], atol=tol * out_scale, rtol=0, msg=lambda m: f"{what} output: {m}")
    grads = [r for r in ref[1:] if r is not None]
    g_scale = max([r.abs().max().item() for r in grads] + [1e-30])
    names = ["q", "k", "v", "hidden"] + [f"param {i}" for i in range(len(ref) - 5)]
    for nm, g, r in zip(names, got[1:], ref[1:]):
        assert (g is None) == (r is None), f"{what}: gradient to {nm} is {g is None and 'missing' or 'extra'}"
        if r is not None:
            torch.testing.assert_close(g.double(), r, atol=tol * g_scale, rtol=0, msg=lambda m, nm=nm: f"{what} d{nm}: {m}")


def _refusal(backend: str, enc: Encoding, grad: bool) -> str | None:
    why = get_backend(backend).supports(enc, CPU, grad)
    assert why is None or (isinstance(why, str) and why.strip()), f"{backend} refuses without a reason: {why!r}"
    return why


def _check(name: str, backend: str, dtype: str, scenario: str, b: int = B, n: int = N,
           heads: tuple[int, int, int] = HEADS, offset: int = 37, record=None) -> None:
    enc, state, x, args, ref = _reference(name, scenario, dtype, b, n, heads, offset)
    why_grad = _refusal(backend, enc, True)
    if why_grad is not None:
        why = _refusal(backend, enc, False)
        if why is not None:
            pytest.skip(f"{backend} cannot run {name}: {why}")
        if record is not None:
            record("backward_refused", why_grad)
    layer = build_layer(name, backend, DTYPES[dtype], heads, state)
    got = run_case(layer, x, args, grad=why_grad is None)
    _compare(got, ref if why_grad is None else ref[:1], _tol(name, dtype), f"{name}/{backend}/{dtype}/{scenario}")


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ENCODINGS)
def test_backend_equals_eager_reference(name, backend, dtype, scenario, record_property):
    _check(name, backend, dtype, scenario, record=record_property)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,  # nothing written to the checkout
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(ENCODINGS), backend=st.sampled_from(BACKENDS), scenario=st.sampled_from(SCENARIOS),
       dtype=st.sampled_from(list(DTYPES)), b=st.integers(1, 2), n=st.integers(3, 40).filter(lambda v: v % 16),
       heads=st.sampled_from([(2, 1, 8), (4, 2, 8), (4, 1, 16), (2, 2, 16), (3, 3, 8)]), offset=st.integers(0, 3000))
@example(name="learned", backend="sdpa", scenario="offset", dtype="fp32", b=2, n=13, heads=(2, 2, 8), offset=3000)
@example(name="exposb", backend="eager", scenario="arange", dtype="fp32", b=1, n=5, heads=(4, 2, 8), offset=0)
@example(name="multiscale_rope", backend="eager", scenario="decode", dtype="bf16", b=1, n=5, heads=(2, 1, 8), offset=9)
def test_randomized_shapes(name, backend, scenario, dtype, b, n, heads, offset):
    """Batch sizes, lengths that do not fill the 16-row tiles, grouped kv heads, offsets up to 3000
    (with decoding from explicit positions): the same law. An encoding that cannot take the
    shape raises a declared ValueError, the same for every backend."""
    try:
        _reference(name, scenario, dtype, b, n, heads, offset)
    except ValueError as e:
        assert any(re.search(p, str(e)) for p in DECLARED_LIMITS), f"undeclared refusal: {e}"
        event(f"declared limit of {name}")
        eager = build_layer(name, "eager", DTYPES[dtype], heads)
        enc = eager.encoding or NO_ENCODING
        if _refusal(backend, enc, False) is not None:
            return
        with pytest.raises(ValueError, match=re.escape(str(e)[:40])):
            layer = build_layer(name, backend, DTYPES[dtype], heads, eager.state_dict())
            args = scenario_args(scenario, b, n, encoding_class(name).position_dims, offset=offset)
            run_case(layer, make_inputs(b, n, heads, DTYPES[dtype]), args, _refusal(backend, enc, True) is None)
        return
    try:
        _check(name, backend, dtype, scenario, b, n, heads, offset)
        event(f"compared on {backend}")
    except pytest.skip.Exception:
        event(f"refused by {backend}")  # a backend's declared refusal (asserted to have a reason)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_refusal_names_a_reason(backend):
    """supports() answers None or a non-empty reason for every encoding, with and without
    gradients; eager and sdpa run every encoding but replacements of softmax (sdpa: none)."""
    refused = {}
    for name in ENCODINGS:
        enc = build_layer(name, "eager", torch.float32, HEADS).encoding or NO_ENCODING
        for grad in (True, False):
            why = _refusal(backend, enc, grad)
            if why is not None:
                refused[(name, grad)] = why
    normalizers = {n for n in ENCODINGS if "normalize" in (build_layer(n, "eager", torch.float32, HEADS).encoding
                                                           or NO_ENCODING).stages}
    if backend == "eager":
        assert refused == {}
    if backend == "sdpa":
        assert {n for n, _ in refused} == normalizers
    if backend == "blockwise":  # the declared normalizers only
        assert {n for n, _ in refused} == set(ENCODINGS) - normalizers
    if backend == "flex":  # forward only on CPU; no softmax replacement but a modulated softmax (exposb)
        score_mod = {n for n in normalizers if "score_mod" in build_layer(n, "eager", torch.float32, HEADS)
                     .encoding.normalizer_kind.fused_in}
        assert score_mod == {"exposb"}
        assert {n for n, g in refused if not g} == normalizers - score_mod
        assert {n for n, g in refused if g} == set(ENCODINGS)
