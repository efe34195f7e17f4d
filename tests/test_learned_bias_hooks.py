"""A second learned-MLP bias, defined in this file and nowhere else (issue 29): it gets the fast
paths FIRE has by declaring its value-dependent form (`Bias.value_dependent`, a
`ValueDependentForm`) and registering its rebuild (`register_opaque_kind`), with no change to the
package. Its rows are recomputed and differentiated by sdpa's own backward (`Bias.rows_from`);
compiled on CPU it runs as the one generic opaque operator (``posenc::opaque_sdpa``), which picks
its O(N) ``f(i - j)`` form below its learned threshold (`ValueDependentForm.distance_shift`,
`ValueDependentForm.distance_table`) and differentiates rows by its compiled-rows hook past it
(`ValueDependentForm.compiled_rows_from`). Forward and every gradient
equal the eager dense reference, at lengths that are no multiple of the block and positions that
are not an arange; the counters show which hook ran."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import Tensor, nn

from posenc_lightning import inject
from posenc_lightning.encodings.base import AttentionContext, Bias, Encoding
from posenc_lightning.encodings.bias import OpaqueOperands, ValueDependentForm, register_opaque_kind
from posenc_lightning.encodings.registry import _REGISTRY, register
from posenc_lightning.functional.positions import arange_offset
from posenc_lightning.functional.tunables import Tunables
from tests.helpers import Attn


# ------------------------------------------------------------ the new learned bias: all it takes
def _log_mlp(q_pos: Tensor, k_pos: Tensor, thr: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """``g(log(1 + |i - j|) / log(1 + max(L, i)))``, ``g(x) = w2 tanh(w1 x + b1) + b2``: ``[B, H, r, K]``."""
    qf, kf = q_pos.float(), k_pos.float()
    norm = torch.log1p(torch.maximum(qf, thr.abs()))[:, :, None]
    x = torch.log1p((qf[:, :, None] - kf[:, None, :]).abs()) / norm
    return (torch.tanh(x[..., None] * w1[:, 0] + b1) @ w2.t() + b2).permute(0, 3, 1, 2)


@dataclass(eq=False)
class LogMLPBias(Bias):
    """Below its learned threshold ``L`` (every query position under it) a function of ``i - j``."""

    q_pos: Tensor
    k_pos: Tensor
    q_start: int | None
    k_start: int | None
    thr: Tensor
    w1: Tensor
    b1: Tensor
    w2: Tensor
    b2: Tensor
    calls: ClassVar[Counter] = Counter()
    recomputable = True

    def grad_inputs(self) -> tuple[Tensor, ...]:
        return self.thr, self.w1, self.b1, self.w2, self.b2

    def rows_from(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        self.calls["rows_from"] += 1
        return _log_mlp(self.q_pos[:, start:stop], self.k_pos[:, :k_stop], *views)

    def rows(self, start: int, stop: int, k_stop: int) -> Tensor:
        return _log_mlp(self.q_pos[:, start:stop], self.k_pos[:, :k_stop], *self.grad_inputs())

    def materialize(self) -> Tensor:
        return self.rows(0, self.q_pos.shape[1], self.k_pos.shape[1])

    def value_dependent(self) -> ValueDependentForm:
        starts = tuple(-1 if s is None else s for s in (self.q_start, self.k_start))
        operands = OpaqueOperands("test_log_mlp", (self.q_pos, self.k_pos, *self.grad_inputs()), starts)
        return ValueDependentForm(operands, self._distance_shift, self._distance_table, self._compiled_rows_from)

    def _compiled_rows_from(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        self.calls["compiled_rows_from"] += 1
        return _log_mlp(self.q_pos[:, start:stop], self.k_pos[:, :k_stop], *views)

    def _distance_shift(self) -> int | None:
        top = self.q_pos.shape[1] - 1 + self.q_start if self.q_start is not None else int(self.q_pos.max())
        a, c = arange_offset(self.q_pos, self.q_start), arange_offset(self.k_pos, self.k_start)
        shift = None if top >= float(self.thr.abs()) or a is None or c is None else a - c
        self.calls["distance_form" if shift is not None else "rows_form"] += 1
        return shift

    def _distance_table(self, distances: Tensor) -> Tensor:
        if not torch.compiler.is_compiling():  # counted where the operator computes it (a traced
            self.calls["distance_table"] += 1  # count would be replayed over the kernels' by dynamo)
        x = torch.log1p(distances.float().abs()) / torch.log1p(self.thr.abs())
        return (torch.tanh(x[:, None] * self.w1[:, 0] + self.b1) @ self.w2.t() + self.b2).t()


@register_opaque_kind("test_log_mlp")
def _rebuild(tensors: Sequence[Tensor], ints: Sequence[int], floats: Sequence[float]) -> LogMLPBias:
    """`LogMLPBias` from its operands, by name inside the operator."""
    LogMLPBias.calls["from_operands"] += 1
    q_start, k_start = (None if s < 0 else s for s in ints)
    return LogMLPBias(tensors[0], tensors[1], q_start, k_start, *tensors[2:])


class LogMLP(Encoding):
    """Stage 3 only: the learned MLP bias above, ``L`` learned too."""

    bias_kinds = (LogMLPBias,)

    def __init__(self, width: int = 8, init_L: float = 200.0) -> None:
        super().__init__()
        self.width, self.init_L = width, init_L

    def _ready(self) -> bool:
        return self.n_heads is not None

    def build(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.thr = nn.Parameter(torch.tensor([float(self.init_L)]))
        self.w1 = nn.Parameter(torch.randn(self.width, 1, generator=g))
        self.b1 = nn.Parameter(torch.randn(self.width, generator=g))
        self.w2 = nn.Parameter(torch.randn(self.n_heads, self.width, generator=g))
        self.b2 = nn.Parameter(torch.randn(self.n_heads, generator=g))

    def bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Bias:
        return LogMLPBias(ctx.q_pos, ctx.k_pos, ctx.q_start, ctx.k_start, self.thr, self.w1, self.b1, self.w2,
                          self.b2)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _registered():
    """``@register(...)`` as an encoding file does it; removed afterwards (the suite's tests over
    every registered encoding do not see this one)."""
    register("test_log_mlp", "bias", "A learned MLP of the log distance (a test encoding)")(LogMLP)
    yield
    _REGISTRY.pop("test_log_mlp")


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    """16-row blocks (37 = 16 + 16 + 5 rows), and the operator at these sizes (they would otherwise
    run as one traced block, `Tunables.compiled_one_block_bytes`)."""
    monkeypatch.setattr(Attn, "posenc_tunables", Tunables(bias_block_bytes=1, compiled_one_block_bytes=0))
    LogMLPBias.calls.clear()


N = 37
GAPS = torch.stack([torch.randperm(N, generator=torch.Generator().manual_seed(1)), 3 * torch.arange(N)])


def _layer(backend: str, init_L: float) -> Attn:
    m = Attn(n_heads=4, head_dim=16)
    inject(m, "test_log_mlp", backend=backend, init_L=init_L)
    return m


def _run(m: Attn, positions: Tensor | None, compiled: bool, graphs: list[str] | None = None):
    """Output and the gradients of q, k, v and every bias parameter."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, N, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, N, 16, generator=g, requires_grad=True) for _ in range(2))  # grouped kv heads
    fn = m
    if compiled:
        import torch._dynamo as dynamo
        from torch._dynamo.backends.debugging import aot_eager

        def backend(gm, example_inputs):
            graphs.append(gm.code)
            return aot_eager(gm, example_inputs)

        dynamo.reset()
        fn = torch.compile(m, fullgraph=True, backend=backend)
    out = fn(q, k, v, positions=positions)
    params = list(m.encoding.parameters())
    return out, torch.autograd.grad(out, [q, k, v, *params], torch.cos(out))


