"""Recipe results state what ran: ``trainer.global_step``, why a run stopped short, and a verdict
(``target_met``) only for a run that reached its configured steps. No file outside the run
directory with or without a logger; ``--trainer.barebones=true`` runs."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest

from posenc_lightning.data import CorpusDataModule
from posenc_lightning.models import TinyGPT
from posenc_lightning.recipes import bigram_perplexity, extension_verdict, stop_reason
from tests.helpers import recipe_module

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--data.max_bytes=100000", "--data.batch_size=2", "--data.max_val_windows=2", "--model.d_model=16",
        "--model.n_layers=1", "--extend.eval_tokens=256", "--extend.factor=2"]


def _fit(**trainer_kw) -> pl.Trainer:
    data = CorpusDataModule(seq_len=16, batch_size=2, max_bytes=50_000, samples_per_epoch=6)
    t = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   limit_val_batches=0, accelerator="cpu", **trainer_kw)
    t.fit(TinyGPT(d_model=16, n_layers=1, n_heads=2, max_seq_len=16), data)
    return t


def test_stop_reason_names_the_cause():
    t = _fit(max_steps=3)
    assert (t.global_step, stop_reason(t)) == (3, None)  # reached max_steps
    t = _fit(max_steps=10, max_epochs=1)  # 6 windows / batch 2 = 3 steps per epoch
    assert t.global_step == 3
    assert stop_reason(t) == "stopped at step 3 of max_steps=10 (max_epochs=1 reached first)"
    t = _fit(max_steps=10, max_time={"seconds": 0})  # the Timer stops before the first step
    assert t.global_step == 0 and stop_reason(t) == "stopped at step 0 of max_steps=10 (max_time reached)"
    t = _fit(max_steps=-1, max_epochs=2)
    assert (t.global_step, stop_reason(t)) == (6, None)  # ran its epochs


@pytest.fixture
def yarn_extend():
    return recipe_module("yarn_extend")


def test_yarn_extend_gives_no_verdict_for_a_shortened_run(yarn_extend, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = yarn_extend.main(["--config", str(ROOT / "configs" / "yarn_extend.yaml"), *TINY, "--trainer.max_steps=20",
                          "--trainer.max_epochs=1", "--data.samples_per_epoch=6", "--extend.finetune_steps=1"])
    assert (r["pretrain_steps"], r["pretrain_max_steps"], r["finetune_steps"]) == (3, 20, 1)
    assert r["target_met"] is None
    assert r["target"] == "no verdict: pre-training stopped at step 3 of max_steps=20 (max_epochs=1 reached first)"
    md = next(tmp_path.rglob("results.md")).read_text()
    assert "Pre-training: 3 steps at L=64" in md and r["target"] in md


def test_yarn_extend_max_epochs_records_the_steps_that_ran(yarn_extend, tmp_path, monkeypatch):
    """--trainer.max_steps=-1: the steps are trainer.global_step (was "-1 steps"), fine-tune 5% of them."""
    monkeypatch.chdir(tmp_path)
    r = yarn_extend.main(["--config", str(ROOT / "configs" / "yarn_extend.yaml"), *TINY, "--trainer.max_steps=-1",
                          "--trainer.max_epochs=2", "--data.samples_per_epoch=40", "--extend.finetune_steps=-1"])
    assert (r["pretrain_steps"], r["finetune_steps"], r["finetune_max_steps"]) == (40, 2, 2)  # 2 x 20; 40 // 20
    # both runs complete and 2 <= 5% of 40, but 40 steps of a 1-layer d=16 model do not beat a byte bigram
    assert r["rope_ppl_L"] > r["bigram_ppl"] and r["target_met"] is None
    assert r["target"].startswith("no verdict: the pre-trained rope") and "byte-bigram" in r["target"]


def test_no_logger_writes_only_into_results_dir(yarn_extend, tmp_path, monkeypatch):
    cwd, out = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yarn_extend.main(["--config", str(ROOT / "configs" / "yarn_extend.yaml"), *TINY, "--trainer.max_steps=2",
                      "--trainer.val_check_interval=2", "--extend.finetune_steps=1", "--trainer.logger=false",
                      f"--extend.results_dir={out}"])
    assert list(cwd.iterdir()) == []
    assert {p.name for p in out.iterdir()} >= {"results.json", "results.md", "pretrained.ckpt", "checkpoints"}
    # and without results_dir: runs/yarn_extend in the working directory, nothing beside it
    yarn_extend.main(["--config", str(ROOT / "configs" / "yarn_extend.yaml"), *TINY, "--trainer.max_steps=2",
                      "--extend.finetune_steps=1", "--trainer.logger=false"])
    assert [p.name for p in cwd.iterdir()] == ["runs"]
    assert (cwd / "runs" / "yarn_extend" / "results.json").is_file()


def test_barebones_runs_and_says_what_it_turned_off(yarn_extend, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    r = yarn_extend.main(["--config", str(ROOT / "configs" / "yarn_extend.yaml"), *TINY, "--trainer.max_steps=2",
                          "--extend.finetune_steps=1", "--trainer.barebones=true"])
    err = capsys.readouterr().err
    assert "barebones=true: turned off log_every_n_steps, logger" in err
    saved = json.loads((tmp_path / "runs" / "yarn_extend" / "results.json").read_text())
    assert saved["results"]["pretrain_steps"] == r["pretrain_steps"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]


def test_bigram_perplexity_by_hand():
    import torch

    # add-one counts over 0,1,0,1,0: [[1, 3], [3, 1]] -> P(1|0) = P(0|1) = 3/4; text 0,1,0: ppl 4/3
    ppl = bigram_perplexity(torch.tensor([0, 1, 0, 1, 0]), torch.tensor([0, 1, 0, 1]), eval_tokens=2, vocab=2)
    assert ppl == pytest.approx(4 / 3, rel=1e-12)


def test_extension_verdict_rules():
    ok = {"pre_reason": None, "ft_reason": None, "ft_steps": 20, "pre_steps": 400, "gap": 0.039, "rope_ppl": 7.0, "bigram_ppl": 10.3}
    assert extension_verdict(**ok) == (True, "met (+3.90%)")
    assert extension_verdict(**{**ok, "gap": 0.06}) == (False, "NOT met (+6.00%)")
    assert extension_verdict(**{**ok, "ft_steps": 21}) == (False, "NOT met: 21 fine-tune steps are more than 5% of 400")
    assert extension_verdict(**{**ok, "pre_reason": "stopped at step 15 of max_steps=400 (max_time reached)"}) == (
        None, "no verdict: pre-training stopped at step 15 of max_steps=400 (max_time reached)")
    assert extension_verdict(**{**ok, "ft_reason": "x"}) == (None, "no verdict: fine-tune x")
    met, why = extension_verdict(**{**ok, "rope_ppl": 16.5})  # the untrained model
    assert met is None and why.startswith("no verdict: the pre-trained rope (ppl 16.50 at L) does not beat")
