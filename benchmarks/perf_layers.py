"""The layers and kernel calls behind benchmarks/perf_cases.py's cases: an encoding through a backend
(the mixins, as a model runs it), the Triton softmax kernels at given tiles, the rotary ablation's
paths and the CUDA-graph replays of the rotary path."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from benchmarks.perf_cases import Case, NeedsCuda, Runner, Unsupported, tile_arg
from posenc_lightning import PosEncAttentionMixin, PosEncEmbeddingMixin

CUDA = torch.device("cuda")


class Layer(nn.Module, PosEncAttentionMixin, PosEncEmbeddingMixin):
    """Attention on given q, k, v; an embedding encoding's vector of ``hidden`` is added to q."""

    def __init__(self, n_heads: int, head_dim: int, max_seq_len: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.d_model = n_heads, head_dim, n_heads * head_dim
        self.max_seq_len = max_seq_len

    def forward(self, q: Tensor, k: Tensor, v: Tensor, hidden: Tensor) -> Tensor:
        enc = self.encoding
        if enc is not None and "embed" in enc.stages:
            b, n, _ = hidden.shape
            q = q + self.embed_positions(hidden).view(b, n, self.n_heads, self.head_dim).transpose(1, 2).to(q.dtype)
        return self.attend(q, k, v, hidden=hidden)


@dataclass
class EncodingRun:
    """One layer's call and the path it takes on CUDA (`resolve_backend` there)."""

    fn: Callable[[], Tensor]
    ran: str
    layer: Layer


def make_layer(name: str, backend: str, q: Tensor, device: torch.device) -> Layer:
    """A `Layer` with ``name`` injected (on CPU, then moved), asking for ``backend``."""
    from posenc_lightning.inject import inject

    _, h, n, d = q.shape
    torch.manual_seed(0)
    layer = Layer(h, d, n)
    inject(layer, name)
    layer.to(device, q.dtype)
    layer.posenc_backend = backend
    return layer


def cuda_choice(layer: Layer, backend: str) -> str:
    """The backend ``backend`` resolves to on CUDA for the layer's encoding (``supports`` reads
    ``device.type`` only, so this holds on any machine).

    Raises:
        Unsupported: an explicit backend that refuses the encoding on CUDA, with its reason.
    """
    from posenc_lightning.attention.backends import get_backend, resolve_backend
    from posenc_lightning.attention.mixin import NO_ENCODING

    enc = layer.encoding or NO_ENCODING
    if backend != "auto":
        why = get_backend(backend).supports(enc, CUDA, True)
        if why is not None:
            raise Unsupported(why)
    return resolve_backend(backend, enc, CUDA, True).NAME


def encoding_runner(case: Case, q: Tensor, k: Tensor, v: Tensor, hidden: Tensor, device: torch.device) -> EncodingRun:
    """``case.label`` injected into a `Layer`, through ``case.backend``."""
    layer = make_layer(case.label, case.backend, q, device)
    ran = cuda_choice(layer, case.backend)
    return EncodingRun(lambda: layer(q, k, v, hidden), ran, layer)


def tiles_runner(case: Case, q: Tensor, k: Tensor, v: Tensor, device: torch.device) -> Callable[[], Tensor]:
    """ALiBi through the Triton softmax kernels at the variant's tiles (`perf_cases.TILE_VARIANTS`)."""
    from posenc_lightning.functional.alibi import alibi_slopes
    from posenc_lightning.kernels.fused import fused_attention

    tiles = tile_arg(case.variant)
    slopes = alibi_slopes(q.shape[1]).to(device)
    return lambda: fused_attention(q, k, v, slopes=slopes, tiles=tiles)


def rope_tables(q: Tensor):
    """RoPE's `RotaryTables` at positions ``arange(N)`` (one row per position, gathered in-kernel)."""
    from posenc_lightning.encodings.rope import RoPE
    from posenc_lightning.kernels.fused import RotaryTables

    b, h, n, d = q.shape
    rope = RoPE().bind(n_heads=h, head_dim=d).to(q.device)
    pos = torch.arange(n, device=q.device)
    cos, sin = rope.cos_sin(pos[None])
    idx = pos.expand(b, n)
    return RotaryTables(cos, sin, idx, cos, sin, idx, "half")


def rotary_runner(case: Case, q: Tensor, k: Tensor, v: Tensor, hidden: Tensor,
                  device: torch.device) -> Callable[[], Tensor]:
    """A path of the rotary ablation (`perf_cases.ROTARY_VARIANTS`). Stick-breaking is the one
    kernel that rotates per tile (its tile loop gathers cos/sin); the softmax kernels take q, k
    rotated once by a pass before them, and SDPA takes them from ``rotate_pair``."""
    from posenc_lightning.kernels.fused import fused_attention

    if case.label in ("sba", "sba+rope"):
        tables = rope_tables(q) if case.label == "sba+rope" else None
        return lambda: fused_attention(q, k, v, rotary=tables, stick_breaking=True)
    return encoding_runner(case, q, k, v, hidden, device).fn


def graph_runner(case: Case, q: Tensor, k: Tensor, v: Tensor, do: Tensor, hidden: Tensor,
                 device: torch.device) -> Runner:
    """RoPE on SDPA (``rotate_pair`` + flash) eagerly, or captured in CUDA graphs and replayed:
    one graph of the forward (no autograd), one of the forward and ``autograd.grad``."""
    layer = make_layer("rope", "sdpa", q, device)
    ran = cuda_choice(layer, "sdpa")

    def eager_fwd() -> Tensor:
        with torch.no_grad():
            return layer(q, k, v, hidden)

    def eager_both() -> object:
        return torch.autograd.grad(layer(q, k, v, hidden), (q, k, v), do)

    if case.variant == "cuda-graph=off":
        return Runner(eager_fwd, eager_both, ran)
    if device.type != "cuda":
        raise NeedsCuda("CUDA graphs need a CUDA device")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: tables cached, kernels compiled
        for _ in range(3):
            eager_fwd()
            eager_both()
    torch.cuda.current_stream().wait_stream(side)
    g_fwd, g_both = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g_fwd):
        out = layer(q, k, v, hidden)
    with torch.cuda.graph(g_both):
        grads = torch.autograd.grad(layer(q, k, v, hidden), (q, k, v), do)

    def fwd() -> Tensor:
        g_fwd.replay()
        return out

    def both() -> object:
        g_both.replay()
        return grads

    return Runner(fwd, both, ran + " (graphed)")
