import os

import pytest
import torch

# The Triton interpreter must be chosen before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
