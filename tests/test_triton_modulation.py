"""The softmax kernels with a normalizer's distance modulation (ExpoSB's stage 4,
`Normalizer.kernel_modulation`) under TRITON_INTERPRET=1, against float64 references written from
the formula ``softmax((q k^T scale + bias) * (floor + (1 - floor) exp(-decay |i - j|)))``:

- `fused_attention` with ``modulation``: forward and the gradients to q, k, v and ALiBi's slopes
  (the modulation multiplies the bias too), causal and not, a KV-cache offset, packed documents,
  padding, grouped kv heads, integer and float positions that are not a range, N not a multiple of
  the tiles (several tilings);
- ExpoSB on the triton backend (its rotation and gains before the kernels, the modulation inside)
  against the eager backend in float64: the output and every gradient (q, k, v, hidden,
  ``band_weights``, ``decay_rates``), at arange, offset, packed, padding and gapped positions,
  causal and not, and its decoding with a KV cache;
- ExpoSB on flex (its ``score_mod`` multiplies the logit by the modulation): the forward on CPU,
  where flex runs eagerly and has no backward.

A strong decay (0.1 and 0.3, not the default 0.005) makes the modulation change the result far
beyond the tolerances (checked: the references with and without it differ).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from posenc_lightning.attention.backends import get_backend
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import LinearBias
from posenc_lightning.encodings.registry import build_encoding
from posenc_lightning.kernels.fused import fused_attention
from tests.conformance import ConfLayer, make_inputs, run_case, scenario_args
from tests.helpers import fast_triton_interpreter

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fast_interpreter(monkeypatch):
    fast_triton_interpreter(monkeypatch)
    yield


def _modulation(qp, kp, decay, floor):
    dist = (qp.double()[:, :, None] - kp.double()[:, None, :]).abs()
    return (floor + (1 - floor) * torch.exp(-decay * dist))[:, None]


def _reference(q, k, v, *, scale, decay, floor, qp, kp, causal, q_offset=0, q_seg=None, k_seg=None, k_valid=None,
               slopes=None, modulate=True):
    """float64 ``softmax((q k^T scale + bias) * mod) v`` over the visible keys (a row that sees none: 0)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    z = q @ k.transpose(-1, -2) * scale
    if slopes is not None:
        z = z + LinearBias(slopes, qp, kp).materialize().double()
    if modulate:
        z = z * _modulation(qp, kp, decay, floor)
    m = AttentionMask(causal, q_offset, q.shape[2], k.shape[2], q_seg, k_seg, k_valid).materialize(q.device)
    if m is not None:
        z = z.masked_fill(~m, float("-inf"))
    return torch.nan_to_num(torch.softmax(z, -1), nan=0.0) @ v


TILES = {"16x16": None, "16x32": {"BM": 16, "BN": 32, "num_warps": 1, "num_stages": 1},
         "32x16": {"BM": 32, "BN": 16, "num_warps": 1, "num_stages": 1}}
CASES = {
    # name: (causal, q_offset, Nq, Nk, heads (h, hkv), positions, segments, padding, slopes)
    "causal": (True, 0, 37, 37, (2, 2), "arange", False, False, False),
    "full": (False, 0, 37, 37, (2, 2), "arange", False, False, False),
    "offset": (True, 21, 19, 40, (2, 2), "arange", False, False, False),
    "gaps_int": (True, 0, 37, 37, (2, 2), "gaps", False, False, False),
    "float_pos": (False, 0, 33, 41, (2, 2), "float", False, False, False),
    "packed": (True, 0, 37, 37, (2, 2), "packed", True, False, False),
    "padding": (False, 0, 37, 37, (2, 2), "arange", False, True, False),
    "gqa_alibi": (True, 0, 37, 37, (4, 2), "gaps", False, False, True),
}


