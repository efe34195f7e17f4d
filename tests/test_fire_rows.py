"""FIRE's rows (`FireBias.rows_from` through `fire_rows`: one autograd Function, backward written
out; the units selected per group of keys, forward and backward; a Toeplitz table of ``psi(i - j)`` at
``start + arange`` positions; one row of positions shared by the batch) equal the straight
formula (`FIRE.bias_tensor`, eq. 3) forward and backward
in every parameter: ragged blocks, offsets below and beyond ``L`` in one block, a query exactly at
``L`` (``max``'s tie), per-batch positions, the scaled kind, the vjp the blockwise backend takes."""

import copy

import pytest
import torch

from posenc_lightning import build_encoding
from posenc_lightning.encodings.base import AttentionContext
from posenc_lightning.encodings.fire import FireBias
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.tunables import Tunables

TOL = {"rtol": 1e-5, "atol": 1e-6}
BLOCKS = [(0, 53, 53), (10, 83, 150), (83, 150, 160), (150, 151, 7)]  # ragged, past the queries, k_stop < rows


def _fire(dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    enc = build_encoding("fire", init_L=100.0, init_c=0.3, mlp_width=16).bind(n_heads=3).to(dtype)
    with torch.no_grad():  # weights away from init, a unit with w1 = 0, L off its initial value
        for p in enc.parameters():
            p.add_(0.3 * torch.randn_like(p))
        enc.mlp[0].weight[0] = 0.0
        enc.L_multiplier.fill_(1.0)  # L = 100 exactly: the query at position 100 ties with it
    return enc


def _mode(**tunables) -> Mode:
    """An eager CPU call's mode with these tunables (the groups of keys, the runs' slack)."""
    return Mode.now("cpu", Tunables(**tunables))


def _grads(out: torch.Tensor, g: torch.Tensor, leaves: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad((out * g).sum(), leaves, retain_graph=True)


def _close_grad(a: torch.Tensor, b: torch.Tensor, tol: dict) -> None:
    """Against the float64 formula, relative to the gradient's largest entry, plus an absolute
    margin for the scalars' (c, L): float32 sums over a block whose terms cancel (measured: the
    float32 reference itself is off by up to 4e-6 relative)."""
    assert a.shape == b.shape
    assert (a.double() - b).abs().max() <= tol["rtol"] * b.abs().max() + 100 * tol["atol"], (a, b)


def _check(enc, bias: FireBias, qp: torch.Tensor, kp: torch.Tensor, shared: bool, tol: dict = TOL) -> None:
    exact = copy.deepcopy(enc).double()  # the straight formula (eq. 3) in float64
    leaves, exact_leaves = list(enc.bias_params()), list(exact.bias_params())
    full, full64 = enc.bias_tensor(qp, kp), exact.bias_tensor(qp, kp)
    for s, e, ke in BLOCKS:
        new = bias.rows(s, e, ke)
        ref, ref64 = full[..., s:e, :ke], full64[..., s:e, :ke]
        assert new.shape[0] == (1 if shared else qp.shape[0]) and new.dtype == torch.float32
        torch.testing.assert_close(new.expand_as(ref), ref, **tol)
        with torch.no_grad():  # without gradients: the units selected per group of keys
            torch.testing.assert_close(bias.rows(s, e, ke).expand_as(ref), ref, **tol)
        g = torch.randn_like(ref64)
        for a, b in zip(_grads(new, g.to(new.dtype), leaves), _grads(ref64, g, exact_leaves)):
            _close_grad(a, b, tol)


@pytest.mark.parametrize("group", [1, 5, 32])  # keys per unit selection (no grad); 150 keys: ragged
@pytest.mark.parametrize("offset", [37, 5000, 60])  # 60: rows below and beyond L = 100 in one block
def test_rows_at_arange_positions_use_one_distance_table(offset, group):
    mode = _mode(fire_column_group=group)
    enc = _fire()
    pos = (torch.arange(151) + offset).expand(2, -1)
    kp = (torch.arange(160) + offset - 9).expand(2, -1)  # 9 keys before the first query (a cache)
    bias = enc.bias(None, None, AttentionContext(pos, kp, q_start=offset, k_start=offset - 9, mode=mode))
    assert bias.tunables is mode.tunables
    assert type(bias) is FireBias and (bias.q_start, bias.k_start) == (offset, offset - 9)
    _check(enc, bias, pos, kp, shared=True)
    # positions not declared: read on CPU (`arange_offset`), the same table
    read = enc.bias(None, None, AttentionContext(pos.clone(), kp.clone(), mode=mode))
    assert (read.q_start, read.k_start) == (offset, offset - 9)


@pytest.mark.parametrize("group", [3, 32])
def test_rows_at_per_batch_positions(group):
    enc = _fire()
    qp = torch.stack([torch.arange(151) + 30, torch.arange(151) * 2, torch.cat([torch.arange(70), torch.arange(81)])])
    kp = torch.cat([qp, qp[:, :9] + 400], 1)  # keys beyond the queries: negative distances too
    bias = enc.bias(None, None, AttentionContext(qp, kp, mode=_mode(fire_column_group=group)))
    assert bias.q_start is None and bias.k_start is None
    _check(enc, bias, qp, kp, shared=False)


def test_rows_shared_by_the_batch_without_a_known_start():
    enc = _fire()
    qp = (torch.arange(151) * 3 + 5).expand(4, -1)  # one row for the batch (stride 0), not an arange
    kp = torch.cat([qp[0], qp[0, :9] + 1000]).expand(4, -1)
    bias = enc.bias(None, None, AttentionContext(qp, kp))
    assert bias.q_start is None
    _check(enc, bias, qp, kp, shared=True)


def test_float64_parameters_and_float_positions():
    enc = _fire(torch.float64)
    qp = (torch.arange(151) + 60.5)[None].double()
    bias = enc.bias(None, None, AttentionContext(qp, qp))
    _check(enc, bias, qp, qp, shared=True, tol={"rtol": 1e-6, "atol": 1e-8})  # rows are float32


def test_scaled_rows_and_the_blockwise_backends_vjp():
    """`FireBias.scaled` (a mixture's weight folded into w2, b2) differentiated as
    `sdpa.rows.RowsAttention` does: ``torch.func.vjp`` of `rows_from` at detached window inputs."""
    enc = _fire()
    pos = (torch.arange(151) + 60)[None]
    w = torch.tensor(0.7, requires_grad=True)
    bias = enc.bias(None, None, AttentionContext(pos, pos, q_start=60, k_start=60)).scaled(w)
    views = [t.detach() for t in bias.grad_inputs()]
    exact, w64 = copy.deepcopy(enc).double(), w.detach().double().requires_grad_()
    full = exact.bias_tensor(pos, pos) * w64
    for s, e, ke in BLOCKS:
        ref = full[..., s:e, :ke]
        rows, vjp = torch.func.vjp(lambda *v, s=s, e=e, ke=ke: bias.rows_from(s, e, ke, v), *views)
        torch.testing.assert_close(rows, ref.float(), **TOL)
        g = torch.randn_like(ref)
        for a, b in zip(vjp(g.float()), _grads(ref, g, [*exact.bias_params(), w64])):
            _close_grad(a, b, TOL)


def test_empty_rows():
    enc = _fire()
    pos = (torch.arange(151) + 60)[None]
    bias = enc.bias(None, None, AttentionContext(pos, pos, q_start=60, k_start=60))
    rows = bias.rows(5, 9, 0)
    assert rows.shape == (1, 3, 4, 0)
    grads = torch.autograd.grad(rows.sum(), list(enc.bias_params()), allow_unused=True)
    assert all(g is None or not g.any() for g in grads)


@pytest.mark.parametrize("slack", [0, 10**9])  # every span its own run / every span in one run
@pytest.mark.parametrize("group", [4, 32])
def test_runs_of_switching_units_forward_and_backward(slack, group):
    """The units that switch within a block are evaluated per element in runs over the union of
    their spans (`functions._merged`); a unit evaluated over keys where it does not switch, and
    not folded there, gives the same rows and gradients whatever the runs."""
    enc = _fire()
    pos = (torch.arange(151) + 60).expand(2, -1)
    mode = _mode(fire_column_group=group, fire_span_slack=slack)
    bias = enc.bias(None, None, AttentionContext(pos, pos, q_start=60, k_start=60, mode=mode))
    _check(enc, bias, pos, pos, shared=True)
