"""PaTH (Yang et al., 2025, arXiv 2505.16381) against its formula: the blockwise rows equal the
Householder products multiplied out (float64, forward and every gradient), attention through the
mixin equals the naive per-document reference with packed documents, decoding equals the full
forward, memory grows linearly in N, and PaTH-FoX adds FoX's gates.

Tolerances: the rows alone are float64 end to end (``1e-12``; measured <= 5e-15). Through a backend
the bias is materialized in float32 by design (`encodings/bias/`, as every bias kind), so attention
in float64 is float32-accurate: ``2e-6`` of the output / gradient scale (measured <= 1e-7)."""

from __future__ import annotations

import pytest
import torch

from posenc_lightning import inject
from posenc_lightning.attention.kv_cache import LayerKVCache
from posenc_lightning.encodings.path import PaTH, PaTHFoX
from posenc_lightning.functional.fox import fox_cumulative
from posenc_lightning.functional.path import (
    path_attention_naive,
    path_householder,
    path_logit_rows,
    path_logits_naive,
    path_ut_transform,
)
from posenc_lightning.functional.tunables import Tunables
from tests.helpers import Attn

B, H, D = 2, 2, 8
TOL_BACKEND = 2e-6


def _reflections(n: int, seed: int = 0, h: int = H, d: int = D) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, h, n, d, generator=g, dtype=torch.float64) for _ in range(2))
    # beta spread over (0, 2): reflections (beta ~ 2), projections (beta ~ 1) and near-identities
    w, beta = path_householder(torch.randn(B, h, n, d, generator=g, dtype=torch.float64),
                               3 * torch.randn(B, h, n, generator=g, dtype=torch.float64))
    return q, k, w, beta


def test_ut_transform_is_the_product_of_the_chunks_reflections():
    _, _, w, beta = _reflections(7)
    t = path_ut_transform(w, beta)
    eye = torch.eye(D, dtype=torch.float64)
    prod = eye.expand(B, H, D, D)
    for s in range(7):  # H_6 ... H_0: the latest reflection on the left
        prod = (eye - beta[:, :, s, None, None] * w[:, :, s, :, None] * w[:, :, s, None, :]) @ prod
    torch.testing.assert_close(eye - w.transpose(-1, -2) @ t @ w, prod, atol=1e-13, rtol=0)
    assert torch.equal(t, t.tril())


