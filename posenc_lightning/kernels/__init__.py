"""Triton kernels: fused attention with rotary, structured biases, packed documents and
stick-breaking inside (`fused.fused_attention`). Importing this package does not import triton;
``from posenc_lightning.kernels.fused import fused_attention`` does."""

from __future__ import annotations

from typing import Any

__all__ = ["RotaryTables", "fused_attention"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from posenc_lightning.kernels import fused

        return getattr(fused, name)
    raise AttributeError(name)
