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
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc_lightning.attention.mixin import PosEncEmbeddingMixin
from posenc_lightning.encodings.base import AttentionContext, Bias
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


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"rope:layout=interleaved,theta=500000"`` -> ``("rope", {"layout": "interleaved", "theta": 500000})``
    (values read as YAML scalars): a configured variant of a registered encoding."""
    import yaml

    name, _, rest = spec.partition(":")
    cfg = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"encoding spec {spec!r}: write options as key=value, e.g. rope:layout=interleaved")
        cfg[key.strip()] = yaml.safe_load(value)
    return name, cfg


def make_layer(name: str, d_model: int, n_heads: int, n: int, seed: int = 0) -> BenchLayer:
    """``name``: a registered encoding or a `parse_spec` variant."""
    torch.manual_seed(seed)
    layer = BenchLayer(d_model, n_heads)
    name, cfg = parse_spec(name)
    if name == "learned":
        cfg.setdefault("max_seq_len", n)
    inject(layer, name, **cfg)
    return layer


def bench_inputs(n: int, d_model: int, seed: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(x [1, n, d_model], ids [1, n + 1])``: a layer's input and a TinyGPT's tokens, drawn from
    their own generator seeded with ``seed`` (the global RNG is left alone). The work of a step
    depends on its input (blockwise normalizers stop where a row's weights run out, CoPE's bands
    end where its counts clamp): runs that compare times share the seed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n, d_model, generator=g)
    ids = torch.randint(0, 256, (1, n + 1), generator=g)
    return x.to(device), ids.to(device)


def make_gpt(name: str, d_model: int, n_heads: int, n_layers: int, n: int, seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    name, cfg = parse_spec(name)
    return TinyGPT(d_model=d_model, n_heads=n_heads, n_layers=n_layers, max_seq_len=n, encoding=name,
                   encoding_cfg=cfg or None)


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


def realize_bias(bias: Bias | None, causal: bool = True, block: int = 256) -> None:
    """Compute a bias's values the way a blockwise backend does, without the attention.

    Rows computed on request (`Bias.rows_shape`: FIRE past its threshold, CoPE, mixtures) are
    computed block by block and dropped; the other kinds already hold what a backend reads after
    the description call (ALiBi slopes, a Toeplitz table of ``2N - 1`` distances, FoX's gates)."""
    for term in bias.terms if bias is not None else []:
        if term.rows_shape is not None:
            nq, nk = term.rows_shape
            for s in range(0, nq, block):
                e = min(nq, s + block)
                term.rows(s, e, nk - nq + e if causal else nk)


def stage_fn(layer: BenchLayer, x: Tensor, sync: Callable[[], None] = lambda: None) -> Callable[[], float]:
    """The encoding's own work on the layer's q/k, self-timed: its stage calls (embed, rotate,
    the bias description) plus the computation of the bias values (`realize_bias`), but not
    the attention. The seed guide's "encoding time".

    The callable runs the stage twice and returns the seconds of the second run: inside a
    layer, q/k have just been written by the projection and are in cache; a cold first run
    (after other encodings' work evicted them) would charge the encoding for a cache miss."""
    attn = layer.attn
    enc = layer_encoding(layer)
    b, n, _ = x.shape
    with torch.no_grad():
        q, k, _v = attn.qkv(x).split([attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim,
                                      attn.n_kv_heads * attn.head_dim], dim=-1)
    q = q.view(b, n, attn.n_heads, attn.head_dim).transpose(1, 2)
    k = k.view(b, n, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    pos = torch.arange(n, device=x.device).expand(b, n)
    stages = enc.stages

    def once() -> None:
        with torch.no_grad():
            if "embed" in stages:
                enc.embed(x, pos)
            ctx = AttentionContext(pos, pos, True, x, None, attn)
            qq, kk = enc.rotate(q, k, ctx) if "rotate" in stages else (q, k)
            if "bias" in stages:
                realize_bias(enc.bias(qq, kk, ctx))

    def run() -> float:
        once()
        sync()
        t0 = time.perf_counter()
        once()
        sync()
        return time.perf_counter() - t0

    return run


def interleaved_medians(fns: dict[tuple, Callable[[], float | None]], reps: int, warmup: int = 1,
                        budget_s: float | None = None) -> dict[tuple, float]:
    """Median seconds of each callable, the callables interleaved in every repetition (a
    callable that returns a float has timed itself: that is its time)."""
    for f in fns.values():
        for _ in range(warmup):
            f()
    times: dict[tuple, list[float]] = {key: [] for key in fns}
    t_start = time.perf_counter()
    for r in range(reps):
        for key, f in fns.items():
            t0 = time.perf_counter()
            own = f()
            times[key].append(own if isinstance(own, float) else time.perf_counter() - t0)
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
        return "{:.1f} / {:.1f} / {:.1f}".format(*os.getloadavg())
    except OSError:
        return "n/a"
