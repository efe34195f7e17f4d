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

The solve is cached (issue 49): one per scale, device and dtype, kept across calls and steps until
the ODE's parameters change (their storage or ``_version``: an optimizer step) or, when it carries
a graph, until a backward has gone through that graph. So within a training step every layer and
call shares one solve, whose graph the backward goes through once (`encodings.clex_ode`, `autograd.rotary_learned`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

from posenc_lightning.autograd.rotary_learned import LearnedRotaryPair
from posenc_lightning.encodings.base import AttentionContext
from posenc_lightning.encodings.clex_ode import clex_solve
from posenc_lightning.encodings.registry import register
from posenc_lightning.encodings.rope import RotaryEncoding
from posenc_lightning.functional.clex import clex_log_freq, clex_ntk_log_freq, clex_rhs, rk4
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.rope import rope_angles, rotate_qk

__all__ = ["CLEX", "clex_ntk_log_freq", "rk4"]


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
        #: the current solve: {"key", "value", "consumed", "serial"} (`solved_inv_freq`)
        self._solve_cache: dict[str, Any] = {}
        self._solve_serial = 0
        self._z0: dict[tuple, Tensor] = {}
        #: the rotation tables of the current solve at a known start (`rotate`)
        self._learned_tables: dict[tuple, tuple[Tensor, ...]] = {}

    def __getstate__(self) -> dict[str, Any]:
        # a solve's graph cannot be copied (deepcopy, pickle): copies solve again
        state = super().__getstate__()
        return {**state, "_solve_cache": {}, "_learned_tables": {}}

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
        """The ODE's right-hand side at scale t (`functional.clex.clex_rhs`), in z's dtype."""
        return clex_rhs(t, z, self.ode_up.to(z.dtype), self.ode_down.to(z.dtype), self.theta)

    def _ode_trains(self) -> bool:
        return torch.is_grad_enabled() and (self.ode_up.requires_grad or self.ode_down.requires_grad)

    def _solve_key(self, seq_len: int | None, device: torch.device) -> tuple:
        """What the solve depends on; Python values only (reading it dispatches no operator)."""
        dtype = torch.float64 if self.ode_up.dtype == torch.float64 else torch.float32  # (no dispatch)
        versions = tuple((p.data_ptr(), p._version) for p in (self.ode_up, self.ode_down))
        return (self.scale_for(seq_len), self.ode_step, device, dtype, versions)

    def solved_inv_freq(self, seq_len: int | None, device: torch.device | None = None) -> Tensor:
        """The frequencies at this length: the cached solve when its key holds and (when the ODE
        trains) its graph has not been through a backward yet, else a new solve.

        Args:
            seq_len: the current length (the scale is ``scale_for(seq_len)``).
            device: where the frequencies are wanted (default: the parameters').

        Returns:
            ``[R/2]`` inverse frequencies, with the solve's graph when the ODE trains.

        Two forwards that share a solve need one backward of both losses (or ``retain_graph``):
        the first backward through the solve frees its graph, as for any shared computation.
        """
        device = device or self.ode_up.device
        key = self._solve_key(seq_len, device)
        trains = self._ode_trains()
        hit = self._solve_cache.get("key") == key
        value = self._solve_cache.get("value")
        if hit and not (trains and (value.grad_fn is None or self._solve_cache["consumed"])):
            return value
        _, step, _, dtype, _ = key
        z0 = self._z0.get((device, dtype))
        if z0 is None:  # log theta: the same every call
            z0 = self._z0[(device, dtype)] = torch.log(self.base_inv_freq(device)).to(dtype)
        up, down = self.ode_up.to(device, dtype), self.ode_down.to(device, dtype)
        inv_freq = torch.exp(clex_solve(z0, up, down, key[0], step, self.theta))
        self._solve_serial += 1
        cache = {"key": key, "value": inv_freq, "consumed": False, "serial": self._solve_serial}
        if inv_freq.requires_grad:
            # the backward through this graph frees it: the next step's forward solves again
            inv_freq.register_hook(lambda g: cache.__setitem__("consumed", True))
        self._solve_cache = cache
        return inv_freq

    def frequencies(self, seq_len: int | None = None, device: torch.device | None = None) -> tuple[Tensor, float]:
        if not Mode.tracing():
            return self.solved_inv_freq(seq_len, device), 1.0
        # traced: the plain solve in the graph (a parameter's version is no traceable cache key)
        device = device or self.ode_up.device
        z0 = torch.log(self.base_inv_freq(device))
        z = clex_log_freq(z0, self.ode_up.float(), self.ode_down.float(), self.scale_for(seq_len), self.ode_step,
                          self.theta)
        if self.scale_for(seq_len) <= 1.0 and torch.is_grad_enabled() and self.ode_up.requires_grad:
            # no ODE step at t = 1: keep the ODE's parameters in the graph with a zero gradient, as
            # DDP expects every parameter to take part in every step (else: "unused parameters")
            z = z + 0.0 * (self.ode_up.float().sum() + self.ode_down.float().sum())
        return torch.exp(z), 1.0

    def frequencies_key(self, seq_len: int | None) -> Any:
        if self._ode_trains() or Mode.tracing():
            # trained frequencies: `rotate` takes them with their graph; compiled: in the graph
            return None
        return ("clex",) + self._solve_key(seq_len, self.ode_up.device)

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        """While the ODE trains, q and k are rotated by `autograd.rotary_learned.LearnedRotaryPair` with the
        shared solve, so the frequencies get their gradient; the tables of a call at known
        ``start + arange`` positions are kept with the solve, and the rotation that backward
        recomputes (`attention.recompute`, without grad) reuses them. Otherwise as rope's."""
        if ctx.mode.compiling or ctx.q_pos.is_floating_point():
            return super().rotate(q, k, ctx)
        trains = self._ode_trains()
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        key = None
        if ctx.q_start is not None and ctx.k_start is not None:
            key = (self._solve_key(ctx.seq_len, q.device), dtype, ctx.q_start, ctx.k_start, tuple(ctx.q_pos.shape),
                   tuple(ctx.k_pos.shape), ctx.k_pos is ctx.q_pos)
        tables = self._learned_tables.get(key) if key is not None else None
        if not trains:
            if tables is None:  # inference: rope's tables, sliced per call
                return super().rotate(q, k, ctx)
            return rotate_qk(q, k, *tables, self.layout)
        inv_freq = self.solved_inv_freq(ctx.seq_len, q.device)
        if tables is None:
            with torch.no_grad():
                aq = rope_angles(ctx.q_pos, inv_freq)
                cq, sq = aq.cos()[:, None].to(dtype), aq.sin()[:, None].to(dtype)
                if ctx.k_pos is ctx.q_pos:
                    ck, sk = cq, sq
                else:
                    ak = rope_angles(ctx.k_pos, inv_freq)
                    ck, sk = ak.cos()[:, None].to(dtype), ak.sin()[:, None].to(dtype)
                tables = (cq, sq, ck, sk)
            if key is not None:
                self._learned_tables = {key: tables}  # the tables of the current solve only
        return LearnedRotaryPair.apply(q, k, inv_freq, *tables, ctx.q_pos, ctx.k_pos, self.layout == "interleaved")
