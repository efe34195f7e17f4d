"""The forms a bias kind gives backends besides its rows: `KeyOnly` (sdpa's key channel),
`OpaqueOperands` (an opaque operator's tensors and constants), `HeadScaled` (a per-head weight times a
shared pattern, the blockwise tiles), `KernelBias` (the Triton kernels' arguments, `Bias.fold_into`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from posenc_lightning.encodings.bias.tile import TileBias
from posenc_lightning.encodings.bias.windows import same_positions

__all__ = ["HeadScaled", "KernelBias", "KeyOnly", "OpaqueOperands"]


@dataclass(eq=False)
class KeyOnly:
    """A bias that, where a query may see a key, is ``q_ch[h] * k_ch[b, h, j]`` plus a term of the
    query alone, which softmax drops: SDPA takes it as one extra q/k channel (`Bias.key_only`).

    ``q_ch``: ``[H]`` (None: 1 for every head); ``k_ch``: ``[B|1, H|1, Nk]`` in the activations'
    dtype (one head: the same for every head, so grouped kv heads stay grouped). ``q_row``
    (optional, ``[B|1, 1, Nq]``): where given, the bias is exactly ``q_ch[h] * (k_ch[j] - q_row[i])``
    wherever the query sees the key (normalizers that keep the row's constant, stick-breaking,
    take it as two extra q/k channels)."""

    q_ch: Tensor | None
    k_ch: Tensor
    q_row: Tensor | None = None

    def key_bias(self) -> Tensor:
        """``[B|1, H, Nk]``: the bias of key j, as every query sees it up to its own constant."""
        return self.k_ch if self.q_ch is None else self.q_ch[None, :, None] * self.k_ch


@dataclass(frozen=True, eq=False)
class OpaqueOperands:
    """A bias as an opaque operator takes it (`Bias.opaque_operands`): tensors and constants only.

    Attributes:
        kind: the name the kind is registered under (`register_opaque_kind`); the operator rebuilds
            the bias with that kind's `Bias.from_operands`, never importing its class.
        tensors: every tensor the bias is computed from (positions, parameters); those that
            require a gradient get one.
        ints: its integer constants (e.g. known position starts).
        floats: its float constants (e.g. an epsilon).
    """

    kind: str
    tensors: tuple[Tensor, ...]
    ints: tuple[int, ...] = ()
    floats: tuple[float, ...] = ()


@dataclass(frozen=True, eq=False)
class HeadScaled:
    """A bias ``w[h] * pattern(q_pos, k_pos)`` (`Bias.head_scaled`).

    Attributes:
        w: the per-head weights ``[H]``, one of the bias's `Bias.grad_inputs`.
        pattern: ``(q_pos [B, Nq], k_pos [B, Nk]) -> [B, Nq, Nk]`` float32, shared by the heads.
    """

    w: Tensor
    pattern: Callable[[Tensor, Tensor], Tensor]


@dataclass(eq=False)
class KernelBias:
    """The bias arguments of the fused Triton kernels, filled term by term (`Bias.fold_into`):
    summed ALiBi ``slopes [H]`` and relative tables (one ``table [H, 2R+1]`` over the widest
    range), both at ``q_pos``/``k_pos``, summed cumulative decays ``c_q``/``c_k``, one parametric
    bias ``tile`` (evaluated per tile, `TileBias`), and a ``dense`` rest."""

    slopes: Tensor | None = None
    table: Tensor | None = None
    c_q: Tensor | None = None
    c_k: Tensor | None = None
    dense: Tensor | None = None
    tile: TileBias | None = None
    q_pos: Tensor | None = None
    k_pos: Tensor | None = None

    def claim_positions(self, q_pos: Tensor, k_pos: Tensor) -> bool:
        """The position-based terms are read at these positions: True when no positions were
        claimed yet (they are now) or the claimed ones are equal."""
        if self.q_pos is None:
            self.q_pos, self.k_pos = q_pos, k_pos
            return True
        return same_positions(self.q_pos, q_pos) and same_positions(self.k_pos, k_pos)

    def add_dense(self, t: Tensor) -> None:
        self.dense = t if self.dense is None else self.dense + t
