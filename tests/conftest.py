import os

import pytest
import torch

# The Triton interpreter must be chosen before triton is first imported.
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