def test_reflections_are_householder_with_beta_in_0_2():
    w, beta = path_householder(torch.randn(3, 5, 8) * 100, torch.tensor([-50.0, 0.0, 50.0]).expand(3, 5, 3)[..., :5])
    torch.testing.assert_close(w.norm(dim=-1), torch.ones(3, 5))
    assert bool((beta >= 0).all() and (beta <= 2).all())
    hh = torch.eye(8) - 2.0 * w[0, 0, :, None] * w[0, 0, None, :]  # beta = 2: orthogonal
    torch.testing.assert_close(hh @ hh, torch.eye(8), atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunk", [1, 4, 5, 64])
@pytest.mark.parametrize("offset,m", [(0, 23), (7, 9), (5, 18), (22, 1)])
def test_rows_equal_the_products_multiplied_out(chunk, offset, m):
    """Blocks of rows starting anywhere (not on a chunk boundary), N = 23 (no multiple of 4 or 5)."""
    n = 23
    q, k, w, beta = _reflections(n)
    qk = q @ k.transpose(-1, -2)
    want = (path_logits_naive(q, k, w, beta) - qk).tril()[:, :, offset:offset + m, :offset + m]
    got = path_logit_rows(q[:, :, offset:offset + m], k[:, :, :offset + m], w, beta, offset, chunk)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_rows_gradients_equal_the_naive_gradients():
    n, offset, m = 13, 4, 9
    q, k, w_raw, b_raw = (t.requires_grad_() for t in (*_reflections(n)[:2], torch.randn(B, H, n, D, dtype=torch.float64),
                                                         torch.randn(B, H, n, dtype=torch.float64)))
    cot = torch.randn(B, H, m, offset + m, dtype=torch.float64).tril(offset)
    grads = []
    for form in ("naive", "rows"):
        w, beta = path_householder(w_raw, b_raw)
        if form == "naive":
            s = path_logits_naive(q, k, w, beta)[:, :, offset:offset + m, :offset + m]
        else:
            s = path_logit_rows(q[:, :, offset:offset + m], k[:, :, :offset + m], w, beta, offset, chunk=4)
            s = s + q[:, :, offset:offset + m] @ k[:, :, :offset + m].transpose(-1, -2)
        grads.append(torch.autograd.grad((s * cot).sum(), (q, k, w_raw, b_raw)))
    for name, a, b in zip(["q", "k", "w", "beta"], *grads):
        assert a.abs().max() > 0, name
        torch.testing.assert_close(b, a, atol=1e-12, rtol=0, msg=lambda s, name=name: f"d{name}: {s}")


def test_rows_with_grouped_kv_heads_repeat_the_keys():
    q, k, w, beta = _reflections(11, h=4)
    k2 = k[:, ::2]
    want = path_logit_rows(q, k2.repeat_interleave(2, dim=1), w, beta, 0, 4)
    torch.testing.assert_close(path_logit_rows(q, k2, w, beta, 0, 4), want, atol=0, rtol=0)


def test_rows_refuse_bad_arguments():
    q, k, w, beta = _reflections(5)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        path_logit_rows(q, k, w, beta, 0, 0)
    with pytest.raises(ValueError, match="w and beta must cover indices 0..6"):
        path_logit_rows(q, k, w, beta, 2, 4)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        PaTH(chunk=0)


# ------------------------------------------------------------------------- through the mixin
def _layer(enc, backend: str = "sdpa") -> Attn:
    torch.manual_seed(0)
    m = Attn(H, D)
    inject(m, enc, backend=backend)
    return m.double()


def _inputs(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, n, D)] * 3 + [(B, n, H * D)]
    return [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]


def _packed(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents of 5, 9 and n - 14 tokens (row 0) and one of n (row 1); positions restart."""
    seg = torch.stack([torch.tensor([0] * 5 + [1] * 9 + [2] * (n - 14)), torch.zeros(n, dtype=torch.long)])
    starts = torch.stack([torch.tensor([0] * 5 + [5] * 9 + [14] * (n - 14)), torch.zeros(n, dtype=torch.long)])
    return seg, torch.arange(n).expand(B, n) - starts


def _assert_scaled_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert want.abs().max() > 0, what
    torch.testing.assert_close(got, want, atol=TOL_BACKEND * float(want.detach().abs().max()), rtol=0, msg=lambda s: f"{what}: {s}")


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_attention_equals_the_naive_reference_with_packed_documents(backend):
    """N = 23 with chunks of 4; every gradient: q, k, v, the layer input and both projections."""
    n = 23
    m = _layer(PaTH(chunk=4), backend)
    q, k, v, hid = _inputs(n)
    seg, pos = _packed(n)
    cot = torch.randn(B, H, n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    enc = m.posenc
    params = [enc.w_proj.weight, enc.beta_proj.weight, enc.beta_proj.bias]
    out = m(q, k, v, positions=pos, hidden=hid, segment_ids=seg)
    got = torch.autograd.grad((out * cot).sum(), [q, k, v, hid, *params])
    w, beta = enc.householder(hid)
    ref = path_attention_naive(q, k, v, w, beta, D ** -0.5, seg)
    want = torch.autograd.grad((ref * cot).sum(), [q, k, v, hid, *params])
    _assert_scaled_close(out, ref, "output")
    for name, a, b in zip(["q", "k", "v", "hidden", "w_proj", "beta_proj.weight", "beta_proj.bias"], got, want):
        _assert_scaled_close(a, b, f"d{name}")


def test_a_product_does_not_cross_a_document_boundary():
    """The second document's output is that of the document alone (its reflections and keys
    only), whatever the first document holds."""
    n = 19
    m = _layer(PaTH(chunk=4))
    q, k, v, hid = (t.detach() for t in _inputs(n))
    seg = torch.tensor([0] * 6 + [1] * 13).expand(B, n)
    out = m(q, k, v, hidden=hid, segment_ids=seg)[:, :, 6:]
    alone = m(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], hidden=hid[:, 6:])
    torch.testing.assert_close(out, alone, atol=1e-6, rtol=0)
    assert (m(q, k, v, hidden=hid)[:, :, 6:] - alone).abs().max() > 1e-3  # unpacked, it would differ


def test_logits_do_not_read_positions():
    """PaTH orders tokens by index: the same call with other positions gives the same output."""
    m = _layer(PaTH(chunk=4))
    q, k, v, hid = (t.detach() for t in _inputs(10))
    a = m(q, k, v, hidden=hid)
    b = m(q, k, v, hidden=hid, positions=torch.arange(10).expand(B, 10) * 3 + 100)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["path", "path_fox"])
def test_decoding_equals_the_full_forward(name):
    """Prefill 9 tokens, then 5 one by one (N = 14, chunks of 4): each step's output and the
    gradients of all of them to the inputs equal the full forward's."""
    n, prefill = 14, 9
    enc = PaTH(chunk=4) if name == "path" else PaTHFoX(chunk=4)
    m = _layer(enc)
    q, k, v, hid = _inputs(n)
    full = m(q, k, v, hidden=hid)
    cache = LayerKVCache()
    steps = [m(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], hidden=hid[:, :prefill], cache=cache)]
    for t in range(prefill, n):
        steps.append(m(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], hidden=hid[:, t:t + 1], cache=cache))
    dec = torch.cat(steps, dim=2)
    _assert_scaled_close(dec, full, "decoded output")
    cot = torch.randn(full.shape, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((dec * cot).sum(), (q, k, v, hid)),
                    torch.autograd.grad((full * cot).sum(), (q, k, v, hid))):
        _assert_scaled_close(a, b, "gradient through the cache")


