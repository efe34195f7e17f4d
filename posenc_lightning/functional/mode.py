"""How one attention call (or one backward pass) runs, decided once at its entry and passed down:
traced or eager, and on which device. The attention context carries it (`AttentionContext.mode`),
the backends pass it to their leaf functions."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables


@dataclass(frozen=True)
class Mode:
    """Traced by ``torch.compile`` or eager, and the device type (reading a tensor's values is free
    only eagerly on CPU: `host_reads`). The one place the backends ask ``is_compiling``; the leaf
    functions take what their entry decided."""

    compiling: bool
    device: str
    #: the block budgets and switches of this call (`functional.tunables.Tunables`)
    tunables: Tunables = DEFAULT_TUNABLES

    @staticmethod
    def tracing() -> bool:
        """Inside a ``torch.compile`` trace now: the package's one call of ``is_compiling``. Code
        outside attention (a table's growth, a model's compiled forward) asks here too."""
        return torch.compiler.is_compiling()

    @classmethod
    def of(cls, t: Tensor, tunables: Tunables | None = None) -> Mode:
        """The mode of a call on ``t``'s device, now, with ``tunables`` (None: the defaults)."""
        return cls.now(t.device.type, tunables)

    @classmethod
    def now(cls, device: str, tunables: Tunables | None = None) -> Mode:
        """The mode of work on ``device`` (a device type) now: the one place ``is_compiling`` is asked
        for attention and the encodings' attention-time code."""
        return cls(cls.tracing(), device, DEFAULT_TUNABLES if tunables is None else tunables)

    @property
    def host_reads(self) -> bool:
        """Reading a tensor's values costs no device sync and breaks no trace."""
        return self.device == "cpu" and not self.compiling
