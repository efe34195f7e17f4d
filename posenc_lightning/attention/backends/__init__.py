"""Attention backends, one file each, with one signature:

``attend(q, k, v, *, bias, mask, scale, normalizer=None, ctx=None) -> out`` and
``supports(encoding, device, requires_grad) -> None | reason``, and the declarations ``NAME`` and
``FUSES_ROTARY`` (it rotates q and k in-kernel with ``ctx.rotary``, the encoding's
`Encoding.fused_rotary`). A backend asks each bias for what it fuses (`posenc_lightning.encodings.bias`).
A fused backend also declares ``FUSED_BIAS``, the form it computes biases in ("kernel": triton,
"score_mod": flex), and refuses an encoding that declares a bias kind without that form
(`unfused_bias`): ``auto`` never picks a backend that would materialize an N x N bias. Every backend
declares ``LOCAL_MASKS``, the local masks it honors (`attention.mask.LOCAL_KINDS`: a sliding window,
a chunk); a layer with one resolves only among the backends that declare it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch

from posenc_lightning.attention.backends.proven import CUSTOM_KERNELS, fastest_first, local_unproven, unproven
from posenc_lightning.encodings.base import Encoding

BACKENDS = ("eager", "sdpa", "flex", "triton", "blockwise")
#: the order ``auto`` tries, fastest first; on CUDA a custom kernel only where a recorded GPU run
#: validated it for the encoding (`Encoding.gpu_record`)
_AUTO_ORDER = {"cuda": ("triton", "flex", "sdpa", "blockwise", "eager"), "cpu": ("sdpa", "blockwise", "eager")}


def unfused_bias(encoding: Encoding, form: str, who: str) -> str | None:
    """Why ``who`` would have to materialize ``encoding``'s bias as an N x N tensor (a declared
    kind without the fused ``form``, or no declaration at all), or None."""
    if "bias" not in encoding.stages:
        return None
    if not encoding.bias_kinds:
        return (f"{encoding.name} declares no bias_kinds, so {who} would materialize its bias N x N; "
                f"declare them on the class (Encoding.bias_kinds) or use backend='sdpa' (blocks of rows)")
    bad = [k.__name__ for k in encoding.bias_kinds if form not in k.fused_in]
    if bad:
        return (f"{who} would materialize {encoding.name}'s {', '.join(bad)} as an N x N tensor; "
                f"backend='sdpa' computes it by blocks of rows")
    alone = [k.__name__ for k in encoding.bias_kinds if k.fused_alone]
    if alone and len(encoding.bias_kinds) > 1:
        return (f"{who} take {', '.join(alone)} only as the one bias of an attention, and {encoding.name} sums it "
                f"with others (else an N x N tensor); backend='sdpa' computes them by blocks of rows")
    return None


#: the backend modules imported so far (`get_backend`), so that resolving one inside a traced
#: forward is a dict lookup, not an import
_LOADED: dict[str, ModuleType] = {}


def get_backend(name: str) -> ModuleType:
    mod = _LOADED.get(name)
    if mod is not None:
        return mod
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {('auto',) + BACKENDS}")
    try:
        mod = _LOADED[name] = importlib.import_module(f"posenc_lightning.attention.backends.{name}")
    except ImportError as e:
        raise ValueError(f"attention backend {name!r} is not available here ({e}); "
                         f"use backend='auto', 'sdpa' or 'eager'") from e
    return mod


def load_backends() -> None:
    """Import every backend module now (they import their heavy dependencies lazily), so that no
    forward ever imports one: `inject` calls it."""
    for name in BACKENDS:
        try:
            get_backend(name)
        except ValueError:
            pass
    # the opaque operator of value-dependent bias forms under compile (`opaque_form`)
    importlib.import_module("posenc_lightning.attention.backends.sdpa.opaque_op")


_NO_LOCAL: frozenset[str] = frozenset()


def _why_not(name: str, encoding: Encoding, device: torch.device, requires_grad: bool,
             local: frozenset[str] = _NO_LOCAL) -> str | None:
    try:
        mod = get_backend(name)
    except ValueError as e:
        return str(e)
    if local and not local <= mod.LOCAL_MASKS:
        return (f"the layer has a {' and a '.join(sorted(local - mod.LOCAL_MASKS))}, which {name} does not "
                f"honor (LOCAL_MASKS = {sorted(mod.LOCAL_MASKS)})")
    return mod.supports(encoding, device, requires_grad)


def resolve_backend(name: str, encoding: Encoding, device: torch.device, requires_grad: bool,
                    local: frozenset[str] = _NO_LOCAL,
                    table: Mapping[tuple[str, str], Any] | None = None) -> ModuleType:
    """The backend module to run ``encoding`` on ``device``; ``auto`` picks the fastest that can.

    Args:
        name: a backend name or ``"auto"``.
        encoding: the bound encoding.
        device: the device of q, k, v.
        requires_grad: whether the call must be differentiable.
        local: the local masks the call carries (`AttentionMask.local`: ``"window"``, ``"chunk"``),
            which the backend must declare in its ``LOCAL_MASKS``.
        table: the proven table to read (`proven_on_gpu.PROVEN`'s form; default that table).

    Returns:
        The backend module.
    """
    if name == "auto":
        order = _AUTO_ORDER.get(device.type, _AUTO_ORDER["cpu"])
        if device.type == "cuda":  # measured times, where a run recorded two or more, beat the fixed order
            for cand in fastest_first(order, encoding, table):
                if not unproven(cand, encoding, device.type, table) and not local_unproven(cand, local, device.type) \
                        and _why_not(cand, encoding, device, requires_grad, local) is None:
                    return get_backend(cand)
        for cand in order:
            if cand in CUSTOM_KERNELS and not {"bias", "normalize"} & set(encoding.stages):
                continue  # nothing to fuse: SDPA's flash kernels are faster (benchmarks/results/gpu-*.md)
            if unproven(cand, encoding, device.type, table) or local_unproven(cand, local, device.type):
                continue
            if _why_not(cand, encoding, device, requires_grad, local) is None:
                return get_backend(cand)
        return get_backend("eager")
    reason = _why_not(name, encoding, device, requires_grad, local)
    if reason is not None:
        ok = [b for b in BACKENDS if _why_not(b, encoding, device, requires_grad, local) is None]
        raise ValueError(f"backend {name!r} cannot run encoding {encoding.name!r} on {device.type}: "
                         f"{reason}. Use backend='auto' or one of {ok}")
    return get_backend(name)


load_backends()
