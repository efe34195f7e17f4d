"""The conformance suite's parts: a layer using both mixins, the scenarios, and one run of a case
(forward and backward) to hold against the eager float64 reference (tests/test_conformance.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from posenc_lightning import PosEncAttentionMixin, PosEncEmbeddingMixin
from posenc_lightning.attention.kv_cache import LayerKVCache
from posenc_lightning.inject import inject

SCENARIOS = ("arange", "offset", "packed", "decode", "padding")
OFFSET = 37


class ConfLayer(nn.Module, PosEncAttentionMixin, PosEncEmbeddingMixin):
    """Attention on given q, k, v; a stage-1 encoding's embedding of ``hidden`` is added to q, so
    embedding encodings (learned, sinusoidal) are held to the same scenarios."""

    max_seq_len = 64  # what `inject` gives a learned table

    def __init__(self, n_heads: int, head_dim: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.d_model = n_heads, head_dim, n_heads * head_dim

    def forward(self, q: Tensor, k: Tensor, v: Tensor, hidden: Tensor, positions: Tensor | None = None,
                cache: LayerKVCache | None = None, **kw) -> Tensor:
        enc = self.encoding
        if enc is not None and "embed" in enc.stages:
            e = self.embed_positions(hidden, positions, offset=cache.length if cache is not None else 0)
            b, n, _ = e.shape
            q = q + e.view(b, n, self.n_heads, self.head_dim).transpose(1, 2).to(q.dtype)
        return self.attend(q, k, v, positions=positions, hidden=hidden, cache=cache, **kw)


def build_layer(name: str, backend: str, dtype: torch.dtype, heads: tuple[int, int, int],
                state: dict[str, Tensor] | None = None) -> ConfLayer:
    """``name`` injected with ``backend`` (same seed as every other layer of the case), cast to
    ``dtype``, holding ``state`` (the eager layer's, already rounded to the tested dtype)."""
    torch.manual_seed(0)
    m = ConfLayer(heads[0], heads[2])
    inject(m, name, backend=backend)
    m.posenc_backend = backend  # an embedding-only encoding leaves the attention's backend unset
    m.to(dtype)
    if state is not None:
        m.load_state_dict(state)
    return m


@dataclass
class Inputs:
    q: Tensor
    k: Tensor
    v: Tensor
    hidden: Tensor
    cotangent: Tensor

    def to(self, dtype: torch.dtype) -> Inputs:
        return Inputs(*(t.to(dtype) for t in (self.q, self.k, self.v, self.hidden, self.cotangent)))


def make_inputs(b: int, n: int, heads: tuple[int, int, int], dtype: torch.dtype, seed: int = 1) -> Inputs:
    """Random inputs rounded to ``dtype`` (kept in ``dtype``: the reference casts these values up)."""
    h, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, h, n, d), (b, hkv, n, d), (b, hkv, n, d), (b, n, h * d), (b, h, n, d)]
    return Inputs(*(torch.randn(s, generator=g).to(dtype) for s in shapes))


def scenario_args(scenario: str, b: int, n: int, position_dims: int, offset: int = OFFSET,
                  decode_steps: int = 2) -> dict[str, Tensor | int]:
    """attend() keyword arguments of a scenario; ``decode`` also names its prefill length (its
    positions: the cache's default, or ``offset`` onwards when ``offset`` is not `OFFSET`)."""
    pos = None
    out: dict[str, Tensor | int] = {}
    if scenario == "offset" or (scenario == "decode" and offset != OFFSET):
        # rows start at different offsets (the second one at 5)
        pos = torch.arange(n).expand(b, n) + torch.tensor([offset, 5])[torch.arange(b) % 2, None]
    elif scenario == "packed":  # documents of lengths 5, 3, rest (even rows) and 2, rest (odd rows)
        bounds = torch.tensor([[5, 8], [2, n]])[torch.arange(b) % 2]
        idx = torch.arange(n).expand(b, n)
        seg = (idx[:, :, None] >= bounds[:, None, :]).sum(-1)
        start = torch.where(seg == 0, 0, bounds.gather(1, (seg - 1).clamp(min=0)))
        pos, out["segment_ids"] = idx - start, seg
    elif scenario == "padding":  # left padding of 3 keys on the last row and a hole at key n-4
        kpm = torch.ones(b, n, dtype=torch.bool)
        kpm[-1, :3] = False
        kpm[0, n - 4] = False
        out["key_padding_mask"] = kpm
    if scenario == "decode":
        out["prefill"] = max(1, n - decode_steps)
    if position_dims == 2:  # a grid 4 wide: [B, N, 2] (row, column)
        p = torch.arange(n).expand(b, n) if pos is None else pos
        pos = torch.stack((p // 4, p % 4), -1)
    if pos is not None:
        out["positions"] = pos
    return out


def run_case(layer: ConfLayer, x: Inputs, args: dict, grad: bool) -> list[Tensor | None]:
    """The output and (with ``grad``) the gradients to q, k, v, hidden and every encoding
    parameter of ``layer`` for the cotangent ``x.cotangent``."""
    ins = [t.clone().requires_grad_(grad) for t in (x.q, x.k, x.v, x.hidden)]
    args = dict(args)
    prefill = args.pop("prefill", None)
    with torch.set_grad_enabled(grad):
        if prefill is None:
            out = layer(*ins, **args)
        else:
            out = _decode(layer, ins, args, prefill)
    if not grad:
        return [out.detach()]
    params = [p for p in layer.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out, ins + params, x.cotangent, allow_unused=True)
    return [out.detach(), *grads]


def _decode(layer: ConfLayer, ins: list[Tensor], args: dict, prefill: int) -> Tensor:
    """A prefill of ``prefill`` tokens, then one token at a time through a `LayerKVCache`."""
    cache, n, outs = LayerKVCache(), ins[0].shape[2], []
    pos = args.pop("positions", None)
    for lo, hi in [(0, prefill)] + [(i, i + 1) for i in range(prefill, n)]:
        q, k, v = (t[:, :, lo:hi] for t in ins[:3])
        p = None if pos is None else pos[:, lo:hi]
        outs.append(layer(q, k, v, ins[3][:, lo:hi], positions=p, cache=cache, **args))
    return torch.cat(outs, 2)
