"""FIRE's rows by distance and their pullback in one compiled pass each (`native.c`), on CPU: the
MLP as the piecewise-linear function it is (`functional.fire.fire_mlp_segments`), each row a few
pieces of one segment. The same values and gradients as `by_distance` (which stays the path on
other devices, under a trace, with a distance table, and wherever the library cannot be built).

The C source is compiled once per machine with the system's C compiler into the user's cache
(``$XDG_CACHE_HOME/posenc_lightning/native``, keyed by the source's hash and flags) and loaded
with `ctypes`; built with OpenMP it splits a block's rows over torch's own intra-op threads (the
same libgomp). Without a compiler, or with ``POSENC_NATIVE=0``, `available` is False and FIRE
keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from posenc_lightning.functional.fire import fire_mlp_segments

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("native.c")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
#: the dtypes the library computes in, by their C names
C_TYPES = {torch.float32: "float", torch.float64: "double"}


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "posenc_lightning" / "native"


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        exe = cc.split()[0] if cc else None
        if exe and shutil.which(exe):
            return exe
    return None


def _flags() -> list[str]:
    """``-O3``, with AVX2 and FMA where this CPU has them (as torch's own kernels detect it)."""
    simd = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return ["-O3", "-mavx2", "-mfma"] if simd else ["-O3"]


def _build(source: Path, target: Path, flags: list[str]) -> None:
    """``source`` compiled with ``flags`` to the shared library ``target`` (written atomically:
    concurrent builds by several processes leave one whole file): with OpenMP (``-fopenmp``: the
    library then runs on torch's own libgomp threads, already loaded in the process), else
    without it (one thread)."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        for extra in (["-fopenmp"], []):
            done = subprocess.run([cc, *flags, *extra, "-shared", "-fPIC", "-o", tmp, str(source)],
                                  check=False, capture_output=True, timeout=120)
            if done.returncode == 0:
                os.replace(tmp, target)
                return
        raise RuntimeError(f"{cc} failed: {done.stderr.decode(errors='replace')[-400:]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The compiled library, built on first use; None where it cannot be (logged once)."""
    if os.environ.get("POSENC_NATIVE", "1") == "0":
        return None
    flags = _flags()
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    target = _cache_dir() / f"fire_{key}.so"  # a source or flag change builds anew
    try:
        if not target.exists():
            _build(_SOURCE, target, flags)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("FIRE's compiled rows unavailable (%s); FIRE keeps its torch path", e)
        return None
    for t in C_TYPES.values():
        getattr(lib, f"fire_rows_{t}").argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR,
                                                   _I64, _I64]
        getattr(lib, f"fire_pullback_{t}").argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64,
                                                       _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR]
        getattr(lib, f"fire_rows_{t}").restype = _I64
        getattr(lib, f"fire_pullback_{t}").restype = _I64
    return lib


def available() -> bool:
    """The compiled rows can run here (built or buildable, not disabled by ``POSENC_NATIVE=0``)."""
    return _library() is not None


