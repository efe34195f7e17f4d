"""The forms a bias kind gives backends besides its rows: `KeyOnly` (sdpa's key channel),
`ValueDependentForm` (a form chosen by values, run as an opaque operator: its `OpaqueOperands` and
hooks), `HandRows` (rows computed and differentiated by the kind's own algorithm), `HeadScaled` (a
per-head weight times a shared pattern, the blockwise tiles), `KernelBias` (the Triton kernels'
arguments, `Bias.fold_into`) and `GatedCounts` (positions counted by
content gates, computed in the kernels' tile)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from posenc_lightning.encodings.bias.tile import TileBias
from posenc_lightning.encodings.bias.windows import same_positions

__all__ = ["GatedCounts", "HandRows", "HeadScaled", "KernelBias", "KeyOnly", "OpaqueOperands", "OwnAttention",
           "ValueDependentForm"]


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
    """A bias as an opaque operator takes it (`ValueDependentForm.operands`): tensors and constants only.

    Attributes:
        kind: the name its rebuild function is registered under (`register_opaque_kind`); the
            operator rebuilds the bias with it (`rebuild_bias`), never importing its class.
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
class ValueDependentForm:
    """A bias whose cheapest exact evaluation depends on values (`Bias.value_dependent`; FIRE's: an
    O(N) table of ``f(i - j)`` while every query is below its learned threshold, the MLP per pair
    past it). A compiled graph cannot branch on a value, so on CPU sdpa hands the bias to one opaque
    operator as its `operands`; the operator rebuilds it by name (`rebuild_bias`) and, where
    reading a CPU tensor costs no sync, makes the eager choice: `distance_shift`, then the Toeplitz
    template of `distance_table`, else rows by blocks differentiated by `compiled_rows_from`.

    Attributes:
        operands: the bias as tensors and constants, rebuilt by `OpaqueOperands.kind`.
        distance_shift: ``() -> int | None``, reads values: ``a - c`` when at positions ``a +
            arange`` (queries) and ``c + arange`` (keys) the bias is a function of ``i - j`` alone
            here (`distance_table` gives it), else None.
        distance_table: ``(distances [T] int64) -> [H, T]`` float32, the bias at those query-key
            distances ``i - j`` where `distance_shift` holds (differentiable in `operands`' tensors).
        compiled_rows_from: ``(start, stop, k_stop, views) -> rows``, `Bias.rows_from` where the
            engine differentiates rows inside the operator (its kernel runs eagerly): a kind may run
            a compiled formula there; None: `Bias.rows_from`.
    """

    operands: OpaqueOperands
    distance_shift: Callable[[], int | None]
    distance_table: Callable[[Tensor], Tensor]
    compiled_rows_from: Callable[[int, int, int, Sequence[Tensor]], Tensor] | None = None


#: ``(rows, pullback)``: rows and ``pullback(d_rows)``, the gradient of ``<rows, d_rows>`` to each
#: view where needed, in order (`HandRows.rows_and_pullback`)
RowsAndPullback = tuple[Tensor, Callable[[Tensor], tuple[Tensor, ...]]]


@dataclass(frozen=True, eq=False)
class HandRows:
    """Rows a kind computes and differentiates by its own algorithm (`Bias.hand_rows`; FIRE by
    distance and `FireTableSum`), which can use what a caller knows beyond `Bias.rows`' arguments.

    Attributes:
        causal_rows: ``(start, stop, k_stop, diagonal) -> rows``, `Bias.rows` for a caller whose
            causal mask hides key ``j`` from row ``start + r`` where ``j > diagonal + r``: the rows
            there may hold any finite value (the caller masks them), so the kind may skip work
            there (FIRE by distance does not evaluate its switching units on a causal block's
            negative distances). Asked by sdpa's rows forward for a causal mask.
        rows_and_pullback: ``(start, stop, k_stop, views, need, diagonal) -> (rows, pullback) |
            None``, `Bias.rows_from` and its pullback from one call with no autograd graph: the
            block engine's backward (`attention.backends.engine.blocks.BlockRows`, eagerly, grad
            mode off) then skips autograd's fixed cost per block. ``views``: as `Bias.rows_from`'s
            (detached); ``need``: per view, whether its gradient is wanted; ``diagonal``: as
            ``causal_rows``' (``d_rows`` is 0 past it), None: every key is seen. Same values and
            gradients as differentiating `Bias.rows_from`; None where the kind has no such form
            for these rows (the engine differentiates `Bias.rows_from`).

    The rows of either (grad mode off) may be written into a buffer the kind reuses: they are
    valid until the next call of either on the same thread, so a caller consumes (or copies) a
    block's rows before it asks for the next block's (sdpa's forward and backward by blocks do).
    """

    causal_rows: Callable[[int, int, int, int], Tensor]
    rows_and_pullback: Callable[[int, int, int, Sequence[Tensor], Sequence[bool], int | None],
                                RowsAndPullback | None]


