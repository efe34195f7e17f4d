"""A layer's sliding window or chunk (`AttentionMask.window`, `.chunk`) on every backend, against a
float64 reference written from the definitions: key j is visible to query i iff ``0 <= i - j < W``
(window) or ``i // C == j // C`` and ``j <= i`` (chunk), by index; biases from their formulas
(ALiBi's ``-m_h |p_i - p_j|``, FIRE's MLP of ``psi(p_i - p_j) / psi(max(L, p_i))``)."""

import math

import pytest
import torch

from posenc_lightning import LayerKVCache, inject
from posenc_lightning.attention.backends import resolve_backend
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.functional.alibi import alibi_slopes
from posenc_lightning.functional.fire import fire_mlp_reference
from tests.helpers import Attn, fast_triton_interpreter

B, H, D = 2, 2, 16
WINDOW = 64


def _visible(n_q: int, n_k: int, q_offset: int, window: int | None, chunk: int | None) -> torch.Tensor:
    i = torch.arange(n_q)[:, None] + q_offset
    j = torch.arange(n_k)[None, :]
    ok = (i - j >= 0)
    if window is not None:
        ok &= i - j < window
    if chunk is not None:
        ok &= (i // chunk) == (j // chunk)
    return ok


def _positions(n: int) -> torch.Tensor:
    """Increasing positions with gaps (not an arange), different per row."""
    g = torch.Generator().manual_seed(3)
    steps = torch.randint(1, 4, (B, n), generator=g)
    return torch.cumsum(steps, 1) + torch.tensor([[0], [17]])


def _alibi_ref(enc, qp, kp):
    m = alibi_slopes(H).double()
    return -m[None, :, None, None] * (qp[:, None, :, None] - kp[:, None, None, :]).abs().double()


def _fire_ref(enc, qp, kp, params):
    c, lmul, w1, b1, w2, b2 = params
    L = (lmul * enc.init_L.double()).abs()

    def psi(x):
        return torch.log1p((c * x).abs())

    qd, kd = qp.double(), kp.double()
    x = psi(qd[:, :, None] - kd[:, None, :]) / (psi(torch.maximum(qd, L)[:, :, None]) + enc.eps)
    b, nq, nk = x.shape
    return fire_mlp_reference(x.reshape(b, nq * nk), w1[:, 0], b1, w2, b2).reshape(b, -1, nq, nk)


def _reference(q, k, v, bias, visible, scale):
    logits = (q.double() @ k.double().transpose(-1, -2)) * scale + bias
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, -1) @ v.double()


def _case(name: str, n: int, window, chunk, backend: str, dtype=torch.float64):
    torch.manual_seed(0)
    m = Attn(n_heads=H, head_dim=D)
    cfg = {"init_L": 40.0, "init_c": 0.5} if name == "fire" else {}
    enc = inject(m, name, backend=backend, **cfg)
    enc.to(dtype)
    m.posenc_window, m.posenc_chunk = window, chunk
    q, k, v = (torch.randn(B, H, n, D, dtype=dtype, requires_grad=True) for _ in range(3))
    pos = _positions(n)
    out = m(q, k, v, positions=pos)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    got = [out.detach(), q.grad, k.grad, v.grad] + [p.grad for p in enc.parameters() if p.requires_grad]
    # the reference
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    if name == "alibi":
        bias, params = _alibi_ref(enc, pos, pos), []
    else:
        params = [t.detach().double().requires_grad_() for t in enc.bias_params()]
        bias = _fire_ref(enc, pos, pos, params)
    ref = _reference(qr, kr, vr, bias, _visible(n, n, 0, window, chunk), 1 / math.sqrt(D))
    (ref * w.double()).sum().backward()
    learned = enc.bias_params() if name == "fire" else ()
    want = [ref.detach(), qr.grad, kr.grad, vr.grad] + [p.grad for p, e in zip(params, learned) if e.requires_grad]
    return got, want


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["alibi", "fire"])
@pytest.mark.parametrize("local", [{"window": WINDOW}, {"chunk": 48}, {"window": 40, "chunk": 64}])
def test_windowed_bias_equals_reference(backend, name, local):
    got, want = _case(name, 150, local.get("window"), local.get("chunk"), backend)
    assert len(got) == len(want)
    # FIRE computes its distances in float32 whatever the inputs (`fire_normalized_distance`)
    tol = {"rtol": 1e-6, "atol": 1e-8} if name == "alibi" else {"rtol": 1e-5, "atol": 1e-5}
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r, **tol)


def test_window_changes_the_output():
    """The window is not a no-op: a query 100 tokens in differs from the full causal attention."""
    torch.manual_seed(0)
    m = Attn(n_heads=H, head_dim=D)
    inject(m, "alibi", backend="sdpa")
    q, k, v = (torch.randn(1, H, 120, D) for _ in range(3))
    full = m(q, k, v)
    m.posenc_window = WINDOW
    local = m(q, k, v)
    torch.testing.assert_close(local[:, :, :WINDOW], full[:, :, :WINDOW])
    assert (local[:, :, WINDOW:] - full[:, :, WINDOW:]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["alibi", "fire"])
