"""CLEX's ODE (Chen et al., 2024, "CLEX: Continuous Length Extrapolation", eq. 9-11), pure math.

The log-frequencies ``z(t)`` solve ``dz/dt = W_down silu(W_up^T (z + log theta_ntk(t))) +
d/dt log theta_ntk(t)`` from ``z(1) = log theta`` (``W_up`` stored ``[R/2, hidden]``, ``W_down``
``[hidden, R/2]``), integrated with fixed-step RK4 (`rk4`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor


def clex_ntk_log_freq(t: float, dim: int, base: float, device: torch.device | None = None,
                      dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """``(log theta_ntk(t), d/dt log theta_ntk(t))`` with ``alpha = max(2t - 1, 1)`` (CLEX's time embedding).

    Args:
        t: the continuous scale.
        dim: the rotary dimension (``dim / 2`` frequencies).
        base: the rope base theta.
        device: where the result lives.
        dtype: its dtype.

    Returns:
        Two ``[dim / 2]`` tensors.
    """
    two_i = torch.arange(0, dim, 2, dtype=dtype, device=device)
    alpha = 2.0 * t - 1.0 if t >= 1 else 1.0
    log_f = -(two_i / dim) * math.log(base) - two_i / (dim - 2) * math.log(alpha)
    dlog = -2.0 * two_i / (dim - 2) / alpha if t >= 1 else torch.zeros_like(two_i)
    return log_f, dlog


def rk4_steps(t0: float, t1: float, step: float) -> int:
    """How many RK4 steps `rk4` takes from t0 to t1 (0 when t0 == t1)."""
    return max(1, math.ceil(abs(t1 - t0) / step)) if t1 != t0 else 0


def rk4(f: Callable[[float, Tensor], Tensor], z0: Tensor, t0: float, t1: float, step: float) -> Tensor:
    """Classic fixed-step Runge-Kutta 4 from t0 to t1 (differentiable)."""
    n = rk4_steps(t0, t1, step)
    z, t = z0, t0
    h = (t1 - t0) / n if n else 0.0
    for _ in range(n):
        k1 = f(t, z)
        k2 = f(t + h / 2, z + h / 2 * k1)
        k3 = f(t + h / 2, z + h / 2 * k2)
        k4 = f(t + h, z + h * k3)
        z = z + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        t = t + h
    return z


def clex_rhs(t: float, z: Tensor, w_up: Tensor, w_down: Tensor, base: float) -> Tensor:
    """The CLEX ODE's right-hand side at scale t (eq. 10): ``silu((z + log theta_ntk) W_up) W_down
    + d/dt log theta_ntk``, in z's dtype."""
    log_ntk, dlog_ntk = clex_ntk_log_freq(t, 2 * z.shape[-1], base, z.device, z.dtype)
    return torch.nn.functional.silu((z + log_ntk) @ w_up) @ w_down + dlog_ntk


def clex_log_freq(z0: Tensor, w_up: Tensor, w_down: Tensor, t: float, step: float, base: float) -> Tensor:
    """``z(t)``: the ODE solved by `rk4` from ``z(1) = z0`` (differentiable in all three tensors).

    Args:
        z0: ``[R/2]`` log theta, the rope log-frequencies.
        w_up: ``[R/2, hidden]``; w_down: ``[hidden, R/2]`` (the ODE's parameters).
        t: the scale (>= 1); step: the RK4 step in t; base: the rope base.

    Returns:
        ``[R/2]`` log-frequencies at scale t.
    """
    return rk4(lambda s, z: clex_rhs(s, z, w_up, w_down, base), z0, 1.0, t, step)
