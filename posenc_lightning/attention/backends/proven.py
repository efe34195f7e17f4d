"""The custom attention kernels a recorded GPU run has validated, per encoding.

On CUDA, ``backend="auto"`` takes a custom kernel (`CUSTOM_KERNELS`: the Triton kernels, flex
attention's compiled ``score_mod``) for an encoding only when `PROVEN` names the pair and the
encoding has a bias or a softmax replacement to fuse (`resolve_backend`); otherwise
it takes PyTorch's own SDPA (flash for rotary encodings, a bias added by blocks of rows) and the
pure-PyTorch blockwise normalizers, the paths the CPU suite proves against the eager reference.
An explicit ``backend="triton"`` or ``"flex"`` still runs whatever its ``supports`` accepts.

How an entry gets here (docs/guides/gpu.md): ``benchmarks/gpu_check.sh`` on a CUDA machine runs
the suite's GPU mode and keeps its JUnit report beside the results page; ``python
benchmarks/gpu_proven.py <that report>`` prints the pairs whose every case passed (every dtype,
scenario of tests/gpu/test_conformance_cuda.py, forward and backward), which are
pasted below with the results page as their record.
"""

from __future__ import annotations

#: backends that run code of this project's own on the GPU (as opposed to PyTorch's SDPA)
CUSTOM_KERNELS = ("triton", "flex")

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


def unproven(backend: str, encoding: str, device_type: str) -> bool:
    """Whether ``auto`` must pass over ``backend`` for ``encoding`` on ``device_type``: a custom
    kernel on CUDA that no recorded run has validated.

    Args:
        backend: a backend name (`posenc_lightning.attention.backends.BACKENDS`).
        encoding: the encoding's registered name.
        device_type: ``torch.device.type`` of the inputs.

    Returns:
        True when ``auto`` may not choose it.
    """
    return device_type == "cuda" and backend in CUSTOM_KERNELS and (backend, encoding) not in PROVEN
