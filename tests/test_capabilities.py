"""Capabilities are declared on `Encoding` (issue 17), not probed with getattr / hasattr."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import posenc_lightning
from posenc_lightning import inject
from posenc_lightning.encodings.base import AttentionContext, Encoding, Normalizer, Walk
from posenc_lightning.encodings.registry import available_encodings, build_encoding, encoding_class
from tests.helpers import Attn

CAPABILITIES = {"position_dims", "accepts_nd_positions", "scalable", "set_scale", "factor", "searchable",
                "set_factors", "normalizer_kind", "fused_rotary", "rotary", "requires_hidden",
                "dynamic", "cheap_rotation", "needs_even_head_dim", "bias_kinds", "hf_rope_type"}


def test_every_capability_is_declared_on_the_base_class_with_a_default():
    for cap in CAPABILITIES - {"rotary"}:
        assert hasattr(Encoding, cap), cap
    plain = Encoding()
    assert (plain.accepts_nd_positions, plain.scalable, plain.searchable, plain.normalizer_kind,
            plain.factor, plain.fused_rotary) == (False, False, False, None, 1.0, None)
    with pytest.raises(ValueError, match="encoding has no set_scale"):
        plain.set_scale(2.0)
    with pytest.raises(ValueError, match="encoding has no set_factors"):
        plain.set_factors(long_factor=[1.0])
    rotary = {f.name: f.default for f in dataclasses.fields(AttentionContext)}["rotary"]
    assert rotary is None  # ctx.rotary is a declared field


def test_no_getattr_probing_of_capabilities():
    found = []
    for path in sorted(Path(posenc_lightning.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in CAPABILITIES):
                found.append(f"{path.name}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    assert found == []


@pytest.mark.parametrize("name", available_encodings())
def test_declarations_match_what_the_class_implements(name):
    cls = encoding_class(name)
    assert cls.scalable == (cls.set_scale is not Encoding.set_scale), "scalable iff set_scale is implemented"
    assert cls.searchable == (cls.set_factors is not Encoding.set_factors)
    enc = build_encoding(name)
    assert (enc.normalizer_kind is not None) == ("normalize" in enc.stages), "normalizer_kind iff stage 4"
    if "normalize" in enc.stages:  # the description is an instance of the declared kind
        ctx = AttentionContext(torch.arange(4)[None], torch.arange(4)[None])
        assert type(enc.normalize(ctx)) is enc.normalizer_kind
    assert bool(enc.bias_kinds) == ("bias" in enc.stages), "bias_kinds declared iff the encoding has a bias"
    if enc.scalable:
        enc.set_scale(2.0)
        assert enc.factor == 2.0 and enc.config()["factor"] == 2.0


def test_fused_rotary_is_the_encodings_declaration():
    def bound(name: str, **cfg) -> Encoding:
        return build_encoding(name, **cfg).bind(n_heads=2, head_dim=16, d_model=32)

    rope = bound("rope")
    assert rope.fused_rotary is rope
    rse, hybrid, fox = bound("rse"), bound("rope_alibi"), bound("fox", rope=True)
    assert rse.fused_rotary is rse.rope and fox.fused_rotary is fox.rope
    assert hybrid.fused_rotary is hybrid.members[0]
    for name in ("alibi", "nope", "mixture", "liere"):  # no rotation, or one the kernels cannot apply
        assert bound(name).fused_rotary is None
    sba, ctx = bound("sba"), AttentionContext(torch.arange(4)[None], torch.arange(4)[None])
    assert sba.normalizer_kind.walk is Walk.STICK_BREAKING and bound("rse").normalize(ctx).attend_current is False


def test_triton_fuses_only_the_normalizer_an_encoding_declares(monkeypatch):
    pytest.importorskip("triton")
    from posenc_lightning.attention.backends import triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = torch.device("cpu")

    class Sparsemax(Encoding):  # replaces softmax and declares no fused normalizer
        name = "sparsemax_test"

        def normalize(self, ctx):
            return None

    class Walked(Normalizer):
        walk = Walk.STICK_BREAKING
        fused_in = frozenset({"kernel"})

    assert triton.FUSES_ROTARY and triton.supports(build_encoding("sba"), cpu, True) is None
    assert "normalizer the kernels do not implement" in triton.supports(Sparsemax(), cpu, True)
    Sparsemax.normalizer_kind = Walked  # a declaration is all the backend reads
    assert triton.supports(Sparsemax(), cpu, True) is None
    Walked.walk = Walk.SOFTMAX  # a softmax walk whose modulation has the kernel form
    assert triton.supports(Sparsemax(), cpu, True) is None
    Walked.fused_in = frozenset({"tiles"})
    assert "normalizer the kernels do not implement" in triton.supports(Sparsemax(), cpu, True)


def test_accepts_nd_positions_is_read_from_the_declaration():
    m = Attn(n_heads=2, head_dim=16, d_model=32)
    q = k = v = torch.randn(1, 2, 4, 16)
    pos2 = torch.stack([torch.arange(4), torch.arange(4)], -1)[None]  # [B, N, 2]
    inject(m, "rope_2d")
    assert m.encoding.accepts_nd_positions and m.attend(q, k, v, positions=pos2).shape == q.shape
    inject(m, "rope")
    with pytest.raises(ValueError, match="positions must be"):
        m.attend(q, k, v, positions=pos2)
