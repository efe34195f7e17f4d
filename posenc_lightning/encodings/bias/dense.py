"""`DenseBias`: any bias given as a tensor, or lazily by a function of rows (the fallback kind every
backend can compute, block by block where it is lazy)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from posenc_lightning.encodings.bias.kinds import Bias, Index, KernelBias, cut

__all__ = ["DenseBias"]


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
             rows_past: Callable[..., Tensor] | None = None) -> DenseBias:
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
        only (`Bias.rows_past`), from the same parts of the inputs as ``fn``.
        """
        ins = None if inputs is None else tuple(inputs)
        return cls(fn=fn, shape_qk=(int(n_q), int(n_k)), inputs=ins, window=window, share=backward_share,
                   constant=constant_before, past=rows_past)

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
