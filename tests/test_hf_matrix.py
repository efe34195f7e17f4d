"""Every architecture x encoding cell of the Hugging Face adapter (the README table), checked on tiny
random configs of real transformers architectures built locally (`benchmarks.hf_matrix`)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hf_matrix import ARCHS, ENCODINGS, ROTARY, cells, check, markdown


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


def test_readme_table_is_the_generated_one() -> None:
    """The README's architecture x encoding table is `markdown` of all-passing cells (regenerate it
    with ``python benchmarks/hf_matrix.py``)."""
    rows = [{"arch": a, "encoding": e, "finite": True, "changed": 1.0, "generate_err": 0.0, "grads_ok": True,
             "reload_err": 0.0} for a in ARCHS for e in ENCODINGS]
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert markdown(rows) in readme
