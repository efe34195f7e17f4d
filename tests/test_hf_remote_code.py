"""Remote-code export: a trained tiny Llama with a score-level encoding reloads through
``trust_remote_code`` in a fresh process where posenc_lightning cannot be imported, with the trained
model's logits (at arange and at shifted positions) and a KV-cached ``generate`` equal to the full
forward and to the trained model's own generation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.hf_matrix import build
from posenc_lightning import inject
from posenc_lightning.models.hf_remote import FAMILIES, export_remote_code, modeling_source

warnings.filterwarnings("ignore")
ENCODINGS = ("alibi", "relative_bias", "fire", "fox", "sba", "cope")
N, PROMPT, NEW = 21, 9, 6


def _trained(name: str, **cfg):
    """A tiny Llama with ``name`` injected after three AdamW steps (the encoding's parameters move
    off their initial values: CoPE's embeddings start at zero)."""
    module = build("llama")
    inject(module, name, **cfg)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    module.train()
    for _ in range(3):
        ids = torch.randint(1, 64, (2, 24), generator=g)
        module.model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return module.eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    ids = torch.randint(1, 64, (2, N), generator=torch.Generator().manual_seed(5))
    shifted = (torch.arange(N) + torch.tensor([[3], [11]]))  # positions that are not arange
    refs = {}
    for name in ENCODINGS:
        module = _trained(name)
        hf = module.model
        moved = [p for n, p in hf.named_parameters() if ".posenc." in n]
        assert all(p.abs().sum() > 0 for p in moved)
        d = root / name
        export_remote_code(module, str(d))
        with torch.no_grad():
            refs[name] = {"logits": hf(ids).logits, "shifted": hf(ids, position_ids=shifted).logits}
        gen = hf.generate(ids[:, :PROMPT], attention_mask=torch.ones_like(ids[:, :PROMPT]), max_new_tokens=NEW,
                          do_sample=False, pad_token_id=0)
        refs[name]["sequences"] = gen
        torch.save({"ids": ids, "position_ids": shifted, "prompt": PROMPT, "new": NEW}, d / "inputs.pt")
    blocker = root / "blocker"
    blocker.mkdir()
    (blocker / "posenc_lightning.py").write_text("raise ImportError('posenc_lightning is not installed here')\n")
    job = root / "job.json"
    job.write_text(json.dumps({"dirs": [str(root / n) for n in ENCODINGS], "out": str(root / "out.pt")}))
    env = {**os.environ, "PYTHONPATH": str(blocker), "HF_HOME": str(root / "hf_home"), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "remote_code_worker.py"), str(job)], check=False,
                         cwd=str(root),
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = torch.load(root / "out.pt", weights_only=False)
    return root, refs, out


@pytest.mark.parametrize("name", ENCODINGS)
def test_remote_code_logits_equal_the_trained_model_without_posenc(exported, name):
    root, refs, out = exported
    assert out["posenc_blocked"]  # the worker could not import posenc_lightning
    got = out[str(root / name)]
    assert got["class"].startswith("transformers_modules")  # loaded from the directory's modeling file
    torch.testing.assert_close(got["logits"], refs[name]["logits"], atol=1e-5, rtol=0)
    torch.testing.assert_close(got["shifted"], refs[name]["shifted"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ENCODINGS)
def test_remote_code_cached_generation_equals_the_full_forward(exported, name):
    root, refs, out = exported
    got = out[str(root / name)]
    seq, full, steps = got["sequences"], got["full"], got["step_logits"]
    # greedy: each new token is the full forward's argmax at the step before it
    assert torch.equal(full[:, PROMPT - 1:-1].argmax(-1), seq[:, PROMPT:])
    # the cached steps' logits are the full forward's at the same tokens, the last step included
    torch.testing.assert_close(steps, full[:, PROMPT - 1:-1], atol=1e-5, rtol=0)
    assert torch.equal(seq, refs[name]["sequences"])  # and the trained model generates the same


def test_remote_code_directory_is_not_served_as_a_plain_model(exported):
    """model_type is posenc_llama: without trust_remote_code transformers refuses the directory instead
    of loading a Llama without its encoding."""
    root, _, _ = exported
    config = json.loads((root / "alibi" / "config.json").read_text())
    assert config["model_type"] == "posenc_llama"
    assert config["posenc"] == {"encoding": "alibi", "template": "alibi", "config": {"slope_scale": 1.0},
                                "n_heads": 4, "head_dim": 16, "d_model": 64}
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoModelForCausalLM.from_pretrained(str(root / "alibi"), local_files_only=True,
                                                          trust_remote_code=False)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_modeling_file_imports_torch_and_transformers_only(name):
    source = modeling_source(name, transformers.LlamaForCausalLM, "posenc_llama")
    compile(source, f"modeling_{name}.py", "exec")
    imports = [ln.split()[1] for ln in source.splitlines() if ln.startswith(("import ", "from "))]
    assert {m.split(".")[0] for m in imports} <= {"__future__", "math", "torch", "transformers"}, imports


@pytest.mark.parametrize("name,cfg,match", [("yarn", {"factor": 4.0}, "format='hf'"),
                                            ("mixture", {}, "no remote-code template"),
                                            ("fox", {"rope": True}, "fox with rope=True")])
def test_remote_code_refuses_what_it_cannot_write(tmp_path, name, cfg, match):
    module = build("llama")
    inject(module, name, **cfg)
    with pytest.raises(ValueError, match=match):
        export_remote_code(module, str(tmp_path))


def test_remote_code_needs_an_injected_encoding(tmp_path):
    with pytest.raises(ValueError, match="no injected encoding"):
        export_remote_code(build("llama"), str(tmp_path))
