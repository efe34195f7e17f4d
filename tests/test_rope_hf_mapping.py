"""Each rope law owns its Hugging Face mapping (issue 46): `Encoding.hf_rope_type`,
`RotaryEncoding.config_from_rope_parameters` and `Encoding.to_rope_parameters`. A law written as
``rope_parameters`` reads back as itself; `encodings/hf.py` and `models/hf_export.py` look the law
up instead of switching on ``rope_type`` strings or rope classes. Equality with transformers' own
``ROPE_INIT_FUNCTIONS`` is in `tests/test_rotary_scaling.py`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import posenc_lightning
from posenc_lightning.encodings import build_encoding, from_hf
from posenc_lightning.encodings.hf import hf_rope_laws
from posenc_lightning.encodings.registry import available_encodings, encoding_class
from posenc_lightning.encodings.rope import RotaryEncoding
from posenc_lightning.encodings.rope_scaling import YaRN
from posenc_lightning.models.hf_export import to_rope_parameters

L = 64  # the model's max_position_embeddings where the export keeps it
SHORT = [1.0 + 0.02 * i for i in range(8)]  # rotary_dim 16: 8 factors each
LONG = [1.0 + 0.5 * i for i in range(8)]
#: a config per rope_type, away from the defaults where the law reads a field
CASES = {
    "default": {"theta": 500000.0},
    "linear": {"factor": 4.0, "original_max_position_embeddings": L},
    "dynamic": {"factor": 4.0, "original_max_position_embeddings": L},
    "yarn": {"factor": 8.0, "original_max_position_embeddings": L, "beta_fast": 16.0, "beta_slow": 2.0,
             "mscale": 0.707, "mscale_all_dim": 1.0, "attention_factor": 0.9, "truncate": False},
    "llama3": {"factor": 8.0, "original_max_position_embeddings": L, "low_freq_factor": 2.0,
               "high_freq_factor": 8.0, "theta": 500000.0},
    "longrope": {"factor": 4.0, "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": L,
                 "max_position_embeddings": 4 * L, "attention_factor": 1.2},
}
ROTARY = [n for n in available_encodings() if issubclass(encoding_class(n), RotaryEncoding)]


def test_the_table_holds_the_declared_laws():
    laws = hf_rope_laws()
    assert set(laws) == set(CASES)
    for rope_type, cls in laws.items():
        assert cls.hf_rope_type == rope_type
    assert sorted(n for n in ROTARY if encoding_class(n).hf_rope_type) == sorted(c.name for c in laws.values())


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("rope_type", list(CASES))
def test_round_trip_encoding_rope_parameters_from_hf(rope_type, partial):
    """encoding -> rope_parameters -> from_hf: the same class and config, equal cos/sin (both
    sides of a dynamic law's switch)."""
    cls = hf_rope_laws()[rope_type]
    head_dim = int(16 / partial)  # rotary_dim 16 either way
    enc = cls(**CASES[rope_type], partial_rotary_factor=partial).bind(head_dim=head_dim)
    params, max_pos = enc.to_rope_parameters()
    assert params["rope_type"] == rope_type and ("partial_rotary_factor" in params) == (partial != 1.0)
    back = from_hf(params, head_dim, L if max_pos is None else max_pos)
    assert type(back) is cls
    assert back.config() == enc.config()
    for n in (L // 2, 3 * L):
        pos = torch.arange(n)[None]
        for a, b in zip(back.cos_sin(pos, seq_len=n), enc.cos_sin(pos, seq_len=n)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", [n for n in ROTARY if encoding_class(n).hf_rope_type is None])
def test_a_law_without_a_rope_type_has_no_rope_parameters_but_ntk(name):
    enc = build_encoding(name).bind(n_heads=2, head_dim=16, d_model=32)
    if name != "ntk":
        assert to_rope_parameters(enc) is None
        return
    params, max_pos = to_rope_parameters(enc)  # written as plain rope with its base
    back = from_hf(params, 16, L)
    assert params["rope_type"] == "default" and max_pos is None and type(back).name == "rope"
    pos = torch.arange(3 * L)[None]
    for a, b in zip(back.cos_sin(pos), enc.cos_sin(pos)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_instances_without_a_transformers_form():
    class Subclass(YaRN):  # may change the law: no mapping unless it declares one
        pass

    assert Subclass.hf_rope_type is None and YaRN.hf_rope_type == "yarn"
    assert Subclass(factor=4.0).bind(head_dim=16).to_rope_parameters() is None
    assert build_encoding("yarn", layout="interleaved").bind(head_dim=16).to_rope_parameters() is None
    assert build_encoding("long_rope", n_hat=4).bind(head_dim=16).to_rope_parameters() is None
    assert build_encoding("alibi").to_rope_parameters() is None


# ------------------------------------------------------------------ no switch left (a source check)
PKG = Path(posenc_lightning.__file__).parent
SWITCH_FREE = (PKG / "encodings" / "hf.py", PKG / "models" / "hf_export.py")


def _rope_class_names() -> set[str]:
    return {encoding_class(n).__name__ for n in ROTARY} | {"ScaledRotary"}


def switches(source: str, rope_types: set[str], rope_classes: set[str]) -> list[str]:
    """Each comparison with a rope_type string or a rope class, each ``isinstance`` / ``issubclass``
    of a rope class, each dict or ``match`` keyed by rope_type strings, each import of a rope law."""

    def mentions(node: ast.AST) -> bool:
        return any((isinstance(n, ast.Constant) and n.value in rope_types)
                   or (isinstance(n, ast.Name) and n.id in rope_classes) for n in ast.walk(node))

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and mentions(node):
            found.append(f"{node.lineno}: comparison")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("isinstance", "issubclass") and mentions(node)):
            found.append(f"{node.lineno}: {node.func.id}")
        elif isinstance(node, ast.Dict) and any(k is not None and mentions(k) for k in node.keys):
            found.append(f"{node.lineno}: dict keyed by rope_type")
        elif isinstance(node, ast.match_case) and mentions(node.pattern):
            found.append(f"{node.pattern.lineno}: match case")
        elif isinstance(node, ast.ImportFrom) and any(a.name in rope_classes for a in node.names):
            found.append(f"{node.lineno}: imports a rope law")
    return found


def test_the_source_check_catches_a_switch():
    types, classes = {"default", "linear"}, {"RoPE", "YaRN"}
    old = ('from posenc_lightning.encodings.rope_scaling import YaRN\n'
           'if rope_type == "linear":\n    pass\n'
           'if isinstance(enc, YaRN) or type(enc) in (RoPE,):\n    pass\n'
           'law = {"default": 1}\n'
           'match rope_type:\n    case "linear":\n        pass\n')
    assert sorted(switches(old, types, classes)) == ["1: imports a rope law", "2: comparison", "4: comparison",
                                                     "4: isinstance", "6: dict keyed by rope_type", "8: match case"]
    fine = 'rope_type = p.get("rope_type", p.get("type", "default"))\nlaws = hf_rope_laws()\nlaws[rope_type]\n'
    assert switches(fine, types, classes) == []


@pytest.mark.parametrize("path", SWITCH_FREE, ids=lambda p: p.name)
def test_hf_and_hf_export_hold_no_switch_on_rope_laws(path):
    assert switches(path.read_text(), set(hf_rope_laws()), _rope_class_names()) == []
