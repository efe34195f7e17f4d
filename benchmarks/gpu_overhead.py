"""Every registered encoding against PyTorch's flash SDPA without an encoding, on one GPU.

For each length: forward and forward+backward time (CUDA events, median of ``--reps`` after
warm-up, bf16 by default) of one attention call through `PosEncAttentionMixin` (stage 1 added to
q for embedding encodings) with the backend ``auto`` picks, and with ``backend="triton"`` where
the Triton kernels take the encoding; as ratios to ``sdpa-flash`` (``F.scaled_dot_product_attention``
restricted to the flash kernel, causal, nothing injected) and to ``nope`` through the mixin.
A case slower than ``--max-ms`` at one length is not timed at the longer ones, and cases left
when ``--budget-s`` runs out are listed as not timed, so the run fits its slot in
benchmarks/gpu_check.sh.

    python benchmarks/gpu_overhead.py --lengths 1024 2048 4096 8192 16384 --out overhead.md
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.bench_triton import cuda_median_ms
from benchmarks.perf_layers import Layer

#: the issue's bars: fused kernels within this factor of flash SDPA without an encoding, at these
#: lengths, for these encodings; FIRE's overhead vs nope is compared with the seed guide's share
FUSED_BAR, BAR_LENGTHS, BAR_ENCODINGS, SEED_FIRE_SHARE = 1.2, (4096, 16384), ("rope", "alibi", "fire", "fox", "sba"), 0.041


def _fwd_bwd(fn: Callable[[], Tensor]) -> Callable[[], None]:
    return lambda: fn().backward(GRAD[0])


GRAD: list[Tensor] = []  # the cotangent of the current shape (one allocation per length)


def time_case(fn: Callable[[], Tensor], reps: int) -> tuple[float, float]:
    """(forward ms, forward+backward ms) of ``fn``."""
    with torch.no_grad():
        fwd = cuda_median_ms(fn, reps)
    return fwd, cuda_median_ms(_fwd_bwd(fn), reps)


def cases(names: list[str], backends: list[str], a: argparse.Namespace, n: int, device: str = "cuda"):
    """(label, backend asked for, backend resolved, callable) for the flash baseline and every case."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from posenc_lightning.attention.backends import get_backend, resolve_backend
    from posenc_lightning.inject import inject

    dev, dt = torch.device(device), getattr(torch, a.dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(a.batch, a.heads, n, a.head_dim, device=dev, dtype=dt, generator=g).requires_grad_()
               for _ in range(3))
    hidden = torch.randn(a.batch, n, a.heads * a.head_dim, device=dev, dtype=dt, generator=g)
    GRAD[:] = [torch.randn(a.batch, a.heads, n, a.head_dim, device=dev, dtype=dt, generator=g)]

    def flash() -> Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    yield "sdpa-flash", "nope", "flash", flash
    for name in names:
        for backend in backends:
            torch.manual_seed(0)
            layer = Layer(a.heads, a.head_dim, n)
            inject(layer, name)  # checked on the module's device: CPU, as the layer has no parameters
            layer.to(dev, dt)
            layer.posenc_backend = backend
            enc = layer.encoding
            if enc is None or not ({"rotate", "bias", "normalize"} & set(enc.stages)):
                chosen = "sdpa"
            else:
                if backend != "auto" and get_backend(backend).supports(enc, dev, True) is not None:
                    continue
                chosen = resolve_backend(backend, enc, dev, True).NAME
            if backend != "auto" and chosen != backend:
                continue
            yield name, backend, chosen, (lambda m=layer: m(q, k, v, hidden))


def run(a: argparse.Namespace, log: Callable[[str], None]) -> list[dict]:
    from posenc_lightning.encodings.registry import available_encodings

    names = a.encodings or available_encodings()
    names = ["nope"] + [n for n in names if n != "nope"]
    rows: list[dict] = []
    too_slow: dict[tuple[str, str], str] = {}
    start = time.perf_counter()
    for n in a.lengths:
        for label, backend, chosen, fn in cases(names, a.backends, a, n):
            row = {"n": n, "encoding": label, "backend": backend, "ran": chosen}
            key = (label, backend)
            if key in too_slow:
                row["note"] = too_slow[key]
            elif time.perf_counter() - start > a.budget_s:
                row["note"] = f"not timed: the {a.budget_s:.0f} s budget ran out"
            else:
                try:
                    row["fwd"], row["fwd_bwd"] = time_case(fn, a.reps)
                    if row["fwd_bwd"] > a.max_ms:
                        too_slow[key] = f"not timed: {row['fwd_bwd']:.0f} ms fwd+bwd at N={n} (> --max-ms {a.max_ms:g})"
                except torch.cuda.OutOfMemoryError:
                    row["note"] = "out of memory"
                    too_slow[key] = f"not timed: out of memory at N={n}"
                except Exception as e:  # noqa: BLE001 - a failing case is reported, the others still run
                    row["note"] = f"error: {type(e).__name__}: {e}"[:200]
            rows.append(row)
            log(_line(rows, row))
        torch.cuda.empty_cache()
    return rows


