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


def test_pretrain_then_extend_a_hugging_face_directory(tmp_path):
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        import hf_pretrain
        import yarn_extend
    finally:
        sys.path.pop(0)

    model_dir = tmp_path / "model"
    hf_pretrain.main(["--config", str(ROOT / "configs/hf_pretrain.yaml"), "--trainer.max_steps=2",
                      "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", "--trainer.logger=false",
                      "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}",
                      "--data.max_bytes=150000", f"--pretrain.out={model_dir}", "--pretrain.tokenizer_vocab=320",
                      "--pretrain.tokenizer_files=10"])
    info = json.loads((model_dir / "posenc_pretrain.json").read_text())
    assert info["steps"] == 2 and info["tokenizer_vocab"] == 320
    assert (model_dir / "tokenizer.json").is_file() and (model_dir / "model.safetensors").is_file()

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
    saved = json.loads((res / "results.json").read_text())
    assert "own tokenizer" in (res / "results.md").read_text() and saved
