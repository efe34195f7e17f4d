"""CLEX's ODE solved once per length and step (issue 49): every call of a training step shares one
solve whose graph the backward goes through once, the solve is redone when the ODE's parameters
change (an optimizer step) or after a backward, and the numbers are those of the plain per-call
solve in float64, forward and the ODE parameters' gradients, across two optimizer steps. One
attention forward+backward dispatches as many operators at N 4096 (scale 8: 70 RK4 steps) as at
N 512 (scale 1: none), at most rope's + 20."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.threads import dispatched_ops
from posenc_lightning.encodings.base import AttentionContext
from posenc_lightning.encodings.clex_ode import clex_solve
from posenc_lightning.encodings.registry import build_encoding
from posenc_lightning.functional.clex import clex_log_freq
from posenc_lightning.functional.rope import apply_rotary_reference
from posenc_lightning.inject import inject
from tests.helpers import Attn

H, D = 2, 24
L = 16  # CLEX's original length in the float64 tests


def _plain_inv_freq(z0, up, down, t, step, base):
    """The formula: RK4 through the ODE, per call, autograd (no cache, no custom operator)."""
    return torch.exp(clex_log_freq(z0, up, down, t, step, base))


def _ode_rhs_by_hand(t, z, up, down, dim, base):
    """Eq. 10 written out again, independently of `functional.clex`."""
    two_i = torch.arange(0, dim, 2, dtype=z.dtype)
    alpha = max(2 * t - 1, 1.0)
    log_ntk = -(two_i / dim) * math.log(base) - two_i / (dim - 2) * math.log(alpha)
    dlog = -2 * two_i / (dim - 2) / alpha
    return torch.nn.functional.silu((z + log_ntk) @ up) @ down + dlog


@pytest.mark.parametrize("t", [1.0, 1.37, 3.05])
def test_the_solve_operator_is_rk4_of_the_ode_forward_and_backward(t):
    """``posenc::clex_solve`` against RK4 of eq. 10 written by hand, value and gradients (float64)."""
    g = torch.Generator().manual_seed(0)
    half, hidden, step, base = 6, 12, 0.1, 10000.0
    z0 = torch.log(1.0 / base ** (torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half)))
    up = (0.3 * torch.randn(half, hidden, dtype=torch.float64, generator=g)).requires_grad_()
    down = (0.3 * torch.randn(hidden, half, dtype=torch.float64, generator=g)).requires_grad_()
    z0 = z0.requires_grad_()
    n = max(1, math.ceil((t - 1) / step)) if t != 1 else 0
    h = (t - 1) / n if n else 0.0
    z, s = z0, 1.0
    for _ in range(n):
        f = lambda s_, z_: _ode_rhs_by_hand(s_, z_, up, down, 2 * half, base)
        k1 = f(s, z)
        k2 = f(s + h / 2, z + h / 2 * k1)
        k3 = f(s + h / 2, z + h / 2 * k2)
        k4 = f(s + h, z + h * k3)
        z, s = z + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4), s + h
    got = clex_solve(z0, up, down, t, step, base)
    torch.testing.assert_close(got, z, rtol=1e-12, atol=1e-12)
    w = torch.randn(half, dtype=torch.float64, generator=g)
    d_got = torch.autograd.grad((got * w).sum(), (z0, up, down), allow_unused=True, materialize_grads=True)
    d_want = torch.autograd.grad((z * w).sum(), (z0, up, down), allow_unused=True, materialize_grads=True)
    for a, b in zip(d_got, d_want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert (t == 1.0) == all(not bool(x.abs().max()) for x in d_got[1:])  # t = 1: no step, zero gradient


def _clex(dtype=torch.float64, **cfg):
    torch.manual_seed(0)
    enc = build_encoding("clex", original_max_position_embeddings=L, max_scale=8.0, **cfg)
    enc = enc.bind(n_heads=H, head_dim=D, d_model=H * D).to(dtype)
    with torch.no_grad():  # W_down starts at zero (an untrained CLEX is NTK): give the ODE a slope
        enc.ode_down.normal_(0, 0.05)
    return enc


def _calls(n, g):
    """Two calls (two layers' worth) at the same length: one at shuffled positions, one at
    ``start + arange`` (cached tables), q and k at different lengths."""
    shuffled = torch.randperm(n, generator=g)[None]
    arange = torch.arange(n)[None]
    return [(shuffled, shuffled[:, : n - 3], None, None), (arange, arange, 0, 0)]


@pytest.mark.parametrize("cfg", [{}, {"layout": "interleaved", "partial_rotary_factor": 0.5}])
@pytest.mark.parametrize("kv_heads", [H, 1])
def test_shared_cached_solve_equals_the_plain_per_call_solve_across_two_optimizer_steps(cfg, kv_heads):
    """Each step: two rotate calls at a length (scale > 1, not a multiple of the RK4 step), the
    loss backward, SGD on the ODE's parameters; the cached encoding and a plain copy (per-call
    solve from the formula) agree on outputs, dq, dk and the ODE's gradients; a stale solve or a
    graph reused after its backward would fail the second step."""
    enc = _clex(**cfg)
    up, down = (p.detach().clone().requires_grad_() for p in (enc.ode_up, enc.ode_down))
    z0 = torch.log(enc.base_inv_freq()).double()
    g = torch.Generator().manual_seed(1)
    solves = []
    for n in (37, 37, 53):  # the second step repeats the length: the parameters changed meanwhile
        loss_got = loss_want = 0.0
        dq_pairs = []
        for q_pos, k_pos, qs, ks in _calls(n, g):
            q = torch.randn(1, H, q_pos.shape[1], D, dtype=torch.float64, generator=g, requires_grad=True)
            k = torch.randn(1, kv_heads, k_pos.shape[1], D, dtype=torch.float64, generator=g, requires_grad=True)
            ctx = AttentionContext(q_pos, k_pos, True, q_start=qs, k_start=ks, context_len=n)
            got = enc.rotate(q, k, ctx)
            solves.append(id(enc._solve_cache))
            f = _plain_inv_freq(z0, up, down, enc.scale_for(n), enc.ode_step, enc.theta)
            want = []
            for x, pos in ((q, q_pos), (k, k_pos)):
                ang = pos[..., None].double() * f
                want.append(apply_rotary_reference(x, ang.cos(), ang.sin(), enc.layout))
            torch.testing.assert_close(got, tuple(want), rtol=1e-12, atol=1e-12)
            wq, wk = torch.randn_like(got[0]), torch.randn_like(got[1])
            loss_got = loss_got + (got[0] * wq).sum() + (got[1] * wk).sum()
            loss_want = loss_want + (want[0] * wq).sum() + (want[1] * wk).sum()
            dq_pairs.append((q, k))
        assert enc.scale_for(n) > 1 and solves[-1] == solves[-2]  # both calls shared one solve
        leaves = [x for pair in dq_pairs for x in pair]
        d_got = torch.autograd.grad(loss_got, [*leaves, enc.ode_up, enc.ode_down])
        d_want = torch.autograd.grad(loss_want, [*leaves, up, down])
        for a, b in zip(d_got, d_want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        assert d_got[-1].abs().max() > 0
        with torch.no_grad():  # the optimizer step, on both
            for p, r, dp in ((enc.ode_up, up, d_got[-2]), (enc.ode_down, down, d_got[-1])):
                p.sub_(0.05 * dp / dp.norm())
                r.sub_(0.05 * dp / dp.norm())


def test_the_solve_is_kept_while_nothing_changes_and_redone_when_something_does():
    enc = _clex()
    with torch.no_grad():
        f1 = enc.solved_inv_freq(40)
        assert enc.solved_inv_freq(40) is f1  # no training: kept across calls and steps
        assert enc.solved_inv_freq(41) is not f1  # another scale
        f2 = enc.solved_inv_freq(40)
        enc.ode_up.mul_(1.5)  # an optimizer step bumps the version
        f3 = enc.solved_inv_freq(40)
    assert f3 is not f2 and not torch.equal(f3, f2)
    fg = enc.solved_inv_freq(40)  # training: a solve with a graph
    assert fg.requires_grad and enc.solved_inv_freq(40) is fg
    fg.sum().backward()
    assert enc.solved_inv_freq(40) is not fg  # its graph is spent: the next step solves again


def test_a_deep_copy_solves_again():
    import copy

    enc = _clex()
    enc.solved_inv_freq(40)
    twin = copy.deepcopy(enc)
    torch.testing.assert_close(twin.solved_inv_freq(40), enc.solved_inv_freq(40), rtol=0, atol=0)


def _step(name, n):
    """One training step of one attention layer: an optimizer-like update of the encoding's
    parameters (outside the count), then forward+backward (counted; as tests/test_rotary_pair.py)."""
    torch.manual_seed(0)
    m = Attn(n_heads=H, head_dim=D)
    inject(m, name)
    x = torch.randn(1, n, 3 * H * D, requires_grad=True)
    params = list(m.encoding.parameters())

    def fwd_bwd():
        q, k, v = x.view(1, n, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        m(q, k, v).sum().backward()

    fwd_bwd()
    with torch.no_grad():
        for p in params:
            p.sub_(1e-3 * p.grad)
    return fwd_bwd


#: operators a CLEX training step may dispatch beyond rope's (16 at this commit): the solve and its
#: backward (2), exp and its backward (2), the new solve's rotation tables (positions to float,
#: angles, cos, sin and their views: 6), the frequencies' gradient (1), the accumulation into the
#: two parameters and their detaches (4); the recomputed rotation in backward reuses the tables
EXTRA = 20


def test_a_training_step_dispatches_as_many_operators_at_n_4096_as_at_512_and_at_most_rope_plus_20():
    rope = sum(dispatched_ops(_step("rope", 512)).values())
    counts = {}
    for n in (512, 4096):  # scale 1 (no RK4 step) and 8 (70 steps)
        ops = dispatched_ops(_step("clex", n))
        counts[n] = sum(ops.values())
        assert ops["posenc::clex_solve"] == 1 and ops["posenc::clex_solve_backward"] == 1, ops
    assert counts[512] == counts[4096] <= rope + EXTRA, (counts, rope)


def test_the_calls_of_a_step_share_one_solve_and_one_backward_through_it():
    """Three attention calls (three layers' worth) then one backward: one solve, one solve backward;
    the next step (parameters updated) solves once again."""
    torch.manual_seed(0)
    m = Attn(n_heads=H, head_dim=D)
    inject(m, "clex", original_max_position_embeddings=64)
    x = torch.randn(1, 200, 3 * H * D, requires_grad=True)  # scale 200 / 64: 22 RK4 steps

    def fwd_bwd():
        q, k, v = x.view(1, 200, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        out = m(q, k, v)
        out = m(out, k, v)
        m(out, k, out).sum().backward()

    for _ in range(2):
        ops = dispatched_ops(fwd_bwd)
        assert ops["posenc::clex_solve"] == 1 and ops["posenc::clex_solve_backward"] == 1, ops
        down = m.encoding.ode_down  # (W_down starts at zero, so W_up's first gradient is zero)
        assert down.grad.abs().max() > 0
        with torch.no_grad():
            down.sub_(1e-3 * down.grad)
