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
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from posenc_lightning.encodings.base import AttentionContext, Encoding
from posenc_lightning.encodings.registry import register
from posenc_lightning.functional.lie_rotary import (
    canonical_basis,
    lie_planes,
    lie_rotate_pair,
    matrix_exp_rotate,
    relative_spectral_gap,
    skew,
)
from posenc_lightning.functional.mode import Mode

__all__ = ["ComRoPE", "LieRE", "MatrixRotary", "skew"]

#: below this relative eigenvalue gap (`relative_spectral_gap`) the eigenbasis path falls back to
#: ``matrix_exp``. The eigen-gradient's error is ~eps / gap in the coupling of the two closest
#: planes: ~1e-15 / gap in float64, ~1.5e-7 / gap in float32 (tests/test_rotary_matrix_fast.py;
#: 2e-6 at the 0.03 of a random 8 x 8 block). Random initial generators have gaps
#: >= 3e-4 (dense 64 x 64, 20 seeds; >= 5e-3 for 8 x 8 blocks).
MIN_RELATIVE_GAP = 1e-6


def _recheck(module: MatrixRotary, _incompatible: Any) -> None:
    module.check_spectrum()


class _Planes:
    """One `lie_planes` result and what it was computed from: the generator tensors themselves
    (identity), their ``_version`` (bumped by every in-place change: an optimizer step, ``copy_``,
    ``load_state_dict``), storage and dtype, and the compute dtype. ``graph``: the outputs carry the
    generators' autograd graph; ``spent`` once that graph's backward ran (its saved tensors freed).
    A change through ``.data`` bumps no version and is not seen: change the generators in place
    under ``torch.no_grad()``, as optimizers and ``load_state_dict`` do (``train()``/``eval()``
    and ``load_state_dict`` also drop the entry)."""

    __slots__ = ("basis", "freq", "graph", "key", "spent", "tensors")

    def __init__(self, tensors: tuple[Tensor, ...], dtype: torch.dtype, graph: bool) -> None:
        self.tensors, self.key, self.graph, self.spent = tensors, _planes_key(tensors, dtype), graph, False
        self.basis: Tensor | None = None
        self.freq: Tensor | None = None

    def serves(self, tensors: tuple[Tensor, ...], dtype: torch.dtype, graph: bool) -> bool:
        return (not self.spent and (self.graph or not graph) and len(tensors) == len(self.tensors)
                and all(a is b for a, b in zip(tensors, self.tensors)) and self.key == _planes_key(tensors, dtype))

    def spend(self) -> None:
        self.spent = True

    def __deepcopy__(self, memo: dict) -> None:  # a copy of the module computes its own
        return None

    def __reduce__(self) -> tuple:  # nor is it saved with the module
        return _no_planes, ()


def _no_planes() -> None:
    return None


def _planes_key(tensors: tuple[Tensor, ...], dtype: torch.dtype) -> tuple:
    return (dtype, *((t._version, t.data_ptr(), t.dtype, t.device) for t in tensors))


