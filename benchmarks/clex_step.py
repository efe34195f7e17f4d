"""One attention layer's training step with CLEX on CPU: forward+backward after an update of the
ODE's parameters (so a cached solve cannot be reused), timed (medians) and its operators counted
(`benchmarks.threads.dispatched_ops`), next to rope: ``python benchmarks/clex_step.py --n 512 4096``.

Run from a checkout's root to measure that checkout (the package is imported from the current
directory), so that a base and a branch can be compared with the same script (issue 49).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

import torch

from benchmarks.harness import bench_inputs, layer_fns, loadavg, make_layer
from benchmarks.threads import dispatched_ops


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--n", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-heads", type=int, default=4)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    out: dict = {"loadavg": loadavg(), "threads": a.threads}
    for n in a.n:
        x, _ = bench_inputs(n, a.d_model, 0, torch.device("cpu"))
        for enc in ("rope", "clex"):
            layer = make_layer(enc, a.d_model, a.n_heads, n)
            fwd_bwd = layer_fns(layer, x)["fwd_bwd"]
            params = [q for name, q in layer.named_parameters() if "ode_" in name]

            def step(params: list = params, fwd_bwd=fwd_bwd) -> None:
                with torch.no_grad():  # an optimizer step: the parameters' versions change
                    for q in params:
                        q.add_(0.0)
                fwd_bwd()

            step()
            times = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            ops = sum(dispatched_ops(step).values())
            out[f"{enc} N={n}"] = {"ms": round(statistics.median(times) * 1e3, 2), "ops": ops}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
