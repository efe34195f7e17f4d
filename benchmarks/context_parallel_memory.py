"""Per-rank peak memory of a TinyGPT training step under context parallelism (issue 27).

``python -m benchmarks.context_parallel_memory [--n 8192] [--grid ...]`` runs, in gloo CPU
processes with one thread each, one forward + backward of TinyGPT on a sequence of N tokens:
1 rank on the whole sequence (no context parallelism) and 2 ranks (``ContextParallel(2)``'s path:
each rank its head-tail shard, keys gathered). The measure is the allocator's: the peak of the
bytes allocated during the step over what was live before it (`benchmarks.memory.peak_allocated_bytes`,
the profiler's allocation events). Then, for a fixed budget (1 rank's peak at ``--budget-n``), the
longest N of ``--grid`` whose step fits it, for 1 and for 2 ranks. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch
import torch.nn.functional as F


def _model(n: int, args: argparse.Namespace):
    from posenc_lightning.models.tinygpt import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads, max_seq_len=n,
                   encoding=args.encoding)


def _step_peak(n: int, world: int, args: argparse.Namespace) -> int:
    from benchmarks.memory import peak_allocated_bytes
    from posenc_lightning.parallel.group import ContextParallelGroup, engaged

    model = _model(n, args)
    x = torch.randint(0, 256, (1, n))
    y = torch.randint(0, 256, (1, n))
    group = ContextParallelGroup.from_world(world) if world > 1 else None

    def step() -> None:
        if group is None:
            F.cross_entropy(model(x).transpose(1, 2), y).backward()
            return
        layout = group.layout(n // world)
        with engaged(model, group):
            F.cross_entropy(model(layout.shard(x)).transpose(1, 2), layout.shard(y)).backward()

    step()  # warm: caches and gradients' buffers are not the step's memory
    model.zero_grad(set_to_none=False)
    return peak_allocated_bytes(step)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, q) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for n in sorted({args.n, *args.grid}):
        peak = torch.tensor([_step_peak(n, world, args)], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the largest rank's peak
        out[n] = float(peak) / 2**20
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def _run(world: int, args: argparse.Namespace) -> dict[int, float]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(_worker, args=(world, port, args, q), nprocs=world, start_method="spawn")
    return q.get()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--grid", type=int, nargs="+", default=[4096, 6144, 7168, 8192])
    p.add_argument("--budget-n", type=int, default=4096)
    p.add_argument("--encoding", default="rope")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    a = p.parse_args(argv)
    one, two = _run(1, a), _run(2, a)
    budget = one[a.budget_n]
    fits = {w: max((n for n, v in res.items() if v <= budget), default=None) for w, res in ((1, one), (2, two))}
    print(json.dumps({"config": vars(a), "peak_mib": {"1": one, "2": two},
                      "ratio_at_n": two[a.n] / one[a.n], "budget_mib": budget,
                      "longest_n_within_budget": fits}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
