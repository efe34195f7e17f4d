"""`DenseBias`: any bias given as a tensor, or lazily by a function of rows (the fallback kind every
backend can compute, block by block where it is lazy)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from posenc_lightning.encodings.bias.kinds import Bias, Index, KernelBias, OwnAttention, cut
from posenc_lightning.encodings.bias.windows import span

__all__ = ["DenseBias", "ProductBias"]


@dataclass(eq=False)
class DenseBias(Bias):
    """Any bias given as a tensor ``[B or 1, H, Nq, Nk]`` (fallback), or lazily by a function of
    rows (`DenseBias.lazy`: FIRE, CoPE, mixtures), so that blockwise backends never hold ``N x N``.

    Args:
        tensor: the bias ``[B or 1, H, Nq, Nk]``; or None with ``fn``.
        fn: ``fn(start, stop, k_stop)`` gives rows ``start:stop``, keys ``:k_stop``.
        shape_qk: ``(Nq, Nk)`` of a lazy bias.
        inputs: the tensors ``fn`` is computed from (its `grad_inputs`).
        window: ``window(start, stop, k_stop)``: the parts of ``inputs`` those rows read.
        share: the share of the engine's backward blocks of rows its rows take (`backward_share`).
        constant: ``constant(start, stop, k_stop)``: the run of leading keys whose rows are one value
            per row (`constant_before`).
        past: ``past(start, stop, k_start, k_stop, *inputs)``: the rows of keys from ``k_start`` on
            (`rows_past`).
        own_form: the whole attention computed by the kind itself (`own_attention`).

    Raises:
        ValueError: neither or both of ``tensor`` and ``fn``, or ``fn`` without ``shape_qk``.
    """

    tensor: Tensor | None = None
    fn: Callable[..., Tensor] | None = field(default=None, repr=False)
    shape_qk: tuple[int, int] | None = None  # (Nq, Nk) of a lazy bias
    inputs: tuple[Tensor, ...] | None = field(default=None, repr=False)  # what ``fn`` is computed from
    window: Callable[[int, int, int], tuple[Index, ...]] | None = field(default=None, repr=False)
    share: float = 1.0
    constant: Callable[[int, int, int], int] | None = field(default=None, repr=False)
    past: Callable[..., Tensor] | None = field(default=None, repr=False)
    own_form: OwnAttention | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.tensor is None) == (self.fn is None) or (self.fn is not None and self.shape_qk is None):
            raise ValueError("DenseBias needs a tensor, or a rows function and its sizes: "
                             "DenseBias(tensor) or DenseBias.lazy(fn, n_q, n_k)")
        if self.window is not None and self.inputs is None:
            raise ValueError("DenseBias.lazy: a window needs the inputs it cuts (inputs=...)")

    @classmethod
    def lazy(cls, fn: Callable[..., Tensor], n_q: int, n_k: int, inputs: Sequence[Tensor] | None = None,
             window: Callable[[int, int, int], tuple[Index, ...]] | None = None,
             backward_share: float = 1.0, constant_before: Callable[[int, int, int], int] | None = None,
             rows_past: Callable[..., Tensor] | None = None, own_attention: OwnAttention | None = None) -> DenseBias:
        """A bias computed only for the rows asked for (``materialize()`` = all rows).

        Without ``inputs``: ``fn(start, stop, k_stop) -> [B|1, H, stop - start, k_stop]``; the SDPA
        backend then checkpoints each block to get gradients.

        With ``inputs`` (every tensor the rows depend on that may need a gradient: parameters,
        q, k...): ``fn(start, stop, k_stop, *inputs)`` must read them from its arguments only.
        ``window(start, stop, k_stop)`` names the part of each input those rows read (an index,
        None = all; e.g. ``span(start, stop, -2)`` for the query rows of q): ``fn`` then gets
        the parts. The SDPA backend's own backward calls ``fn`` on detached parts and
        differentiates to them: no ``N x N`` kept, gradients only as large as the parts.
        ``backward_share``: below 1 for rows whose recomputation keeps more row-sized state alive
        (smaller backward blocks, `Bias.backward_share`). ``constant_before(start, stop, k_stop)``:
        how many leading keys of those rows hold one value per row (`Bias.constant_before`);
        ``rows_past(start, stop, k_start, k_stop, *inputs)``: the rows of keys ``[k_start, k_stop)``
        only (`Bias.rows_past`), from the same parts of the inputs as ``fn``. ``own_attention``: the
        kind computes the whole attention itself where a backend can let it (`Bias.own_attention`).
        """
        ins = None if inputs is None else tuple(inputs)
        return cls(fn=fn, shape_qk=(int(n_q), int(n_k)), inputs=ins, window=window, share=backward_share,
                   constant=constant_before, past=rows_past, own_form=own_attention)

    def own_attention(self) -> OwnAttention | None:
        return self.own_form

    def grad_inputs(self) -> tuple[Tensor, ...] | None:
        return (self.tensor,) if self.tensor is not None else self.inputs

    def input_windows(self, start: int, stop: int, k_stop: int) -> tuple[Index, ...]:
        if self.tensor is not None:
            return ((Ellipsis, slice(start, stop), slice(0, k_stop)),)
        if self.window is None:
            return (None,) * len(self.inputs or ())
        return tuple(self.window(start, stop, k_stop))

    @property
    def is_lazy(self) -> bool:
        return self.tensor is None

    @property
    def rows_shape(self) -> tuple[int, int] | None:
        return self.shape_qk if self.is_lazy else None

    @property
    def recomputable(self) -> bool:
        return self.tensor is not None or self.inputs is not None

    @property
    def fresh_rows(self) -> bool:
        return self.is_lazy and self.inputs is not None  # a function of its arguments: new rows

    @property
    def backward_share(self) -> float:
        return self.share

    def constant_before(self, start: int, stop: int, k_stop: int) -> int:
        return 0 if self.constant is None else self.constant(start, stop, k_stop)

    def rows_past(self, start: int, stop: int, k_start: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        if self.past is None or self.inputs is None:
            return super().rows_past(start, stop, k_start, k_stop, views)
        return self.past(start, stop, k_start, k_stop, *views).to(torch.float32)

    def rows_from(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        if self.tensor is not None:
            return views[0].to(torch.float32)
        if self.inputs is None:
            return super().rows_from(start, stop, k_stop, views)
        return self.fn(start, stop, k_stop, *views).to(torch.float32)

    def materialize(self) -> Tensor:
        if self.tensor is None:
            return self.rows(0, *self.shape_qk)
        return self.tensor.to(torch.float32)

    def rows(self, start: int, stop: int, k_stop: int) -> Tensor:
        if self.tensor is not None:
            return self.tensor[..., start:stop, :k_stop].to(torch.float32)
        if self.inputs is None:
            return self.fn(start, stop, k_stop).to(torch.float32)
        return self.rows_from(start, stop, k_stop, cut(self.inputs, self.input_windows(start, stop, k_stop)))

    def scaled(self, w: Tensor) -> Bias:
        """A given tensor times ``w``; a lazy bias stays lazy (its rows times ``w``)."""
        if self.tensor is not None:
            return DenseBias(self.materialize() * w)
        ins = self.grad_inputs()
        if ins is None:
            return DenseBias.lazy(lambda s, e, ke: self.rows(s, e, ke) * w, *self.shape_qk)
        past = None if self.past is None else lambda s, e, k0, ke, *v: self.rows_past(s, e, k0, ke, v[:-1]) * v[-1]
        return DenseBias.lazy(lambda s, e, ke, *v: self.rows_from(s, e, ke, v[:-1]) * v[-1], *self.shape_qk,
                              inputs=(*ins, w), window=lambda s, e, ke: (*self.input_windows(s, e, ke), None),
                              backward_share=self.share, constant_before=self.constant, rows_past=past)

    def fold_into(self, args: KernelBias) -> None:
        args.add_dense(self.tensor if self.tensor is not None else self.materialize())


@dataclass(eq=False)
class ProductBias(DenseBias):
    """``own * q k^T + sum_j a_j b_j^T``: products of q-sized and k-sized operands (a rotation's
    logit change ``scale (q' k'^T - q k^T)`` in a mixture), lazy rows as `DenseBias` for every
    backend, and for the Triton kernels one product of wider operands
    (``[(1 + own / scale) q, a_j / scale] . [k, b_j]``: `fold_into`), no ``N x N`` tensor.

    Build it with `ProductBias.of`; ``q``, ``k`` are the attention's own operands (``k`` per kv
    head, repeated for grouped queries), ``own`` a scalar tensor.
    """

    q: Tensor | None = field(default=None, repr=False)
    k: Tensor | None = field(default=None, repr=False)
    own: Tensor | None = field(default=None, repr=False)
    pairs: tuple[tuple[Tensor, Tensor], ...] = field(default=(), repr=False)
    fused_in: ClassVar[frozenset[str]] = frozenset({"kernel"})

    @classmethod
    def of(cls, q: Tensor, k: Tensor, own: Tensor, pairs: Sequence[tuple[Tensor, Tensor]]) -> ProductBias:
        """The bias ``own * q k^T + sum_j a_j b_j^T``.

        Args:
            q: ``[B, H, Nq, D]`` the attention's queries.
            k: ``[B, Hkv, Nk, D]`` its keys.
            own: a scalar tensor, the coefficient of ``q k^T``.
            pairs: ``(a [B, H, Nq, D], b [B, Hkv, Nk, D])`` operands.

        Returns:
            The bias, with rows computed on request.
        """
        rep = q.shape[1] // k.shape[1]
        n = len(pairs)

        def rows(s: int, e: int, ke: int, qs: Tensor, ks: Tensor, w: Tensor, *ab: Tensor) -> Tensor:
            out = (qs.float() @ ks.float().repeat_interleave(rep, 1).transpose(-1, -2)) * w.float()
            for a, b in zip(ab[0::2], ab[1::2]):
                out = out + a.float() @ b.float().repeat_interleave(rep, 1).transpose(-1, -2)
            return out

        def window(s: int, e: int, ke: int) -> tuple:
            return (span(s, e, -2), span(0, ke, -2), None) + (span(s, e, -2), span(0, ke, -2)) * n

        flat = tuple(t for p in pairs for t in p)
        # recomputed from q and k: the q/k windows' gradients are kept too (`Bias.backward_share`)
        return cls(fn=rows, shape_qk=(q.shape[-2], k.shape[-2]), inputs=(q, k, own, *flat), window=window,
                   share=0.75, q=q, k=k, own=own, pairs=tuple((a, b) for a, b in pairs))

    def scaled(self, w: Tensor) -> Bias:
        """``w * self``, the same kind: ``own`` and every ``a_j`` times ``w``."""
        return ProductBias.of(self.q, self.k, self.own * w, [(a * w, b) for a, b in self.pairs])

    def fold_into(self, args: KernelBias) -> None:
        args.own = self.own if args.own is None else args.own + self.own
        args.products.extend(self.pairs)
