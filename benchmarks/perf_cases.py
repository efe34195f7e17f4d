"""The cases of benchmarks/gpu_perf.py (issue 45): what is timed, its FLOP and byte floors, and the
callables that run it, at the device's sizes or at tiny ones (the CPU dry run).

Sections, in the order they run: the SDPA baselines; every registered encoding through ``auto``,
``triton`` and ``flex``; the ablations (matmul precision, tile sizes, rotary pre-rotated vs in-kernel,
CUDA graphs around the rotary path). Every case times the forward (no autograd) and the
forward+backward (``torch.autograd.grad`` of q, k, v: nothing accumulates between repetitions).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

#: the issue's shapes: batch, heads, lengths, head dims; bf16, causal
BATCH, HEADS, LENGTHS, HEAD_DIMS, DTYPE = 4, 16, (4096, 16384), (64, 128), "bfloat16"
#: the dry run's stand-ins (a length that no tile of 16 or 32 divides; head dims 16 and 32)
TINY = {"batch": 1, "heads": 2, 4096: 24, 16384: 40, 64: 16, 128: 32}
ENCODING_BACKENDS = ("auto", "triton", "flex")
#: the section order, each with its share of the time budget (unused time passes to the next)
SECTIONS = (("baseline", 0.05), ("auto", 0.25), ("ablation", 0.25), ("triton", 0.25), ("flex", 0.20))


def attention_flops(b: int, h: int, n: int, d: int, *, causal: bool = True, backward: bool = False) -> float:
    """Matrix-product FLOPs of attention: forward ``S = Q K^T`` and ``O = P V``, 2 N^2 d each per
    head (a multiply and an add), halved by a causal mask; the backward's four products (dV = P^T dO,
    dP = dO V^T, dQ = dS K, dK = dS^T Q) are twice the forward's (the fewest: FlashAttention-2
    recomputes S as well, a fifth). Elementwise work (softmax, rotation, biases) is not counted.

    Returns:
        ``4 B H N^2 d / 2`` for a causal forward; three times that with ``backward``.
    """
    fwd = 2 * 2 * b * h * n * n * d / (2 if causal else 1)
    return 3 * fwd if backward else fwd


def attention_bytes(b: int, h: int, n: int, d: int, element_size: int, *, backward: bool = False) -> float:
    """The fewest bytes attention moves through device memory: the forward reads q, k, v and
    writes o (4 tensors of ``B H N d``); the backward reads q, k, v, o, dO and writes dq, dk, dv
    (8 more). The softmax statistics (``B H N`` floats) and an encoding's parameters are left out."""
    return (12 if backward else 4) * b * h * n * d * element_size


def floor_ms(flops: float, nbytes: float, flops_per_s: float, bytes_per_s: float) -> float:
    """The floor: the larger of FLOPs over the matrix rate and bytes over the bandwidth, in ms."""
    return 1e3 * max(flops / flops_per_s, nbytes / bytes_per_s)


@dataclass
class Case:
    """One timed case: a baseline, an encoding through a backend, or an ablation's variant."""

    section: str
    label: str
    backend: str
    n: int
    d: int
    dtype: str = DTYPE
    batch: int = BATCH
    heads: int = HEADS
    #: what the case varies (an ablation's setting), shown beside the label
    variant: str = ""
    #: the path that ran (``auto``'s choice; a baseline's kernel)
    ran: str = ""
    status: str = "planned"
    fwd_ms: float | None = None
    fwd_bwd_ms: float | None = None
    #: the first forward+backward, compile included (host clock, synchronized)
    first_s: float | None = None
    #: (20th, 80th) percentiles of each mode's repetitions
    spread: dict = field(default_factory=dict)
    note: str = ""

    @property
    def key(self) -> str:
        return f"{self.section}|{self.label}|{self.backend}|{self.variant}|{self.n}|{self.d}|{self.dtype}|{self.batch}"

    def floors(self, flops_per_s: float, bytes_per_s: float) -> dict:
        """FLOPs, bytes and floor ms of each mode (`attention_flops`, `attention_bytes`)."""
        size = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        out = {}
        for mode, bwd in (("fwd", False), ("fwd_bwd", True)):
            fl = attention_flops(self.batch, self.heads, self.n, self.d, backward=bwd)
            by = attention_bytes(self.batch, self.heads, self.n, self.d, size, backward=bwd)
            out[mode] = {"flops": fl, "bytes": by, "floor_ms": floor_ms(fl, by, flops_per_s, bytes_per_s)}
        return out