class MatrixRotary(Encoding):
    """Shared path: positions -> block rotations ``exp(sum_a x_a A_a)`` -> rotated q and k.

    When every block has one generator direction (``A_{a,k} = c_{a,k} P_k``: LieRE with one axis,
    ComRoPE AP and LD) the rotation is RoPE in the learned eigenbasis of ``P_k``
    (`functional.lie_rotary`): ``O(D * D)`` per token, nothing ``D x D`` per token. Otherwise
    (LieRE with several axes, ``exact=True``, or a degenerate spectrum) it is the exact
    ``matrix_exp`` per token, recomputed in backward. `rotation_blocks` is the reference.
    """

    needs_even_head_dim = True
    accepts_nd_positions: ClassVar[bool] = True
    #: the ``matrix_exp`` path's chunk: ~this many matrix entries per chunk of tokens (1 MiB fp32;
    #: matrix_exp's workspace is ~20x that)
    exact_chunk_elems: int = 1 << 18

    def __init__(self, n_axes: int = 1, block_size: int | None = 8, exact: bool = False) -> None:
        super().__init__()
        if int(n_axes) < 1:
            raise ValueError(f"{self.name}: n_axes must be >= 1, got {n_axes}")
        if block_size is not None and (int(block_size) < 2 or int(block_size) % 2):
            raise ValueError(f"{self.name}: block_size must be an even number >= 2 (or None for one "
                             f"head_dim block), got {block_size}")
        self.n_axes = int(n_axes)
        self.block_size_arg = None if block_size is None else int(block_size)
        self.exact = bool(exact)
        #: the eigenbasis path is in use (a Python bool: decided by `check_spectrum`, never in rotate)
        self.fast_path = False
        #: the last `planes` (eager only): shared by every call until the generators change or, when it
        #: carries their graph, until that graph's backward ran: layers sharing the encoding, attention's
        #: recompute in backward (`attention.recompute`) and frozen or inference calls decompose once
        self._planes: _Planes | None = None
        self.register_load_state_dict_post_hook(_recheck)

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

    def directions(self) -> tuple[Tensor, Tensor] | None:
        """``(P [K, b, b] skew, c [n_axes, K])`` with generators ``A_{a,k} = c_{a,k} P_k``, or None
        when the generators of a block point in several directions (no shared eigenbasis)."""
        raise NotImplementedError

    def generators(self) -> Tensor:
        """``[n_axes, n_blocks, b, b]`` skew-symmetric generator blocks."""
        p, c = self.directions()
        return c[:, :, None, None] * p[None]

    def _positions(self, positions: Tensor) -> Tensor:
        if positions.dim() == 2:
            if self.n_axes != 1:
                raise ValueError(f"{self.name} has n_axes={self.n_axes}: pass positions [B, N, {self.n_axes}]")
            positions = positions[..., None]
        if positions.shape[-1] != self.n_axes:
            raise ValueError(f"{self.name}: positions have {positions.shape[-1]} coordinates, n_axes={self.n_axes}")
        return positions

    def _check_axes(self, positions: Tensor) -> None:
        """`_positions`' checks without its view (shapes only: no operator)."""
        if positions.dim() == 2 and self.n_axes != 1:
            raise ValueError(f"{self.name} has n_axes={self.n_axes}: pass positions [B, N, {self.n_axes}]")
        if positions.dim() == 3 and positions.shape[-1] != self.n_axes:
            raise ValueError(f"{self.name}: positions have {positions.shape[-1]} coordinates, n_axes={self.n_axes}")

    def _math_dtype(self, *xs: Tensor) -> torch.dtype:
        """`_dtype` without ``torch.promote_types`` (a dispatched operator): float64 if the weights or
        an input are, else float32."""
        return torch.float64 if any(t.dtype == torch.float64 for t in (self.weight, *xs)) else torch.float32

    def _dtype(self, *xs: Tensor) -> torch.dtype:
        dt = torch.promote_types(self.weight.dtype, torch.float32)
        for x in xs:
            dt = torch.promote_types(dt, x.dtype)
        return dt

    # ---------------------------------------------------------------- the exact reference
    def rotation_blocks(self, positions: Tensor) -> Tensor:
        """Reference: ``exp(sum_a x_a A_a)`` per token and block, ``[B, N, n_blocks, b, b]``
        (float32, or float64 for float64 parameters)."""
        x = self._positions(positions)
        gens = self.generators().to(self._dtype())
        return torch.linalg.matrix_exp(torch.einsum("bna,akij->bnkij", x.to(gens.dtype), gens))

    def rotation_matrix(self, positions: Tensor) -> Tensor:
        """The dense ``[..., D, D]`` rotation (for tests and visualization)."""
        blocks = self.rotation_blocks(positions)
        k, b = blocks.shape[-3], blocks.shape[-1]
        out = blocks.new_zeros(*blocks.shape[:-3], k * b, k * b)
        for j in range(k):
            out[..., j * b:(j + 1) * b, j * b:(j + 1) * b] = blocks[..., j, :, :]
        return out

    # ---------------------------------------------------------------- the eigenbasis path
    def plane_inputs(self) -> tuple[Tensor, Tensor | None]:
        """``(W, c)`` for `lie_planes`: raw generator weights ``[(1,) K, b, b]`` whose skew parts are
        the directions ``P_k``, and the axis weights (``[A, K]``, ``[A]``, or None for ``c = 1``),
        as stored (no operator: `directions` is the same as matrices)."""
        raise NotImplementedError

    def planes(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(Q [D, D] in dtype, F [n_axes, K, b/2] float64)``: the rotation of a token at ``x`` is RoPE
        with angles ``sum_a x_a F[a]`` (half layout, plane ``k b/2 + j``) in the orthonormal basis
        ``Q`` (block diagonal up to a column order). Eager calls share one result until the
        generators change (`_Planes`); a traced call computes it in the graph (the same two operators,
        traced by their fake implementations)."""
        w, c = self.plane_inputs()
        if Mode.tracing():
            return lie_planes(w, c, dtype)
        tensors = (w,) if c is None else (w, c)
        graph = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        memo = self._planes
        if memo is not None and memo.serves(tensors, dtype, graph):
            return memo.basis, memo.freq  # type: ignore[return-value]
        memo = _Planes(tensors, dtype, graph)
        memo.basis, memo.freq = lie_planes(w, c, dtype, memo.spend if graph else None)
        self._planes = memo
        return memo.basis, memo.freq

    def spectral_gap(self) -> float:
        """The smallest `relative_spectral_gap` over blocks (a host read: a diagnostic)."""
        with torch.no_grad():
            p, _ = self.directions()
            return float(relative_spectral_gap(canonical_basis(p)[1]).min())

    def check_spectrum(self) -> bool:
        """Choose the path (host read, done at build, after loading a state dict and on
        ``train()``/``eval()``, never inside `rotate`): the eigenbasis unless ``exact``, the
        generators are not of one direction per block, or a block's spectrum is degenerate."""
        fast = False
        self._planes = None
        if self._built and not self.exact and self.weight.device.type != "meta":
            fast = self.directions() is not None and self.spectral_gap() > MIN_RELATIVE_GAP
        self.fast_path = fast
        return fast

    def build(self) -> None:
        self._build_parameters()
        self._built = True
        self.check_spectrum()

    def _build_parameters(self) -> None:
        raise NotImplementedError

    def train(self, mode: bool = True) -> MatrixRotary:
        super().train(mode)
        self.check_spectrum()
        return self

    #: attention keeps the rotated q and k for its backward (`Encoding.cheap_rotation`): on either
    #: path the rotation is a per-token change of basis, not RoPE's elementwise tables, so it is
    #: applied once per call; backward then needs no second rotation and no saved-tensor hooks
    cheap_rotation: ClassVar[bool] = False

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        if self.fast_path:
            self._check_axes(ctx.q_pos)
            self._check_axes(ctx.k_pos)
            basis, freq = self.planes(self._math_dtype(q, k))
            return lie_rotate_pair(q, k, basis, freq, ctx.q_pos, ctx.k_pos)
        gens, chunk = self.generators().to(self._dtype(q, k)), self.exact_chunk_elems
        if ctx.k_pos is ctx.q_pos:
            qr, kr = matrix_exp_rotate((q, k), self._positions(ctx.q_pos), gens, chunk)
            return qr, kr
        return (matrix_exp_rotate((q,), self._positions(ctx.q_pos), gens, chunk)[0],
                matrix_exp_rotate((k,), self._positions(ctx.k_pos), gens, chunk)[0])


@register("liere", "rotate", "LieRE: learned skew-symmetric generators, R(x) = exp(sum x_a A_a) (Ostmeier et al., 2024)")
class LieRE(MatrixRotary):
    """LieRE (Ostmeier et al., 2024, eq. 3): one free learned generator per position axis.

    Args:
        n_axes: position coordinates (1 for text, 2 for images). With 1 the rotation runs in the
            generator's eigenbasis; with more the generators do not commute and it is the exact
            per-token ``matrix_exp`` (one ``b x b`` exp per token and block, twice in backward).
        block_size: generator block size; None = one dense ``head_dim x head_dim`` block.
        exact: always use the per-token ``matrix_exp`` path.
    """

    def __init__(self, n_axes: int = 1, block_size: int | None = None, exact: bool = False) -> None:
        super().__init__(n_axes=n_axes, block_size=block_size, exact=exact)

    def _build_parameters(self) -> None:
        self.weight = nn.Parameter(torch.stack([self._init_blocks(self.n_blocks) for _ in range(self.n_axes)]))

    def directions(self) -> tuple[Tensor, Tensor] | None:
        if self.n_axes != 1:
            return None
        p = skew(self.weight[0])
        return p, p.new_ones(1, p.shape[0])

    def plane_inputs(self) -> tuple[Tensor, Tensor | None]:
        return self.weight, None

    def generators(self) -> Tensor:
        return skew(self.weight)


@register("comrope", "rotate", "ComRoPE: trainable commuting angle matrices, AP or LD (Yu et al., 2025)")
class ComRoPE(MatrixRotary):
    """ComRoPE (Yu et al., 2025, sec. 4): commuting generators, so ``R(x)^T R(y) = R(y - x)``.

    Args:
        variant: ``"ap"`` (axial partition: block j belongs to axis ``j % n_axes``) or ``"ld"``
            (linearly dependent: ``A_a = w_a P`` with learned shared P and per-axis ``w_a``).
            Either way block k has one direction ``P_k``, rotated by ``x_{j % n_axes}`` (AP) or
            ``w . x`` (LD): RoPE in ``P_k``'s eigenbasis.
        n_axes: position coordinates.
        block_size: size of the learned blocks (even).
        exact: always use the per-token ``matrix_exp`` path.
    """

    def __init__(self, variant: Literal["ap", "ld"] = "ap", n_axes: int = 1, block_size: int = 8,
                 exact: bool = False) -> None:
        if variant not in ("ap", "ld"):
            raise ValueError(f"comrope: variant must be 'ap' or 'ld', got {variant!r}")
        super().__init__(n_axes=n_axes, block_size=block_size, exact=exact)
        self.variant = variant

    def _build_parameters(self) -> None:
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

    def directions(self) -> tuple[Tensor, Tensor]:
        p = skew(self.weight)  # [K, b, b]
        if self.variant == "ld":
            return p, self.axis_weight[:, None].expand(-1, p.shape[0])
        return p, self.axis_mask.to(p.dtype)

    def plane_inputs(self) -> tuple[Tensor, Tensor | None]:
        return self.weight, self.axis_weight if self.variant == "ld" else self.axis_mask
