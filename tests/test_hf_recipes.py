"""The offline pretrained-model flow, shortened: recipes/hf_pretrain.py makes a Hugging Face directory
(a Llama with a BPE tokenizer trained locally), recipes/yarn_extend.py extends it through
``--model=posenc_lightning.models.hf.HFCausalLM --model.pretrained_dir=...`` (no pre-training), runs
RULER inside the fine-tune's fit with the model's own tokenizer, exports and reloads in plain transformers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _recipes():
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        import hf_pretrain
        import longrope_extend
        import yarn_extend
    finally:
        sys.path.pop(0)
    return hf_pretrain, yarn_extend, longrope_extend


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    hf_pretrain = _recipes()[0]
    tmp = tmp_path_factory.mktemp("hf_pretrain")
    out = tmp / "model"
    hf_pretrain.main(["--config", str(ROOT / "configs/hf_pretrain.yaml"), "--trainer.max_steps=2",
                      "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", "--trainer.logger=false",
                      "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp}",
                      "--data.max_bytes=150000", f"--pretrain.out={out}", "--pretrain.tokenizer_vocab=320",
                      "--pretrain.tokenizer_files=10"])
    return out


def test_pretrain_writes_a_hugging_face_directory(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = json.loads((model_dir / "posenc_pretrain.json").read_text())
    assert info["steps"] == 2 and info["tokenizer_vocab"] == 320 and info["seq_len"] == 64
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    assert len(tok) == 320 == model.config.vocab_size and tok.eos_token_id == 0


def test_yarn_extend_a_hugging_face_directory(model_dir, tmp_path):
    yarn_extend = _recipes()[1]
    res = tmp_path / "res"
    r = yarn_extend.main(["--config", str(ROOT / "configs/hf_yarn_extend.yaml"), f"--model.pretrained_dir={model_dir}",
                          "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--data.max_bytes=150000",
                          "--extend.finetune_steps=1", "--extend.eval_tokens=1024", f"--extend.results_dir={res}",
                          "--extend.lm_eval_lengths=[512]", "--extend.lm_eval_limit=1",
                          f"--extend.export_dir={tmp_path / 'export'}"])
    assert r["pretrain_steps"] == 2 and r["finetune_steps"] == 1 and r["L"] == 64
    assert "lm_eval/niah_single_1/512" in r  # RULER ran inside fit
    assert r["export_format"] == "transformers" and r["export_reload_max_abs_logit_diff"] < 1e-5
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == "yarn" and cfg["rope_parameters"]["factor"] == 8.0
    assert cfg["rope_parameters"]["original_max_position_embeddings"] == 64 and cfg["max_position_embeddings"] == 512
    assert (tmp_path / "export" / "tokenizer.json").is_file()
    assert "own tokenizer" in (res / "results.md").read_text()


def test_longrope_extend_searches_a_hugging_face_model(model_dir, tmp_path):
    longrope_extend = _recipes()[2]
    r = longrope_extend.main(["--config", str(ROOT / "configs/longrope_extend.yaml"),
                              "--model=posenc_lightning.models.hf.HFCausalLM", f"--model.pretrained_dir={model_dir}",
                              "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--data.max_bytes=150000",
                              "--extend.finetune_steps=1", "--extend.eval_tokens=512", "--extend.population=3",
                              "--extend.parents=2", "--extend.iterations=1", "--extend.search_windows=1",
                              f"--extend.results_dir={tmp_path / 'res'}"])
    assert r["pretrain_steps"] == 2 and r["L"] == 64
    assert len(r["long_factor"]) == 8 and r["long_factor"] == sorted(r["long_factor"])  # monotonic, rotary_dim/2
    assert r["finetune_steps"] == 1