@dataclass(frozen=True, eq=False)
class OwnAttention:
    """A kind whose logits its own algorithm computes whole, not as ``q . k`` plus rows
    (`Bias.own_attention`; PaTH: ``q~ . k~`` carried through the reflections between them), so it
    computes the causal softmax attention itself, forward and backward.

    Attributes:
        q, k: the queries and keys the bias was computed from: a backend takes the form only when
            it attends with these, under a causal mask with at most documents (no padding or local
            window).
        attend: ``(v, q_offset, scale, key_bias, segments) -> out | None``: ``softmax(logits *
            scale + key_bias) v`` for the queries whose first is key ``q_offset``, causal by index
            and within documents, ``[B, H, Nq, D]`` in q's dtype; ``key_bias`` ``[B|1, H|1, Nk]``
            or None (the key-only terms of a sum, `BiasSum.own_attention`); ``segments``
            ``(q_seg [B, Nq], k_seg [B, Nk])`` document ids or None; None where the kind declines
            (the backend then runs its other forms).
    """

    q: Tensor
    k: Tensor
    attend: Callable[[Tensor, int, float, Tensor | None, tuple[Tensor, Tensor] | None], Tensor | None]


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
class GatedCounts:
    """A bias read at positions counted by content gates, which the Triton kernels compute from the
    scores of the same tile (`KernelBias.counted`): ``g_ij = sigmoid(gate_scale q_i.k_j)``, the
    position ``p_ij = sum_{t=j..i} g_it`` over the keys the causal rule allows (query ``i`` at key
    ``i + q_offset``), clamped to ``P - 1``, and the bias ``z_i[p_ij]`` with ``z_i[n] = q_i . table[:, n]``
    linearly interpolated between ``floor(p)`` and ``ceil(p)``.

    Attributes:
        q: the queries the bias reads; k: its keys (a backend checks that they are the ones it
            attends with).
        table: ``[1|H, D, P]`` the embeddings of the integer positions (differentiable).
        gate_scale: the gates' logit scale.
        q_offset: query ``i`` sits at key ``i + q_offset``.
        causal: False where the counts run both ways from the query (the kernels count causally only).
    """

    q: Tensor
    k: Tensor
    table: Tensor
    gate_scale: float
    q_offset: int
    causal: bool = True


@dataclass(eq=False)
class KernelBias:
    """The bias arguments of the fused Triton kernels, filled term by term (`Bias.fold_into`):
    summed ALiBi ``slopes [H]`` and relative tables (one ``table [H, 2R+1]`` over the widest
    range), both at ``q_pos``/``k_pos``, summed cumulative decays ``c_q``/``c_k``, one parametric
    bias ``tile`` (evaluated per tile, `TileBias`), and a ``dense`` rest; products of operands
    (`ProductBias`): ``own`` times the attention's own ``q k^T`` plus ``a b^T`` for each
    ``(a, b)`` of ``products`` (q-sized, k-sized), which a kernel takes as wider q and k; or
    positions ``counted`` by content gates (`GatedCounts`), which the kernels take with no other term."""

    slopes: Tensor | None = None
    table: Tensor | None = None
    c_q: Tensor | None = None
    c_k: Tensor | None = None
    dense: Tensor | None = None
    tile: TileBias | None = None
    q_pos: Tensor | None = None
    k_pos: Tensor | None = None
    counted: GatedCounts | None = None
    own: Tensor | None = None
    products: list[tuple[Tensor, Tensor]] = field(default_factory=list)

    def claim_positions(self, q_pos: Tensor, k_pos: Tensor) -> bool:
        """The position-based terms are read at these positions: True when no positions were
        claimed yet (they are now) or the claimed ones are equal."""
        if self.q_pos is None:
            self.q_pos, self.k_pos = q_pos, k_pos
            return True
        return same_positions(self.q_pos, q_pos) and same_positions(self.k_pos, k_pos)

    def add_dense(self, t: Tensor) -> None:
        self.dense = t if self.dense is None else self.dense + t
