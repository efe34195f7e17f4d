"""The custom attention kernels a recorded GPU run has validated, per encoding.

On CUDA, ``backend="auto"`` takes a custom kernel (`CUSTOM_KERNELS`: the Triton kernels, flex
attention's compiled ``score_mod``) for an encoding only when a recorded run validated the pair
(`Encoding.gpu_record`: the table lives with the encodings, `encodings/proven_on_gpu.py`) and the
encoding has a bias or a softmax replacement to fuse (`resolve_backend`); otherwise
it takes PyTorch's own SDPA (flash for rotary encodings, a bias added by blocks of rows) and the
pure-PyTorch blockwise normalizers, the paths the CPU suite proves against the eager reference.
An explicit ``backend="triton"`` or ``"flex"`` still runs whatever its ``supports`` accepts.

How an entry gets here (docs/guides/gpu.md): ``benchmarks/gpu_check.sh`` on a CUDA machine runs
the suite's GPU mode and keeps its JUnit report beside the results page; ``python
benchmarks/gpu_proven.py <that report>`` prints the pairs whose every case passed (every dtype,
scenario of tests/gpu/test_conformance_cuda.py, forward and backward), which are
pasted into `PROVEN` in `posenc_lightning/encodings/proven_on_gpu.py` with the results page as
their record.

Times: an entry may carry the path's measured milliseconds (`proven_on_gpu.Proven`, written by
``benchmarks/gpu_proven.py --times`` from the JSON of ``benchmarks/gpu_perf.sh``), and ``sdpa`` or
``blockwise`` may have entries that carry only a time. Where at least two of the paths ``auto`` may
take for an encoding have a time, it takes the fastest of them (`fastest_first`); otherwise the fixed
order, as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from posenc_lightning.encodings.base import Encoding

#: backends that run code of this project's own on the GPU (as opposed to PyTorch's SDPA)
CUSTOM_KERNELS = ("triton", "flex")
#: per custom kernel, the local masks (`attention.mask.LOCAL_KINDS`) a recorded GPU run validated it
#: with; none yet (the recorded H100 run predates layer windows and chunks), so on CUDA ``auto``
#: leaves a windowed or chunked layer to SDPA's rows and the blockwise normalizers
PROVEN_LOCAL: dict[str, frozenset[str]] = {}

def unproven(backend: str, encoding: Encoding, device_type: str,
             table: Mapping[tuple[str, str], Any] | None = None) -> bool:
    """Whether ``auto`` must pass over ``backend`` for ``encoding`` on ``device_type``: a custom
    kernel on CUDA that no recorded run has validated.

    Args:
        backend: a backend name (`posenc_lightning.attention.backends.BACKENDS`).
        encoding: the bound encoding.
        device_type: ``torch.device.type`` of the inputs.
        table: a table of `proven_on_gpu.PROVEN`'s form to read instead of it.

    Returns:
        True when ``auto`` may not choose it.
    """
    return device_type == "cuda" and backend in CUSTOM_KERNELS and encoding.gpu_record(backend, table) is None


def local_unproven(backend: str, local: frozenset[str], device_type: str) -> bool:
    """Whether ``auto`` must pass over ``backend`` for a layer with the local masks ``local`` on
    ``device_type``: a custom kernel on CUDA that no recorded run validated with them (`PROVEN_LOCAL`).

    Args:
        backend: a backend name.
        local: the call's local masks (``"window"``, ``"chunk"``).
        device_type: ``torch.device.type`` of the inputs.

    Returns:
        True when ``auto`` may not choose it.
    """
    return (device_type == "cuda" and backend in CUSTOM_KERNELS and bool(local)
            and not local <= PROVEN_LOCAL.get(backend, frozenset()))


def fastest_first(order: Sequence[str], encoding: Encoding,
                  table: Mapping[tuple[str, str], Any] | None = None) -> list[str]:
    """The backends of ``order`` with a recorded time for ``encoding``, fastest first, when at least
    two have one (one time alone compares with nothing: ``auto`` keeps its fixed order).

    Args:
        order: the candidates, in ``auto``'s fixed order for the device (ties keep this order).
        encoding: the bound encoding.
        table: a table of `proven_on_gpu.PROVEN`'s form to read instead of it.

    Returns:
        Backend names sorted by their recorded milliseconds, or ``[]``.
    """
    timed = [(ms, i, b) for i, b in enumerate(order) if (ms := encoding.gpu_ms(b, table)) is not None]
    return [b for *_, b in sorted(timed)] if len(timed) >= 2 else []