def _positions(kind: str, b: int, nq: int, nk: int, q_offset: int, g: torch.Generator):
    if kind == "arange":
        return torch.arange(nq).expand(b, nq) + q_offset, torch.arange(nk).expand(b, nk)
    if kind == "gaps":  # integer, increasing by 1 to 3
        p = torch.cumsum(torch.randint(1, 4, (b, max(nq, nk)), generator=g), 1) + 5
        return p[:, :nq].contiguous(), p[:, :nk].contiguous()
    if kind == "float":  # unordered float positions
        return torch.rand(b, nq, generator=g, dtype=torch.float64) * 60, torch.rand(b, nk, generator=g,
                                                                                 dtype=torch.float64) * 60
    if kind == "packed":  # documents of 14, 11, 12 tokens, positions restarting in each
        p = torch.cat([torch.arange(14), torch.arange(11), torch.arange(12)])[None].expand(b, -1)
        return p, p
    raise ValueError(kind)


@pytest.mark.parametrize("tiling", list(TILES))
@pytest.mark.parametrize("case", list(CASES))
def test_fused_modulation_equals_float64_reference(case, tiling):
    causal, off, nq, nk, (h, hkv), pos, seg, pad, alibi = CASES[case]
    if tiling != "16x16" and case not in ("causal", "offset", "gqa_alibi"):
        pytest.skip("other tilings on the causal cases only (the interpreter is slow)")
    b, d, decay, floor = 2, 16, 0.1, 0.6
    g = torch.Generator().manual_seed(7)
    q = torch.randn(b, h, nq, d, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, hkv, nk, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    qp, kp = _positions(pos, b, nq, nk, off, g)
    q_seg = torch.cat([torch.zeros(14), torch.ones(11), 2 * torch.ones(12)]).long()[None].expand(b, -1) if seg else None
    k_valid = None
    if pad:
        k_valid = torch.ones(b, nk, dtype=torch.bool)
        k_valid[-1, :3] = False
        k_valid[0, nk - 4] = False
    slopes = torch.tensor([0.3, 0.1, 0.05, 0.02][:h], dtype=torch.float64, requires_grad=True) if alibi else None
    scale = d ** -0.5
    kw = {"scale": scale, "causal": causal, "q_offset": off, "q_seg": q_seg, "k_seg": q_seg, "k_valid": k_valid,
          "slopes": slopes}
    ref = _reference(q, k, v, decay=decay, floor=floor, qp=qp, kp=kp, **kw)
    plain = _reference(q, k, v, decay=decay, floor=floor, qp=qp, kp=kp, modulate=False, **kw)
    assert (ref - plain).abs().max() > 1e-2  # the modulation matters at these sizes
    tiles = {kind: TILES[tiling] for kind in ("fwd", "bwd_dkdv", "bwd_dq")} if TILES[tiling] else None
    out = fused_attention(q, k, v, scale=scale, causal=causal, q_offset=off, q_segments=q_seg, k_valid=k_valid,
                          slopes=slopes, bias_q_pos=qp, bias_k_pos=kp, modulation=(decay, floor), tiles=tiles)
    ins = [t for t in (q, k, v, slopes) if t is not None]
    cot = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got_g = torch.autograd.grad(out, ins, cot)
    ref_g = torch.autograd.grad(ref, ins, cot)
    # float64 throughout but the modulation's scalars, passed as float32 (decay * log2(e), floor)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    for name, a, r in zip(["q", "k", "v", "slopes"], got_g, ref_g):
        torch.testing.assert_close(a, r, atol=1e-6 * max(1.0, r.abs().max().item()), rtol=0,
                                   msg=lambda m, n=name: f"d{n}: {m}")


def test_fused_modulation_at_default_range_positions():
    """Without given positions the kernels modulate at ``q_offset + arange`` and ``arange`` (computed
    from the indices, `Plan.pos_start`)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 20, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 2, 45, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    qp, kp = torch.arange(25, 45)[None], torch.arange(45)[None]
    ref = _reference(q, k, v, scale=0.25, decay=0.3, floor=0.5, qp=qp, kp=kp, causal=True, q_offset=25)
    out = fused_attention(q, k, v, scale=0.25, causal=True, q_offset=25, modulation=(0.3, 0.5))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    for a, r in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(a, r, atol=1e-6, rtol=0)


def test_modulation_refused_with_stick_breaking():
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="stick-breaking"):
        fused_attention(q, q, q, stick_breaking=True, modulation=(0.1, 0.5))


# ------------------------------------------------------------------------------- ExpoSB on the backend
def _layer(backend: str, dtype: torch.dtype, heads, state=None, decay=0.1) -> ConfLayer:
    from posenc_lightning.inject import inject

    torch.manual_seed(0)
    m = ConfLayer(heads[0], heads[2])
    inject(m, build_encoding("exposb", distance_decay=decay, distance_floor=0.6), backend=backend)
    m.to(dtype)
    if state is not None:
        m.load_state_dict(state)
    else:
        with torch.no_grad():  # parameters away from their initial values, so their gradients are generic
            m.encoding.band_weights.mul_(torch.tensor([1.3, 0.7]))
            m.encoding.decay_rates.add_(torch.tensor([0.02, 0.05]))
    return m


def test_exposb_is_routed_to_the_kernels_by_its_declared_normalizer():
    enc = build_encoding("exposb").bind(n_heads=2, head_dim=16, d_model=32)
    assert get_backend("triton").supports(enc, CPU, True) is None
    assert enc.normalize(None).kernel_modulation() == (enc.distance_decay, enc.distance_floor)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scenario", ["arange", "offset", "packed", "padding", "gaps", "decode"])
def test_exposb_triton_equals_eager_float64(scenario, causal):
    if scenario == "decode" and not causal:
        pytest.skip("decoding is causal")
    heads, b, n = (2, 2, 16), 2, 37
    eager = _layer("eager", torch.float32, heads)
    state = eager.state_dict()
    x = make_inputs(b, n, heads, torch.float32, seed=5)
    if scenario == "gaps":
        args = {"positions": torch.cumsum(torch.randint(1, 4, (b, n), generator=torch.Generator().manual_seed(2)), 1)}
    else:
        args = scenario_args(scenario, b, n, 1)
    if not causal:
        args["causal"] = False
    full = {k: v for k, v in args.items() if k != "prefill"}
    ref = run_case(_layer("eager", torch.float64, heads, state), x.to(torch.float64), full, True)
    got = run_case(_layer("triton", torch.float32, heads, state), x, args, True)
    assert len(got) == len(ref) == 7  # output; q, k, v, hidden; band_weights, decay_rates
    out_scale = ref[0].abs().max().item()
    torch.testing.assert_close(got[0].double(), ref[0], atol=2e-5 * out_scale, rtol=0)
    g_scale = max(r.abs().max().item() for r in ref[1:] if r is not None)
    for name, a, r in zip(["q", "k", "v", "hidden", "band_weights", "decay_rates"], got[1:], ref[1:]):
        assert (a is None) == (r is None), name
        if r is not None:
            torch.testing.assert_close(a.double(), r, atol=2e-5 * g_scale, rtol=0, msg=lambda m, nm=name: f"d{nm}: {m}")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scenario", ["padding", "gaps"])
def test_exposb_flex_forward_equals_eager_float64(scenario, causal):
    heads, b, n = (2, 2, 16), 2, 37
    state = _layer("eager", torch.float32, heads).state_dict()
    x = make_inputs(b, n, heads, torch.float32, seed=6)
    if scenario == "gaps":
        args = {"positions": torch.cumsum(torch.randint(1, 4, (b, n), generator=torch.Generator().manual_seed(4)), 1)}
    else:
        args = scenario_args(scenario, b, n, 1)
    args["causal"] = causal
    ref = run_case(_layer("eager", torch.float64, heads, state), x.to(torch.float64), args, False)
    got = run_case(_layer("flex", torch.float32, heads, state), x, args, False)
    torch.testing.assert_close(got[0].double(), ref[0], atol=2e-5 * ref[0].abs().max().item(), rtol=0)
