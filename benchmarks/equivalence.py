"""Outputs and gradients of every encoding, saved, or compared bitwise with a saved file.

A refactor that claims "behaviour unchanged" runs this at the base commit (``--save``) and after
(``--check``): one attention layer (`harness.BenchLayer`), B 2, N 300 and 2048, forward with and
without grad and the gradients of the input and of every parameter, for every registered encoding
(and the configured variants below), on the backends CPU ``auto`` takes; plus the ``blockwise`` and
``eager`` backends at N 300, a decode step against a KV cache, packed documents, and a compiled
forward+backward.

    python benchmarks/equivalence.py --save /tmp/base.pt      # at the base commit
    python benchmarks/equivalence.py --check /tmp/base.pt     # after the change: exit 1 on a difference
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import make_layer
from posenc_lightning.attention.kv_cache import LayerKVCache
from posenc_lightning.encodings.registry import available_encodings

D_MODEL, N_HEADS = 64, 4
VARIANTS = ["fire:init_L=4096", "rope:layout=interleaved"]
NEEDS_2D = {"rope_2d"}


def _layer_case(spec: str, n: int, backend: str | None, seed: int = 0) -> dict[str, torch.Tensor]:
    layer = make_layer(spec, D_MODEL, N_HEADS, n, seed=seed)
    if backend is not None:
        layer.attn.posenc_backend = backend
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, n, D_MODEL, generator=g)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        out["fwd"] = layer(x)
    xx = x.clone().requires_grad_(True)
    y = layer(xx)
    y.square().mean().backward()
    out["fwd_grad"] = y.detach()
    out["dx"] = xx.grad
    for name, p in layer.named_parameters():
        if p.grad is not None:
            out[f"d:{name}"] = p.grad
    return out


def _attn_inputs(layer, x):
    attn = layer.attn
    b, n, _ = x.shape
    q, k, v = attn.qkv(layer.norm(x)).split([attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim,
                                             attn.n_kv_heads * attn.head_dim], dim=-1)
    shape = lambda t, h: t.view(b, n, h, attn.head_dim).transpose(1, 2)
    return shape(q, attn.n_heads), shape(k, attn.n_kv_heads), shape(v, attn.n_kv_heads)


def _decode_case(spec: str) -> dict[str, torch.Tensor]:
    """A prefill of 37 tokens, then 3 single-token steps against the cache."""
    layer = make_layer(spec, D_MODEL, N_HEADS, 64)
    x = torch.randn(2, 40, D_MODEL, generator=torch.Generator().manual_seed(3))
    attn = layer.attn
    cache = LayerKVCache()
    outs = []
    with torch.no_grad():
        for s, e in [(0, 37), (37, 38), (38, 39), (39, 40)]:
            xs = x[:, s:e]
            q, k, v = _attn_inputs(layer, xs)
            outs.append(attn.attend(q, k, v, hidden=layer.norm(xs), cache=cache))
    return {"decode": torch.cat(outs, dim=2)}


def _packed_case(spec: str) -> dict[str, torch.Tensor]:
    layer = make_layer(spec, D_MODEL, N_HEADS, 96)
    x = torch.randn(2, 96, D_MODEL, generator=torch.Generator().manual_seed(4)).requires_grad_(True)
    seg = torch.cat([torch.zeros(2, 40, dtype=torch.long), torch.ones(2, 56, dtype=torch.long)], dim=1)
    pos = torch.cat([torch.arange(40), torch.arange(56)]).expand(2, 96)
    q, k, v = _attn_inputs(layer, x)
    y = layer.attn.attend(q, k, v, positions=pos, hidden=layer.norm(x), segment_ids=seg)
    y.square().mean().backward()
    return {"packed": y.detach(), "packed_dx": x.grad}


def _compiled_case(spec: str) -> dict[str, torch.Tensor]:
    layer = make_layer(spec, D_MODEL, N_HEADS, 128)
    fn = torch.compile(layer, dynamic=False)
    x = torch.randn(2, 128, D_MODEL, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    y = fn(x)
    y.square().mean().backward()
    return {"compiled": y.detach(), "compiled_dx": x.grad}


def cases(names: list[str], compiled: bool) -> dict[str, dict[str, torch.Tensor]]:
    results: dict[str, dict[str, torch.Tensor]] = {}
    for spec in names:
        for n in (300, 2048):
            results[f"{spec}/N{n}/auto"] = _layer_case(spec, n, None)
        for backend in ("blockwise", "eager"):
            try:
                results[f"{spec}/N300/{backend}"] = _layer_case(spec, 300, backend)
            except (ValueError, NotImplementedError) as e:  # the backend refuses the encoding
                results[f"{spec}/N300/{backend}"] = {"refused": torch.tensor(len(str(e)))}
        results[f"{spec}/decode"] = _decode_case(spec)
        results[f"{spec}/packed"] = _packed_case(spec)
        if compiled:
            results[f"{spec}/compiled"] = _compiled_case(spec)
        print(spec, flush=True)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", type=Path)
    g.add_argument("--check", type=Path)
    p.add_argument("--encodings", nargs="*", default=None)
    p.add_argument("--no-compile", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    names = a.encodings or [e for e in available_encodings() if e not in NEEDS_2D] + VARIANTS
    results = cases(names, compiled=not a.no_compile)
    if a.save:
        torch.save(results, a.save)
        print(f"saved {len(results)} cases to {a.save}")
        return 0
    base = torch.load(a.check)
    bad = []
    for case, tensors in results.items():
        ref = base.get(case)
        if ref is None or ref.keys() != tensors.keys():
            bad.append(f"{case}: keys {sorted(tensors)} vs {None if ref is None else sorted(ref)}")
            continue
        for key, t in tensors.items():
            if not torch.equal(t, ref[key]):
                diff = (t.double() - ref[key].double()).abs().max().item() if t.shape == ref[key].shape else "shape"
                bad.append(f"{case} {key}: max |diff| {diff}")
    print("\n".join(bad) if bad else f"all {len(results)} cases bitwise equal")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
