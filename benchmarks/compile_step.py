"""Compiled vs eager TinyGPT training step on this machine (forward, backward, AdamW step).

    python benchmarks/compile_step.py [--encodings rope alibi fire fox] [--seq-len 512] [--threads 1]
    python benchmarks/compile_step.py --from-config configs/fire_train.yaml   # the recipes' sizes
    python benchmarks/compile_step.py --encodings fire:init_L=4096 fire:init_L=128   # an encoding's arguments

``TinyGPT(compile=True)`` (inductor, the forward without a cache) against the same model eager, the
two interleaved in every repetition (medians), after warm-up steps that include the compilation
(reported separately). Writes ``benchmarks/results/compile-<device>-<date>.md`` with the command.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import machine, parse_spec
from posenc_lightning.models.tinygpt import TinyGPT


def _step(model: TinyGPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    t = time.perf_counter()
    loss = model.token_nll(x, y).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def measure(spec: str, args: argparse.Namespace) -> dict:
    name, cfg = parse_spec(spec)  # e.g. fire:init_L=128 (FIRE's threshold decides its form at a length)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.batch, args.seq_len), generator=g)
    y = torch.randint(0, 256, (args.batch, args.seq_len), generator=g)
    runs = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        m = TinyGPT(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads, max_seq_len=args.seq_len,
                    encoding=name, encoding_cfg=cfg or None, compile=compiled)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            _step(m, opt, x, y)
        runs[compiled] = {"model": m, "opt": opt, "warmup_s": time.perf_counter() - t0, "times": []}
    for rep in range(args.reps):  # interleaved: a load change slows both alike
        # the order alternates, so that whatever the first step of a pair leaves the second (freed
        # pages, caches) does not favour one side
        for compiled in ((False, True) if rep % 2 == 0 else (True, False)):
            r = runs[compiled]
            r["times"].append(_step(r["model"], r["opt"], x, y))
    eager, comp = (statistics.median(runs[c]["times"]) for c in (False, True))
    # each rep's pair ran back to back: its ratio is free of slow load drifts
    pairs = sorted(e / c for e, c in zip(runs[False]["times"], runs[True]["times"]))
    q1, _, q3 = statistics.quantiles(pairs, n=4)
    return {"encoding": spec, "eager_ms": 1e3 * eager, "compiled_ms": 1e3 * comp, "speedup": eager / comp,
            "pair_median": statistics.median(pairs), "pair_q1": q1, "pair_q3": q3,
            "faster": sum(r > 1 for r in pairs), "reps": len(pairs),
            "compile_warmup_s": runs[True]["warmup_s"], "eager_warmup_s": runs[False]["warmup_s"]}


def _keep_heap() -> str:
    """glibc: large blocks from the heap, never returned to the system (``mallopt``, as the
    ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_TOP_PAD_`` variables), so that
    a step's multi-MiB temporaries do not land on fresh pages, whose faults differ with what else
    the process holds and so make two timings of the same code differ."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    ok = all(libc.mallopt(k, v) for k, v in ((m_mmap_threshold, 2**30), (m_trim_threshold, 2**31 - 1),
                                               (m_top_pad, 2**28)))
    return "glibc heap kept (mallopt: mmap threshold 1 GiB, no trim, top pad 256 MiB)" if ok else "mallopt failed"


def _sizes_from(args: argparse.Namespace, path: Path) -> None:
    """The model's sizes and the batch of a recipe's YAML (its ``model`` and ``data`` sections)."""
    import yaml

    cfg = yaml.safe_load(path.read_text())
    model, data = cfg.get("model", {}), cfg.get("data", {})
    for arg, section, key in (("d_model", model, "d_model"), ("n_layers", model, "n_layers"),
                              ("n_heads", model, "n_heads"), ("seq_len", data, "seq_len"),
                              ("batch", data, "batch_size")):
        if key in section:
            setattr(args, arg, int(section[key]))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--encodings", nargs="+", default=["rope", "alibi", "fire", "fox"])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--from-config", default=None, metavar="YAML",
                   help="take the model and batch sizes from a recipe's config (e.g. configs/fire_train.yaml)")
    p.add_argument("--keep-heap", action="store_true",
                   help="glibc: keep freed memory in the heap (no page faults on a step's temporaries)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.reps < 2:
        p.error(f"--reps {args.reps}: at least 2 (the paired ratios' quartiles)")
    allocator = _keep_heap() if args.keep_heap else "default"
    if args.from_config:
        _sizes_from(args, Path(args.from_config))
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    rows = [measure(n, args) for n in args.encodings]
    load1 = os.getloadavg()
    cmd = "python benchmarks/compile_step.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"# Compiled vs eager TinyGPT training step ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
             f"- machine: {machine()}", f"- command: `{cmd.strip()}`",
             (f"- load average (1/5/15 min) before: {' / '.join(f'{v:.1f}' for v in load0)}, "
             f"after: {' / '.join(f'{v:.1f}' for v in load1)}"),
             (f"- TinyGPT d_model={args.d_model}, {args.n_layers} layers, {args.n_heads} heads; batch {args.batch} x "
             f"{args.seq_len} tokens; one step = forward + backward + AdamW; {args.reps} interleaved reps (the order alternating), medians, "
             f"after {args.warmup} warm-up steps (the compiled model's include compiling)"),
             "- compiled: `TinyGPT(compile=True)` (torch.compile, inductor) on the default backend",
             f"- allocator: {allocator}", "",
             ("- paired: eager / compiled of each rep's back-to-back pair: median [quartiles], and in how many "
              "pairs the compiled step was the faster"), "",
             ("| encoding | eager step (ms) | compiled step (ms) | speedup | paired | compiled faster in | "
              "compile + warm-up (s) |"),
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['encoding']} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | {r['speedup']:.2f}x | "
              f"{r['pair_median']:.3f}x [{r['pair_q1']:.3f}, {r['pair_q3']:.3f}] | {r['faster']}/{r['reps']} | "
              f"{r['compile_warmup_s']:.1f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / (
        f"compile-{dev}-{datetime.now(timezone.utc):%Y%m%d-%H%M}.md")
    out.write_text(text)
    print(f"written {out}")


if __name__ == "__main__":
    main()