def plan(names: list[str], lengths=LENGTHS, head_dims=HEAD_DIMS) -> list[Case]:
    """Every case, in `SECTIONS` order: baselines, encodings through each backend, ablations."""
    shapes = [(n, d) for n in lengths for d in head_dims]
    cases = [Case("baseline", lab, "sdpa", n, d) for n, d in shapes
             for lab in ("sdpa-default", "sdpa-flash", "sdpa-cudnn")]
    for backend in ENCODING_BACKENDS:
        cases += [Case(backend, name, backend, n, d) for n, d in shapes for name in names]
    n0 = lengths[0]
    for prec in ("highest", "high"):  # fp32 inputs: TF32 products or not
        cases += [Case("ablation", lab, be, n0, 64, dtype="float32", batch=1, variant=f"precision={prec}")
                  for lab, be in (("sdpa-default", "sdpa"), ("rope", "sdpa"), ("alibi", "eager"))]
    for d in head_dims:
        cases += [Case("ablation", "tiles", "triton", n0, d, variant=f"{kind}={_tile_name(t)}")
                  for kind, t in TILE_VARIANTS]
    for n, d in ((n0, 64), (n0, 128)):
        cases += [Case("ablation", lab, be, n, d, variant=v) for lab, be, v in ROTARY_VARIANTS]
    for n, b in ((1024, 1), (n0, BATCH)):
        cases += [Case("ablation", "rope", "sdpa", n, 64, batch=b, variant=f"cuda-graph={g}") for g in ("off", "on")]
    return cases


#: tile ablation: (kernel kind, tiles) on ALiBi through the Triton softmax kernels; None: the pinned
#: `kernels.tile_table.SOFTMAX_CONFIGS` entry
TILE_VARIANTS: list[tuple[str, tuple[int, int, int, int] | None]] = [
    ("fwd", None), ("fwd", (128, 64, 8, 3)), ("fwd", (128, 32, 8, 2)), ("fwd", (64, 64, 4, 3)), ("fwd", (32, 32, 4, 2)),
    ("bwd_dkdv", (64, 64, 8, 2)), ("bwd_dkdv", (32, 64, 4, 2)), ("bwd_dq", (64, 64, 8, 2)), ("bwd_dq", (64, 32, 4, 2))]
#: rotary ablation: (label, backend, variant): where the rotation happens
ROTARY_VARIANTS = [
    ("nope", "sdpa", "no rotation, flash"),
    ("rope", "sdpa", "pre-rotated (rotate_pair) + flash"),
    ("nope", "triton", "no rotation, Triton softmax"),
    ("rope", "triton", "pre-rotated (fused rotate pass) + Triton softmax"),
    ("sba", "triton", "no rotation, stick-breaking kernel"),
    ("sba+rope", "triton", "in-kernel per tile, stick-breaking kernel")]


def _tile_name(t: tuple[int, int, int, int] | None) -> str:
    return "pinned" if t is None else "BM{}xBN{}/w{}/s{}".format(*t)


def tile_arg(variant: str) -> dict | None:
    """``fused_attention(tiles=...)`` of a tile variant (`TILE_VARIANTS`), None for the pinned ones."""
    kind, name = variant.split("=")
    for k, t in TILE_VARIANTS:
        if k == kind and _tile_name(t) == name:
            return None if t is None else {kind: dict(zip(("BM", "BN", "num_warps", "num_stages"), t))}
    raise ValueError(f"unknown tile variant {variant!r}")


