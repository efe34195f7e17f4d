"""A short ``Trainer.fit`` on one GPU with ``precision="bf16-mixed"`` for each encoding family
(rotary, linear bias, learned bias, data-dependent decay, stick-breaking normalizer), injected by
`PosEncCallback` on the default backend: the loss is finite at every step and goes down."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import GPU

pytestmark = GPU


def _loss_recorder():
    """A callback that keeps every training step's loss and the device it ran on (lightning imported here: collection on
    a machine without a GPU stays light)."""
    import lightning.pytorch as pl

    class Losses(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.devices: set[str] = set()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))
            self.devices.add(next(pl_module.parameters()).device.type)

    return Losses()


@pytest.mark.parametrize("name", ["rope", "alibi", "fire", "fox", "sba"])
def test_trainer_fit_bf16_mixed_on_one_gpu(tmp_path, name):
    import lightning.pytorch as pl

    from posenc_lightning import PosEncCallback
    from posenc_lightning.data import CorpusDataModule
    from posenc_lightning.models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(d_model=64, n_layers=2, n_heads=4, max_seq_len=256, encoding=None, lr=3e-3, warmup_steps=2)
    rec, cb = _loss_recorder(), PosEncCallback(name)
    trainer = pl.Trainer(max_steps=30, accelerator="gpu", devices=1, precision="bf16-mixed", logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[cb, rec], default_root_dir=tmp_path, limit_val_batches=0)
    trainer.fit(model, CorpusDataModule(seq_len=200, batch_size=8, max_bytes=400_000, max_val_windows=4))
    assert trainer.global_step == 30 and cb.injected.name == name
    assert rec.devices == {"cuda"}  # while it trained: the strategy's teardown moves it back to the CPU
    losses = rec.losses
    assert len(losses) == 30 and all(torch.isfinite(torch.tensor(losses))), losses
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.3, (first, last)  # byte-level corpus: starts near ln 256 = 5.5
