"""``auto`` never materializes an N x N bias (issue 15). Each encoding declares the bias kinds it
may return (`Encoding.bias_kinds`), each kind the fused forms it has (`Bias.fused_in`), and each
fused backend the form it computes (``FUSED_BIAS``: "kernel" for triton, "score_mod" for flex);
`supports` refuses a kind without it. Checked on CPU for a CUDA device (``supports`` reads
``device.type`` only), with every custom kernel proven (`proven_on_gpu.PROVEN`; the rule for unproven
ones is in tests/test_cuda_defaults.py): FIRE and a mixture with a rotary member (its rotation's logit change
a product of operands, `ProductBias`) run in the Triton kernels, CoPE and PaTH (rows that read q and k) fall to
the blockwise SDPA path. And whenever a backend says yes on
CUDA, running it (triton under TRITON_INTERPRET=1, sdpa; flex's ``score_mod`` plan, as CPU flex
evaluates every score eagerly) creates no tensor of ``B H N x N`` elements."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from posenc_lightning.attention.backends import BACKENDS, flex, get_backend, proven, resolve_backend
from posenc_lightning.encodings import proven_on_gpu
from posenc_lightning.encodings.registry import available_encodings, build_encoding
from posenc_lightning.functional.tunables import Tunables
from posenc_lightning.inject import inject
from tests.helpers import Attn, fast_triton_interpreter

CUDA = torch.device("cuda")
B, H, N, D = 1, 2, 192, 16
#: every registered encoding with a bias, and configurations whose bias takes another kind
CASES = {**{n: (n, {}) for n in available_encodings() if "bias" in build_encoding(n).stages},
         "fire_past_L": ("fire", {"init_L": 8.0, "mlp_width": 8}),
         "mixture_rope": ("mixture", {"members": ("alibi", "fire", "rope"), "member_cfgs": {"fire": {"init_L": 8.0}}}),
         "fox_rope": ("fox", {"rope": True}),
         # CoPE's table z = q E is N x P: P well below N, so that N x P is told from N x N
         "cope": ("cope", {"max_position": 16})}
#: where ``auto`` lands on CUDA once a recorded run has proven every custom kernel
#: (`proven_on_gpu.PROVEN`): the fused kernels, except for rows that read q and k (CoPE's gated counts
#: are computed in its own kernels' tile)
EXPECTED = {case: "sdpa" if case in ("path", "path_fox") else "triton" for case in CASES}


@pytest.fixture
def all_proven(monkeypatch):
    """`proven_on_gpu.PROVEN` naming every (custom kernel, encoding) pair."""
    table = {(b, n): "test" for b in proven.CUSTOM_KERNELS for n in available_encodings()}
    monkeypatch.setattr(proven_on_gpu, "PROVEN", table)


@pytest.fixture(autouse=True)
def _fast_interpreter(monkeypatch):
    fast_triton_interpreter(monkeypatch)
    yield


def _bound(case: str):
    name, cfg = CASES[case]
    return build_encoding(name, **cfg).bind(n_heads=H, head_dim=D, d_model=H * D)


def test_the_cases_cover_every_registered_bias_encoding_and_kind():
    assert {"alibi", "relative_bias", "fire", "cope", "fox", "mixture", "rope_alibi", "rse"} <= set(CASES)
    kinds = {k.__name__ for case in CASES for k in _bound(case).bias_kinds}
    assert kinds == {"LinearBias", "RelativeBias", "DecayBias", "FireBias", "DenseBias", "CoPEBias", "ProductBias"}


@pytest.mark.parametrize("case", list(CASES))
def test_every_bias_encoding_declares_its_kinds(case):
    enc = _bound(case)
    assert enc.bias_kinds, f"{case} has a bias stage and declares no bias_kinds"


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_auto_on_cuda_picks_a_backend_that_fuses_the_bias(case, requires_grad, all_proven):
    pytest.importorskip("triton")
    enc = _bound(case)
    mod = resolve_backend("auto", enc, CUDA, requires_grad)
    assert mod.NAME == EXPECTED[case]
    form = vars(mod).get("FUSED_BIAS")  # sdpa computes every kind by blocks of rows
    assert form is None or all(form in k.fused_in for k in enc.bias_kinds)
    if EXPECTED[case] == "sdpa":  # refused with a reason that names the way out
        for fused in ("triton", "flex"):
            why = get_backend(fused).supports(enc, CUDA, requires_grad)
            assert why is not None and "N x N" in why and "sdpa" in why


def test_fire_is_fused_by_triton_and_by_flex_without_grad_on_cuda():
    enc = _bound("fire_past_L")
    assert get_backend("triton").supports(enc, CUDA, True) is None
    assert flex.supports(enc, CUDA, False) is None
    why = flex.supports(enc, CUDA, True)  # inductor's flex backward does not lower FIRE's MLP
    assert why is not None and "FireBias" in why and "triton" in why
    assert flex.supports(_bound("mixture"), CUDA, True) is not None  # a FIRE member
    assert flex.supports(_bound("fox"), CUDA, True) is None
    assert flex.supports(_bound("cope"), torch.device("cpu"), False) is None  # CPU flex: the eager reference


class _Sizes(TorchDispatchMode):
    """The element count of every tensor a torch op creates; a uint8 tensor's in float32 elements
    (its bytes / 4: the Triton interpreter copies each argument's storage as bytes, which counted
    one by one would make a [B, H, N, 32] float32 operand look 4 x its size)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = [0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sizes += [t.numel() // 4 if t.dtype == torch.uint8 else t.numel()
                       for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
        return out


def _layer(case: str, backend: str):
    name, cfg = CASES[case]
    torch.manual_seed(0)
    m = Attn(n_heads=H, head_dim=D, d_model=H * D)
    inject(m, name, backend=backend, **cfg)
    with torch.no_grad():
        for p in m.encoding.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def _inputs(grad: bool):
    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(B, H, N, D, generator=g) for _ in range(3)] + [torch.randn(B, N, H * D, generator=g)]
    return [t.requires_grad_(grad) for t in ts]


N_BY_N = B * H * N * N


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "eager"])  # eager: the N x N reference
@pytest.mark.parametrize("case", list(CASES))
def test_a_backend_that_claims_an_encoding_on_cuda_never_materializes_its_bias(case, backend, monkeypatch):
    if backend == "triton":
        pytest.importorskip("triton")
    enc = _bound(case)
    grad = backend != "flex"  # CPU flex has no backward; its claim for training on CUDA is the same plan
    if get_backend(backend).supports(enc, CUDA, grad) is not None:
        pytest.skip(f"{backend} refuses {case} on cuda")
    monkeypatch.setattr(Attn, "posenc_tunables", Tunables(bias_block_bytes=1))  # 16-row blocks
    if backend == "triton":
        from posenc_lightning.kernels import fused

        monkeypatch.setattr(fused, "INTERPRET_BLOCKS", (64, 64))  # the interpreter's copies are [N, 64]
    m = _layer(case, backend)
    q, k, v, hidden = _inputs(grad)
    rec = _Sizes()
    if backend == "flex":  # the plan: one score_mod from every term (CPU flex then scores all N x N)
        seen = []
        real = m.encoding.bias
        monkeypatch.setattr(m.encoding, "bias", lambda *a: seen.append(real(*a)) or seen[-1])
        m.posenc_backend = "sdpa"
        with torch.no_grad():
            m(q, k, v, hidden=hidden)
        with rec:
            score_mod = flex.score_mod_for(seen[-1], B, H)
        with torch.no_grad():  # and it is the bias: one score per (b, h, i, j) equals eager's
            ref = seen[-1].materialize()
            idx = [torch.tensor([0]), torch.tensor([1]), torch.tensor([N - 1]), torch.tensor([3])]
            got = score_mod(torch.zeros(1), *idx)
            torch.testing.assert_close(got, ref[0, 1, N - 1, 3].reshape(1), rtol=1e-5, atol=1e-5)
    else:
        with rec:
            out = m(q, k, v, hidden=hidden)
            out.backward(torch.ones_like(out))
        assert q.grad is not None and all(p.grad is not None for p in m.encoding.parameters() if p.requires_grad)
    assert max(rec.sizes) < N_BY_N // 2, (case, backend, max(rec.sizes), N_BY_N)