def test_path_fox_adds_the_forget_gates_to_the_logits():
    n = 17
    m = _layer(PaTHFoX(chunk=4))
    q, k, v, hid = (t.detach() for t in _inputs(n))
    out = m(q, k, v, hidden=hid)
    path, fox = m.posenc.members
    w, beta = path.householder(hid)
    c = fox_cumulative(fox.log_forget(hid)).double()
    s = path_logits_naive(q, k, w, beta) * D ** -0.5 + (c[..., :, None] - c[..., None, :])
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    _assert_scaled_close(out, torch.softmax(s, -1) @ v, "path_fox output")


def test_non_causal_attention_is_refused():
    m = _layer(PaTH())
    q, k, v, hid = (t.detach() for t in _inputs(5))
    with pytest.raises(ValueError, match="path is causal by construction"):
        m(q, k, v, hidden=hid, causal=False)


# ------------------------------------------------------------------------- own attention
TOL_OWN = 1e-12  # the own attention is float64 end to end for float64 inputs (measured <= 3e-15)


def _float32_layer(n: int, h: int, d: int, seed: int) -> tuple[Attn, torch.Generator, tuple[torch.Tensor, ...]]:
    """A float32 PaTH layer on sdpa, the generator its inputs came from, and ``(q, k, v, hidden)``."""
    torch.manual_seed(0)
    m = Attn(h, d)
    inject(m, PaTH(), backend="sdpa")
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, d, generator=g, requires_grad=True) for _ in range(3))
    return m, g, (q, k, v, torch.randn(1, n, h * d, generator=g, requires_grad=True))


def _walked(out: torch.Tensor) -> bool:
    """``out``'s graph runs PaTH's own attention (`encodings.path_attention`), not bias rows."""
    seen, stack = set(), [out.grad_fn]
    while stack:
        f = stack.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        if "PaTHWalk" in type(f).__name__:
            return True
        stack.extend(g for g, _ in f.next_functions)
    return False


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    assert want.abs().max() > 0, what
    torch.testing.assert_close(got, want, atol=tol * float(want.detach().abs().max()), rtol=0,
                               msg=lambda s: f"{what}: {s}")


