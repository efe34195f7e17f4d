"""Flush-to-zero of denormal floats on CPU around code of the user's own, such as a model they
compiled.

Biased softmax weights decay into the denormal range (below ~1e-38 in float32), where x86 CPU
arithmetic is many times slower. The ``sdpa`` backend's biased calls and the blockwise normalizers
flush them inside their own calls, but ``torch.compile`` cannot change the setting inside a graph,
so a compiled model needs it set around the graph: `flush_denormals` around a block (forward and
backward), `call_flushing_denormals` around one call and, later, its backward (TinyGPT's
``compile_forward`` uses it). Both do nothing on other devices' arithmetic: the setting is the
CPU's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from posenc_lightning.attention.backends.engine import denormals as _denormals
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.tunables import Tunables

__all__ = ["call_flushing_denormals", "flush_denormals"]


@contextlib.contextmanager
def flush_denormals() -> Iterator[bool]:
    """Flush denormal floats to zero on CPU inside the ``with`` block.

    Call it outside compiled code, around a compiled model's forward and backward::

        compiled = torch.compile(model)
        with posenc_lightning.flush_denormals():
            loss = compiled(x).square().mean()
            loss.backward()

    The setting reaches the calling thread and every thread of PyTorch's intra-op pool (where the
    pool is GNU OpenMP; elsewhere the calling thread's). Regions nest, and the backends' own
    switches leave the setting on inside one. On exit it is off
    again (PyTorch's default) unless an outer region is still open.

    Returns:
        A context manager; ``as`` binds whether this CPU supports flush-to-zero (False: nothing
        changes).
    """
    with _denormals._user_region() as supported:
        yield supported


def call_flushing_denormals(fn: Callable[..., Tensor], *args: object, tunables: Tunables | None = None) -> Tensor:
    """``fn(*args)`` with denormals flushed to zero on CPU, in the call and in its backward.

    For a LightningModule whose compiled forward runs in ``training_step`` while Lightning runs the
    backward elsewhere: the output carries an identity node that turns flush-to-zero on when the
    backward reaches it, and the end of the backward pass turns it off again.

    Args:
        fn: the callable, e.g. a ``torch.compile``-d module or function returning one tensor.
        *args: its arguments.
        tunables: `Tunables.flush_denormals` False turns the flush off (None: the defaults).

    Returns:
        ``fn(*args)``.
    """
    mode = Mode.now("cpu", tunables)  # the user's region, not an attention call: its own mode
    with _denormals._flush_denormals(mode):
        out = fn(*args)
    if mode.tunables.flush_denormals and torch.is_grad_enabled() and out.requires_grad and out.device.type == "cpu":
        out = _denormals._DenormalsOnForBackward.apply(out)
    return out