@dataclass
class Runner:
    """A case's callables: the forward (returns its output) and the forward+backward."""

    fwd: Callable[[], Tensor]
    fwd_bwd: Callable[[], object]
    ran: str


class Unsupported(Exception):
    """The backend refuses the case on CUDA; the message says why."""


class NeedsCuda(Unsupported):
    """The case runs on CUDA only (the dry run validates it there)."""


def sizes(case: Case, tiny: bool) -> tuple[int, int, int, int]:
    """(B, H, N, D) of ``case`` at the device's sizes or the dry run's (`TINY`)."""
    if not tiny:
        return case.batch, case.heads, case.n, case.d
    return TINY["batch"], TINY["heads"], TINY.get(case.n, 24), TINY.get(case.d, 16)


def inputs(case: Case, device: torch.device, tiny: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q, k, v (requiring grad), the cotangent dO and the layer's hidden states, random (never zeros)."""
    b, h, n, d = sizes(case, tiny)
    dt = torch.float32 if tiny else getattr(torch, case.dtype)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, device=device, dtype=dt, generator=g) for _ in range(4))
    hidden = torch.randn(b, n, h * d, device=device, dtype=dt, generator=g)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do, hidden


def _runner(fn: Callable[[], Tensor], leaves: tuple[Tensor, ...], do: Tensor, ran: str,
            around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> Runner:
    def fwd() -> Tensor:
        with torch.no_grad(), around():
            return fn()

    def fwd_bwd() -> object:
        with around():
            return torch.autograd.grad(fn(), leaves, do)

    return Runner(fwd, fwd_bwd, ran)


def sdpa_backend(label: str) -> contextlib.AbstractContextManager:
    """The SDPA kernel a baseline restricts to (none for ``sdpa-default``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pick = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}.get(label)
    return contextlib.nullcontext() if pick is None else sdpa_kernel(pick)


@contextlib.contextmanager
def matmul_precision(value: str) -> Iterator[None]:
    """``torch.set_float32_matmul_precision(value)`` for the block, the old value restored."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(value)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def _around(case: Case) -> Callable[[], contextlib.AbstractContextManager]:
    """What each call of ``case`` runs inside: its matmul precision, or its SDPA kernel."""
    if case.variant.startswith("precision="):
        value = case.variant.split("=")[1]
        return lambda: matmul_precision(value)
    return lambda: sdpa_backend(case.label)


def build(case: Case, device: torch.device, tiny: bool = False) -> Runner:
    """The callables of ``case`` on ``device`` (tiny: the dry run's sizes, float32).

    Raises:
        Unsupported: the backend refuses the encoding (its reason), or the case needs CUDA.
    """
    from benchmarks.perf_layers import encoding_runner, graph_runner, rotary_runner, tiles_runner

    q, k, v, do, hidden = inputs(case, device, tiny)
    if case.section == "baseline" or (case.section == "ablation" and case.label == "sdpa-default"):
        if case.label == "sdpa-cudnn" and device.type != "cuda":
            raise NeedsCuda("cuDNN attention runs on CUDA only")
        around = _around(case)
        return _runner(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do,
                       case.label, around)
    if case.section in ENCODING_BACKENDS or case.variant.startswith("precision="):
        run = encoding_runner(case, q, k, v, hidden, device)
        return _runner(run.fn, (q, k, v), do, run.ran, _around(case))
    if case.label == "tiles":
        return _runner(tiles_runner(case, q, k, v, device), (q, k, v), do, "triton")
    if case.variant.startswith("cuda-graph="):
        return graph_runner(case, q, k, v, do, hidden, device)
    return _runner(rotary_runner(case, q, k, v, hidden, device), (q, k, v), do, case.backend)
