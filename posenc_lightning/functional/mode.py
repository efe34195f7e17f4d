"""How one attention call (or one backward pass) runs, decided once at its entry and passed down:
traced or eager, and on which device. The attention context carries it (`AttentionContext.mode`),
the backends pass it to their leaf functions."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Mode:
    """Traced by ``torch.compile`` or eager, and the device type (reading a tensor's values is free
    only eagerly on CPU: `host_reads`). The one place the backends ask ``is_compiling``; the leaf
    functions take what their entry decided."""

    compiling: bool
    device: str

    @classmethod
    def of(cls, t: Tensor) -> Mode:
        """The mode of a call on ``t``'s device, now."""
        return cls(torch.compiler.is_compiling(), t.device.type)

    @property
    def host_reads(self) -> bool:
        """Reading a tensor's values costs no device sync and breaks no trace."""
        return self.device == "cpu" and not self.compiling