def test_windowed_bias_flex_forward(name):
    pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(0)
    m = Attn(n_heads=H, head_dim=D)
    enc = inject(m, name, backend="flex", **({"init_L": 40.0, "init_c": 0.5} if name == "fire" else {}))
    m.posenc_window = WINDOW
    q, k, v = (torch.randn(B, H, 100, D) for _ in range(3))
    pos = _positions(100)
    with torch.no_grad():
        out = m(q, k, v, positions=pos)
        bias = _alibi_ref(enc, pos, pos) if name == "alibi" else _fire_ref(
            enc, pos, pos, [t.double() for t in enc.bias_params()])
        ref = _reference(q, k, v, bias, _visible(100, 100, 0, WINDOW, None), 1 / math.sqrt(D))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,n,local", [(name, n, local) for name in ("alibi", "fire")
                                          for n, local in ((37, {"chunk": 16}), (80, {"window": WINDOW}))]
                         + [("alibi", 80, {"window": 40, "chunk": 64})])
def test_local_bias_triton_interpreter(name, n, local, monkeypatch):
    """The kernels take a chunk as segment ids and a window as their loop bounds and edge mask
    (N 80: the 64-token window hides keys from the last 16 queries; FIRE's MLP per tile is slow
    under the interpreter, hence no larger N)."""
    pytest.importorskip("triton")
    fast_triton_interpreter(monkeypatch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got, want = _case(name, n, local.get("window"), local.get("chunk"), "triton", dtype=torch.float32)
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-4)


def test_window_routes_away_from_backends_without_it(monkeypatch):
    """A backend that does not declare "window" in ``LOCAL_MASKS`` is skipped by ``auto`` and
    refused by name (every backend declares it today: one is made to lack it)."""
    from posenc_lightning.attention.backends import sdpa

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    m = Attn(n_heads=H, head_dim=D)
    enc = inject(m, "alibi")
    assert resolve_backend("triton", enc, torch.device("cpu"), True, frozenset({"window"})).NAME == "triton"
    monkeypatch.setattr(sdpa, "LOCAL_MASKS", frozenset({"chunk"}))
    picked = resolve_backend("auto", enc, torch.device("cpu"), True, frozenset({"window"}))
    assert picked.NAME != "sdpa" and "window" in picked.LOCAL_MASKS
    with pytest.raises(ValueError, match="window.*LOCAL_MASKS"):
        resolve_backend("sdpa", enc, torch.device("cpu"), True, frozenset({"window"}))


def test_stick_breaking_window_blockwise_equals_reference():
    """Stick-breaking inside a window (blockwise tiles) against the formula
    ``A_ij = sigmoid(z_ij) prod_{j < k < i, visible} (1 - sigmoid(z_ik))``."""
    torch.manual_seed(0)
    n, window = 70, 24
    m = Attn(n_heads=H, head_dim=D)
    inject(m, "sba", backend="blockwise")
    m.posenc_window = window
    q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = m(q, k, v)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    z = (qr @ kr.transpose(-1, -2)) / math.sqrt(D)
    vis = _visible(n, n, 0, window, None) & ~torch.eye(n, dtype=torch.bool)  # attend_current=False
    log_keep = torch.where(vis, torch.nn.functional.logsigmoid(-z), torch.zeros_like(z))
    after = log_keep.flip(-1).cumsum(-1).flip(-1) - log_keep  # sum over visible k > j
    a = torch.where(vis, torch.exp(torch.nn.functional.logsigmoid(z) + after), torch.zeros_like(z))
    ref = a @ vr
    (ref * w).sum().backward()
    for g, r in zip((out, q.grad, k.grad, v.grad), (ref, qr.grad, kr.grad, vr.grad)):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", ["alibi", "rope", "fire"])
@pytest.mark.parametrize("local", [{"window": 8}, {"chunk": 8}])
def test_kv_cache_decode_with_window_equals_full_forward(name, local):
    torch.manual_seed(0)
    m = Attn(n_heads=H, head_dim=D)
    inject(m, name, backend="sdpa")
    m.posenc_window, m.posenc_chunk = local.get("window"), local.get("chunk")
    n = 29
    q, k, v = (torch.randn(1, H, n, D) for _ in range(3))
    with torch.no_grad():
        full = m(q, k, v)
        cache = LayerKVCache()
        steps = [m(q[:, :, :5], k[:, :, :5], v[:, :, :5], cache=cache)]
        for t in range(5, n):
            steps.append(m(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(steps, 2), full, rtol=1e-5, atol=1e-6)


def test_mask_rejects_a_non_causal_window():
    with pytest.raises(ValueError, match="causal=True"):
        AttentionMask(False, 0, 4, 4, window=2)
