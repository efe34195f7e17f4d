"""The generic parts of the Triton kernels and their backend name no encoding (issue 29): what an
encoding brings to the kernels comes through the `Bias` protocol (`fold_into`, `TileBias`), so
a new parametric bias needs no edit here. A name is matched case-insensitively as a word, ``_``
separating words (``HAS_FIRE`` names FIRE, ``pid_m`` does not name ``pi``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import posenc_lightning
from posenc_lightning.encodings.registry import available_encodings

ROOT = Path(posenc_lightning.__file__).parent
GENERIC = [*(f"kernels/{m}.py" for m in ("_common", "fused", "softmax", "stick_breaking", "resource_report")),
           "attention/backends/triton.py"]


def _names() -> list[str]:
    return sorted({*available_encodings(), "fire"})


def _hits(text: str, names: list[str]) -> list[str]:
    """``line: name`` for every word of ``text`` that is one of ``names``."""
    out = []
    for name in names:
        for m in re.finditer(rf"(?<![a-z0-9]){re.escape(name)}(?![a-z0-9])", text, re.IGNORECASE):
            out.append(f"{text.count(chr(10), 0, m.start()) + 1}: {name}")
    return out


def test_the_matcher_finds_names_as_words():
    names = ["fire", "pi", "rope_2d"]
    assert _hits("HAS_FIRE = fire_tile(FIRE)", names) == ["1: fire"] * 3
    assert _hits("x = tl.program_id(0); pid_m = 1; spin\nrope_2d", names) == ["2: rope_2d"]
    assert _hits("firefly empire", names) == []
    assert {"fire", "alibi", "rope", "sba"} <= set(_names())  # the registry is read


@pytest.mark.parametrize("path", GENERIC)
def test_generic_kernel_code_names_no_encoding(path):
    assert _hits((ROOT / path).read_text(), _names()) == []
