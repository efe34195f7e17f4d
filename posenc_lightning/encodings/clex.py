"""CLEX (Chen et al., 2023, "CLEX: Continuous Length Extrapolation for Large Language Models").

The log-frequencies ``z(t) = log theta(t)`` follow a learned ODE in the continuous scale t
(eq. 9-11)::

    dz/dt = W_down silu(W_up (z + log theta_ntk(t))) + d/dt log theta_ntk(t),   z(1) = log theta

with ``theta_ntk(t)`` the NTK-scaled frequencies for ``alpha = 2t - 1`` (the time embedding of the
reference code). ``W_down`` starts at zero, so an untrained CLEX is NTK scaling. The ODE is solved
with fixed-step RK4 (``ode_step``), differentiably, so ``W_up``/``W_down`` train by backprop.

The scale used is ``max(factor, L / original_max_position_embeddings)`` for the current length
L (``dynamic``: keys are cached un-rotated). The context curriculum samples ``t`` in
``[1, max_scale]`` each training step and calls ``set_scale(t)``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

from posenc_lightning.encodings.registry import register
from posenc_lightning.encodings.rope import RotaryEncoding
from posenc_lightning.functional.mode import Mode


def clex_ntk_log_freq(t: float, dim: int, base: float, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """``(log theta_ntk(t), d/dt log theta_ntk(t))`` with ``alpha = max(2t - 1, 1)`` (CLEX's time embedding)."""
    two_i = torch.arange(0, dim, 2, dtype=torch.float32, device=device)
    alpha = 2.0 * t - 1.0 if t >= 1 else 1.0
    log_f = -(two_i / dim) * math.log(base) - two_i / (dim - 2) * math.log(alpha)
    dlog = -2.0 * two_i / (dim - 2) / alpha if t >= 1 else torch.zeros_like(two_i)
    return log_f, dlog


def rk4(f, z0: Tensor, t0: float, t1: float, step: float) -> Tensor:
    """Classic fixed-step Runge-Kutta 4 from t0 to t1 (differentiable)."""
    n = max(1, math.ceil(abs(t1 - t0) / step)) if t1 != t0 else 0
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


@register("clex", "rotate", "CLEX: a neural ODE maps the continuous scale t to rope frequencies (Chen et al., 2023)")
class CLEX(RotaryEncoding):
    """CLEX: rope whose log-frequencies at scale ``t`` solve a learned ODE from ``log theta`` at
    ``t = 1`` (eq. 9-11, module docstring); untrained, it is NTK scaling.

    Args:
        factor: the scale t (>= 1); ``set_scale(t)`` changes it.
        max_scale: t_max, the largest scale trained (the curriculum samples t in [1, t_max]).
        original_max_position_embeddings: the training length L; at length L' the scale is at
            least L'/L.
        hidden_mult: width of the ODE's up-projection in multiples of rotary_dim.
        ode_step: RK4 step in t.
    """

    dynamic = True
    scalable = True

    def __init__(self, factor: float = 1.0, max_scale: float = 16.0, original_max_position_embeddings: int = 512,
                 theta: float = 10000.0, hidden_mult: int = 1, ode_step: float = 0.1,
                 layout: Literal["half", "interleaved"] = "half", partial_rotary_factor: float = 1.0) -> None:
        super().__init__(theta=theta, layout=layout, partial_rotary_factor=partial_rotary_factor)
        if max_scale < 1 or ode_step <= 0 or hidden_mult < 1:
            raise ValueError(f"clex: need max_scale >= 1, ode_step > 0, hidden_mult >= 1; got {max_scale}, "
                             f"{ode_step}, {hidden_mult}")
        self.max_scale = float(max_scale)
        self.original_max_position_embeddings = int(original_max_position_embeddings)
        self.hidden_mult, self.ode_step = int(hidden_mult), float(ode_step)
        self.factor = 1.0
        self.set_scale(factor)

    def build(self) -> None:
        half, hidden = self.rotary_dim // 2, self.hidden_mult * self.rotary_dim
        self.ode_up = nn.Parameter(torch.empty(half, hidden))
        nn.init.kaiming_uniform_(self.ode_up, a=math.sqrt(5))
        self.ode_down = nn.Parameter(torch.zeros(hidden, half))

    def set_scale(self, factor: float) -> None:
        """Set the continuous scale t (>= 1) used by the ODE."""
        factor = float(factor)
        if not math.isfinite(factor) or factor < 1:
            raise ValueError(f"clex: the scale t must be >= 1 (1 = the training length), got {factor}")
        self.factor = factor

    def config(self) -> dict[str, Any]:
        return {**super().config(), "factor": self.factor}

    def scale_for(self, seq_len: int | None) -> float:
        return max(self.factor, (seq_len or 0) / self.original_max_position_embeddings)

    def ode_rhs(self, t: float, z: Tensor) -> Tensor:
        log_ntk, dlog_ntk = clex_ntk_log_freq(t, self.rotary_dim, self.theta, z.device)
        return nn.functional.silu((z + log_ntk) @ self.ode_up.float()) @ self.ode_down.float() + dlog_ntk

    def frequencies(self, seq_len: int | None = None, device: torch.device | None = None) -> tuple[Tensor, float]:
        device = device or self.ode_up.device
        z0 = torch.log(self.base_inv_freq(device))
        t = self.scale_for(seq_len)
        z = rk4(self.ode_rhs, z0, 1.0, t, self.ode_step)
        if t <= 1.0 and torch.is_grad_enabled() and self.ode_up.requires_grad:
            # no ODE step at t = 1: keep the ODE's parameters in the graph with a zero gradient, as
            # DDP expects every parameter to take part in every step (else: "unused parameters")
            z = z + 0.0 * (self.ode_up.float().sum() + self.ode_down.float().sum())
        return torch.exp(z), 1.0

    def frequencies_key(self, seq_len: int | None) -> Any:
        if (torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())) \
                or Mode.tracing():
            # trained frequencies: recompute every call so gradients flow; compiled: in the graph
            # (a parameter's storage and version are no traceable cache key)
            return None
        versions = tuple((p.data_ptr(), p._version) for p in self.parameters())
        return ("clex", self.scale_for(seq_len), self.ode_step, versions)
