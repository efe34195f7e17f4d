"""Speed of the bias / normalizer family per backend: one attention layer, forward and
forward+backward, median of a few runs. Writes ``benchmarks/results/bias_family_<device>.json``.

    python benchmarks/bias_family.py --lengths 256 512 --device cpu
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from posenc_lightning import PosEncAttentionMixin, inject
from posenc_lightning.attention.backends import get_backend

ENCODINGS = ["alibi", "fire", "cope", "fox", "sba", "rse", "rope_alibi", "mixture"]


class Attn(torch.nn.Module, PosEncAttentionMixin):
    def __init__(self, n_heads: int, head_dim: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.d_model = n_heads, head_dim, n_heads * head_dim


def _time(fn, device: torch.device, reps: int) -> float:
    fn()  # warm-up (flex compiles / traces here)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def _fwd_bwd(attn: Attn, q, k, v, hidden) -> None:
    attn.attend(q, k, v, hidden=hidden).sum().backward()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    for n in args.lengths:
        for name in ENCODINGS:
            for backend in ("eager", "sdpa", "flex", "triton"):
                attn = Attn(args.heads, args.head_dim).to(device)
                try:
                    enc = inject(attn, name, backend=backend)
                except ValueError:
                    continue  # the backend cannot run this encoding here
                shape = (args.batch, args.heads, n, args.head_dim)
                q, k, v = (torch.randn(shape, device=device, requires_grad=True) for _ in range(3))
                hidden = torch.randn(args.batch, n, attn.d_model, device=device)
                row = {"encoding": name, "backend": backend, "n": n}
                with torch.no_grad():
                    row["fwd_ms"] = _time(functools.partial(attn.attend, q, k, v, hidden=hidden), device, args.reps)
                if get_backend(backend).supports(enc, device, True) is None:
                    row["fwd_bwd_ms"] = _time(functools.partial(_fwd_bwd, attn, q, k, v, hidden), device, args.reps)
                rows.append(row)
                print(json.dumps(row))
    out = Path(__file__).parent / "results" / f"bias_family_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "batch": args.batch,
            "heads": args.heads, "head_dim": args.head_dim}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
