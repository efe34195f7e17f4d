"""``posenc export``: a Lightning checkpoint of a trained `HFCausalLM` (or its run directory) written
as remote code or as a transformers directory, and the parse-time checks' one-line errors."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hf_matrix import build
from posenc_lightning import inject
from posenc_lightning.cli_export import load_trained, precheck_export
from tests.helpers import run_posenc

warnings.filterwarnings("ignore")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with the checkpoint of two training steps of a tiny Llama with FIRE."""
    import lightning.pytorch as pl

    root = tmp_path_factory.mktemp("run")
    module = build("llama").train()
    inject(module, "fire")
    ids = torch.randint(1, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(list(zip(ids[:, :-1], ids[:, 1:])), batch_size=2)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(module, data)
    (root / "checkpoints").mkdir()
    trainer.save_checkpoint(root / "checkpoints" / "last.ckpt")
    with torch.no_grad():
        ref = module.eval().model(ids).logits
    return root, ids, ref


@pytest.mark.parametrize("fmt", ["remote-code", "hf"])
def test_export_a_run_directory(run_dir, tmp_path, fmt):
    root, ids, ref = run_dir
    code, out = run_posenc("export", str(root), str(tmp_path / "out"), "--format", fmt)
    assert code == 0, out
    assert (tmp_path / "out" / "config.json").is_file()
    # the checkpoint's model, re-read from the export, is the trained one
    back = (transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), trust_remote_code=True,
                                                              local_files_only=True)
            if fmt == "remote-code" else load_trained(str(tmp_path / "out"))).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, atol=1e-5, rtol=0)


def test_export_checks_its_arguments_before_loading(run_dir, tmp_path):
    root, _, _ = run_dir
    assert "does not exist" in precheck_export(str(tmp_path / "nope"), str(tmp_path / "o"), "hf")
    assert "holds no .ckpt" in precheck_export(str(tmp_path), str(tmp_path / "o"), "hf")
    assert "not one of" in precheck_export(str(root), str(tmp_path / "o"), "onnx")
    assert precheck_export(str(root), str(tmp_path / "o"), "gguf") is None
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert "not empty" in precheck_export(str(root), str(tmp_path / "full"), "hf")
    code, out = run_posenc("export", str(tmp_path / "nope"), str(tmp_path / "o"))
    assert code == 2 and "RUN_OR_CHECKPOINT" in out
