"""Stage 4 as a description: what replaces softmax, and the forms a backend may run it in.

An encoding's ``normalize(ctx)`` returns a `Normalizer`, as its ``bias`` returns a `Bias`: the
backends read its declared capabilities (the tile walk it needs, whether it is causal by
construction, a multiplicative modulation of the logits), never the encoding or a name. Each
normalizer lives with its encoding (stick-breaking's in `encodings.stick_breaking`, ExpoSB's
distance-modulated softmax in `encodings.exposb`); its dense reference is `Normalizer.weights`.

| walk | what the blockwise tiles and the kernels run | normalizers |
|---|---|---|
| `Walk.STICK_BREAKING` | key tiles nearest first, log-space sums carried across tiles | sba, rse |
| `Walk.SOFTMAX` | an online softmax of the logits times `Normalizer.modulation` | exposb |

A softmax walk runs in the Triton kernels ("kernel" in `Normalizer.fused_in`) when its modulation
has a form they compute from a tile's positions: `Normalizer.kernel_modulation` (a `DistanceDecay`).
"""

from __future__ import annotations

import enum
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

__all__ = ["DistanceDecay", "Normalizer", "Walk", "modulated_softmax"]


class Walk(enum.Enum):
    """How a normalizer's weights are computed tile by tile (the blockwise backend's walk over key
    tiles, the Triton kernels' loop)."""

    #: keys broken off nearest first: each tile needs the log-space sum of the nearer keys' softplus
    STICK_BREAKING = "stick_breaking"
    #: a softmax of the (modulated) logits: an online softmax over key tiles, one log-sum-exp per row
    SOFTMAX = "softmax"


class DistanceDecay(NamedTuple):
    """A modulation the kernels compute per tile from the positions alone:
    ``floor + (1 - floor) exp(-decay |q_pos - k_pos|)``.

    Attributes:
        decay: the distance decay rate (per position).
        floor: the value far away (at distance 0 the modulation is 1).
    """

    decay: float
    floor: float


class Normalizer:
    """What replaces softmax (stage 4), as a description the backends compute.

    Subclasses declare their walk and fused forms and implement `weights`, the dense reference;
    a softmax walk may also give a multiplicative `modulation` of the logits.
    """

    #: the tile walk a fused form of this normalizer runs (`Walk`)
    walk: ClassVar[Walk]
    #: the fused forms that compute it with no ``N x N`` tensor: "tiles" (the blockwise backend),
    #: "kernel" (the Triton kernels), "score_mod" (flex: a softmax walk's `kernel_modulation`); the
    #: eager reference (`weights`) always
    fused_in: ClassVar[frozenset[str]] = frozenset({"tiles"})
    #: defined only for causal attention (stick-breaking breaks keys off nearest first)
    causal_only: ClassVar[bool] = False
    #: `modulation` depends on ``q_pos - k_pos`` only: at arange positions a tile's modulation is
    #: read off one diagonal
    modulation_distance_only: ClassVar[bool] = False

    def __init__(self, name: str, attend_current: bool = False) -> None:
        #: the encoding's name, for error messages
        self.name = name
        #: a query may attend to its own key (stick-breaking's option; softmax always does)
        self.attend_current = attend_current

    def modulation(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        """A multiplicative modulation of the scaled logits (plus bias) before the softmax walk.

        Args:
            q_pos: ``[B, Nq]`` query positions.
            k_pos: ``[B, Nk]`` key positions.

        Returns:
            ``[B, 1, Nq, Nk]`` float32, or None (default: no modulation).
        """
        return None

    def kernel_modulation(self) -> DistanceDecay | None:
        """`modulation` as parameters the Triton kernels evaluate per tile (with "kernel" in
        `fused_in`, a softmax walk that is `modulated` must give one).

        Returns:
            The modulation's form, or None (default: no modulation, or none in this form).
        """
        return None

    @property
    def modulated(self) -> bool:
        """Whether `modulation` gives a value (declared by overriding it)."""
        return type(self).modulation is not Normalizer.modulation

    def check_causal(self, causal: bool) -> None:
        """Refuse a non-causal call for a `causal_only` normalizer.

        Raises:
            ValueError: ``causal`` is False and the normalizer is causal by construction.
        """
        if self.causal_only and not causal:
            raise ValueError(f"{self.name} is causal by construction (keys are broken off nearest first); "
                             f"call attend(..., causal=True) or use a softmax encoding")

    def weights(self, logits: Tensor, mask: Tensor | None, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The attention weights from dense logits: the reference every fused form is tested against.

        Args:
            logits: scaled scores plus bias ``[B, H, Nq, Nk]``.
            mask: True where a query may see a key, broadcastable to ``logits``; None: all.
            q_pos: ``[B, Nq]`` query positions; k_pos: ``[B, Nk]`` key positions.

        Returns:
            The weights ``[B, H, Nq, Nk]``.
        """
        raise NotImplementedError(f"{type(self).__name__} gives no dense weights")


def modulated_softmax(logits: Tensor, mask: Tensor | None, modulation: Tensor | None = None) -> Tensor:
    """``softmax(logits * modulation)`` over the keys a query sees (a row that sees none: 0).

    Args:
        logits: ``[B, H, Nq, Nk]``.
        mask: True where a query may see a key; None: all.
        modulation: multiplies the logits first; None: none.

    Returns:
        The weights, the dtype of ``logits``.
    """
    if modulation is not None:
        logits = logits * modulation
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    w = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(w, nan=0.0) if mask is not None else w
