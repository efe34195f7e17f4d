"""Time the fused Triton attention (rope, alibi, fox, sba) against SDPA without any encoding.

Needs a CUDA GPU (it exits with a message otherwise). For each sequence length it times
forward and forward+backward (CUDA events, median of ``--reps`` after warm-up) of:

* ``sdpa``      torch SDPA, causal, no positional encoding (the floor);
* ``sdpa+rope`` q, k rotated by the encoding in PyTorch, then SDPA (the unfused baseline);
* ``triton:*``  `fused_attention` with the encoding inside the kernel.

    python benchmarks/bench_triton.py --dtype bfloat16 --lengths 1024 2048 4096 8192 \
        --out benchmarks/results/bench_triton_<gpu>.md
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F


def cuda_median_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls, by CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def cases(b: int, h: int, n: int, d: int, dtype: torch.dtype, dev: str = "cuda"):
    from posenc_lightning.encodings.rope import RoPE
    from posenc_lightning.functional.alibi import alibi_slopes
    from posenc_lightning.functional.rope import apply_rotary
    from posenc_lightning.kernels.fused import RotaryTables, fused_attention

    q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    pos = torch.arange(n, device=dev).expand(b, n)
    rope = RoPE().bind(n_heads=h, head_dim=d).to(dev)
    cos, sin = rope.cos_sin(torch.arange(n, device=dev)[None])
    tables = RotaryTables(cos, sin, pos, cos, sin, pos, "half")
    cpt, spt = rope.cos_sin(pos)
    slopes = alibi_slopes(h).to(dev)
    logf = F.logsigmoid(torch.randn(b, h, n, device=dev) + 3).cumsum(-1).requires_grad_()

    yield "sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    yield "sdpa+rope", lambda: F.scaled_dot_product_attention(apply_rotary(q, cpt, spt), apply_rotary(k, cpt, spt),
                                                              v, is_causal=True)
    yield "triton:nope", lambda: fused_attention(q, k, v)
    yield "triton:rope", lambda: fused_attention(q, k, v, rotary=tables)
    yield "triton:alibi", lambda: fused_attention(q, k, v, slopes=slopes, bias_q_pos=pos, bias_k_pos=pos)
    yield "triton:fox", lambda: fused_attention(q, k, v, c_q=logf, c_k=logf)
    yield "triton:sba", lambda: fused_attention(q, k, v, stick_breaking=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", nargs="*", type=int, default=[1024, 2048, 4096, 8192])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", help="also write the markdown table here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_triton needs a CUDA GPU (the Triton kernels are compiled for it); none here", file=sys.stderr)
        return 2
    dtype = getattr(torch, a.dtype)
    title = (f"# fused Triton attention vs SDPA ({torch.cuda.get_device_name()}, {a.dtype}, B={a.batch}, "
             f"H={a.heads}, D={a.head_dim}, causal; ms, median of {a.reps})")
    rows = [title, "",
            "| N | case | fwd ms | fwd+bwd ms | fwd x sdpa | fwd+bwd x sdpa |", "|---|---|---|---|---|---|"]
    for n in a.lengths:
        base = None
        for name, fn in cases(a.batch, a.heads, n, a.head_dim, dtype):
            fwd = cuda_median_ms(fn, a.reps)
            both = cuda_median_ms(lambda f=fn: f().sum().backward(), a.reps)
            if base is None:
                base = (fwd, both)
            rows.append(f"| {n} | {name} | {fwd:.3f} | {both:.3f} | {fwd / base[0]:.2f} | {both / base[1]:.2f} |")
            print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    text = "\n".join(rows)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
