"""A mixture with a rotary member on the Triton kernels in one call (TRITON_INTERPRET=1): the rotary
member's logit change ``scale (q' k'^T - q k^T)`` is a `ProductBias`, which the backend folds into
one product of wider operands ``[(1 - w) q, w q'] . [k, k']`` (v zero-padded to their width), the
other members' biases summed in the same kernels (ALiBi's slopes, one relative table, FIRE's tile).

Against the eager backend in float64: the output and every gradient (q, k, v, hidden, the mixture
weights and every member parameter: ALiBi's, T5's table, FIRE's MLP and its threshold), at arange,
offset, packed, padding and gapped positions, causal and not, grouped kv heads, decoding with a KV
cache, N not a multiple of the 16 x 16 tiles. And the refusals: a head dim whose widened operands
pass the kernels' 128 channels.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from posenc_lightning.attention.backends import get_backend
from posenc_lightning.encodings.base import KernelBias, ProductBias
from posenc_lightning.encodings.registry import build_encoding
from posenc_lightning.inject import inject
from tests.conformance import ConfLayer, make_inputs, run_case, scenario_args
from tests.helpers import fast_triton_interpreter

CPU = torch.device("cpu")
MEMBERS = {"rope_fire": ("rope", "fire"), "all": ("alibi", "relative_bias", "fire", "rope")}


@pytest.fixture(autouse=True)
def _fast_interpreter(monkeypatch):
    fast_triton_interpreter(monkeypatch)
    yield


def _layer(members, backend: str, dtype: torch.dtype, heads, state=None) -> ConfLayer:
    torch.manual_seed(0)
    m = ConfLayer(heads[0], heads[2])
    enc = build_encoding("mixture", members=members, member_cfgs={"fire": {"init_L": 8.0}},
                         init_weights=tuple(0.3 * i - 0.2 for i in range(len(members))))
    inject(m, enc, backend=backend)
    m.to(dtype)
    if state is not None:
        m.load_state_dict(state)
    else:
        with torch.no_grad():  # every parameter away from its initial value: generic gradients
            g = torch.Generator().manual_seed(1)
            for p in m.encoding.parameters():
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return m


@pytest.mark.parametrize("members", list(MEMBERS))
def test_mixture_with_a_rotary_member_is_taken_by_the_kernels(members):
    enc = build_encoding("mixture", members=MEMBERS[members]).bind(n_heads=4, head_dim=64, d_model=256)
    assert enc.product_operands == 1
    assert get_backend("triton").supports(enc, CPU, True) is None
    wide = build_encoding("mixture", members=MEMBERS[members]).bind(n_heads=2, head_dim=128, d_model=256)
    assert "wide" in get_backend("triton").supports(wide, CPU, True)


def test_product_bias_folds_into_wider_operands():
    g = torch.Generator().manual_seed(0)
    q, a = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(2))
    k, b = (torch.randn(2, 2, 7, 8, generator=g) for _ in range(2))
    bias = ProductBias.of(q, k, torch.tensor(-0.3), [(a, b)]).scaled(torch.tensor(0.5))
    ref = -0.15 * q @ k.repeat_interleave(2, 1).transpose(-1, -2) + 0.5 * a @ b.repeat_interleave(2, 1).transpose(-1, -2)
    torch.testing.assert_close(bias.materialize(), ref)
    torch.testing.assert_close(bias.rows(1, 4, 6), ref[..., 1:4, :6])
    kb = KernelBias()
    bias.fold_into(kb)
    assert kb.dense is None and len(kb.products) == 1
    torch.testing.assert_close(kb.own, torch.tensor(-0.15))


CASES = [("arange", True), ("arange", False), ("offset", True), ("packed", True), ("padding", False),
         ("gaps", True), ("decode", True)]


@pytest.mark.parametrize("heads", [(2, 2, 16), (4, 2, 8)], ids=["mha", "gqa"])
@pytest.mark.parametrize("scenario,causal", CASES)
@pytest.mark.parametrize("members", list(MEMBERS))
def test_mixture_triton_equals_eager_float64(members, scenario, causal, heads):
    if heads[0] != heads[1] and (members != "all" or scenario not in ("packed", "decode")):
        pytest.skip("grouped heads on every member kind, two scenarios (the interpreter is slow)")
    b, n = 2, 37
    state = _layer(MEMBERS[members], "eager", torch.float32, heads).state_dict()
    x = make_inputs(b, n, heads, torch.float32, seed=3)
    if scenario == "gaps":
        args = {"positions": torch.cumsum(torch.randint(1, 4, (b, n), generator=torch.Generator().manual_seed(2)), 1)}
    else:
        args = scenario_args(scenario, b, n, 1)
    args["causal"] = causal
    full = {k: v for k, v in args.items() if k != "prefill"}
    ref = run_case(_layer(MEMBERS[members], "eager", torch.float64, heads, state), x.to(torch.float64), full, True)
    got = run_case(_layer(MEMBERS[members], "triton", torch.float32, heads, state), x, args, True)
    assert len(got) == len(ref)
    out_scale = ref[0].abs().max().item()
    torch.testing.assert_close(got[0].double(), ref[0], atol=2e-5 * out_scale, rtol=0)
    g_scale = max(r.abs().max().item() for r in ref[1:] if r is not None)
    for i, (a, r) in enumerate(zip(got[1:], ref[1:])):
        assert (a is None) == (r is None), i
        if r is not None:
            torch.testing.assert_close(a.double(), r, atol=2e-5 * g_scale, rtol=0, msg=lambda m, i=i: f"grad {i}: {m}")
