"""A bias that is one value per query row before some key (`Bias.constant_before`, `Bias.rows_past`)
runs those keys on SDPA's CPU kernel with no mask (`runs`): forward and every gradient equal the
dense formula in float64, with a kind defined here (a clipped relative bias plus a content term)
and with CoPE past its clamp; cached keys, GQA, batches, lengths that divide no block."""

import pytest
import torch

from posenc_lightning import inject
from posenc_lightning.attention.backends import sdpa
from posenc_lightning.attention.backends.sdpa import rows as _rows
from posenc_lightning.attention.backends.sdpa import runs as _runs
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import DenseBias, span
from posenc_lightning.encodings.cope import encoding as ecope
from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables
from tests.helpers import Attn

R = 9  # distances from R on share one table entry: the bias is q_i . w_h + t_h[min(i - j, R)]


def clipped(q, w, t, q_offset, s, e, k0, ke):
    """Rows ``[s, e)`` x keys ``[k0, ke)`` of ``q_i . w_h + t_h[min(i - j, R)]`` (0 past the query)."""
    i = torch.arange(s, e)[:, None] + q_offset
    d = (i - torch.arange(k0, ke)[None, :]).clamp(0, R)
    return (q @ w[..., None]) + t[:, d]


def clipped_bias(q, w, t, q_offset):
    n_q, n_k = q.shape[-2], q_offset + q.shape[-2]

    def past(s, e, k0, ke, qs, w_, t_):
        return clipped(qs, w_, t_, q_offset, s, e, k0, ke)

    return DenseBias.lazy(lambda s, e, ke, *v: past(s, e, 0, ke, *v), n_q, n_k, inputs=(q, w, t),
                          window=lambda s, e, ke: (span(s, e, -2), None, None),
                          constant_before=lambda s, e, ke: max(0, s + q_offset - R + 1), rows_past=past)


def counted(monkeypatch):
    """Count the blocks that ran in the run form, forward and backward (the real functions)."""
    calls = {"forward": 0, "backward": 0}

    def wrap(module, name, key):
        real = getattr(module, name)

        def f(*a, **kw):
            calls[key] += 1
            return real(*a, **kw)

        monkeypatch.setattr(module, name, f)

    wrap(_runs, "attend_run", "forward")
    wrap(_rows, "run_backward", "backward")
    return calls


