"""The suite's GPU mode (issue 28): ``python -m pytest -m gpu tests`` on a CUDA machine.

Every test here is marked ``gpu`` and runs on the device with the Triton interpreter off
(tests/conftest.py leaves ``TRITON_INTERPRET`` unset in GPU mode, so the kernels are compiled).
Anywhere else it is collected and skipped with `WHY_SKIPPED` (tests/test_gpu_mode.py checks both).
"""

from __future__ import annotations

import os

import pytest
import torch


def why_skipped() -> str | None:
    """Why the GPU tests cannot run in this process, or None when they can."""
    if not torch.cuda.is_available():
        return "no CUDA device: the GPU mode runs on a GPU machine (python -m pytest -m gpu tests)"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return ("TRITON_INTERPRET=1 (the CPU suite's interpreter): run the GPU mode alone, "
                "python -m pytest -m gpu tests, so the Triton kernels are compiled")
    return None


WHY_SKIPPED = why_skipped()
#: the marks of every GPU test module (``pytestmark = GPU``)
GPU = [pytest.mark.gpu, pytest.mark.skipif(WHY_SKIPPED is not None, reason=WHY_SKIPPED or "")]
