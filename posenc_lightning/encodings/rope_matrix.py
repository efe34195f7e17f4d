"""Rotary encodings with learned rotation matrices: liere and comrope (AP and LD).

Both rotate q and k by ``R(x) = exp(sum_a x_a A_a)`` for a position ``x`` with ``n_axes``
coordinates and learned skew-symmetric generators ``A_a`` (so ``R(x)`` is orthogonal), block
diagonal with ``block_size`` blocks. The RoPE equation ``R(x)^T R(y) = R(y - x)`` holds iff the
generators commute (ComRoPE, Yu et al., 2025, Theorem 1):

* ``liere`` (LieRE, Ostmeier et al., 2024): free generators; relative only for one axis.
* ``comrope`` ``variant="ap"`` (axial partition): each block belongs to one axis, so generators
  of different axes act on disjoint blocks and commute.
* ``comrope`` ``variant="ld"`` (linearly dependent): ``A_a = w_a P`` with one shared learned ``P``.

Positions may be ``[B, N]`` (read as ``[B, N, 1]``; needs ``n_axes = 1``) or ``[B, N, n_axes]``.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from posenc_lightning.encodings.base import AttentionContext, Encoding
from posenc_lightning.encodings.registry import register


def skew(m: Tensor) -> Tensor:
    """The skew-symmetric part ``(M - M^T) / 2`` (over the last two dims)."""
    return 0.5 * (m - m.transpose(-1, -2))


class MatrixRotary(Encoding):
    """Shared path: positions -> block rotation matrices -> rotated q and k."""

    needs_even_head_dim = True
    accepts_nd_positions: ClassVar[bool] = True

    def __init__(self, n_axes: int = 1, block_size: int | None = 8) -> None:
        super().__init__()
        if int(n_axes) < 1:
            raise ValueError(f"{self.name}: n_axes must be >= 1, got {n_axes}")
        if block_size is not None and (int(block_size) < 2 or int(block_size) % 2):
            raise ValueError(f"{self.name}: block_size must be an even number >= 2 (or None for one "
                             f"head_dim block), got {block_size}")
        self.n_axes = int(n_axes)
        self.block_size_arg = None if block_size is None else int(block_size)

    @property
    def block_size(self) -> int:
        if self.head_dim is None:
            raise RuntimeError(f"{self.name}: head_dim unknown; call bind(head_dim=...) or inject() first")
        b = self.block_size_arg or self.head_dim
        if self.head_dim % b:
            raise ValueError(f"{self.name}: head_dim={self.head_dim} is not a multiple of block_size={b}; "
                             f"choose a block_size that divides head_dim")
        return b

    @property
    def n_blocks(self) -> int:
        return self.head_dim // self.block_size

    def _init_blocks(self, n: int) -> Tensor:
        """``[n, b, b]`` blocks whose rotation speeds spread like RoPE's frequencies."""
        b = self.block_size
        speed = 10000.0 ** (-torch.arange(n, dtype=torch.float32) / max(n, 1))
        return torch.randn(n, b, b) * speed[:, None, None] / math.sqrt(b)

    def generators(self) -> Tensor:
        """``[n_axes, n_blocks, b, b]`` skew-symmetric generator blocks."""
        raise NotImplementedError

    def _positions(self, positions: Tensor) -> Tensor:
        if positions.dim() == 2:
            if self.n_axes != 1:
                raise ValueError(f"{self.name} has n_axes={self.n_axes}: pass positions [B, N, {self.n_axes}]")
            positions = positions[..., None]
        if positions.shape[-1] != self.n_axes:
            raise ValueError(f"{self.name}: positions have {positions.shape[-1]} coordinates, n_axes={self.n_axes}")
        return positions

    def rotation_blocks(self, positions: Tensor) -> Tensor:
        """``exp(sum_a x_a A_a)`` per token and block: ``[B, N, n_blocks, b, b]`` float32."""
        x = self._positions(positions).to(torch.float32)
        flat = x.reshape(-1, self.n_axes)
        uniq, inv = torch.unique(flat, dim=0, return_inverse=True)
        gens = self.generators().to(torch.float32)  # [A, K, b, b]
        r = torch.linalg.matrix_exp(torch.einsum("ua,akij->ukij", uniq, gens))
        return r[inv].reshape(*x.shape[:-1], *r.shape[1:])

    def rotation_matrix(self, positions: Tensor) -> Tensor:
        """The dense ``[..., D, D]`` rotation (for tests and visualization)."""
        blocks = self.rotation_blocks(positions)
        k, b = blocks.shape[-3], blocks.shape[-1]
        out = blocks.new_zeros(*blocks.shape[:-3], k * b, k * b)
        for j in range(k):
            out[..., j * b:(j + 1) * b, j * b:(j + 1) * b] = blocks[..., j, :, :]
        return out

    def apply_rotation(self, x: Tensor, rot: Tensor) -> Tensor:
        b_, h, n, d = x.shape
        xb = x.float().reshape(b_, h, n, self.n_blocks, self.block_size)
        return torch.einsum("bnkij,bhnkj->bhnki", rot, xb).reshape(b_, h, n, d).to(x.dtype)

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        rq = self.rotation_blocks(ctx.q_pos)
        rk = rq if ctx.k_pos is ctx.q_pos else self.rotation_blocks(ctx.k_pos)
        return self.apply_rotation(q, rq), self.apply_rotation(k, rk)