@pytest.mark.parametrize("n,chunk,budget,kv_heads", [(23, 4, None, H), (23, 4, 1, 1), (37, 5, 3000, H)])
def test_own_attention_equals_the_naive_reference(n, chunk, budget, kv_heads):
    """Without documents sdpa lets PaTH compute the whole attention (`Bias.own_attention`); its
    output and every gradient equal the float64 reference: N not a multiple of the chunk, grouped
    kv heads, and walks of one chunk per block (``budget`` 1) or a few (3000 bytes)."""
    m = _layer(PaTH(chunk=chunk))
    if budget is not None:
        m.posenc_tunables = Tunables(path_walk_bytes=budget)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, n, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, kv_heads, n, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    hid = torch.randn(B, n, H * D, generator=g, dtype=torch.float64, requires_grad=True)
    enc = m.posenc
    params = [enc.w_proj.weight, enc.beta_proj.weight, enc.beta_proj.bias]
    out = m(q, k, v, hidden=hid)
    assert _walked(out)
    cot = torch.randn(out.shape, dtype=torch.float64, generator=g)
    got = torch.autograd.grad((out * cot).sum(), [q, k, v, hid, *params])
    w, beta = enc.householder(hid)
    rep = H // kv_heads
    ref = path_attention_naive(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), w, beta, D ** -0.5)
    want = torch.autograd.grad((ref * cot).sum(), [q, k, v, hid, *params])
    _close(out, ref, TOL_OWN, "output")
    for name, a, b in zip(["q", "k", "v", "hidden", "w_proj", "beta_proj.weight", "beta_proj.bias"], got, want):
        _close(a, b, TOL_OWN, f"d{name}")


def test_own_attention_after_a_cache_at_an_offset():
    """6 tokens, then 11 at once (queries from key 6, inside a chunk of 4): the second call's
    output and gradients (through the cache too) equal the full reference's."""
    n, first = 17, 6
    m = _layer(PaTH(chunk=4))
    q, k, v, hid = _inputs(n)
    cache = LayerKVCache()
    m(q[:, :, :first], k[:, :, :first], v[:, :, :first], hidden=hid[:, :first], cache=cache)
    out = m(q[:, :, first:], k[:, :, first:], v[:, :, first:], hidden=hid[:, first:], cache=cache)
    assert _walked(out)
    w, beta = m.posenc.householder(hid)
    ref = path_attention_naive(q, k, v, w, beta, D ** -0.5)[:, :, first:]
    cot = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    _close(out, ref, TOL_OWN, "output")
    for a, b in zip(torch.autograd.grad((out * cot).sum(), (q, k, v, hid)),
                    torch.autograd.grad((ref * cot).sum(), (q, k, v, hid))):
        _close(a, b, TOL_OWN, "gradient")


def test_own_attention_in_float32_at_the_default_chunk():
    """The float32 path the layers take (chunk 64, N 130: three chunks, the last partial)
    against the float64 reference, forward and the gradients of q, k, v and the layer input."""
    n, h, d = 130, 2, 16
    m, g, (q, k, v, hid) = _float32_layer(n, h, d, seed=5)
    out = m(q, k, v, hidden=hid)
    assert _walked(out) and out.dtype == torch.float32
    cot = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad((out * cot).sum(), (q, k, v, hid))
    w, beta = m.posenc.householder(hid)
    ref = path_attention_naive(q, k, v, w, beta, d ** -0.5)
    want = torch.autograd.grad((ref * cot.double()).sum(), (q, k, v, hid))
    _close(out.double(), ref, 2e-6, "output")
    for name, a, b in zip("qkvh", got, want):
        _close(a.double(), b.double(), 2e-5, f"d{name}")


