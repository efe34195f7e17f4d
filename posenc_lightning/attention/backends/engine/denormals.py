"""Flush-to-zero of denormals around biased attention on CPU, forward and backward: the switches
the sdpa backend's biased calls and the blockwise normalizers use. The public helpers, for a region
of the user's own (a compiled model), are in `posenc_lightning.attention.denormals`."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from posenc_lightning.functional.mode import Mode

#: `flush_denormals()` regions open now: inside one, the switches here leave flush-to-zero on
#: where they would turn it off
_USER_REGIONS = 0


def set_flush_denormal(on: bool) -> bool:
    """``torch.set_flush_denormal(on)`` on the calling thread and on every thread of PyTorch's
    intra-op pool.

    The setting is a per-thread CPU register (MXCSR on x86), and ``torch.set_flush_denormal`` sets
    the calling thread's only: with more than one intra-op thread, the pool's threads would still
    compute on denormals, the slow case this flush exists to avoid. Where PyTorch's pool is GNU
    OpenMP (``libgomp``, the Linux wheels), one empty parallel region of the pool's size sets it
    on each of its threads; elsewhere only the calling thread's is set (the state before).

    Args:
        on: flush denormals to zero (True) or restore IEEE behaviour (False).

    Returns:
        Whether this CPU supports the setting (``torch.set_flush_denormal``'s answer).
    """
    ok = torch.set_flush_denormal(on)
    if ok and torch.get_num_threads() > 1:
        region = _openmp_region()
        if region is not None:
            region(on, torch.get_num_threads())
    return ok


def pytorch_libgomp(loaded: list[str], torch_dir: str) -> str | None:
    """The ``libgomp`` whose threads are PyTorch's intra-op pool, among the ``loaded`` ones.

    Args:
        loaded: paths of the libgomp copies mapped in the process, in the order ``/proc/self/maps``
            lists them.
        torch_dir: the directory of the ``torch`` package.

    Returns:
        The copy inside ``torch_dir`` where PyTorch's wheel bundles one (another library, such as
        llama.cpp's ggml, may have loaded the system's, whose threads are not PyTorch's pool), else
        the first; None when none is loaded.
    """
    own = [p for p in loaded if p.startswith(torch_dir.rstrip("/") + "/")]
    return own[0] if own else (loaded[0] if loaded else None)


@functools.cache
def _openmp_region() -> Callable[[bool, int], None] | None:
    """A function running ``torch.set_flush_denormal(on)`` on each thread of the calling thread's
    OpenMP team, through the ``libgomp`` PyTorch loaded (None where there is none)."""
    if not sys.platform.startswith("linux") or "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as maps:
            path = pytorch_libgomp([line.split()[-1] for line in maps if "libgomp" in line],
                                   os.path.dirname(torch.__file__))
        if path is None:
            return None
        lib = ctypes.CDLL(path)
        body_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        lib.GOMP_parallel.argtypes = [body_type, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        lib.GOMP_parallel.restype = None
    except (OSError, AttributeError):
        return None
    wanted = [False]

    @body_type
    def body(_: object) -> None:  # runs on every thread of the team, the caller included
        torch.set_flush_denormal(wanted[0])

    def region(on: bool, n_threads: int) -> None:
        wanted[0] = on
        lib.GOMP_parallel(body, None, n_threads, 0)

    return region


def _restore() -> None:
    """Flush-to-zero back to the caller's setting: on inside a `flush_denormals()` region, else off
    (PyTorch's default)."""
    set_flush_denormal(_USER_REGIONS > 0)


def _flush_in_backward(mode: Mode, *xs: Tensor) -> bool:
    """Whether a call in ``mode`` on ``xs`` flushes in its backward (`Tunables.flush_denormals`)."""
    return (mode.tunables.flush_denormals and torch.is_grad_enabled() and mode.device == "cpu"
            and any(x.requires_grad for x in xs) and not mode.compiling)


class _DenormalsOnForBackward(torch.autograd.Function):
    """Identity on the attention output; in backward it turns flush-to-zero on, before the
    SDPA backward runs (the autograd engine runs CPU nodes on the calling thread). It is turned
    off by `_DenormalsOffAfterBackward` once the gradients of q, k, v are in, and, should that
    node not run (``autograd.grad`` to a bias parameter only, an error in between), at the end
    of the backward pass at the latest (an engine callback)."""

    @staticmethod
    def forward(ctx, out: Tensor) -> Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        set_flush_denormal(True)
        torch.autograd.Variable._execution_engine.queue_callback(_restore)
        return grad


class _DenormalsOffAfterBackward(torch.autograd.Function):
    """Identity on q, k, v; its backward runs once all of their gradients are in (after the
    attention's backward) and turns flush-to-zero off again."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, gq: Tensor, gk: Tensor, gv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        _restore()
        return gq, gk, gv


@contextlib.contextmanager
def _flush_denormals(mode: Mode):
    """Flush-to-zero on for the block of a call in ``mode`` (eagerly on CPU, `Tunables.flush_denormals`)."""
    if mode.compiling or not (mode.tunables.flush_denormals and mode.device == "cpu"
                              and set_flush_denormal(True)):
        yield
        return
    try:
        yield
    finally:
        _restore()


@contextlib.contextmanager
def _user_region() -> Iterator[bool]:
    """Flush-to-zero on for the block and kept on by the switches above (regions nest); yields
    whether the CPU supports it."""
    global _USER_REGIONS
    supported = set_flush_denormal(True)
    _USER_REGIONS += 1
    try:
        yield supported
    finally:
        _USER_REGIONS -= 1
        _restore()