def _assert_equal(got, ref) -> None:
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    assert len(got[1]) == len(ref[1]) == 8
    for a, b in zip(got[1], ref[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert all(t.abs().max() > 0 for t in ref[1])  # every parameter, L included, gets a gradient


@pytest.mark.parametrize("init_L, positions", [(200.0, None), (200.0, GAPS), (20.0, None)])
def test_eager_rows_equal_the_dense_reference(init_L, positions):
    ref = _run(_layer("eager", init_L), positions, compiled=False)
    LogMLPBias.calls.clear()
    _assert_equal(_run(_layer("sdpa", init_L), positions, compiled=False), ref)
    assert LogMLPBias.calls["rows_from"] >= 3  # its rows recomputed by blocks in sdpa's own backward
    assert LogMLPBias.calls["from_operands"] == 0  # no operator eagerly


OFFSET = (5 + torch.arange(N)).expand(2, N)


@pytest.mark.parametrize("init_L, positions, form", [
    (200.0, None, "distance"),  # known arange below L: the template traced in the graph
    (200.0, OFFSET, "distance"),  # read inside the operator: an offset arange below L
    (200.0, GAPS, "rows"),  # not an arange: rows
    (20.0, None, "rows"),  # past L: rows
])
def test_compiled_runs_the_generic_operator(init_L, positions, form):
    ref = _run(_layer("eager", init_L), positions, compiled=False)
    LogMLPBias.calls.clear()
    graphs: list[str] = []
    _assert_equal(_run(_layer("sdpa", init_L), positions, compiled=True, graphs=graphs), ref)
    assert any("posenc.opaque_sdpa" in g for g in graphs)
    calls = LogMLPBias.calls
    assert calls["from_operands"] >= 2  # rebuilt by name in the forward and the backward operator
    if form == "distance":
        assert calls["distance_form"] >= 1 and not calls["rows_form"] and not calls["compiled_rows_from"]
        # the template: traced in the graph (known positions), or made and differentiated inside
        assert calls["distance_table"] == (0 if positions is None else 2)
    else:
        assert calls["rows_form"] >= 1 and not calls["distance_form"]
        assert calls["compiled_rows_from"] >= 3  # each block's rows differentiated by the hook