def test_path_fox_own_attention_takes_the_gates_as_a_key_bias():
    """PaTH-FoX's sum runs PaTH's own attention with FoX's gates as a per-key bias; output and
    every gradient (both encodings' parameters) equal the float64 reference, in blocks of one chunk."""
    n = 19
    m = _layer(PaTHFoX(chunk=4))
    m.posenc_tunables = Tunables(path_walk_bytes=1)
    q, k, v, hid = _inputs(n)
    params = list(m.posenc.parameters())
    out = m(q, k, v, hidden=hid)
    assert _walked(out)
    path, fox = m.posenc.members
    w, beta = path.householder(hid)
    c = fox_cumulative(fox.log_forget(hid)).double()
    s = path_logits_naive(q, k, w, beta) * D ** -0.5 + (c[..., :, None] - c[..., None, :])
    ref = torch.softmax(s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")), -1) @ v
    cot = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    _close(out, ref, TOL_OWN, "output")
    for a, b in zip(torch.autograd.grad((out * cot).sum(), [q, k, v, hid, *params]),
                    torch.autograd.grad((ref * cot).sum(), [q, k, v, hid, *params])):
        _close(a, b, TOL_OWN, "gradient")


@pytest.mark.parametrize("budget", [None, 1])
def test_own_attention_with_packed_documents(budget):
    """Documents 5, 9 and 9 tokens (row 0) and one of 23 (row 1), chunks of 4 straddling the
    boundaries: the own attention keeps each query in its document; output and every gradient
    equal the per-document float64 reference."""
    n = 23
    m = _layer(PaTH(chunk=4))
    if budget is not None:
        m.posenc_tunables = Tunables(path_walk_bytes=budget)
    q, k, v, hid = _inputs(n)
    seg, pos = _packed(n)
    enc = m.posenc
    params = [enc.w_proj.weight, enc.beta_proj.weight, enc.beta_proj.bias]
    out = m(q, k, v, positions=pos, hidden=hid, segment_ids=seg)
    assert _walked(out)
    w, beta = enc.householder(hid)
    ref = path_attention_naive(q, k, v, w, beta, D ** -0.5, seg)
    cot = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    _close(out, ref, TOL_OWN, "output")
    for a, b in zip(torch.autograd.grad((out * cot).sum(), [q, k, v, hid, *params]),
                    torch.autograd.grad((ref * cot).sum(), [q, k, v, hid, *params])):
        _close(a, b, TOL_OWN, "gradient")


def test_key_padding_takes_the_rows_form():
    """With key padding the own attention declines (its mask is causal within documents): bias
    rows run, and agree with it where nothing is padded."""
    n = 13
    m = _layer(PaTH(chunk=4))
    q, k, v, hid = (t.detach() for t in _inputs(n))
    keep = torch.ones(B, n, dtype=torch.bool)
    rows = m(q, k, v, hidden=hid, key_padding_mask=keep)
    assert rows.grad_fn is not None and not _walked(rows)
    torch.testing.assert_close(rows, m(q, k, v, hidden=hid), atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------ memory
def _peak_fwd_bwd(n: int, h: int = 4, d: int = 32) -> int:
    from benchmarks.memory import peak_allocated_bytes

    m, g, (q, k, v, hid) = _float32_layer(n, h, d, seed=0)
    cot = torch.randn(q.shape, generator=g)

    def step():
        out = m(q, k, v, hidden=hid)
        torch.autograd.grad(out, [q, k, v, hid, *m.posenc.parameters()], cot)

    step()
    return peak_allocated_bytes(step)


def test_memory_grows_linearly_in_n():
    """Allocator peak of forward+backward (4 heads of 32, default chunk and row blocks): from
    N = 1024 to 2048 it grows less than 2.5x (an N x N term would quadruple it) and stays under
    one ``H x N x N`` float32 tensor at 2048 (64 MiB)."""
    small, large = _peak_fwd_bwd(1024), _peak_fwd_bwd(2048)
    assert large / small < 2.5, f"peak grows {large / small:.2f}x from N=1024 to 2048"
    assert large < 4 * 2048 * 2048 * 4, f"peak {large / 2**20:.1f} MiB at N=2048"
