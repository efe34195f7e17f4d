"""Bias kinds own their behaviour (issue 17): backends ask the kind, never test its class; every
method a backend calls agrees with the kind's dense ``materialize()``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import posenc_lightning
from posenc_lightning.encodings import bias as bias_module
from posenc_lightning.encodings.bias import (
    Bias,
    BiasSum,
    DecayBias,
    DenseBias,
    KernelBias,
    LinearBias,
    RelativeBias,
    ScaledBias,
)

PACKAGE = Path(posenc_lightning.__file__).parent
KINDS = {n for n, c in vars(bias_module).items() if isinstance(c, type) and issubclass(c, Bias)}


def _names(node: ast.AST) -> set[str]:
    """Every name and attribute name in ``node``."""
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))}


def test_no_class_tests_on_bias_kinds_outside_their_module():
    assert {"Bias", "LinearBias", "RelativeBias", "DecayBias", "DenseBias", "BiasSum", "ScaledBias"} <= KINDS
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == Path(bias_module.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            # isinstance(x, Kind) / issubclass(...) / type(x) is Kind / type(x) == Kind
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
                hit = _names(node.args[1]) & KINDS
            elif isinstance(node, ast.Compare) and any(isinstance(o, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq))
                                                      for o in node.ops):
                hit = _names(node) & KINDS if "type" in _names(node) else set()
            else:
                continue
            if hit:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} tests {sorted(hit)}")
    assert found == []


def test_rows_is_abstract():
    class OnlyDense(Bias):
        def materialize(self):
            return torch.zeros(1, 1, 2, 2)

    with pytest.raises(TypeError, match="rows"):
        OnlyDense()


class _Square(Bias):
    """A kind with only the two required methods: ``-(i - j)^2 * w[h]``."""

    def __init__(self, w, q_pos, k_pos):
        self.w, self.q_pos, self.k_pos = w, q_pos, k_pos

    def materialize(self):
        d = (self.q_pos[:, :, None] - self.k_pos[:, None, :]).float()
        return -self.w.float()[None, :, None, None] * d[:, None] ** 2

    def rows(self, start, stop, k_stop):
        return _Square(self.w, self.q_pos[:, start:stop], self.k_pos[:, :k_stop]).materialize()


def _kinds(b=2, h=3, n_q=5, n_k=7):
    g = torch.Generator().manual_seed(0)
    kp = torch.tensor([[0, 3, 1, 2, 9, 4, 5], [10, 11, 12, 13, 14, 15, 16]])[:, :n_k]
    qp = kp[:, n_k - n_q:]
    dense = torch.randn(b, h, n_q, n_k, generator=g)
    return {
        "linear": LinearBias(torch.rand(h, generator=g), qp, kp),
        "relative": RelativeBias(torch.randn(h, 7, generator=g), qp, kp),
        "decay": DecayBias(torch.randn(b, h, n_q, generator=g), torch.randn(b, h, n_k, generator=g)),
        "dense": DenseBias(dense),
        "lazy": DenseBias.lazy(lambda s, e, ke: dense[..., s:e, :ke], n_q, n_k),
        "new kind": _Square(torch.rand(h, generator=g), qp, kp),
        "sum": LinearBias(torch.rand(h, generator=g), qp, kp) + RelativeBias(torch.randn(h, 5, generator=g), qp, kp)
        + _Square(torch.rand(h, generator=g), qp, kp),
    }


def _from_kernel_args(a: KernelBias, shape) -> torch.Tensor:
    """The bias the Triton kernels compute from their arguments (the formulas of docs/architecture.md)."""
    out = torch.zeros(shape)
    if a.slopes is not None or a.table is not None:
        d = (a.q_pos[:, :, None] - a.k_pos[:, None, :])[:, None]
        if a.slopes is not None:
            out = out - a.slopes[None, :, None, None] * d.abs()
        if a.table is not None:
            r = (a.table.shape[-1] - 1) // 2
            out = out + a.table[torch.arange(shape[1])[None, :, None, None], d.clamp(-r, r) + r]
    if a.c_q is not None:
        out = out + a.c_q[..., :, None] - a.c_k[..., None, :]
    return out + (a.dense if a.dense is not None else 0)


@pytest.mark.parametrize("name", list(_kinds()))
def test_every_method_agrees_with_materialize(name):
    bias = _kinds()[name]
    full = bias.materialize()
    b, h, n_q, n_k = 2, 3, 5, 7
    shape = (b, h, n_q, n_k)
    torch.testing.assert_close(bias.rows(1, 4, 6), full[..., 1:4, :6])
    w = torch.tensor(0.3)
    s = bias.scaled(w)
    torch.testing.assert_close(s.materialize(), 0.3 * full)
    torch.testing.assert_close(s.rows(2, 5, 3), 0.3 * full[..., 2:5, :3])
    if name in ("linear", "relative", "decay", "dense", "sum"):
        assert type(s) is type(bias)  # the kinds keep their kind: backends still fuse them
    bb, hh, qi, ki = torch.meshgrid(*(torch.arange(n) for n in shape), indexing="ij")
    term = sum(t.score_term(b, h)(bb, hh, qi, ki) for t in bias.terms)
    torch.testing.assert_close(term, full.expand(shape))
    args = KernelBias()
    bias.fold_into(args)
    torch.testing.assert_close(_from_kernel_args(args, shape), full.expand(shape))
    native = name in ("linear", "relative", "decay")
    assert (args.dense is None) == native  # the kernels read these kinds natively
    assert bias.distance_only == (name in ("linear", "relative"))
    if not bias.distance_only:
        assert bias.at(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)) is None


def test_at_moves_a_distance_bias():
    """``at(q_pos, k_pos)`` is the same function of ``i - j`` at the new positions."""
    h = 3
    for kind in (LinearBias(torch.rand(h), torch.arange(4)[None], torch.arange(4)[None]),
                 RelativeBias(torch.randn(h, 5), torch.arange(4)[None], torch.arange(4)[None])):
        qp, kp = torch.tensor([[100, 101]]), torch.tensor([[97, 99, 100, 104]])
        moved = kind.at(qp, kp).materialize()
        i, j = torch.meshgrid(torch.arange(2), torch.arange(4), indexing="ij")
        dist = (qp[0][i] - kp[0][j])  # [2, 4]
        if isinstance(kind, LinearBias):
            expect = -kind.slopes[:, None, None] * dist.abs()
        else:
            expect = kind.table[:, dist.clamp(-2, 2) + 2]
        torch.testing.assert_close(moved[0], expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_key_only_equals_the_bias_up_to_a_row_constant(dtype):
    """Where a query sees a key, ``key_only().key_bias()`` differs from the bias by a constant per
    query row (which softmax drops): causal ALiBi at increasing positions, FoX under any mask."""
    b, h, n = 2, 3, 6
    pos = torch.tensor([[0, 1, 2, 5, 6, 9], [3, 4, 5, 6, 7, 8]])
    c = torch.randn(b, h, n, dtype=dtype).cumsum(-1)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for bias, visible in ((LinearBias(torch.rand(h), pos, pos), causal), (DecayBias(c, c), torch.ones(n, n).bool())):
        ko = bias.key_only(dtype, True)
        diff = bias.materialize().double() - ko.key_bias().double()[:, :, None, :]
        diff = diff.masked_fill(~visible, float("nan"))
        row = diff.nanmean(-1, keepdim=True)
        torch.testing.assert_close(diff.nan_to_num(0.0), row.expand_as(diff).masked_fill(~visible, 0.0),
                                   rtol=1e-6, atol=1e-6)
    assert LinearBias(torch.rand(h), pos, pos).key_only(dtype, plain_causal=False) is None
    assert LinearBias(torch.rand(h), pos.flip(-1), pos.flip(-1)).key_only(dtype, True) is None  # decreasing
    assert DecayBias(c, c).key_only(torch.bfloat16, True) is None
    assert _kinds()["dense"].key_only(dtype, True) is None


def test_scaled_new_kind_is_lazy_and_recomputable_when_its_inner_is():
    lazy = DenseBias.lazy(lambda s, e, ke, t: t * 2, 3, 4, inputs=(torch.ones(1, 1, 3, 4),),
                          window=lambda s, e, ke: ((Ellipsis, slice(s, e), slice(0, ke)),))
    s = ScaledBias(lazy, torch.tensor(0.5, requires_grad=True))
    assert s.recomputable and s.fresh_rows and len(s.grad_inputs()) == 2
    views = [t[w] if w is not None else t for t, w in zip(s.grad_inputs(), s.input_windows(1, 3, 2))]
    torch.testing.assert_close(s.rows_from(1, 3, 2, views), torch.ones(1, 1, 2, 2))
    assert not ScaledBias(_kinds()["new kind"], torch.tensor(2.0)).recomputable
    assert isinstance(_kinds()["new kind"].scaled(torch.tensor(2.0)), ScaledBias)
    assert isinstance(_kinds()["sum"], BiasSum)
