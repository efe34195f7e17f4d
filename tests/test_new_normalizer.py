"""A new normalizer (stage 4), defined in this file and nowhere else (issue 46): one `Normalizer`
subclass and the encoding that returns it, registered here. It gets the blockwise backend's tiles
(equal to eager forward and backward, on lengths that divide no tile and positions that are not an
arange), ``auto``'s choice of that backend, and a compiled forward+backward, with no edit to
``attention/``: the backends read the description's declarations (`Normalizer.walk`,
``fused_in``, `Normalizer.modulation`), never the encoding."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from posenc_lightning import inject
from posenc_lightning.attention.backends import BACKENDS, get_backend, resolve_backend
from posenc_lightning.encodings.base import AttentionContext, Encoding
from posenc_lightning.encodings.normalizer import Normalizer, Walk, modulated_softmax
from posenc_lightning.encodings.registry import _REGISTRY, register
from posenc_lightning.functional.tunables import Tunables
from tests.helpers import Attn


# ------------------------------------------------------------ the new normalizer: all it takes
class LogTemperedSoftmax(Normalizer):
    """``softmax(s * (1 + t log(1 + |i - j|)))``: a temperature that grows with log distance."""

    walk = Walk.SOFTMAX
    modulation_distance_only = True

    def __init__(self, name: str, t: float) -> None:
        super().__init__(name)
        self.t = t

    def modulation(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        d = (q_pos[:, :, None] - k_pos[:, None, :]).abs().to(torch.float32)
        return (1 + self.t * torch.log1p(d))[:, None]

    def weights(self, logits: Tensor, mask: Tensor | None, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return modulated_softmax(logits, mask, self.modulation(q_pos, k_pos))


class LogTempered(Encoding):
    """Stage 4 only: the log-distance temperature, ``t`` learned."""

    normalizer_kind = LogTemperedSoftmax

    def __init__(self, t: float = 0.3) -> None:
        super().__init__()
        self.t = t

    def normalize(self, ctx: AttentionContext) -> LogTemperedSoftmax:
        return LogTemperedSoftmax(self.name, self.t)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _registered():
    """Registered as an encoding file does it; removed afterwards so that the suite's tests over
    every registered encoding do not see it."""
    register("log_tempered", "normalize", "softmax with a log-distance temperature (a test encoding)")(LogTempered)
    yield
    _REGISTRY.pop("log_tempered")


CPU = torch.device("cpu")
N = 37  # no multiple of the tiles below


def _inputs(grad: bool = True):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, N, 16, generator=g)
    k, v = torch.randn(2, 2, N, 16, generator=g), torch.randn(2, 2, N, 16, generator=g)  # grouped kv heads
    pos = torch.stack([torch.cat([torch.arange(300, 320), torch.arange(7, 24)]), torch.randperm(N, generator=g)])
    return [t.requires_grad_(grad) for t in (q, k, v)], pos


def test_the_backends_read_its_declarations():
    enc = LogTempered().bind(n_heads=4, head_dim=16)
    claims = {b: get_backend(b).supports(enc, CPU, True) is None for b in BACKENDS}
    # sdpa and flex keep softmax; triton runs only the stick-breaking walk in-kernel
    assert claims == {"eager": True, "sdpa": False, "flex": False, "triton": False, "blockwise": True}
    assert resolve_backend("auto", enc, CPU, True).NAME == "blockwise"


@pytest.mark.parametrize("arange", [False, True])
def test_blockwise_tiles_equal_eager_forward_and_backward(arange):
    (q, k, v), pos = _inputs()
    if arange:  # the modulation read off one diagonal per tile
        pos = torch.arange(5, 5 + N).expand(2, N)
    outs, grads = [], []
    for backend in ("eager", "blockwise"):
        m = Attn(n_heads=4, head_dim=16)
        m.posenc_tunables = Tunables(block_rows=8, block_keys=16)  # several query blocks and key tiles
        inject(m, "log_tempered", backend=backend)
        out = m(q, k, v, positions=pos)
        outs.append(out)
        grads.append(torch.autograd.grad(out, [q, k, v], torch.cos(out)))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_compiled_forward_and_backward_equal_eager():
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attn(n_heads=4, head_dim=16)

        def forward(self, q, k, v, pos):
            return self.attn(q, k, v, positions=pos)

    layer = Layer()
    inject(layer, "log_tempered")
    (q, k, v), pos = _inputs()
    ref = layer(q, k, v, pos)
    want = torch.autograd.grad(ref, [q, k, v], torch.cos(ref))
    out = torch.compile(layer, backend="aot_eager", fullgraph=True)(q, k, v, pos)
    got = torch.autograd.grad(out, [q, k, v], torch.cos(out))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
