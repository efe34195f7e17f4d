"""Cost of every registered encoding against ``nope``: ``python benchmarks/run.py [--quick]``.

For each length: forward and forward+backward time of one attention layer (embed stage +
TinyGPT attention, B=1) and of a TinyGPT, as ratios to ``nope`` measured in the same process
(encodings interleaved in every repetition, medians); the encoding's share of the layer forward;
and the peak memory of one step (measured in a fresh process, see benchmarks/memory.py).
Writes ``benchmarks/results/<device>-<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch

from benchmarks.harness import (
    bench_inputs,
    gpt_fns,
    interleaved_medians,
    layer_encoding,
    layer_fns,
    loadavg,
    machine,
    make_gpt,
    make_layer,
    stage_fn,
)
from posenc_lightning.attention.backends import resolve_backend
from posenc_lightning.encodings.registry import available_encodings

#: the seed guide's "encoding time as a share of the forward" at seq 4096 (000, "Computational Overhead")
SEED_SHARE = {"nope": 0.0, "sinusoidal": 0.008, "learned": 0.008, "rope": 0.024, "alibi": 0.016,
              "fire": 0.041, "yarn": 0.024, "clex": 0.098}
#: configured variants timed beside the registered encodings by default: rope in the RoFormer /
#: Meta layout (one complex multiply), FIRE with its threshold at 4096 (every query below L: the
#: bias is a function of i - j, a table of 2N - 1 distances instead of N x N MLP calls)
VARIANTS = ["rope:layout=interleaved", "fire:init_L=4096"]


def time_length(names: list[str], n: int, a: argparse.Namespace, log) -> dict[str, dict]:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, ids = bench_inputs(n, a.d_model, a.seed, dev)
    info: dict[str, dict] = {}
    fns: dict[tuple, object] = {}
    for name in names:
        try:
            layer = make_layer(name, a.d_model, a.n_heads, n).to(dev)
            enc = layer_encoding(layer)
            info[name] = {"stages": "+".join(sorted(enc.stages)) or "-",
                          "backend": resolve_backend("auto", enc, dev, True).NAME}
            lf = layer_fns(layer, x)
            fns[(name, "layer_fwd")] = lf["fwd"]
            fns[(name, "layer_fwd_bwd")] = lf["fwd_bwd"]
            fns[(name, "stage")] = stage_fn(layer, x, sync=torch.cuda.synchronize if dev.type == "cuda" else
                                            lambda: None)
            if not a.no_gpt:
                gf = gpt_fns(make_gpt(name, a.d_model, a.n_heads, a.n_layers, n).to(dev), ids)
                fns[(name, "gpt_fwd")] = gf["fwd"]
                fns[(name, "gpt_fwd_bwd")] = gf["fwd_bwd"]
            for key in [k for k in fns if k[0] == name]:
                fns[key]()  # smoke-run: an encoding that fails is reported, not fatal
        except Exception as e:  # noqa: BLE001
            info[name] = {"error": f"{type(e).__name__}: {e}"[:160]}
            fns = {k: v for k, v in fns.items() if k[0] != name}
            log(f"  {name}: {info[name]['error']}")

    def sync_wrap(f):
        if dev.type != "cuda":
            return f
        return lambda: (f(), torch.cuda.synchronize())[0]  # a self-timed callable's time passes through

    t0 = time.perf_counter()
    med = interleaved_medians({k: sync_wrap(v) for k, v in fns.items()}, a.reps, warmup=0, budget_s=a.budget)
    log(f"  N={n}: timed {len(fns)} callables in {time.perf_counter() - t0:.0f}s")
    for (name, metric), t in med.items():
        info[name][metric] = t
    return info


def memory_length(names: list[str], n: int, a: argparse.Namespace) -> dict[str, dict]:
    cmd = [sys.executable, "-m", "benchmarks.memory", "--n", str(n), "--d-model", str(a.d_model),
           "--n-heads", str(a.n_heads), "--n-layers", str(a.n_layers), "--seed", str(a.seed), "--encodings", *names]
    if a.no_gpt or a.no_gpt_memory:
        cmd.append("--no-gpt")
    r = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if r.returncode:
        return {nm: {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "failed"} for nm in names}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _ratio(info: dict, name: str, metric: str) -> str:
    base = info.get("nope", {}).get(metric)
    val = info.get(name, {}).get(metric)
    if base is None or val is None:
        return "-"
    return f"{val / base:.2f}"


def render(results: dict, a: argparse.Namespace, meta: dict) -> str:
    lines = [f"# Encoding cost vs `nope` ({meta['date']})", "",
             f"- machine: {meta['machine']}",
             f"- command: `{meta['command']}`",
             f"- load average (1/5/15 min) before: {meta['load_before']}, after: {meta['load_after']}",
             (f"- shapes: B=1, d_model={a.d_model}, {a.n_heads} heads (head_dim {a.d_model // a.n_heads}); "
             f"TinyGPT {a.n_layers} layers; reps={a.reps} interleaved, medians; backend `auto`; input seed {a.seed}"),
             "- time columns: median time / median time of `nope` in the same process (1.00 = free).",
             ("- share = layer fwd ratio - 1: the encoding's time as a share of the no-encoding attention "
             "forward; stage = the encoding's own work alone (embed, rotate, the bias description and the "
             "computation of the bias values a backend reads, not the attention; q/k in cache as inside "
             "the layer) / nope layer fwd: the seed guide's 'encoding time / attention time'."),
             ("- memory: peak extra resident memory of one step in a fresh process (benchmarks/memory.py; "
             "MiB, and x nope)."), ""]
    for n, (info, mem) in results.items():
        nope_t = info.get("nope", {}).get("layer_fwd")
        lines += [f"## N = {n}", "",
                  f"nope: layer fwd {1e3 * nope_t:.1f} ms" if nope_t else "", "",
                  ("| encoding | stages | backend | layer fwd | layer fwd+bwd | gpt fwd | gpt fwd+bwd | share | "
                  "stage | seed share | mem layer fwd | mem layer fwd+bwd | mem gpt fwd+bwd |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name in info:
            i = info[name]
            if "error" in i:
                lines.append(f"| {name} | error: {i['error']} |" + " |" * 11)
                continue
            share = (i["layer_fwd"] / nope_t - 1) if nope_t else None
            stage = i.get("stage", 0) / nope_t if nope_t else None
            seed = SEED_SHARE.get(name)
            mm = mem.get(name, {})
            mn = mem.get("nope", {})

            def mcell(metric: str, mm: dict = mm, mn: dict = mn) -> str:
                if metric not in mm:
                    return mm.get("error", "-")[:40] if metric == "layer_fwd" else "-"
                r = f" ({mm[metric] / mn[metric]:.2f}x)" if mn.get(metric) else ""
                return f"{mm[metric]:.0f}{r}"

            lines.append(
                f"| {name} | {i['stages']} | {i['backend']} | {_ratio(info, name, 'layer_fwd')} | "
                f"{_ratio(info, name, 'layer_fwd_bwd')} | {_ratio(info, name, 'gpt_fwd')} | "
                f"{_ratio(info, name, 'gpt_fwd_bwd')} | {share:+.1%} | {stage:.1%} | "
                f"{'-' if seed is None else f'{seed:.1%}'} | {mcell('layer_fwd')} | {mcell('layer_fwd_bwd')} | "
                f"{mcell('gpt_fwd_bwd')} |")
        lines.append("")
    lines += checks(results)
    return "\n".join(lines)


def checks(results: dict) -> list[str]:
    """The issue's bars at the longest length measured: the seed guide's overhead shares, and
    bias encodings' peak memory (layer fwd+bwd) <= 1.2x nope's."""
    n = max(results)
    info, mem = results[n]
    nope_t = info.get("nope", {}).get("layer_fwd")
    out = [f"## Checks at N = {n}", "",
           "| check | encoding | measured | bar | met |", "|---|---|---|---|---|"]
    for name, seed in SEED_SHARE.items():
        i = info.get(name, {})
        if name == "nope" or not nope_t or "layer_fwd" not in i:
            continue
        share, stage = i["layer_fwd"] / nope_t - 1, i.get("stage", 0) / nope_t
        out.append(f"| whole layer fwd vs nope | {name} | {share:+.1%} | {seed:.1%} | "
                   f"{'yes' if share <= seed else 'no'} |")
        out.append(f"| encoding time / nope fwd (the seed's measure) | {name} | {stage:.1%} | {seed:.1%} | "
                   f"{'yes' if stage <= seed else 'no'} |")
    base = mem.get("nope", {}).get("layer_fwd_bwd")
    for name, i in info.items():
        if "bias" not in i.get("stages", "").split("+"):
            continue
        m = mem.get(name, {}).get("layer_fwd_bwd")
        if base and m is not None:
            out.append(f"| peak memory layer fwd+bwd / nope | {name} | {m / base:.2f}x | 1.20x | "
                       f"{'yes' if m / base <= 1.2 else 'no'} |")
        else:
            out.append(f"| peak memory layer fwd+bwd / nope | {name} | not measured | 1.20x | no |")
    return out + [""]


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="N=256, 512; 5 reps; small model (a smoke run)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--encodings", nargs="+", default=None,
                   help="default: every registered encoding and VARIANTS; a configured variant as "
                        "name:key=value,... (e.g. rope:layout=interleaved)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--budget", type=float, default=None, help="seconds per length before stopping repetitions")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--no-gpt", action="store_true")
    p.add_argument("--gpt-lengths", type=int, nargs="+", default=None,
                   help="lengths at which TinyGPT is timed too (default: all)")
    p.add_argument("--max-ratio", type=float, default=None,
                   help="skip, at the longer lengths, encodings whose layer fwd ratio was above this at the "
                        "previous length (reported as skipped)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--no-gpt-memory", action="store_true", help="memory of the layer only")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the input (data-dependent encodings do more or less work per input)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.lengths, a.reps, a.d_model, a.n_heads = [256, 512], 5, 128, 4
    names = a.encodings or available_encodings() + VARIANTS
    names = ["nope"] + [nm for nm in names if nm != "nope"]
    def log(s):
        return print(s, file=sys.stderr, flush=True)
    meta = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
            "command": "python benchmarks/run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "load_before": loadavg()}
    if a.threads:
        torch.set_num_threads(a.threads)
    meta["machine"] = machine()
    dev_name = "cuda" if torch.cuda.is_available() else "cpu"
    partial_out = a.out or ROOT / "benchmarks" / "results" / (
        f"{dev_name}-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M}{'-quick' if a.quick else ''}.md")
    partial_out.parent.mkdir(parents=True, exist_ok=True)
    results = {}
    skipped: dict[str, str] = {}
    no_gpt = a.no_gpt
    for n in a.lengths:
        a.no_gpt = no_gpt or (a.gpt_lengths is not None and n not in a.gpt_lengths)
        run_names = [nm for nm in names if nm not in skipped]
        log(f"N={n}: timing {len(run_names)} encodings")
        info = time_length(run_names, n, a, log)
        mem = {} if a.no_memory else memory_length([nm for nm in run_names if "error" not in info[nm]], n, a)
        for nm, why in skipped.items():
            info[nm] = {"error": why}
        results[n] = (info, mem)
        if partial_out is not None:  # a long run leaves what it has measured so far
            meta["load_after"] = loadavg()
            partial_out.write_text(render(results, a, meta) + "\n")
        if a.max_ratio and "layer_fwd" in info.get("nope", {}):
            for nm in run_names:
                r = info[nm].get("layer_fwd", 0) / info["nope"]["layer_fwd"]
                if r > a.max_ratio:
                    skipped[nm] = f"skipped: {r:.1f}x nope at N={n} (> --max-ratio {a.max_ratio})"
    meta["load_after"] = loadavg()
    text = render(results, a, meta)
    out = partial_out
    out.write_text(text + "\n")
    print(text)
    log(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
