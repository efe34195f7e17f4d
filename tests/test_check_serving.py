"""``posenc check-serving``: planted divergences flagged for each engine with the numbers the engines
compute (YaRN's 0.1 ln(s) + 1 against transformers' mscale ratio, a doubled length limit), the
transformers comparison measured on the directory, and clean exports passing."""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hf_matrix import build
from posenc_lightning import inject
from posenc_lightning.cli_export import check_serving
from posenc_lightning.models.hf_export import export_pretrained
from posenc_lightning.models.hf_remote import export_remote_code
from posenc_lightning.models.serving import (
    TOLERANCE,
    check_rules,
    compare_transformers,
    export_facts,
    reference_model,
)
from posenc_lightning.models.serving_rules import PINNED, RULES, in_range
from tests.helpers import run_posenc

warnings.filterwarnings("ignore")
CASES = {  # the tiny Llama is trained at 16 tokens (its max_position_embeddings)
    "yarn_mscale": ("yarn", {"factor": 16.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "yarn_attention_factor": ("yarn", {"factor": 4.0, "attention_factor": 1.0}),
    "dynamic": ("dynamic_ntk", {"factor": 4.0}),
    "longrope": ("long_rope", {"factor": 4.0}),
    "alibi": ("alibi", {}),
    "yarn": ("yarn", {"factor": 4.0}),
    "pi": ("pi", {"factor": 4.0}),
}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    out = {}
    for key, (name, cfg) in CASES.items():
        module = build("llama")
        inject(module, name, **cfg)
        (export_remote_code if name == "alibi" else export_pretrained)(module, str(root / key))
        out[key] = (str(root / key), module)
    return out


def _flagged(path: str, **versions: str) -> dict[str, list]:
    found: dict[str, list] = {}
    for f in check_rules(export_facts(path), versions):
        found.setdefault(f.engine, []).append(f)
    return found


def test_yarn_mscale_all_dim_flagged_for_vllm_and_llama_cpp(exports):
    found = _flagged(exports["yarn_mscale"][0])
    assert set(found) == {"vllm", "llama.cpp"}
    default = 0.1 * math.log(16) + 1  # 1.2773: what vLLM 0.25 and llama.cpp multiply cos/sin by
    assert f"{default:.4f}" == "1.2773"
    (vllm,) = found["vllm"]
    assert "1.2773" in vllm.computes and "transformers: 1.0000" in vllm.computes
    override = json.loads(vllm.override.split("'")[1])["rope_parameters"]
    assert override["attn_factor"] == pytest.approx(1 / default, abs=1e-6)  # 1.2773 x attn_factor = 1.0
    assert override["factor"] == 16.0 and "mscale_all_dim" not in override
    assert found["llama.cpp"][0].override.startswith(f"--override-kv llama.rope.scaling.attn_factor=float:{1 / default:.6g},")


def test_yarn_attention_factor_dropped_by_vllm(exports):
    found = _flagged(exports["yarn_attention_factor"][0])
    (vllm,) = found["vllm"]
    assert "drops attention_factor" in vllm.computes and f"{0.1 * math.log(4) + 1:.4f}" in vllm.computes


def test_dynamic_law_flagged_for_every_rope_engine_and_measured_in_transformers(exports):
    path, module = exports["dynamic"]
    found = _flagged(path)
    assert set(found) == {"vllm", "llama.cpp", "transformers"}
    assert "constant base" in found["vllm"][0].computes
    assert "one constant base theta (s^2 - s + 1)" in _flagged(path, vllm="0.19.0")["vllm"][0].computes
    # transformers, run here: the full forward is the trained model's, decoding past 16 tokens is not
    err = compare_transformers(path, module)
    assert err["full"] < 1e-5 and err["cached"] > 10 * TOLERANCE


def test_longrope_flagged_per_vllm_version(exports):
    path, module = exports["longrope"]
    assert "long factors for every request" in _flagged(path)["vllm"][0].computes
    assert "concurrent" in _flagged(path, vllm="0.11.0")["vllm"][0].computes
    assert "-c 16" in _flagged(path)["llama.cpp"][0].override
    assert compare_transformers(path, module)["cached"] > 10 * TOLERANCE


def test_vllm_doubles_an_already_extended_length(exports, tmp_path):
    """A dynamic export whose max_position_embeddings is already factor x original (as checkpoints
    that declare their extended context do): vLLM multiplies by the factor again."""
    path, _ = exports["dynamic"]
    cfg = json.loads((Path(path) / "config.json").read_text())
    cfg["max_position_embeddings"] = 64
    cfg["rope_parameters"]["original_max_position_embeddings"] = 16
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    length = [f for f in _flagged(str(tmp_path))["vllm"] if f.what == "length limit"]
    assert "= 256" in length[0].computes and length[0].override == "--max-model-len 64"


def test_alibi_remote_code_loses_its_bias_in_vllm_and_sglang(exports):
    path, _ = exports["alibi"]
    found = _flagged(path)
    for engine in ("vllm", "sglang"):
        lost = [f for f in found[engine] if f.what == "score-level encoding"]
        assert "alibi's score-level term is silently lost" in lost[0].computes
    assert "transformers" not in found
    lines, diverges = check_serving(path, engines=("transformers",))
    assert not diverges and any("equal [measured]" in line for line in lines)
    assert lines[-2:] == ["summary (per engine):", "  transformers: OK"]


@pytest.mark.parametrize("key", ["yarn", "pi"])
def test_clean_export_passes(exports, key):
    path, _ = exports[key]
    assert _flagged(path) == {}
    code, out = run_posenc("check-serving", path)
    assert code == 0, out
    assert out.count("no known divergence") == 3 and "equal [measured]" in out


def test_reference_model_is_posenc_reading_of_the_directory(exports):
    for key in ("dynamic", "alibi"):
        path, module = exports[key]
        assert compare_transformers(path, reference_model(path)) == pytest.approx(compare_transformers(path, module))


@pytest.mark.parametrize("key", ["yarn_mscale", "yarn_attention_factor", "dynamic", "longrope", "alibi"])
def test_planted_divergence_exits_non_zero(exports, key):
    code, out = run_posenc("check-serving", exports[key][0], "--no-compare")
    assert code == 1 and ("DIVERGES" in out or "REFUSES" in out)


def test_check_serving_argument_errors(tmp_path):
    assert run_posenc("check-serving", str(tmp_path))[0] == 2
    assert run_posenc("check-serving", str(tmp_path), "--version", "vlm=1")[0] == 2


def test_every_rule_formats_and_names_its_override_and_source(exports):
    facts = export_facts(exports["yarn_mscale"][0])
    for rule in RULES:
        assert rule.engine in PINNED and rule.override and rule.source
        rule.computes.format(**facts), rule.override.format(**facts)  # no fact a rule names is missing
    assert in_range("0.25.0", None, "0.26.0") and not in_range("0.26.0", None, "0.26.0")
    assert in_range("0.11.0", "0.7.0", "0.12.0") and not in_range("0.3.35", "0.3.36", None)


def _gguf(path: str) -> dict[str, object]:
    from posenc_lightning.models.gguf_check import gguf_precheck

    cfg = json.loads((Path(path) / "config.json").read_text())
    return {c.field: c.key for c in gguf_precheck(export_facts(path), cfg.get("rope_parameters") or {})}


def test_gguf_precheck_maps_each_rope_field_or_says_why_not(exports):
    clean = _gguf(exports["yarn"][0])
    assert clean["factor"] == "llama.rope.scaling.factor" and None not in clean.values()
    assert clean["original_max_position_embeddings"] == "llama.rope.scaling.original_context_length"
    msc = _gguf(exports["yarn_mscale"][0])
    assert msc["mscale_all_dim"] is None and msc["mscale"] is None  # the LLaMA loader reads neither
    assert _gguf(exports["dynamic"][0])["rope_type"] is None
    assert _gguf(exports["alibi"][0])["encoding"] is None


def test_gguf_precheck_refuses_a_beta_llama_cpp_cannot_read(exports, tmp_path):
    cfg = json.loads((Path(exports["yarn"][0]) / "config.json").read_text())
    cfg["rope_parameters"]["beta_fast"] = 16.0  # llama.cpp's LLaMA loader keeps its 32
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert _gguf(str(tmp_path))["beta_fast"] is None
    code, out = run_posenc("check-serving", str(tmp_path), "--no-compare", "--engines", "llama.cpp")
    assert code == 1 and "beta_fast=16.0: CANNOT" in out


def test_summary_has_one_line_per_engine(exports):
    """The report ends with one line per engine: OK, or what diverges."""
    _, out = run_posenc("check-serving", exports["yarn_mscale"][0], "--no-compare")
    tail = out.strip().splitlines()[-4:]
    assert tail[0].startswith("  transformers: OK") and tail[2] == "  sglang: OK"
    assert tail[1] == "  vllm: diverges: attention factor"
    assert tail[3].startswith("  llama.cpp: diverges: attention factor; GGUF cannot carry mscale, mscale_all_dim")
    _, out = run_posenc("check-serving", exports["alibi"][0], "--no-compare")
    assert "  vllm: diverges: score-level encoding; refuses: architecture" in out
