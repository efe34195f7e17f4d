"""The (custom kernel, encoding) pairs a recorded GPU run has validated: the data that
`posenc_lightning.attention.backends.proven` reads (docs/guides/gpu.md says how an entry is earned).

It lives with the encodings, whose names it holds; the backends name none."""

from __future__ import annotations

_H100_RUN = "benchmarks/results/gpu-h100-80gb-hbm3-20261127-1745.md (NVIDIA H100 80GB HBM3)"

#: (backend, encoding name) -> the recorded run that validated it (a benchmarks/results page and
#: the GPU it ran on): `benchmarks/gpu_proven.py` of that run's report and its rerun's.
PROVEN: dict[tuple[str, str], str] = {
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
