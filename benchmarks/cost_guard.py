"""Cost guard: every encoding's attention-layer time as a ratio to nope, against stated bounds.

A small version of `benchmarks/run.py` in one process (interleaved repetitions, medians, one
thread; never absolute times). The bounds are generous for a shared 2-core machine but tight
enough to catch a lost fast path: ALiBi falling back to a dense N x N bias, rotary to chunk/cat,
a normalizer's backward computing on denormals. Run it before and after a change to a fast path:

    PYTHONPATH=. python -m benchmarks.cost_guard [--reps 5]

It prints the table (markdown) and exits 1 when a ratio is above its bound after a second
measurement of the offenders. Recorded runs: ``benchmarks/results/cost-guard-*.md``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.harness import interleaved_medians, layer_encoding, layer_fns, make_layer
from posenc_lightning.encodings.registry import available_encodings

N, D_MODEL, HEADS = 512, 128, 4
#: layer forward / nope's layer forward. Fast paths get their own (tighter) bounds.
FWD_BOUND = {"rope": 1.8, "alibi": 1.8, "relative_bias": 2.5, "sinusoidal": 1.5, "learned": 1.5}
#: learned rotations: the eigenbasis path (1.1-1.2x nope at N=1024; the per-token matrix_exp it
#: replaced was 10.6x / 1.6x)
SLOW_BOUND = {"liere": 3.0, "comrope": 3.0}
#: content-dependent biases computed by blocks of rows (FIRE past its threshold: the MLP per pair,
#: `encodings.fire.functions.fire_rows`; CoPE's gates; the mixture's table + FIRE), forward and
#: forward+backward, measured here 1.06 / 1.53 (fire, a table below L at N=512), 2.37 / 2.84
#: (fire past L; 2.87 / 5.15 before its rows Function), 6.1 / 5.0 (cope: at N=512 its clamped-key
#: skip saves little; 1.83x at N=4096), 1.12 / 1.65 (mixture); with a dense bias they were 8-14x
ROWS_BOUND = {"fire": {"fwd": 2.5, "fwd_bwd": 3.5}, "fire:init_L=64": {"fwd": 4.0, "fwd_bwd": 4.5},
              "cope": {"fwd": 12.0, "fwd_bwd": 12.0}, "mixture": {"fwd": 2.5, "fwd_bwd": 3.5}}
#: configured variants measured too (the default FIRE at N=512 is below its threshold: a table)
VARIANTS = ["fire:init_L=64"]
#: encodings that replace softmax, on the blockwise backend (forward and forward+backward): measured
#: 2.0-2.6x here (tiles of 128 x 256 are few and small at N=512), 1.4-1.9x at N=4096; on the eager
#: backend with N x N weights they were 9-20x nope at N=1024
NORMALIZER_BOUND = {"sba": 4.0, "rse": 5.0, "exposb": 4.0}
#: everything else on the sdpa backend; and other encodings that replace softmax (eager backend)
DEFAULT_BOUND, EAGER_BOUND = 6.0, 40.0
#: layer forward+backward / nope's
FWD_BWD_BOUND = {"rope": 2.0, "alibi": 2.5, "relative_bias": 4.0, "fox": 2.5}


def _bound(name: str, stages: frozenset, metric: str) -> float:
    if name in NORMALIZER_BOUND:
        return NORMALIZER_BOUND[name]
    if name in ROWS_BOUND:
        return ROWS_BOUND[name][metric]
    table = FWD_BOUND if metric == "fwd" else FWD_BWD_BOUND
    if name in table:
        return table[name]
    if name in SLOW_BOUND:
        return SLOW_BOUND[name]
    return EAGER_BOUND if "normalize" in stages else DEFAULT_BOUND


def _measure(names: list[str], x: torch.Tensor, reps: int) -> dict[tuple, float]:
    fns = {}
    for name in names:
        f = layer_fns(make_layer(name, D_MODEL, HEADS, N), x)
        fns[(name, "fwd")] = f["fwd"]
        if name in FWD_BWD_BOUND or name in NORMALIZER_BOUND or name in ROWS_BOUND or name == "nope":
            fns[(name, "fwd_bwd")] = f["fwd_bwd"]
    return interleaved_medians(fns, reps, warmup=1)


def ratios(names: list[str], reps: int) -> tuple[dict[tuple, float], dict[str, frozenset]]:
    """``{(name, metric): time / nope's}`` and each encoding's stages, at N, one thread."""
    torch.manual_seed(0)
    x = torch.randn(1, N, D_MODEL)
    stages = {n: layer_encoding(make_layer(n, D_MODEL, HEADS, N)).stages for n in names}
    med = _measure(["nope", *names], x, reps)
    return {k: t / med[("nope", k[1])] for k, t in med.items() if k[0] != "nope"}, stages


def over_bound(ratio: dict[tuple, float], stages: dict[str, frozenset]) -> dict[tuple, float]:
    """The ratios above their bound."""
    return {k: r for k, r in ratio.items() if r > _bound(k[0], stages[k[0]], k[1])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    names = [n for n in available_encodings() if n != "nope"] + VARIANTS
    ratio, stages = ratios(names, args.reps)
    bad = over_bound(ratio, stages)
    if bad:  # the offenders once more, next to nope, before calling it a regression
        again, _ = ratios(sorted({n for n, _ in bad}), args.reps + 2)
        ratio.update(again)
        bad = over_bound(again, stages)
    print(f"| encoding | metric | time / nope (N={N}) | bound |\n|---|---|---|---|")
    for (n, m), r in sorted(ratio.items()):
        flag = " **over**" if (n, m) in bad else ""
        print(f"| {n} | {m} | {r:.2f}{flag} | {_bound(n, stages[n], m)} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
