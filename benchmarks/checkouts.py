"""Two commits' layer step against ``nope``, paired: each commit checked out in its own worktree, one
process per commit, the processes alternated (``--rounds``), so that both see the same machine state.

In each process every repetition times ``nope``, the encoding, ``nope`` on one attention layer's
forward+backward (`harness.make_layer`); the ratio is the encoding's time over the mean of its two
nopes, and the process reports the median of ``--reps``. A change worth a few percent is then read
against the spread of the rounds, not against a record made on another day or machine.

    OMP_NUM_THREADS=2 python benchmarks/checkouts.py 3a32de3 HEAD --encodings cope mixture --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(root: str, encodings: list[str], n: int, d_model: int, heads: int, reps: int) -> dict[str, float]:
    """Median paired ratios to nope, with the package and harness of the checkout at ``root``."""
    sys.path.insert(0, root)
    import torch

    import posenc_lightning
    from benchmarks.harness import layer_fns, make_layer

    if not Path(posenc_lightning.__file__).resolve().is_relative_to(Path(root).resolve()):
        raise RuntimeError(f"imported {posenc_lightning.__file__}, not the checkout at {root}")
    # `harness.bench_inputs(n, d_model, 0)`'s input, drawn here: an older checkout's harness lacks it
    x = torch.randn(1, n, d_model, generator=torch.Generator().manual_seed(0))
    steps = {e: layer_fns(make_layer(e, d_model, heads, n), x)["fwd_bwd"] for e in ["nope", *encodings]}
    for step in steps.values():
        step()
        step()

    def seconds(step) -> float:
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0

    ratios: dict[str, list[float]] = {e: [] for e in encodings}
    for _ in range(reps):
        for e in encodings:
            before, own, after = seconds(steps["nope"]), seconds(steps[e]), seconds(steps["nope"])
            ratios[e].append(2 * own / (before + after))
    return {e: statistics.median(v) for e, v in ratios.items()}


def compare(revs: list[str], encodings: list[str], rounds: int, **sizes: int) -> dict[str, list[dict[str, float]]]:
    """``{rev: [ratios of each round]}``, each rev in a detached worktree removed afterwards. A rev
    given twice (an A/A comparison: the noise alone) is labelled ``rev#i`` by its place."""
    labels = [rev if revs.count(rev) == 1 else f"{rev}#{i + 1}" for i, rev in enumerate(revs)]
    out: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for i, (label, rev) in enumerate(zip(labels, revs)):
            trees[label] = str(Path(tmp) / f"tree{i}")
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", trees[label], rev], check=True)
        try:
            for _ in range(rounds):
                for label in labels:
                    cmd = [sys.executable, __file__, "--child", trees[label], "--encodings", *encodings,
                           *(f"--{k.replace('_', '-')}={v}" for k, v in sizes.items())]
                    done = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=tmp)
                    out[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", tree], check=False)
    return out


def markdown(results: dict[str, list[dict[str, float]]], encodings: list[str]) -> str:
    """One row per commit: each encoding's ratio in every round."""
    lines = ["| commit | " + " | ".join(encodings) + " |", "|---|" + "---|" * len(encodings)]
    for rev, rounds in results.items():
        cells = [", ".join(f"{r[e]:.3f}" for r in rounds) for e in encodings]
        lines.append(f"| {rev} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("revs", nargs="*", help="commits to compare (git revisions)")
    p.add_argument("--encodings", nargs="+", default=["cope", "mixture", "fire"])
    p.add_argument("--rounds", type=int, default=2, help="processes per commit, alternated")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.encodings, a.n, a.d_model, a.heads, a.reps)))
        return
    if len(a.revs) < 2:
        p.error("give two or more commits, e.g. `3a32de3 HEAD`")
    results = compare(a.revs, a.encodings, a.rounds, reps=a.reps, n=a.n, d_model=a.d_model, heads=a.heads)
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(f"One layer fwd+bwd / nope (N {a.n}, d_model {a.d_model}, {a.heads} heads), OMP_NUM_THREADS={threads}, "
          f"median of {a.reps} a round, {a.rounds} rounds:\n")
    print(markdown(results, a.encodings))


if __name__ == "__main__":
    main()