def _ratio(rows: list[dict], row: dict, base_enc: str, base_backend: str, metric: str) -> float | None:
    base = next((r for r in rows if r["n"] == row["n"] and r["encoding"] == base_enc
                 and r["backend"] == base_backend and metric in r), None)
    return row[metric] / base[metric] if base is not None and metric in row else None


def _fmt(x: float | None, pattern: str = "{:.2f}") -> str:
    return "-" if x is None else pattern.format(x)


def _line(rows: list[dict], r: dict) -> str:
    if "fwd" not in r:
        return f"| {r['n']} | {r['encoding']} | {r['backend']} | {r['ran']} | {r.get('note', '-')} |" + " |" * 5
    return (f"| {r['n']} | {r['encoding']} | {r['backend']} | {r['ran']} | {r['fwd']:.3f} | {r['fwd_bwd']:.3f} | "
            f"{_fmt(_ratio(rows, r, 'sdpa-flash', 'nope', 'fwd'))} | "
            f"{_fmt(_ratio(rows, r, 'sdpa-flash', 'nope', 'fwd_bwd'))} | "
            f"{_fmt(_ratio(rows, r, 'nope', 'auto', 'fwd'), '{:.3f}')} | "
            f"{_fmt(_ratio(rows, r, 'nope', 'auto', 'fwd_bwd'), '{:.3f}')} |")


def render(rows: list[dict], a: argparse.Namespace, device: str) -> str:
    """The markdown table of ``rows`` (`run`) and the issue's checks at `BAR_LENGTHS`."""
    head = [(f"## Encodings vs flash SDPA ({device}, {a.dtype}, B={a.batch}, H={a.heads}, "
            f"D={a.head_dim}, causal; ms, median of {a.reps})"), "",
            ("backend: asked for; ran: what it resolved to. x flash: time / `sdpa-flash` (no encoding); "
            "x nope: time / `nope` through the mixin with `auto`."), "",
            ("| N | encoding | backend | ran | fwd ms | fwd+bwd ms | fwd x flash | fwd+bwd x flash | fwd x nope "
            "| fwd+bwd x nope |"), "|---|---|---|---|---|---|---|---|---|---|"]
    checks = ["", (f"## Checks (fused kernels within {FUSED_BAR}x of flash SDPA; FIRE vs nope against the seed "
              f"guide's {SEED_FIRE_SHARE:.1%})"), "", "| N | case | measured | bar | met |", "|---|---|---|---|---|"]
    for r in rows:
        if r["n"] not in BAR_LENGTHS or r["encoding"] not in BAR_ENCODINGS:
            continue
        if r["backend"] == "triton":
            x = _ratio(rows, r, "sdpa-flash", "nope", "fwd_bwd")
            checks.append(f"| {r['n']} | {r['encoding']} triton fwd+bwd x flash | {_fmt(x)} | {FUSED_BAR} | "
                          f"{'-' if x is None else ('yes' if x <= FUSED_BAR else 'no')} |")
        if r["encoding"] == "fire":
            x = _ratio(rows, r, "nope", "auto", "fwd")
            share = None if x is None else x - 1
            checks.append(f"| {r['n']} | fire {r['backend']} ({r['ran']}) fwd vs nope | {_fmt(share, '{:+.1%}')} | "
                          f"{SEED_FIRE_SHARE:.1%} | {'-' if share is None else ('yes' if share <= SEED_FIRE_SHARE else 'no')} |")
    return "\n".join(head + [_line(rows, r) for r in rows] + checks) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--encodings", nargs="+", default=None, help="default: every registered encoding")
    p.add_argument("--backends", nargs="+", default=["auto", "triton"], choices=["auto", "sdpa", "flex", "triton",
                                                                               "blockwise", "eager"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-ms", type=float, default=250.0, help="fwd+bwd ms above which a case is not timed longer")
    p.add_argument("--budget-s", type=float, default=150.0, help="seconds of timing before the rest is listed as not timed")
    p.add_argument("--out", type=Path, default=None, help="write the markdown here too")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_overhead needs a CUDA GPU; none here", file=sys.stderr)
        return 2
    rows = run(a, lambda s: print(s, file=sys.stderr, flush=True))
    text = render(rows, a, torch.cuda.get_device_name())
    if a.out:
        a.out.write_text(text)
    print(text)
    return 1 if any(r.get("note", "").startswith("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
