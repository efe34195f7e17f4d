"""Rotary variants: resonance_rope, multiscale_rope, xpos, rope_2d."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from posenc_lightning.encodings.base import AttentionContext
from posenc_lightning.encodings.registry import register
from posenc_lightning.encodings.rope import RotaryEncoding
from posenc_lightning.encodings.rope_scaling import YaRN
from posenc_lightning.functional.rope import rope_cos_sin, rope_inv_freq
from posenc_lightning.functional.rope_scaling import resonance_inv_freq

Layout = Literal["half", "interleaved"]


@register("resonance_rope", "rotate", "Resonance RoPE: integer wavelengths; with factor > 1, Resonance YaRN "
          "(Wang et al., 2024)")
class ResonanceRoPE(YaRN):
    """Resonance RoPE (Wang et al., 2024, eq. 7): ``theta_i' = 2 pi / round(2 pi / theta_i)``, so
    every feature repeats exactly after an integer number of tokens. It wraps YaRN: with
    ``factor = 1`` (default) the frequencies are RoPE's, rounded; with ``factor > 1`` the YaRN
    frequencies are rounded (Resonance YaRN) and YaRN's attention scale applies. The YaRN args
    and ``set_scale`` work as in `YaRN`."""

    hf_rope_type: ClassVar[str | None] = None  # rounded wavelengths: no transformers rope law

    def __init__(self, factor: float = 1.0, original_max_position_embeddings: int = 512, theta: float = 10000.0,
                 beta_fast: float = 32.0, beta_slow: float = 1.0, mscale: float | None = None,
                 mscale_all_dim: float | None = None, attention_factor: float | None = None, truncate: bool = True,
                 layout: Layout = "half", partial_rotary_factor: float = 1.0) -> None:
        super().__init__(factor, original_max_position_embeddings, theta, beta_fast, beta_slow, mscale,
                         mscale_all_dim, attention_factor, truncate, layout, partial_rotary_factor)

    def frequencies(self, seq_len: int | None = None, device: torch.device | None = None) -> tuple[Tensor, float]:
        inv, scale = super().frequencies(seq_len, device)
        return resonance_inv_freq(inv), scale


@register("multiscale_rope", "rotate", "Multi-scale RoPE: each head rotates at its own frequency scale")
class MultiScaleRoPE(RotaryEncoding):
    """Per-head frequency scales: head h uses ``theta_i / s_h`` with ``s_h`` geometric from
    ``min_scale`` to ``max_scale`` (short-range heads and long-range heads). ``inv_freq`` is
    ``[n_heads, rotary_dim/2]``; needs ``n_kv_heads == n_heads``."""

    def __init__(self, theta: float = 10000.0, min_scale: float = 1.0, max_scale: float = 16.0,
                 layout: Layout = "half", partial_rotary_factor: float = 1.0) -> None:
        super().__init__(theta=theta, layout=layout, partial_rotary_factor=partial_rotary_factor)
        if not 0 < min_scale <= max_scale:
            raise ValueError(f"multiscale_rope: need 0 < min_scale <= max_scale, got {min_scale}, {max_scale}")
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)

    def head_scales(self, device: torch.device | None = None) -> Tensor:
        if self.n_heads is None:
            raise RuntimeError("multiscale_rope: n_heads unknown; call bind(n_heads=...) or inject() first")
        lo, hi = torch.tensor([self.min_scale, self.max_scale], dtype=torch.float64).log()
        t = torch.linspace(0, 1, self.n_heads, dtype=torch.float64) if self.n_heads > 1 else torch.zeros(1, dtype=torch.float64)
        return (lo + t * (hi - lo)).exp().to(torch.float32).to(device)

    def frequencies(self, seq_len: int | None = None, device: torch.device | None = None) -> tuple[Tensor, float]:
        return self.base_inv_freq(device)[None, :] / self.head_scales(device)[:, None], 1.0


@register("xpos", "rotate", "xPos: rope with an exponential scale zeta^((m - n)/scale_base) (Sun et al., 2022)")
class XPos(RotaryEncoding):
    """xPos (Sun et al., 2022, eq. 9-10): q at position m is rotated and scaled by
    ``zeta_i^(m / scale_base)``, k at n by ``zeta_i^(-n / scale_base)``, with
    ``zeta_i = (2i/d + gamma) / (1 + gamma)``; so ``q . k`` carries ``zeta^((m - n)/scale_base)``.

    Positions are centred on the middle of the current keys before scaling (the product only
    depends on m - n), which keeps the scales finite; so keys are cached un-rotated (``dynamic``).
    """

    dynamic = True

    def __init__(self, theta: float = 10000.0, scale_base: float = 512.0, gamma: float = 0.4,
                 layout: Layout = "half", partial_rotary_factor: float = 1.0) -> None:
        super().__init__(theta=theta, layout=layout, partial_rotary_factor=partial_rotary_factor)
        if scale_base <= 0 or gamma <= 0:
            raise ValueError(f"xpos: scale_base and gamma must be positive, got {scale_base}, {gamma}")
        self.scale_base, self.gamma = float(scale_base), float(gamma)

    def zeta(self, device: torch.device | None = None) -> Tensor:
        r = self.rotary_dim
        return (torch.arange(0, r, 2, dtype=torch.float32, device=device) / r + self.gamma) / (1 + self.gamma)

    def xpos_scale(self, positions: Tensor, center: Tensor) -> Tensor:
        """``zeta^((p - center) / scale_base)``: ``[B, N, R/2]`` float32."""
        rel = (positions.to(torch.float64) - center.to(torch.float64)[:, None]).to(torch.float32)
        return torch.exp(rel[..., None] / self.scale_base * self.zeta(positions.device).log())

    def rotation_tables(self, ctx: AttentionContext) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """RoPE's cos/sin times ``zeta^((m - c) / scale_base)`` for q, its inverse for k (the
        rotation and the scale of a pair are one linear map, which `rotate` applies)."""
        cq, sq = self.cos_sin(ctx.q_pos, start=ctx.q_start)
        ck, sk = (cq, sq) if ctx.k_pos is ctx.q_pos else self.cos_sin(ctx.k_pos, start=ctx.k_start)
        kp = ctx.k_pos.to(torch.float64)
        center = torch.floor((kp.amin(-1) + kp.amax(-1)) / 2) if kp.numel() else kp.new_zeros(kp.shape[0])
        zq, zk = self.xpos_scale(ctx.q_pos, center), 1.0 / self.xpos_scale(ctx.k_pos, center)
        return cq * zq, sq * zq, ck * zk, sk * zk


@register("rope_2d", "rotate", "Axial 2-D RoPE for [B, N, 2] (row, column) positions (Heo et al., 2024)")
class RoPE2D(RotaryEncoding):
    """Axial 2-D RoPE (Heo et al., 2024, eq. 9): half of the rotary pairs rotate with the row
    coordinate, half with the column, each with frequencies ``theta^(-4t/d)``.

    Positions may be ``[B, N, 2]`` (row, column) or ``[B, N]``; a 1-D position p is read as the
    grid cell ``(p // grid_width, p % grid_width)`` (a raster scan), so it also runs in a language
    model. ``position_dims`` stays 1 and ``accepts_nd_positions`` lets the mixin pass ``[B, N, 2]``.
    """

    accepts_nd_positions: ClassVar[bool] = True

    def __init__(self, theta: float = 100.0, grid_width: int = 16, layout: Layout = "half",
                 partial_rotary_factor: float = 1.0) -> None:
        super().__init__(theta=theta, layout=layout, partial_rotary_factor=partial_rotary_factor)
        if int(grid_width) < 1:
            raise ValueError(f"rope_2d: grid_width must be >= 1, got {grid_width}")
        self.grid_width = int(grid_width)

    def build(self) -> None:
        if self.head_dim is not None and self.rotary_dim % 4:
            raise ValueError(f"rope_2d needs a rotary dim divisible by 4 (two axes of pairs), got {self.rotary_dim}; "
                             f"use head_dim a multiple of 4")

    def axis_inv_freq(self, device: torch.device | None = None) -> Tensor:
        return rope_inv_freq(self.rotary_dim // 2, self.theta, device=device)

    def frequencies(self, seq_len: int | None = None, device: torch.device | None = None) -> tuple[Tensor, float]:
        f = self.axis_inv_freq(device)
        return torch.cat((f, f)), 1.0

    def grid_positions(self, positions: Tensor) -> Tensor:
        """``[B, N, 2]`` (row, column) from ``[B, N]`` raster positions or as given."""
        if positions.dim() == 3:
            if positions.shape[-1] != 2:
                raise ValueError(f"rope_2d: positions must be [B, N, 2] or [B, N], got {tuple(positions.shape)}")
            return positions
        return torch.stack((torch.div(positions, self.grid_width, rounding_mode="floor"),
                            torch.remainder(positions, self.grid_width)), dim=-1)

    def cos_sin(self, positions: Tensor, seq_len: int | None = None, start: int | None = None
                ) -> tuple[Tensor, Tensor]:
        grid = self.grid_positions(positions)
        f = self.axis_inv_freq(positions.device)
        cr, sr = rope_cos_sin(grid[..., 0], f)
        cc, sc = rope_cos_sin(grid[..., 1], f)
        return torch.cat((cr, cc), -1), torch.cat((sr, sc), -1)

    def frequencies_key(self, seq_len: int | None) -> Any:
        return "static"

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        # the shared rotation with our cos_sin; overridden so that fused backends (which fuse only
        # the unmodified RotaryEncoding.rotate of [B, N] positions) leave [B, N, 2] to this path
        return super().rotate(q, k, ctx)
