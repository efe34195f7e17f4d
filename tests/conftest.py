import os

import pytest
import torch


def gpu_mode(markexpr: str, cuda: bool) -> bool:
    """The suite's GPU mode: a mark expression that keeps only ``gpu`` tests (``-m gpu``,
    ``-m "gpu and not slow"``) on a machine with CUDA."""
    words = markexpr.replace("(", " ").replace(")", " ").split()
    if not cuda or "gpu" not in words or "or" in words:
        return False
    i = words.index("gpu")
    return i == 0 or words[i - 1] != "not"


def pytest_configure(config):
    # The Triton interpreter must be chosen before triton is first imported (before collection):
    # on for the CPU suite, off in GPU mode, where the kernels are compiled for the device.
    if not gpu_mode(config.getoption("markexpr") or "", torch.cuda.is_available()):
        os.environ.setdefault("TRITON_INTERPRET", "1")


# The suite's models are tiny: one intra-op thread is fastest (and ~10x faster than two on a busy machine).
torch.set_num_threads(1)

try:  # hypothesis keeps its files (unicode tables, examples) in a temporary directory, not the checkout
    import tempfile

    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(tempfile.mkdtemp(prefix="posenc-hypothesis-"))
except ImportError:
    pass


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
