"""Shared pieces of the benchmarks and of the regression guard (tests/test_benchmark_guard.py).

Every timing is a *ratio to* ``nope`` measured in the same process, with the encodings
interleaved in every repetition and the median taken, so a loaded machine slows all of them
alike. The benchmarked "attention layer" is TinyGPT's attention block plus the embedding stage
(so that sinusoidal/learned are charged for their stage 1 too).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc_lightning.attention.mixin import PosEncEmbeddingMixin
from posenc_lightning.encodings.base import AttentionContext
from posenc_lightning.inject import inject
from posenc_lightning.models.tinygpt import CausalSelfAttention, TinyGPT


class BenchLayer(nn.Module, PosEncEmbeddingMixin):
    """Stage 1 (embed) followed by one pre-norm TinyGPT attention layer (stages 2-4).

    The LayerNorm is what every pre-LN block has: without it, an embedding stage that scales
    its input (sinusoidal's sqrt(d_model)) gives a random layer logits in the hundreds, whose
    softmax gradients fall into the denormal range and slow the backward matmuls 3x: a cost
    of the benchmark, not of the encoding."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.norm = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(self.norm(self.embed_positions(x)))


def layer_encoding(layer: BenchLayer):
    """The injected encoding (embed-only encodings live on the layer, nope on neither)."""
    from posenc_lightning.encodings.absolute import NoPE

    return layer.attn.encoding or layer.encoding or NoPE()


def make_layer(name: str, d_model: int, n_heads: int, n: int, seed: int = 0) -> BenchLayer:
    torch.manual_seed(seed)
    layer = BenchLayer(d_model, n_heads)
    cfg = {"max_seq_len": n} if name == "learned" else {}
    inject(layer, name, **cfg)
    return layer


def make_gpt(name: str, d_model: int, n_heads: int, n_layers: int, n: int, seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(d_model=d_model, n_heads=n_heads, n_layers=n_layers, max_seq_len=n, encoding=name)


def layer_fns(layer: BenchLayer, x: Tensor) -> dict[str, Callable[[], None]]:
    def fwd() -> None:
        with torch.no_grad():
            layer(x)

    def fwd_bwd() -> None:
        layer.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_(True)
        layer(xx).square().mean().backward()

    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


def gpt_fns(gpt: TinyGPT, ids: Tensor) -> dict[str, Callable[[], None]]:
    def fwd() -> None:
        with torch.no_grad():
            gpt(ids[:, :-1])

    def fwd_bwd() -> None:
        gpt.zero_grad(set_to_none=True)
        logits = gpt(ids[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()

    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


def stage_fn(layer: BenchLayer, x: Tensor) -> Callable[[], None]:
    """Only the encoding's own stage calls (embed, rotate, bias description) on the layer's q/k.

    A bias is a lazy description; its materialization happens inside the backend and is only
    visible in the whole-layer ratio."""
    attn = layer.attn
    enc = layer_encoding(layer)
    b, n, _ = x.shape
    with torch.no_grad():
        q, k, _v = attn.qkv(x).split([attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim,
                                      attn.n_kv_heads * attn.head_dim], dim=-1)
    q = q.view(b, n, attn.n_heads, attn.head_dim).transpose(1, 2)
    k = k.view(b, n, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    pos = torch.arange(n).expand(b, n)
    stages = enc.stages

    def run() -> None:
        with torch.no_grad():
            if "embed" in stages:
                enc.embed(x, pos)
            ctx = AttentionContext(pos, pos, True, x, None, attn)
            qq, kk = enc.rotate(q, k, ctx) if "rotate" in stages else (q, k)
            if "bias" in stages:
                enc.bias(qq, kk, ctx)

    return run


def interleaved_medians(fns: dict[tuple, Callable[[], None]], reps: int, warmup: int = 1,
                        budget_s: float | None = None) -> dict[tuple, float]:
    """Median seconds of each callable, the callables interleaved in every repetition."""
    for f in fns.values():
        for _ in range(warmup):
            f()
    times: dict[tuple, list[float]] = {key: [] for key in fns}
    t_start = time.perf_counter()
    for r in range(reps):
        for key, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[key].append(time.perf_counter() - t0)
        if budget_s is not None and r >= 2 and time.perf_counter() - t_start > budget_s:
            break
    return {key: statistics.median(v) for key, v in times.items()}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}; {os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} threads; "
            f"{dev}; {platform.platform()}")


def loadavg() -> str:
    try:
        return "%.1f / %.1f / %.1f" % os.getloadavg()
    except OSError:
        return "n/a"
