"""``python -m tests.cp_fsdp_worker OUT DEVICES``: TinyGPT (alibi) under Lightning's
``ModelParallelStrategy`` (FSDP2 over gloo CPU, `TinyGPT.shard`) for 3 steps; with 2 devices also
``ContextParallel(2)``. Each rank writes its losses and shard lengths to ``OUT/rankR.json``
(tests/test_context_parallel_fsdp.py; the strategy starts rank 1 by running this module again)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl


class Losses(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out, self.rows = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append([float(outputs["loss"]), batch[0].shape[1]])

    def on_train_end(self, trainer, pl_module):
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))


def main(out: Path, devices: int) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from posenc_lightning import ContextParallel
    from tests.curriculum_helpers import tiny_data, tiny_model

    pl.seed_everything(0)
    callbacks = [Losses(out)] + ([ContextParallel(devices)] if devices > 1 else [])
    strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1, process_group_backend="gloo")
    pl.Trainer(max_steps=3, accelerator="cpu", devices=devices, strategy=strategy, callbacks=callbacks, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
               deterministic=True).fit(tiny_model("alibi"), tiny_data(seq_len=16, batch_size=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
