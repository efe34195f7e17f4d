"""Stage 2 recomputed in backward (`attention.recompute`): attention keeps the un-rotated q, k
and rotates them again when backward needs them. Gradients must be exactly those of keeping the
rotated tensors, on every backend, with grouped kv heads, packed documents and offsets."""

from __future__ import annotations

import pytest
import torch

from posenc_lightning.attention import recompute
from posenc_lightning.inject import inject
from posenc_lightning.models.tinygpt import CausalSelfAttention


def _grads(name: str, backend: str, on: bool, **cfg):
    torch.manual_seed(0)
    attn = CausalSelfAttention(32, 4, n_kv_heads=2)
    inject(attn, name, backend=backend, **cfg)
    attn.posenc_recompute_rotation = on
    x = torch.randn(2, 37, 32, requires_grad=True)
    positions = torch.cat([torch.arange(5, 25), torch.arange(17)])[None].expand(2, -1)  # offset + a second document
    seg = torch.cat([torch.zeros(20, dtype=torch.long), torch.ones(17, dtype=torch.long)])[None].expand(2, -1)
    out = attn(x, positions=positions, segment_ids=seg)
    g = torch.randn_like(out)
    return out, torch.autograd.grad(out, [x, *attn.parameters()], g)


@pytest.mark.parametrize("name,cfg", [("rope", {}), ("rope", {"layout": "interleaved"}), ("yarn", {"factor": 4.0}),
                                      ("xpos", {}), ("rope_alibi", {}), ("dynamic_ntk", {"factor": 2.0})])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_recomputed_rotation_gives_the_same_gradients(name, cfg, backend, monkeypatch):
    calls = []
    orig = recompute.RotationRecompute._unpack
    monkeypatch.setattr(recompute.RotationRecompute, "_unpack",
                        lambda self, p: (calls.append(isinstance(p, recompute._Rotated)), orig(self, p))[1])
    out0, g0 = _grads(name, backend, False, **cfg)
    assert not calls
    out1, g1 = _grads(name, backend, True, **cfg)
    # SDPA saves q and k as given; eager's matmul may save a copy instead (then nothing changes)
    assert any(calls) or backend == "eager", "backward did not rotate again: the rotated q/k were kept"
    torch.testing.assert_close(out1, out0, rtol=0, atol=0)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_only_cheap_deterministic_rotations_are_recomputed():
    from posenc_lightning.encodings.registry import build_encoding

    assert build_encoding("rope").cheap_rotation and build_encoding("rope_alibi").cheap_rotation
    assert not build_encoding("liere").cheap_rotation  # a matrix exponential per position: kept
    assert not build_encoding("alibi").cheap_rotation


def test_no_recompute_without_gradients_or_with_a_kv_cache(monkeypatch):
    monkeypatch.setattr(recompute.RotationRecompute, "__init__",
                        lambda *a, **k: pytest.fail("recompute set up where nothing is saved for backward"))
    attn = CausalSelfAttention(32, 4)
    inject(attn, "rope")
    x = torch.randn(1, 9, 32)
    with torch.no_grad():
        attn(x)
    from posenc_lightning.attention.kv_cache import KVCache

    cache = KVCache(1)
    attn(x, cache=cache[0])  # incremental decoding keeps its rotated keys in the cache
