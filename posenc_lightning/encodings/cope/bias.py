"""`CoPEBias`: CoPE's bias kind, its rows by blocks for the backends that compute rows (the lazy
`DenseBias` it extends) and its gated counts (`GatedCounts`) for the Triton kernels, which count the
positions from the scores of the same tile (no N x N tensor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posenc_lightning.encodings.bias import DenseBias, GatedCounts, KernelBias

__all__ = ["CoPEBias"]


@dataclass(eq=False)
class CoPEBias(DenseBias):
    """CoPE's ``z_i[p_ij]``: a lazy `DenseBias` (rows, the band and clamp hooks) that also describes
    itself to the Triton kernels as `GatedCounts` (``counts``; None: folded as a dense tensor)."""

    fused_in: ClassVar[frozenset[str]] = frozenset({"kernel"})
    counts: GatedCounts | None = None

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
