"""Every registered encoding has a path on CUDA of this project's own (a `CUSTOM_KERNELS` backend
whose ``supports`` takes it for training on a cuda device), or is listed in
`encodings.proven_on_gpu.NO_CUSTOM_KERNEL` with the reason (issue 49): adding an encoding without
a kernel fails here until it is listed, and a kernel that comes to take a listed one fails here
until the entry goes. ``supports`` decides from the encoding and the device type alone, so this
runs without a GPU."""

from __future__ import annotations

import pytest
import torch

from posenc_lightning.attention.backends import _why_not
from posenc_lightning.attention.backends.proven import CUSTOM_KERNELS
from posenc_lightning.encodings.proven_on_gpu import NO_CUSTOM_KERNEL
from posenc_lightning.encodings.registry import available_encodings, build_encoding

CUDA = torch.device("cuda")


def _why_no_kernel(name: str) -> dict[str, str | None]:
    enc = build_encoding(name).bind(n_heads=4, head_dim=64, d_model=256)
    return {b: _why_not(b, enc, CUDA, True) for b in CUSTOM_KERNELS}


@pytest.mark.parametrize("name", available_encodings())
def test_an_encoding_has_a_custom_kernel_on_cuda_or_is_listed_with_why(name):
    pytest.importorskip("triton")  # without triton the Triton backend refuses everything
    why = _why_no_kernel(name)
    covered = any(reason is None for reason in why.values())
    if name in NO_CUSTOM_KERNEL:
        assert not covered, (f"{name} now runs on {[b for b, r in why.items() if r is None]}: remove it "
                             "from NO_CUSTOM_KERNEL")
    else:
        assert covered, f"{name} has no custom kernel on CUDA ({why}); add a kernel or list it in NO_CUSTOM_KERNEL"


def test_every_listed_encoding_is_registered_and_has_a_reason():
    assert set(NO_CUSTOM_KERNEL) <= set(available_encodings())
    assert all(len(why) > 20 and "issue" in why for why in NO_CUSTOM_KERNEL.values())
