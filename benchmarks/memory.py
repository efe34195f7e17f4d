"""Peak memory of one step, per encoding, in a fresh process: ``python -m benchmarks.memory``.

CPU: the peak resident set (``VmHWM``) of this process during the step minus the resident set
just before it. The peak is reset through ``/proc/self/clear_refs`` before every step, and glibc
is told to give every block above 64 KiB its own mapping (``mallopt(M_MMAP_THRESHOLD)``) and to
trim after each step, so freed tensors leave the resident set and each step is measured on its
own. It counts everything the step touches (tensors, allocator slack, thread stacks), so it is an
honest upper bound of the step's tensor memory. GPU: ``torch.cuda.max_memory_allocated`` delta.
Prints one JSON object ``{encoding: {metric: MiB}}``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import re

import torch

from benchmarks.harness import bench_inputs, gpt_fns, layer_fns, make_gpt, make_layer

_libc = None


def _setup_allocator() -> None:
    global _libc
    try:
        _libc = ctypes.CDLL("libc.so.6")
        _libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except OSError:
        _libc = None


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) / 1024


def peak_mib(fn, device: torch.device) -> float:
    """Extra memory at the peak of ``fn()`` over what was resident before it."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    if _libc is not None:
        _libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _rss_mib("VmRSS")
    fn()
    return _rss_mib("VmHWM") - base


def peak_allocated_bytes(fn) -> int:
    """Peak of the bytes allocated through the CPU allocator during ``fn()``, over what was live
    before it: the profiler's allocation and free events (``profile_memory``) in order, summed.
    Counts tensors (inside kernels too), not allocator slack or stacks; deterministic for a given
    code path, so it can be compared within one process without timing anything."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--encodings", nargs="+", required=True)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--no-gpt", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="seed of the input (the work of a step depends on it)")
    a = p.parse_args(argv)
    _setup_allocator()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out: dict[str, dict[str, float]] = {}
    x, ids = bench_inputs(a.n, a.d_model, a.seed, dev)
    for name in a.encodings:
        res: dict[str, float] = {}
        try:
            layer = make_layer(name, a.d_model, a.n_heads, a.n).to(dev)
            fns = layer_fns(layer, x)
            for m in ("fwd", "fwd_bwd"):
                fns[m]()  # warm: lazily built caches and parameters are not the step's memory
                res[f"layer_{m}"] = peak_mib(fns[m], dev)
            del layer, fns
            if not a.no_gpt:
                gpt = make_gpt(name, a.d_model, a.n_heads, a.n_layers, a.n).to(dev)
                f = gpt_fns(gpt, ids)["fwd_bwd"]
                f()
                res["gpt_fwd_bwd"] = peak_mib(f, dev)
                del gpt, f
        except Exception as e:  # noqa: BLE001 - reported in the table
            res["error"] = f"{type(e).__name__}: {e}"[:200]
        out[name] = res
    print(json.dumps(out))


if __name__ == "__main__":
    main()
