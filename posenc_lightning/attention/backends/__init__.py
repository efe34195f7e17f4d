"""Attention backends, one file each, with one signature:

``attend(q, k, v, *, bias, mask, scale, normalize=None, ctx=None) -> out`` and
``supports(encoding, device, requires_grad) -> None | reason``, and the declarations ``NAME`` and
``FUSES_ROTARY`` (it rotates q and k in-kernel with ``ctx.rotary``, the encoding's
`Encoding.fused_rotary`). A backend asks each bias for what it fuses (`posenc_lightning.encodings.bias`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from posenc_lightning.encodings.base import Encoding

BACKENDS = ("eager", "sdpa", "flex", "triton", "blockwise")
#: the order ``auto`` tries, fastest first
_AUTO_ORDER = {"cuda": ("triton", "flex", "sdpa", "blockwise", "eager"), "cpu": ("sdpa", "blockwise", "eager")}


def get_backend(name: str) -> ModuleType:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {('auto',) + BACKENDS}")
    try:
        return importlib.import_module(f"posenc_lightning.attention.backends.{name}")
    except ImportError as e:
        raise ValueError(f"attention backend {name!r} is not available here ({e}); "
                         f"use backend='auto', 'sdpa' or 'eager'") from e


def _why_not(name: str, encoding: Encoding, device: torch.device, requires_grad: bool) -> str | None:
    try:
        mod = get_backend(name)
    except ValueError as e:
        return str(e)
    return mod.supports(encoding, device, requires_grad)


def resolve_backend(name: str, encoding: Encoding, device: torch.device, requires_grad: bool) -> ModuleType:
    """The backend module to run ``encoding`` on ``device``; ``auto`` picks the fastest that can."""
    if name == "auto":
        for cand in _AUTO_ORDER.get(device.type, _AUTO_ORDER["cpu"]):
            if cand == "flex" and "bias" not in encoding.stages:
                continue  # nothing to fuse into a score_mod: SDPA's flash kernels are faster
            if _why_not(cand, encoding, device, requires_grad) is None:
                return get_backend(cand)
        return get_backend("eager")
    reason = _why_not(name, encoding, device, requires_grad)
    if reason is not None:
        ok = [b for b in BACKENDS if _why_not(b, encoding, device, requires_grad) is None]
        raise ValueError(f"backend {name!r} cannot run encoding {encoding.name!r} on {device.type}: "
                         f"{reason}. Use backend='auto' or one of {ok}")
    return get_backend(name)
