"""`CoPEBias`: CoPE's bias kind, its rows by blocks for the backends that compute rows (the lazy
`DenseBias` it extends) and its gated counts (`GatedCounts`) for the Triton kernels, which count the
positions from the scores of the same tile (no N x N tensor)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar

from torch import Tensor

from posenc_lightning.encodings.bias import Bias, DenseBias, GatedCounts, KernelBias

__all__ = ["CoPEBias"]


@dataclass(eq=False)
class CoPEBias(DenseBias):
    """CoPE's ``z_i[p_ij]``: a lazy `DenseBias` (rows, the band and clamp hooks) that also describes
    itself to the Triton kernels as `GatedCounts` (``counts``; None: folded as a dense tensor)."""

    fused_in: ClassVar[frozenset[str]] = frozenset({"kernel"})
    #: its kernels compute the whole attention: no other bias term beside it
    fused_alone: ClassVar[bool] = True
    counts: GatedCounts | None = None

    def scaled(self, w: Tensor) -> Bias:
        """``w`` times the bias, still counted in the kernels: the interpolation is linear in the
        table, so ``w z_i[p] = q_i . (w E)[p]``.

        Args:
            w: a scalar tensor.

        Returns:
            A `CoPEBias`: the lazy rows times ``w`` and the counts read from ``w E``.
        """
        rows = super().scaled(w)
        out = CoPEBias(**{f.name: getattr(rows, f.name) for f in fields(DenseBias)})
        out.counts = None if self.counts is None else replace(self.counts, table=self.counts.table * w)
        return out

    def fold_into(self, args: KernelBias) -> None:
        """The gated counts as the kernels' ``counted`` argument (one per attention).

        Args:
            args: the kernels' bias arguments, updated in place.

        Raises:
            ValueError: a second counted bias in the same attention.
        """
        if self.counts is None:
            super().fold_into(args)
            return
        if args.counted is not None:
            raise ValueError("the Triton kernels take one bias counted by content gates per attention; "
                             "use backend='sdpa' for a sum of two")
        args.counted = self.counts
