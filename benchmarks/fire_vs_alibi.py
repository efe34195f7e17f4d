"""One attention layer's forward+backward with FIRE against ALiBi (and `nope`), on CPU, in one process:
``python benchmarks/fire_vs_alibi.py --threads 1 --reps 7``.

The encodings are interleaved in every repetition (the machine is shared: a slow stretch hits all of
them) and the medians are printed, with FIRE's median over ALiBi's (issue 45's bar: at most 1.3x at
N 2048) and the median of the repetitions' own ratios (``_paired``). Run from a checkout's root to time that checkout (the package is imported from the current
directory), so that a base and a branch can be timed alternately with the same script.
``--torch-path`` adds ``fire_torch``: FIRE with its compiled segment pass off (``Tunables(fire_native=False)``).
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
from posenc_lightning.functional.tunables import Tunables


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--encodings", nargs="+", default=["nope", "alibi", "fire"])
    p.add_argument("--torch-path", action="store_true", help="also time FIRE on its torch path (fire_torch)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    x, _ = bench_inputs(a.n, a.d_model, 0, torch.device("cpu"))
    fns = {e: layer_fns(make_layer(e, a.d_model, a.n_heads, a.n), x)["fwd_bwd"] for e in a.encodings}
    if a.torch_path:
        layer = make_layer("fire", a.d_model, a.n_heads, a.n)
        for m in layer.modules():
            if hasattr(m, "posenc_tunables"):
                m.posenc_tunables = Tunables(fire_native=False)
        fns["fire_torch"] = layer_fns(layer, x)["fwd_bwd"]
    for f in fns.values():  # warm-up
        f()
    times: dict[str, list[float]] = {e: [] for e in fns}
    load = loadavg()
    for _ in range(a.reps):
        for e, f in fns.items():
            t = time.perf_counter()
            f()
            times[e].append(time.perf_counter() - t)
    med = {e: statistics.median(v) * 1e3 for e, v in times.items()}
    out = {"threads": a.threads, "n": a.n, "reps": a.reps, "median_ms": {e: round(m, 1) for e, m in med.items()},
           "load_before": load, "load_after": loadavg()}
    for name in ("fire", "fire_torch"):
        if name in med and "alibi" in med:
            out[f"{name}_over_alibi"] = round(med[name] / med["alibi"], 3)
            # the median of each repetition's ratio: the two timed moments apart, so a slow stretch
            # of a shared machine that spans several repetitions moves it less than the medians
            out[f"{name}_over_alibi_paired"] = round(statistics.median(
                f / a for f, a in zip(times[name], times["alibi"])), 3)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
