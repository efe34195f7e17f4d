"""A new encoding, with a new bias kind, defined in this file and nowhere else (issue 17): it runs
through every backend that claims it (equal to eager, forward and backward, on lengths that do
not divide the block sizes and positions that are not an arange), `PosEncCallback` in a real
``Trainer.fit`` and a checkpoint round trip, with no change to the package. The fused Triton
kernels refuse it (issue 15): its kind has no in-kernel form, so they would materialize it."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn

from posenc_lightning import PosEncCallback, inject
from posenc_lightning.attention.backends import BACKENDS, get_backend, resolve_backend
from posenc_lightning.data import CorpusDataModule
from posenc_lightning.encodings.base import AttentionContext, Bias, Encoding
from posenc_lightning.encodings.registry import _REGISTRY, register
from posenc_lightning.functional.tunables import Tunables
from posenc_lightning.models import TinyGPT
from tests.helpers import Attn


# ------------------------------------------------------------ the new encoding: all it takes
class LogDistanceBias(Bias):
    """``-slopes[h] * log(1 + |i - j|)``: a kind needs only its dense value and its rows."""

    def __init__(self, slopes: Tensor, q_pos: Tensor, k_pos: Tensor) -> None:
        self.slopes, self.q_pos, self.k_pos = slopes, q_pos, k_pos

    def materialize(self) -> Tensor:
        return self.rows(0, self.q_pos.shape[1], self.k_pos.shape[1])

    def rows(self, start: int, stop: int, k_stop: int) -> Tensor:
        d = (self.q_pos[:, start:stop, None] - self.k_pos[:, None, :k_stop]).abs().float()
        return -self.slopes.float()[None, :, None, None] * torch.log1p(d)[:, None]


class LogDistance(Encoding):
    """Stage 3 only: a learned per-head slope on ``log(1 + |i - j|)``."""

    bias_kinds = (LogDistanceBias,)

    def __init__(self, slope_init: float = 0.5) -> None:
        super().__init__()
        self.slope_init = slope_init
        self.slopes: nn.Parameter | None = None

    def _ready(self) -> bool:
        return self.n_heads is not None

    def build(self) -> None:
        self.slopes = nn.Parameter(torch.full((self.n_heads,), float(self.slope_init)))

    def bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Bias:
        return LogDistanceBias(self.slopes, ctx.q_pos, ctx.k_pos)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _registered():
    """``@register(...)`` as an encoding file does it; removed afterwards so that the suite's
    tests over every registered encoding do not see this one."""
    register("log_distance", "bias", "Learned per-head slope on log(1 + |i - j|) (a test encoding)")(LogDistance)
    yield
    _REGISTRY.pop("log_distance")


CPU = torch.device("cpu")
N = 37  # not a multiple of any block size (16-row SDPA blocks here, the Triton tiles)


def _layer(backend: str, slopes: Tensor) -> Attn:
    m = Attn(n_heads=4, head_dim=16)
    inject(m, "log_distance", backend=backend)
    with torch.no_grad():
        m.encoding.slopes.copy_(slopes)
    return m


def _inputs():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, N, 16, generator=g)
    k, v = torch.randn(2, 2, N, 16, generator=g), torch.randn(2, 2, N, 16, generator=g)  # grouped kv heads
    # packed documents at far-off offsets, and a permutation: never an arange
    pos = torch.stack([torch.cat([torch.arange(500, 520), torch.arange(3, 20)]), torch.randperm(N, generator=g)])
    return q, k, v, pos


def test_every_backend_claims_it_or_refuses_clearly():
    enc = LogDistance().bind(n_heads=4, head_dim=16)
    claims = {b: get_backend(b).supports(enc, CPU, True) is None for b in BACKENDS}
    # triton: no in-kernel form of the new kind; blockwise: only encodings that replace softmax
    assert claims == {"eager": True, "sdpa": True, "flex": False, "triton": False, "blockwise": False}
    assert "N x N" in get_backend("triton").supports(enc, CPU, True)
    with pytest.raises(ValueError, match="backend 'flex' cannot run encoding 'log_distance'.*no backward on CPU"):
        resolve_backend("flex", enc, CPU, True)
    assert get_backend("flex").supports(enc, CPU, False) is None  # inference only on CPU


@pytest.mark.parametrize("backend", ["sdpa"])
def test_forward_and_backward_equal_eager(backend, monkeypatch):
    monkeypatch.setattr(Attn, "posenc_tunables", Tunables(bias_block_bytes=1))  # 16-row blocks: 16 + 16 + 5 rows
    slopes = torch.tensor([0.3, 1.1, 0.05, 2.0])
    q, k, v, pos = _inputs()
    outs, grads = [], []
    for m in (_layer("eager", slopes), _layer(backend, slopes)):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = m(*ins, positions=pos)
        outs.append(out)
        grads.append(torch.autograd.grad(out, [*ins, m.encoding.slopes], torch.cos(out)))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert grads[0][3].abs().min() > 0  # the slopes learn


def test_flex_forward_equals_eager():
    slopes = torch.tensor([0.3, 1.1, 0.05, 2.0])
    q, k, v, pos = _inputs()
    with torch.no_grad():
        ref, out = (_layer(b, slopes)(q, k, v, positions=pos) for b in ("eager", "flex"))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_posenc_callback_trains_it_and_a_checkpoint_restores_it(tmp_path):
    pl.seed_everything(0)
    model = TinyGPT(d_model=32, n_layers=2, n_heads=2, max_seq_len=64, encoding=None)
    cb = PosEncCallback("log_distance", slope_init=0.25)
    t = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, callbacks=[cb], default_root_dir=tmp_path, num_sanity_val_steps=0,
                   limit_val_batches=1)
    t.fit(model, CorpusDataModule(seq_len=32, batch_size=4, max_bytes=200_000, max_val_windows=4))
    assert t.global_step == 3 and torch.isfinite(t.callback_metrics["train/loss"])
    enc = model.blocks[1].attn.posenc
    assert isinstance(enc, LogDistance) and enc is cb.injected
    assert not torch.allclose(enc.slopes, torch.full_like(enc.slopes, 0.25))  # trained through the blockwise SDPA
    t.save_checkpoint(tmp_path / "m.ckpt")
    fresh = TinyGPT.load_from_checkpoint(tmp_path / "m.ckpt")
    assert isinstance(fresh.blocks[0].attn.posenc, LogDistance) and fresh.blocks[0].attn.posenc.slope_init == 0.25
    x = torch.randint(0, 256, (2, 45))
    model.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(model(x), fresh(x))


@pytest.mark.parametrize("scenario", ["arange", "offset", "packed", "decode", "padding"])
@pytest.mark.parametrize("dtype", ["fp32", "fp64", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_it_passes_the_conformance_suite(backend, dtype, scenario, monkeypatch):
    """The registry-driven conformance suite's own check (tests/test_conformance.py) on the new
    encoding: every backend that claims it equals the float64 eager reference, forward and
    backward, in every dtype and scenario; the rest skip with their supports() reason."""
    from tests import test_conformance
    from tests.helpers import fast_triton_interpreter

    fast_triton_interpreter(monkeypatch)
    monkeypatch.setitem(test_conformance.FP32_BY_DESIGN, "log_distance",
                        "its bias kind materializes in float32, as every kind does (encodings/bias/)")
    test_conformance._check("log_distance", backend, dtype, scenario)
