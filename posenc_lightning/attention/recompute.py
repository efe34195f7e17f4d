"""Stage 2 recomputed in backward: the rotated q and k that attention keeps for its backward are
stored as "rotate these un-rotated q, k again" instead (gradient checkpointing of the rotation).

Attention's backward needs q and k as its forward saw them, i.e. rotated: two new ``[B, H, N, D]``
tensors kept per layer until backward, where the un-rotated q, k are views of the projection
output that attention keeps anyway (through v). For encodings whose rotation is cheap and
deterministic (`Encoding.cheap_rotation`: cos/sin tables and elementwise ops), saved-tensor hooks
around the backend call swap those two for a marker and rotate again when backward unpacks them:
training memory as without an encoding, at the cost of one more rotation per step. Any other
tensor the backend saves (a copy of q with an extra channel, say) is kept as usual.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posenc_lightning.encodings.base import AttentionContext, Encoding


def _storage(t: Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr())


class _Rotated:
    """A saved view ``(shape, stride, offset)`` of rotated q (index 0) or k (1)."""

    __slots__ = ("index", "view")

    def __init__(self, index: int, view: tuple) -> None:
        self.index, self.view = index, view


class RotationRecompute:
    """Saved-tensor hooks for one attention call (``with RotationRecompute(...).hooks(): ...``).

    A saved tensor is recognised as (a view of) rotated q or k by its storage; backward rotates
    again and takes the same view of the result, which the same code lays out the same way
    (checked)."""

    def __init__(self, encoding: Encoding, raw: tuple[Tensor, Tensor], rotated: tuple[Tensor, Tensor],
                 ctx: AttentionContext) -> None:
        self.encoding, self.raw, self.ctx = encoding, raw, ctx
        self.layout = [(t.storage_offset(), tuple(t.stride()), t.dtype) for t in rotated]
        keys = [_storage(t) for t in rotated]
        shared = keys[0] == keys[1] or any(_storage(t) in keys for t in raw)
        self.ids = {} if shared else {key: i for i, key in enumerate(keys)}
        self.memo: tuple[Tensor, Tensor] | None = None
        self.recomputed = 0  # how many times backward rotated again

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: Tensor) -> object:
        i = self.ids.get(_storage(t)) if self.ids else None
        if i is None or t.dtype != self.layout[i][2]:
            return t
        return _Rotated(i, (tuple(t.shape), tuple(t.stride()), t.storage_offset()))

    def _unpack(self, packed: object) -> Tensor:
        if not isinstance(packed, _Rotated):
            return packed
        if self.memo is None:  # q and k are unpacked together: rotate both once
            self.memo = self.encoding.rotate(*self.raw, self.ctx)
            self.recomputed += 1
        r = self.memo[packed.index]
        if (r.storage_offset(), tuple(r.stride()), r.dtype) != self.layout[packed.index]:
            raise RuntimeError(f"{self.encoding.name}: the rotation recomputed in backward is laid out differently "
                               "from the forward's; set posenc_recompute_rotation = False on the attention module")
        shape, stride, offset = packed.view
        if r.shape == shape and r.stride() == stride and r.storage_offset() == offset:
            return r  # the saved tensor was the rotated tensor itself
        return r.as_strided(*packed.view)