@dataclass(frozen=True)
class Segments:
    """``f(x) = w2 relu(w1 x + b1) + b2`` as ``A[:, s] x + B[:, s]`` on segment ``s`` of the sorted
    breakpoints ``tau`` (``[S]`` in the compute dtype, where ``x`` is compared with them; segment
    ``s`` is ``(tau[s-1], tau[s]]``): ``a``, ``b`` ``[H, S + 1]`` in the compute dtype; ``active``
    ``[W, S + 1]`` the 0/1 units on each segment, decided at a point inside it in float64 (a unit
    with ``w1 = 0`` is constant: on everywhere iff ``b1 > 0``)."""

    tau: Tensor
    a: Tensor
    b: Tensor
    active: Tensor

    @classmethod
    def of(cls, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Segments:
        """The segments of the MLP ``w1, b1 [W]``, ``w2 [H, W]``, ``b2 [H]`` (``a``, ``b`` in ``w2``'s dtype)."""
        tau, active = fire_mlp_segments(w1.double(), b1.double())
        s = int(torch.isfinite(tau).sum())  # the constant units' +inf sort last: their segments are empty
        tau, active = tau[:s], active[:, :s + 1].to(w2.dtype)  # [S], [W, S + 1]
        a = (w2 * w1) @ active
        b = b2[:, None] + (w2 * b1) @ active
        return cls(tau.to(w2.dtype).contiguous(), a.contiguous(), b.contiguous(), active)


def _ptr(t: Tensor) -> int:
    return t.data_ptr()


def _ok(status: int) -> bool:
    """The library's return: 0 done, -1 a row with more pieces than it takes (the caller falls back)."""
    if status == -2:
        raise MemoryError("fire: the compiled rows could not allocate their per-thread buffers")
    return status == 0


def rows(p: Tensor, n: Tensor, seg: Segments, c_len: int, out: Tensor) -> bool:
    """``out [1, H, R, c_len]`` (last dim contiguous) written with the block's rows: row ``r``, key
    ``j`` at ``x = p[R - 1 - r + j] / n[r]``. ``p``, ``n``, ``seg.a``, ``seg.b`` and ``out`` in one
    dtype (float32 or float64), contiguous. False (nothing written that counts) where a row has
    more pieces than the library takes: the caller computes them otherwise."""
    h, r = out.shape[1], out.shape[2]
    a, b = seg.a.detach(), seg.b.detach()
    status = getattr(_library(), f"fire_rows_{C_TYPES[out.dtype]}")(
        _ptr(p), _ptr(n), r, c_len, _ptr(seg.tau), seg.tau.numel(), _ptr(a), _ptr(b), h, _ptr(out), out.stride(1),
        out.stride(2))
    return _ok(status)


def pullback_sums(g: Tensor, p: Tensor, n: Tensor, dpsi: Tensor | None, seg: Segments, last: int | None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """The pullback's sums from the rows' gradient ``g`` ``[H, R, C]`` (key layout, last dim
    contiguous): ``(G0, G1)`` ``[H, S + 1]`` float64, per head and segment ``sum g`` and ``sum g x``,
    and per row ``(sum_m g_x dpsi, sum_m g_x x)`` ``[R]`` float64 with ``g_x = sum_h g_h A[h, s]``
    (zeros without ``dpsi``). ``last``: the last table column the caller's mask shows (``g`` is 0
    past it). None where a row has more pieces than the library takes."""
    h, r, c = g.shape
    g0 = torch.zeros(h, seg.tau.numel() + 1, dtype=torch.float64)
    g1 = torch.zeros_like(g0)
    row_c = torch.empty(r, dtype=torch.float64)
    row_n = torch.empty(r, dtype=torch.float64)
    a = seg.a.detach()
    status = getattr(_library(), f"fire_pullback_{C_TYPES[g.dtype]}")(
        _ptr(p), _ptr(n), None if dpsi is None else _ptr(dpsi), r, c, -1 if last is None else last, _ptr(seg.tau),
        seg.tau.numel(), _ptr(a), h, _ptr(g), g.stride(0), g.stride(1), _ptr(g0), _ptr(g1), _ptr(row_c),
        _ptr(row_n))
    return (g0, g1, row_c, row_n) if _ok(status) else None


def unit_grads(g0: Tensor, g1: Tensor, seg: Segments, w1: Tensor, b1: Tensor, w2: Tensor
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(d w1, d b1, d w2, d b2)`` from the per-segment sums (`pullback_sums`): a unit on over a
    segment takes ``sum g (w1 x + b1)`` there, so with ``P0 = G0 active^T``, ``P1 = G1 active^T``
    ``[H, W]``: ``d w2 = w1 P1 + b1 P0``, ``d w1 = sum_h w2 P1``, ``d b1 = sum_h w2 P0``, ``d b2 =
    sum_s G0``."""
    dt = w2.dtype
    act = seg.active.to(torch.float64).t()  # [S + 1, W]
    p0, p1 = (g0 @ act).to(dt), (g1 @ act).to(dt)
    return (w2 * p1).sum(0), (w2 * p0).sum(0), w1 * p1 + b1 * p0, g0.sum(1).to(dt)