@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("q_offset", [0, 13])
def test_runs_equal_the_dense_formula(hkv, q_offset, monkeypatch):
    tunables = Tunables(bias_block_bytes=1)  # the minimum blocks: 16 query rows, 8 in backward
    calls = counted(monkeypatch)
    torch.manual_seed(0)
    b, h, n, d = 2, 4, 75, 8
    q = torch.randn(b, h, n, d, requires_grad=True)
    k = torch.randn(b, hkv, n + q_offset, d, requires_grad=True)
    v = torch.randn(b, hkv, n + q_offset, d, requires_grad=True)
    w = torch.randn(h, d, requires_grad=True)
    t = torch.randn(h, R + 1, requires_grad=True)
    mask = AttentionMask(True, q_offset, n, n + q_offset)
    out = sdpa.attend(q, k, v, bias=clipped_bias(q, w, t, q_offset), mask=mask, scale=0.3, tunables=tunables)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), [q, k, v, w, t])
    assert calls["forward"] > 0 and calls["backward"] > 0

    q64, k64, v64, w64, t64 = (x.double() for x in (q, k, v, w, t))
    kr, vr = (x.repeat_interleave(h // hkv, dim=1) for x in (k64, v64))
    s = q64 @ kr.mT * 0.3 + clipped(q64, w64, t64, q_offset, 0, n, 0, n + q_offset)
    s = s.masked_fill(~mask.materialize(q.device), float("-inf"))
    ref = torch.softmax(s, -1) @ vr
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for a, b_ in zip(got, torch.autograd.grad((ref * g.double()).sum(), [q64, k64, v64, w64, t64])):
        torch.testing.assert_close(a.double(), b_, rtol=1e-4, atol=1e-5)
    before = calls["forward"]
    with torch.no_grad():  # inference: the rows form, with runs too
        out = sdpa.attend(q, k, v, bias=clipped_bias(q, w, t, q_offset), mask=mask, scale=0.3, tunables=tunables)
    assert calls["forward"] > before
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_rows_past_are_the_rows_from_their_first_key():
    torch.manual_seed(0)
    q, w, t = torch.randn(1, 4, 30, 8), torch.randn(4, 8), torch.randn(4, R + 1)
    bias = clipped_bias(q, w, t, 5)
    views = [q[:, :, 16:30], w, t]
    c = bias.constant_before(16, 30, 35)
    assert c == 16 + 5 - R + 1
    full = bias.rows_from(16, 30, 35, views)
    torch.testing.assert_close(bias.rows_past(16, 30, c - 1, 35, views), full[..., c - 1:])
    assert (full[..., :c] == full[..., :1]).all()  # one value per row before c
    scaled = bias.scaled(torch.tensor(0.5))
    assert scaled.constant_before(16, 30, 35) == c
    torch.testing.assert_close(scaled.rows_past(16, 30, c - 1, 35, [*views, torch.tensor(0.5)]), full[..., c - 1:] * 0.5)


@pytest.mark.parametrize("hkv", [4, 2])
def test_cope_past_its_clamp_runs_on_the_kernel(hkv, monkeypatch):
    """CoPE with few positions on long rows: most keys are clamped, so most blocks run in the run
    form, their rows on each row's band (`cope_band_rows`); the attention and all its gradients
    equal the eager backend's in float64, with GQA too."""
    tunables = Tunables(bias_block_bytes=2**14)
    calls = counted(monkeypatch)
    banded = {"n": 0}
    real = ecope.cope_band_rows

    def band_rows(*a, **kw):
        banded["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(ecope, "cope_band_rows", band_rows)
    n, h, d = 203, 4, 8
    attn = Attn(n_heads=h, head_dim=d)
    attn.posenc_tunables = tunables
    enc = inject(attn, "cope", backend="sdpa", max_position=5, init_std=0.5)
    torch.manual_seed(0)
    q = torch.randn(1, h, n, d, requires_grad=True)
    k, v = (torch.randn(1, hkv, n, d, requires_grad=True) for _ in range(2))
    kw = {"positions": torch.arange(n)[None], "causal": True}
    out = attn(q, k, v, **kw)
    g = torch.randn_like(out)
    params = [q, k, v, enc.pos_emb]
    got = torch.autograd.grad((out * g).sum(), params)
    assert calls["forward"] > 0 and calls["backward"] > 0 and banded["n"] >= calls["forward"] + calls["backward"]
    attn.posenc_backend = "eager"
    enc.double()
    ref = attn(*(x.double() for x in (q, k, v)), **kw)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(got, torch.autograd.grad((ref * g.double()).sum(), params)):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5)


def test_run_form_needs_a_run_that_pays():
    """A block runs in the run form only where the keys past the run are at most `Tunables.run_share` of its
    keys; no run (0) or one over all of them (`k_stop`) leaves the block to the engine."""
    bias = DenseBias.lazy(lambda s, e, ke: torch.zeros(1, 1, e - s, ke), 10, 100,
                          constant_before=lambda s, e, ke: ke - 40)
    assert _runs.run_of(bias, 0, 10, 100) == 60
    over = int(40 / DEFAULT_TUNABLES.run_share)  # the fewest keys of which 40 past the run are at most the share
    assert _runs.run_of(bias, 0, 10, over + 1) == over + 1 - 40
    assert _runs.run_of(bias, 0, 10, over - 1) == 0  # 40 of them past the run: over the share
    assert _runs.run_of(DenseBias.lazy(lambda s, e, ke: torch.zeros(1, 1, e - s, ke), 10, 100), 0, 10, 100) == 0
    full = DenseBias.lazy(lambda s, e, ke: torch.zeros(1, 1, e - s, ke), 10, 100, constant_before=lambda s, e, ke: ke)
    assert _runs.run_of(full, 0, 10, 100) == 0


def test_run_form_needs_a_run_every_query_sees():
    """A run that reaches the block's first query (a bias whose idea of the queries' keys is not the
    mask's) leaves the block to the engine: the first query must see all the run and a key past it."""
    zeros = lambda s, e, ke: torch.zeros(1, 1, e - s, ke)
    mask = AttentionMask(True, 0, 600, 600)
    late = DenseBias.lazy(zeros, 600, 600, constant_before=lambda s, e, ke: s + 1)
    assert all(c == 0 for *_, c in _runs.run_blocks(late, mask, 1, 1, 600, 600, 32))
    early = DenseBias.lazy(zeros, 600, 600, constant_before=lambda s, e, ke: s)
    runs = [(s, c) for s, _, _, c in _runs.run_blocks(early, mask, 1, 1, 600, 600, 32) if c]
    assert runs and all(c == s for s, c in runs)


def test_run_blocks_cover_the_rows_once():
    """Blocks are consecutive and cover every query once; a run-form block takes `run_rows` rows
    (more as its queries see more keys), any other the engine's."""
    torch.manual_seed(0)
    q_offset, n = 40, 700
    bias = clipped_bias(torch.randn(1, 4, n, 8), torch.randn(4, 8), torch.randn(4, R + 1), q_offset)
    mask = AttentionMask(True, q_offset, n, n + q_offset)
    blocks = list(_runs.run_blocks(bias, mask, 1, 4, n, n + q_offset, 24))
    assert [b[0] for b in blocks] == [0] + [b[1] for b in blocks[:-1]] and blocks[-1][1] == n
    for start, stop, k_stop, c in blocks:
        assert k_stop == q_offset + stop
        if c:
            assert c == bias.constant_before(start, stop, k_stop)
            assert stop - start == min(n - start, _runs.run_rows(q_offset + start, 1, 4))
        else:
            assert stop - start == min(n - start, 24)
    sizes = [e - s for s, e, _, c in blocks if c]
    assert sizes[-2] > sizes[0]  # the run form's blocks grow with their keys
