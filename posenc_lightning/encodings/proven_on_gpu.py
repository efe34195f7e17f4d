"""The (custom kernel, encoding) pairs a recorded GPU run has validated: the data that
`posenc_lightning.attention.backends.proven` reads (docs/guides/gpu.md says how an entry is earned).

It lives with the encodings, whose names it holds; the backends name none.

An entry's value is the record alone (a string: the pair passed, no time kept) or a `Proven`
that also carries the path's measured time: ``benchmarks/gpu_perf.sh`` times every path at
`REFERENCE_CASE`, and `auto` takes the fastest of the paths with a time (`attention/backends/proven.py`).
A path that needs no proof (``sdpa``, ``blockwise``) may have an entry too, to carry its time."""

from __future__ import annotations

from typing import NamedTuple

#: the case whose time a `Proven` entry records: forward+backward, causal, bf16, B 4, 16 heads,
#: N 4096, head_dim 128 (`benchmarks/gpu_perf.py`, ``--proven``)
REFERENCE_CASE = "fwd+bwd, causal, bf16, B=4, H=16, N=4096, D=128"


class Proven(NamedTuple):
    """A path a recorded run validated or timed, with its time.

    Attributes:
        record: the benchmarks/results page and the GPU of the run.
        ms: median milliseconds of `REFERENCE_CASE` on that GPU (None: not timed).
    """

    record: str
    ms: float | None = None


def record_of(entry: str | Proven) -> str:
    """The record (results page and GPU) of a `PROVEN` value of either form."""
    return entry if isinstance(entry, str) else entry.record


def ms_of(entry: str | Proven | None) -> float | None:
    """The measured time of a `PROVEN` value, None for a bare record or a missing entry."""
    return entry.ms if isinstance(entry, Proven) else None

_H100_RUN = "benchmarks/results/gpu-h100-80gb-hbm3-20261127-1745.md (NVIDIA H100 80GB HBM3)"

#: (backend, encoding name) -> the recorded run that validated it (a benchmarks/results page and
#: the GPU it ran on): `benchmarks/gpu_proven.py` of that run's report and its rerun's; a `Proven`
#: where the run also timed the path (`gpu_proven.py --times`).
PROVEN: dict[tuple[str, str], str | Proven] = {
    ("flex", "alibi"): _H100_RUN,
    ("flex", "clex"): _H100_RUN,
    ("flex", "comrope"): _H100_RUN,
    ("flex", "dynamic_ntk"): _H100_RUN,
    ("flex", "fox"): _H100_RUN,
    ("flex", "llama3"): _H100_RUN,
    ("flex", "long_rope"): _H100_RUN,
    ("flex", "multiscale_rope"): _H100_RUN,
    ("flex", "nope"): _H100_RUN,
    ("flex", "ntk"): _H100_RUN,
    ("flex", "pi"): _H100_RUN,
    ("flex", "relative_bias"): _H100_RUN,
    ("flex", "resonance_rope"): _H100_RUN,
    ("flex", "rope_2d"): _H100_RUN,
    ("flex", "rope_alibi"): _H100_RUN,
    ("flex", "sinusoidal"): _H100_RUN,
    ("flex", "xpos"): _H100_RUN,
    ("flex", "yarn"): _H100_RUN,
    ("triton", "alibi"): _H100_RUN,
    ("triton", "clex"): _H100_RUN,
    ("triton", "comrope"): _H100_RUN,
    ("triton", "dynamic_ntk"): _H100_RUN,
    ("triton", "fox"): _H100_RUN,
    ("triton", "learned"): _H100_RUN,
    ("triton", "llama3"): _H100_RUN,
    ("triton", "long_rope"): _H100_RUN,
    ("triton", "multiscale_rope"): _H100_RUN,
    ("triton", "nope"): _H100_RUN,
    ("triton", "ntk"): _H100_RUN,
    ("triton", "pi"): _H100_RUN,
    ("triton", "relative_bias"): _H100_RUN,
    ("triton", "resonance_rope"): _H100_RUN,
    ("triton", "rope_2d"): _H100_RUN,
    ("triton", "rope_alibi"): _H100_RUN,
    ("triton", "sba"): _H100_RUN,
    ("triton", "sinusoidal"): _H100_RUN,
    ("triton", "xpos"): _H100_RUN,
    ("triton", "yarn"): _H100_RUN,
}


#: the registered encodings that no custom-kernel backend (`attention.backends.proven.CUSTOM_KERNELS`)
#: takes for training on CUDA (so they run on SDPA by blocks of rows or on the blockwise normalizers),
#: each with why; tests/test_cuda_paths.py fails on an encoding missing here and on an entry a kernel
#: now takes (written by hand, not by benchmarks/gpu_proven.py)
NO_CUSTOM_KERNEL: dict[str, str] = {
    "path": "no kernel yet (issue 47, PaTH's cost): its logit change (the Householder products between each key and query) is a "
            "DenseBias computed by blocks of rows (functional/path.py); the in-kernel form carries each "
            "query block through the key chunks' UT transforms per tile (the paper's blockwise algorithm)",
    "path_fox": "no kernel yet (issue 47, PaTH's cost): PaTH's DenseBias (as path) plus FoX's gates",
}
