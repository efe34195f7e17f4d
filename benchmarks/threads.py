"""How an encoding's layer step uses the intra-op threads: the operators of one forward+backward
large enough for PyTorch to split across threads (each a fork/join of the thread pool), beside the
step's time as a ratio to ``nope`` in the same process.

A step with many such operators pays the pool's wake-up and join cost once per operator, and that
cost depends on the machine and on how the OpenMP workers wait between regions
(``OMP_WAIT_POLICY``): compare the ratios under ``ACTIVE`` and ``PASSIVE`` to see how much of an
encoding's cost at two threads is that synchronisation rather than arithmetic.

    OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE python benchmarks/threads.py --out benchmarks/results/<dir>/x.md
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import bench_inputs, interleaved_medians, layer_fns, loadavg, machine, make_layer

#: ATen's ``at::internal::GRAIN_SIZE``: an element-wise or reduction operator over fewer elements
#: runs on the calling thread alone
GRAIN_SIZE = 32768
#: operators that only make views or metadata: no pass over the data
_VIEWS = frozenset({
    "_reshape_alias", "_unsafe_view", "alias", "as_strided", "detach", "diagonal", "expand", "imag",
    "narrow", "permute", "real", "select", "slice", "split", "split_with_sizes", "squeeze", "t",
    "transpose", "unbind", "unsqueeze", "view", "view_as_complex", "view_as_real", "empty", "empty_like",
    "empty_strided", "set_", "lift_fresh",
})


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a.copy_(b)`` with ``b`` the very elements of ``a`` (``t[i] += x`` writes back its own view):
    ATen returns before any pass over the data."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


class _Count(TorchDispatchMode):
    """Counts, per operator, the calls that read or write at least `GRAIN_SIZE` elements; and every
    operator dispatched, views included (``every``: each is a launch on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.large: collections.Counter[str] = collections.Counter()
        self.small = 0
        self.every: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        self.every[f"{func.namespace}::{name}"] += 1
        if name in _VIEWS or (name == "copy_" and _same_view(args[0], args[1])):
            return out
        outs = out if isinstance(out, (tuple, list)) else (out,)
        tensors = [t for t in (*args, *kwargs.values(), *outs) if isinstance(t, torch.Tensor)]
        if max((t.numel() for t in tensors), default=0) >= GRAIN_SIZE:
            self.large[name] += 1
        else:
            self.small += 1
        return out


def parallel_ops(fn: Callable[[], object]) -> tuple[collections.Counter[str], int]:
    """``(large, small)``: the operators ``fn`` dispatches that touch at least `GRAIN_SIZE` elements
    (per operator name: the ones the intra-op pool may split) and how many others it dispatches
    (view and allocation operators not counted)."""
    count = _Count()
    with count:
        fn()
    return count.large, count.small


def dispatched_ops(fn: Callable[[], object]) -> collections.Counter[str]:
    """Every operator ``fn`` dispatches (forward and backward alike, views and allocations
    included), by ``namespace::name``: on CUDA each is a kernel launch or at least a trip through
    the dispatcher from Python."""
    count = _Count()
    with count:
        fn()
    return count.every


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--encodings", nargs="+", default=["cope", "mixture", "fire", "rse", "exposb", "sba"])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--seed", type=int, default=0, help="seed of the input (the same input as run.py's)")
    p.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    a = p.parse_args(argv)
    x = bench_inputs(a.length, a.d_model, a.seed, torch.device("cpu"))[0]
    names = ["nope", *a.encodings]
    steps = {n: layer_fns(make_layer(n, a.d_model, a.n_heads, a.length), x)["fwd_bwd"] for n in names}
    times = interleaved_medians({(n,): step for n, step in steps.items()}, a.reps, warmup=1)
    # counted after the timing: the dispatch mode's Python hook must not shape the timed runs
    counts = {n: parallel_ops(step) for n, step in steps.items()}
    base = times[("nope",)]
    policy = os.environ.get("OMP_WAIT_POLICY")
    lines = [
        f"# Intra-op parallel operators of one layer step (N = {a.length}, d_model {a.d_model}, {a.n_heads} heads)",
        "",
        f"- machine: {machine()}",
        (f"- OMP_WAIT_POLICY: {policy or 'unset'}; load average {loadavg()}; medians of {a.reps} repetitions; "
         f"input seed {a.seed}"),
        f"- command: `OMP_NUM_THREADS={torch.get_num_threads()} {f'OMP_WAIT_POLICY={policy} ' if policy else ''}"
        + f"python benchmarks/threads.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        f"- nope: layer fwd+bwd {base * 1e3:.1f} ms",
        "",
        "| encoding | fwd+bwd / nope | operators >= 32768 elements | smaller operators | most frequent large |",
        "|---|---|---|---|---|",
    ]
    for n in names:
        large, small = counts[n]
        top = ", ".join(f"{k} {v}" for k, v in large.most_common(4))
        lines.append(f"| {n} | {times[(n,)] / base:.2f} | {sum(large.values())} | {small} | {top} |")
    text = "\n".join(lines) + "\n"
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
