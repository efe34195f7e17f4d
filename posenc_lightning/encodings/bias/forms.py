"""The forms a bias kind gives backends besides its rows: `KeyOnly` (sdpa's key channel),
`OpaqueOperands` (an opaque operator's tensors and constants), `HeadScaled` (a per-head weight times a
shared pattern, the blockwise tiles)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

__all__ = ["HeadScaled", "KeyOnly", "OpaqueOperands"]


@dataclass(eq=False)
class KeyOnly:
    """A bias that, where a query may see a key, is ``q_ch[h] * k_ch[b, h, j]`` plus a term of the
    query alone, which softmax drops: SDPA takes it as one extra q/k channel (`Bias.key_only`).

    ``q_ch``: ``[H]`` (None: 1 for every head); ``k_ch``: ``[B|1, H|1, Nk]`` in the activations'
    dtype (one head: the same for every head, so grouped kv heads stay grouped)."""

    q_ch: Tensor | None
    k_ch: Tensor

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
