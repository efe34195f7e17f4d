"""The bias base class, the Triton kernels' arguments (`KernelBias`; the other forms a kind gives
backends are in `forms`), and the generic kinds that combine others: `ScaledBias`, `BiasSum`.
`DenseBias` (a tensor, or rows by a function) is in `dense`, the kinds with O(N) data in `structured`
(see the package docstring for what a kind answers)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar

import torch
from torch import Tensor

from posenc_lightning.encodings.bias._distance_table import DistanceTable, accumulate
from posenc_lightning.encodings.bias.forms import (
    GatedCounts,
    HandRows,
    HeadScaled,
    KernelBias,
    KeyOnly,
    OpaqueOperands,
    OwnAttention,
    ValueDependentForm,
)
from posenc_lightning.encodings.bias.windows import Index, cut, span
from posenc_lightning.functional.mode import Mode

__all__ = [
    "Bias",
    "BiasSum",
    "GatedCounts",
    "HandRows",
    "HeadScaled",
    "KernelBias",
    "KeyOnly",
    "OpaqueOperands",
    "OwnAttention",
    "ScaledBias",
    "ValueDependentForm",
    "cut",
    "span",
]

#: ``f(b, h, q_idx, kv_idx) -> value`` (float32), one term of a flex ``score_mod``
ScoreTerm = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
_WIDE = (torch.float32, torch.float64)


class Bias(ABC):
    """A structured additive bias on the attention logits (see the module docstring)."""

    #: the fused forms that compute this kind with no ``N x N`` tensor: "kernel" (the Triton
    #: kernels' arguments, `fold_into`) and "score_mod" (flex, `score_term`). Backends that fuse
    #: one form refuse encodings declaring a kind without it (`Encoding.bias_kinds`); blocks of
    #: rows (`rows`, SDPA) compute every kind.
    fused_in: ClassVar[frozenset[str]] = frozenset()
    #: whether compiled flex attention (CUDA) differentiates this kind's ``score_term``
    score_mod_backward: ClassVar[bool] = True
    #: the fused forms take this kind only as the one bias of an attention (kernels of its own compute
    #: the whole attention: `GatedCounts`); an encoding declaring it beside other kinds is refused
    fused_alone: ClassVar[bool] = False

    @abstractmethod
    def materialize(self) -> Tensor:
        """Returns:
            The dense bias ``[B|1, H, Nq, Nk]``, float32."""

    @abstractmethod
    def rows(self, start: int, stop: int, k_stop: int) -> Tensor:
        """``materialize()[..., start:stop, :k_stop]`` without building the rest (blockwise SDPA).

        Args:
            start: first query row.
            stop: query row past the last.
            k_stop: keys ``0..k_stop-1`` (a causal block needs no later key).

        Returns:
            ``[B|1, H, stop - start, k_stop]``.
        """

    def grad_inputs(self) -> tuple[Tensor, ...] | None:
        """Backends with their own backward recompute rows (`rows_from`) and differentiate to these.

        Returns:
            Every tensor the bias is computed from that may need a gradient (None: unknown).
        """
        return None

    def input_windows(self, start: int, stop: int, k_stop: int) -> tuple[Index, ...]:
        """The parts of `grad_inputs` that ``rows(start, stop, k_stop)`` reads.

        Args:
            start: first query row.
            stop: query row past the last.
            k_stop: keys ``0..k_stop-1``.

        Returns:
            One index per tensor of `grad_inputs` (None: all of it).
        """
        return (None,) * len(self.grad_inputs() or ())

    @property
    def recomputable(self) -> bool:
        """`rows_from` works: rows can be recomputed from stand-ins for the inputs."""
        return False

    def rows_from(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        """``rows(start, stop, k_stop)`` computed from stand-ins instead of the stored tensors: a
        backward pass gives detached leaves here and differentiates to them, so gradients are
        window-sized and never run through the model's own graph.

        Args:
            start: first query row.
            stop: query row past the last.
            k_stop: keys ``0..k_stop-1``.
            views: each of `grad_inputs` cut by `input_windows`.

        Returns:
            The rows, differentiable to ``views``.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot recompute rows from stand-in inputs")

    @property
    def fresh_rows(self) -> bool:
        """`rows` returns a new tensor (never a view of a stored one): a backend may write into it."""
        return False

    @property
    def backward_share(self) -> float:
        """The share of the engine's backward block of rows this kind's rows take (default 1); less
        for rows whose recomputation keeps more row-sized state alive (CoPE's gates and counts)."""
        return 1.0

    @property
    def forward_blocks(self) -> bool:
        """The engine's own backward takes the forward's blocks of rows (its whole block budget)
        at any thread count, not half of it at one thread: this kind's rows cost a fixed amount per
        block and keep work from a forward block for the backward block of the same rows (FIRE's
        unit selection by distance), so fewer, larger blocks pay it fewer times (default False)."""
        return False

    @property
    def rows_shape(self) -> tuple[int, int] | None:
        """``(Nq, Nk)`` when the values exist only as `rows` computed on request (a lazy dense
        bias, FIRE's MLP per pair): what a backend computes block by block; None when the kind
        holds what backends read (O(N) data: slopes, a table, gates, or a given tensor)."""
        return None

    @property
    def distance_only(self) -> bool:
        """The value depends on ``i - j`` only, and `at` gives it at other positions."""
        return False

    def at(self, q_pos: Tensor, k_pos: Tensor) -> Bias | None:
        """The same bias at other positions.

        Args:
            q_pos: query positions ``[B, Nq]``.
            k_pos: key positions ``[B, Nk]``.

        Returns:
            The bias there, or None unless `distance_only`.
        """
        return None

    @property
    def positions(self) -> tuple[Tensor, Tensor] | None:
        """``(q_pos, k_pos)`` a `distance_only` kind is read at (None: not known)."""
        return None

    def key_only(self, dtype: torch.dtype, plain_causal: bool, ascending: bool = False) -> KeyOnly | None:
        """The key-only form under softmax: ``q_ch[h] * k_ch[b, h, j]`` plus a per-row term.

        Args:
            dtype: the dtype the form is computed in.
            plain_causal: query i sees keys ``0..i`` and nothing else (forms that hold only there need it).
            ascending: queries and keys are the same tokens at ascending positions, known without
                reading them (`AttentionContext.ascending`; False: not known, a kind may read the
                positions where `host_reads_ok`).

        Returns:
            The form, or None when there is none.
        """
        return None

    def scaled(self, w: Tensor) -> Bias:
        """``w * self`` (default: lazily, row by row; kinds keep their kind).

        Args:
            w: a scalar tensor.

        Returns:
            The scaled bias.
        """
        return ScaledBias(self, w)

    def score_term(self, b_size: int, n_heads: int) -> ScoreTerm:
        """This bias's value at ``(b, h, q_idx, kv_idx)`` for flex's ``score_mod`` (default: a
        lookup in the materialized tensor).

        Args:
            b_size: the batch size.
            n_heads: the number of query heads.

        Returns:
            ``f(b, h, q_idx, kv_idx)``.
        """
        t = self.materialize().expand(b_size, n_heads, -1, -1)
        return lambda b, h, qi, ki: t[b, h, qi, ki]

    def fold_into(self, args: KernelBias) -> None:
        """Add this bias to the Triton kernels' arguments (default: as a dense tensor).

        Args:
            args: the kernels' bias arguments, updated in place.
        """
        args.add_dense(self.materialize())

    def value_dependent(self) -> ValueDependentForm | None:
        """Whether the cheapest exact form depends on values, which a compiled graph cannot branch
        on (FIRE below and past its learned threshold): then one opaque operator makes the eager
        choice inside the graph, where reading a CPU tensor costs no sync (`ValueDependentForm`).

        Returns:
            The form's operands and hooks, or None (default): the compiled graph traces the rows.
        """
        return None

    def head_scaled(self) -> HeadScaled | None:
        """Whether the bias is ``w[h] * pattern(q_pos, k_pos)``: one weight per head times a pattern
        the heads share (ALiBi: the slopes and ``-|i - j|``). A blockwise engine then adds a tile as
        one broadcast product and takes ``w``'s gradient as a reduction over the tile, with no
        recomputed rows and no autograd graph per tile.

        Returns:
            The factors, or None (default: not of this form).
        """
        return None

    def constant_before(self, start: int, stop: int, k_stop: int) -> int:
        """How many leading keys ``[0, c)`` have one bias value per query row in these rows (CoPE past
        its clamp: ``z_i[P - 1]``): sdpa runs them on SDPA's CPU kernel with no mask, and the run's
        value gets minus the row sums of the other keys' ``dS`` (`attention.backends.sdpa.runs`).

        Args:
            start: first query row.
            stop: query row past the last.
            k_stop: keys ``0..k_stop-1``.

        Returns:
            ``c`` (default 0: no such run).
        """
        return 0

    def rows_past(self, start: int, stop: int, k_start: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        """`rows_from` for the keys ``[k_start, k_stop)`` only: from ``c - 1`` (`constant_before`), the
        run's value and the keys past it, never the run itself (default: cut from all the keys).

        Args:
            start: first query row.
            stop: query row past the last.
            k_start: first key, at most `constant_before`.
            k_stop: keys up to ``k_stop - 1``.
            views: as `rows_from`'s.

        Returns:
            ``[B|1, H|1, stop - start, k_stop - k_start]``, differentiable to ``views``; at keys a causal
            mask hides from a query, any finite value (the run form masks them).
        """
        return self.rows_from(start, stop, k_stop, views)[..., k_start:]

    def hand_rows(self) -> HandRows | None:
        """Whether the kind computes and differentiates its rows by its own algorithm and so can
        use what a caller knows: the keys its causal mask hides, and no autograd graph wanted
        (`HandRows`; FIRE by distance).

        Returns:
            The hooks, or None (default): callers take `rows` and differentiate `rows_from`.
        """
        return None

    def own_attention(self) -> OwnAttention | None:
        """Whether the kind computes the whole attention of its logits itself (`OwnAttention`:
        PaTH's walk, whose logits are not ``q . k`` plus rows).

        Returns:
            The form, or None (default): backends add the bias to their own logits.
        """
        return None

    @property
    def terms(self) -> list[Bias]:
        return [self]

    def __add__(self, other: Bias | None) -> Bias:
        if other is None:
            return self
        return BiasSum(self.terms + other.terms)

    __radd__ = __add__


@dataclass(eq=False)
class ScaledBias(Bias):
    """``weight * inner`` (a scalar tensor ``weight``), row by row: `Bias.scaled` of a kind that
    has no scaled form of its own."""

    inner: Bias
    weight: Tensor
    fresh_rows = True

    def materialize(self) -> Tensor:
        return self.inner.materialize() * self.weight

    def rows(self, start: int, stop: int, k_stop: int) -> Tensor:
        return self.inner.rows(start, stop, k_stop) * self.weight

    def grad_inputs(self) -> tuple[Tensor, ...] | None:
        ins = self.inner.grad_inputs()
        return None if ins is None else (*ins, self.weight)

    def input_windows(self, start: int, stop: int, k_stop: int) -> tuple[Index, ...]:
        return (*self.inner.input_windows(start, stop, k_stop), None)

    @property
    def recomputable(self) -> bool:
        return self.inner.recomputable

    def rows_from(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        return self.inner.rows_from(start, stop, k_stop, views[:-1]) * views[-1]

    @property
    def backward_share(self) -> float:
        return self.inner.backward_share

    @property
    def distance_only(self) -> bool:
        return self.inner.distance_only

    def at(self, q_pos: Tensor, k_pos: Tensor) -> Bias | None:
        moved = self.inner.at(q_pos, k_pos)
        return None if moved is None else moved.scaled(self.weight)

    @property
    def positions(self) -> tuple[Tensor, Tensor] | None:
        return self.inner.positions

    def score_term(self, b_size: int, n_heads: int) -> ScoreTerm:
        f, w = self.inner.score_term(b_size, n_heads), self.weight.to(torch.float32)
        return lambda b, h, qi, ki: f(b, h, qi, ki) * w


@dataclass(eq=False)
class BiasSum(Bias):
    """A sum of bias kinds (hybrids); backends may fuse each term separately.

    Rows: the distance-only terms at the same integer positions are one lookup in their summed
    table of distances (`_table`), and the other terms are added into the first fresh rows (no
    tensor per term; exact for autograd too, as no term's backward keeps its output).

    Args:
        parts: the terms (``a + b`` of two kinds builds one).
    """

    parts: list[Bias] = field(default_factory=list)

    @property
    def terms(self) -> list[Bias]:
        return list(self.parts)

    def materialize(self) -> Tensor:
        out = self.parts[0].materialize()
        for p in self.parts[1:]:
            out = out + p.materialize()
        return out

    @property
    def _group(self) -> DistanceTable | None:
        return None if Mode.tracing() else self._table

    @cached_property
    def _table(self) -> DistanceTable | None:
        """The distance-only terms as one table of distances (`DistanceTable.of`)."""
        return DistanceTable.of(self.parts)

    def grad_inputs(self) -> tuple[Tensor, ...] | None:
        g = self._group
        ins = [p.grad_inputs() for i, p in enumerate(self.parts) if g is None or i not in g.terms]
        if any(i is None for i in ins):
            return None
        return (*(() if g is None else (g.u,)), *(t for i in ins for t in i))

    def input_windows(self, start: int, stop: int, k_stop: int) -> tuple[Index, ...]:
        g = self._group
        rest = tuple(w for i, p in enumerate(self.parts) if g is None or i not in g.terms
                     for w in p.input_windows(start, stop, k_stop))
        return rest if g is None else (g.window(start, stop, k_stop), *rest)

    @property
    def recomputable(self) -> bool:
        return all(p.recomputable for p in self.parts)

    def own_attention(self) -> OwnAttention | None:
        """One term's own attention (`OwnAttention`) with the others' key-only forms (FoX's gates
        beside PaTH) added to its logits; it declines where one of them has none."""
        forms = [t.own_attention() for t in self.terms]
        found = [f for f in forms if f is not None]
        if len(found) != 1:
            return None
        own, others = found[0], [t for t, f in zip(self.terms, forms) if f is None]

        def attend(v: Tensor, q_offset: int, scale: float, key_bias: Tensor | None,
                   segments: tuple[Tensor, Tensor] | None) -> Tensor | None:
            plain = q_offset == 0 and v.shape[-2] == own.q.shape[-2] and segments is None
            for t in others:
                form = t.key_only(v.dtype, plain)
                if form is None:
                    return None
                key_bias = form.key_bias() if key_bias is None else key_bias + form.key_bias()
            return own.attend(v, q_offset, scale, key_bias, segments)

        return OwnAttention(own.q, own.k, attend)

    def rows(self, start: int, stop: int, k_stop: int) -> Tensor:
        g = self._group
        u = None if g is None else cut((g.u,), (g.window(start, stop, k_stop),))[0]
        return self._rows(start, stop, k_stop, u, [None] * len(self.parts))

    def rows_from(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        g = self._group
        split, i = [], 0 if g is None else 1
        for j, p in enumerate(self.parts):
            n = 0 if g is not None and j in g.terms else len(p.grad_inputs())
            split.append(views[i:i + n])
            i += n
        return self._rows(start, stop, k_stop, None if g is None else views[0], split)

    def _rows(self, start: int, stop: int, k_stop: int, u: Tensor | None,
              views: Sequence[Sequence[Tensor] | None]) -> Tensor:
        """The rows from the table's window ``u`` and ``views`` per term (None: its own inputs)."""
        g = self._group
        out, own = (None, False) if g is None else g.rows(u, start, stop, k_stop)
        for i in sorted(range(len(self.parts)), key=lambda i: not self.parts[i].fresh_rows):
            if g is None or i not in g.terms:
                p, v = self.parts[i], views[i]
                r = p.rows(start, stop, k_stop) if v is None else p.rows_from(start, stop, k_stop, v)
                out, own = accumulate(out, own, r, p.fresh_rows)
        return out

    @property
    def fresh_rows(self) -> bool:
        return all(p.fresh_rows for p in self.parts)

    @property
    def backward_share(self) -> float:
        return min(p.backward_share for p in self.parts)

    @property
    def distance_only(self) -> bool:
        return all(p.distance_only for p in self.parts)

    def at(self, q_pos: Tensor, k_pos: Tensor) -> Bias | None:
        parts = [p.at(q_pos, k_pos) for p in self.parts]
        return None if any(p is None for p in parts) else BiasSum(parts)

    def scaled(self, w: Tensor) -> Bias:
        return BiasSum([p.scaled(w) for p in self.parts])

    def score_term(self, b_size: int, n_heads: int) -> ScoreTerm:
        fs = [p.score_term(b_size, n_heads) for p in self.parts]
        return lambda b, h, qi, ki: sum(f(b, h, qi, ki) for f in fs)

    def fold_into(self, args: KernelBias) -> None:
        for p in self.parts:
            p.fold_into(args)