@register("liere", "rotate", "LieRE: learned skew-symmetric generators, R(x) = exp(sum x_a A_a) (Ostmeier et al., 2024)")
class LieRE(MatrixRotary):
    """LieRE (Ostmeier et al., 2024, eq. 3): one free learned generator per position axis.

    Args:
        n_axes: position coordinates (1 for text, 2 for images).
        block_size: generator block size; None = one dense ``head_dim x head_dim`` block.
    """

    def __init__(self, n_axes: int = 1, block_size: int | None = None) -> None:
        super().__init__(n_axes=n_axes, block_size=block_size)

    def build(self) -> None:
        self.weight = nn.Parameter(torch.stack([self._init_blocks(self.n_blocks) for _ in range(self.n_axes)]))

    def generators(self) -> Tensor:
        return skew(self.weight)


@register("comrope", "rotate", "ComRoPE: trainable commuting angle matrices, AP or LD (Yu et al., 2025)")
class ComRoPE(MatrixRotary):
    """ComRoPE (Yu et al., 2025, sec. 4): commuting generators, so ``R(x)^T R(y) = R(y - x)``.

    Args:
        variant: ``"ap"`` (axial partition: block j belongs to axis ``j % n_axes``) or ``"ld"``
            (linearly dependent: ``A_a = w_a P`` with learned shared P and per-axis ``w_a``).
        n_axes: position coordinates.
        block_size: size of the learned blocks (even).
    """

    def __init__(self, variant: Literal["ap", "ld"] = "ap", n_axes: int = 1, block_size: int = 8) -> None:
        if variant not in ("ap", "ld"):
            raise ValueError(f"comrope: variant must be 'ap' or 'ld', got {variant!r}")
        super().__init__(n_axes=n_axes, block_size=block_size)
        self.variant = variant

    def build(self) -> None:
        if self.variant == "ap" and self.n_blocks < self.n_axes:
            raise ValueError(f"comrope ap: {self.n_blocks} blocks cannot cover n_axes={self.n_axes}; "
                             f"use a smaller block_size")
        self.weight = nn.Parameter(self._init_blocks(self.n_blocks))  # [K, b, b]
        if self.variant == "ld":
            self.axis_weight = nn.Parameter(torch.ones(self.n_axes))
        else:
            owner = torch.arange(self.n_blocks) % self.n_axes
            self.register_buffer("axis_mask", (owner[None, :] == torch.arange(self.n_axes)[:, None]).float(),
                                 persistent=False)

    def generators(self) -> Tensor:
        p = skew(self.weight)[None]  # [1, K, b, b]
        if self.variant == "ld":
            return self.axis_weight[:, None, None, None] * p
        return self.axis_mask[:, :, None, None] * p
