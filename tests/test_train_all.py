"""Every registered encoding trains in TinyGPT through PosEncCallback(name) with a finite loss."""

import lightning.pytorch as pl
import pytest
import torch

from posenc_lightning import PosEncCallback, available_encodings
from posenc_lightning.data import CorpusDataModule
from posenc_lightning.models import TinyGPT


@pytest.mark.parametrize("name", available_encodings())
def test_every_encoding_trains_in_tinygpt(tmp_path, name):
    torch.manual_seed(0)
    model = TinyGPT(d_model=64, n_layers=2, n_heads=2, max_seq_len=64, encoding=None)
    data = CorpusDataModule(seq_len=48, batch_size=4, max_bytes=100_000, max_val_windows=2)
    cb = PosEncCallback(name)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         limit_val_batches=1, val_check_interval=3, callbacks=[cb], default_root_dir=tmp_path)
    trainer.fit(model, data)
    assert trainer.global_step == 3
    assert torch.isfinite(trainer.callback_metrics["train/loss"]), name
    assert torch.isfinite(trainer.callback_metrics["val/ppl"]), name
    assert cb.injected.name == name
