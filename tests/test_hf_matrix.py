"""Every architecture x encoding cell of the Hugging Face adapter (docs/reference/hf-matrix.md), checked
on tiny random configs of real transformers architectures built locally (`benchmarks.hf_matrix`)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hf_matrix import BREADTH, EAGER, PAGE, ROTARY, breadth_cells, cells, check, markdown, page


@pytest.mark.parametrize("arch,name", cells())
def test_cell(arch: str, name: str) -> None:
    warnings.filterwarnings("ignore")
    r = check(arch, name)
    assert r["finite"]
    assert r["changed"] > 1e-5, f"{arch} + {name} gives the original model's logits"
    # dynamic_ntk re-encodes the whole prefix at each new length in a full forward; decoding keeps the
    # earlier layers' outputs of the prefix (keys are re-rotated, not recomputed): 1e-5 per step here
    tol = 1e-4 if name == "dynamic_ntk" else 2e-5
    assert r["generate_err"] < tol, f"cached generate differs from a full forward by {r['generate_err']}"
    assert r["grads_ok"], f"encoding parameters without a finite nonzero gradient: {r['grads']}"
    assert r["reload_err"] == 0.0
    if name in ("nope", "dynamic_ntk", "long_rope") or arch == "gpt2" and name in ROTARY:
        assert r["mode"] in ("sdpa", "posenc_wrap_sdpa")  # only the rotation (or nothing) changes: the user's sdpa
    elif name in ROTARY:
        assert r["rotary"] == "RotaryTable" and r["mode"] == "sdpa"
    else:
        assert r["mode"] == "posenc_fused"
    if name in ("relative_bias", "fire", "fox", "cope"):
        assert r["n_params"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("arch,name", breadth_cells())
def test_breadth_cell(arch: str, name: str) -> None:
    """Gemma 2 (softcapping), Gemma 3 (per-layer-type rope), Cohere (interleaved), OPT (learned table
    with its offset) with alibi, fire and yarn; BLOOM (built-in ALiBi) refused, naming why."""
    warnings.filterwarnings("ignore")
    r = check(arch, name)
    if arch == "bloom":
        assert "BloomAttention computes its scores itself" in r["refused"]
        assert "Closest supported route" in r["refused"]
        return
    assert r["finite"] and r["changed"] > 1e-5
    assert r["generate_err"] < 2e-5, f"cached generate differs from a full forward by {r['generate_err']}"
    assert r["grads_ok"], f"encoding parameters without a finite nonzero gradient: {r['grads']}"
    assert r["reload_err"] == 0.0
    if name == "yarn":
        assert r["rotary"] == "RotaryTable" and r["mode"] == ("eager" if arch in EAGER else "sdpa")
    else:
        assert r["mode"] == "posenc_fused"
    if name == "fire":
        assert r["n_params"] > 0


def _passing_rows() -> list[dict]:
    rows = [{"arch": a, "encoding": e, "finite": True, "changed": 1.0, "generate_err": 0.0, "grads_ok": True,
             "reload_err": 0.0} for a, e in cells() + breadth_cells()]
    return [r | ({"refused": "BloomAttention ..."} if r["arch"] == "bloom" else {}) for r in rows]


def test_docs_table_is_the_generated_one() -> None:
    """docs/reference/hf-matrix.md is `page` of all-passing cells (regenerate it with
    ``python benchmarks/hf_matrix.py``); BLOOM's cells say refused."""
    text = PAGE.read_text()
    assert text == page(markdown(_passing_rows()))
    assert "| bloom | refused |  | refused |" in text and f"| {next(iter(BREADTH))} |" in text
