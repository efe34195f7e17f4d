"""Tiny TinyGPT runs shared by the curriculum / DDP / recipe tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from posenc_lightning.data import CorpusDataModule
from posenc_lightning.models import TinyGPT


class Recorder(pl.Callback):
    """Records per step: loss, batch length, batch size, the encoding scale, the LR; optionally
    writes them as JSON per rank (DDP)."""

    def __init__(self, out_dir: str | None = None) -> None:
        self.rows: list[dict[str, Any]] = []
        self.out_dir = out_dir

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from posenc_lightning.curriculum.context import encodings_of

        enc = encodings_of(pl_module)
        self.rows.append({"step": trainer.global_step - 1, "loss": float(outputs["loss"]),
                          "seq_len": int(batch[0].shape[-1]), "batch": int(batch[0].shape[0]),
                          "scale": getattr(enc[0], "factor", None) if enc else None,
                          "lr": trainer.optimizers[0].param_groups[0]["lr"],
                          "rank": trainer.global_rank, "world": trainer.world_size})

    def on_train_end(self, trainer, pl_module):
        if self.out_dir:
            p = Path(self.out_dir) / f"rank{trainer.global_rank}.json"
            p.write_text(json.dumps(self.rows))


def tiny_model(encoding: str | None = "rope", max_seq_len: int = 64, **kw: Any) -> TinyGPT:
    pl.seed_everything(0)
    return TinyGPT(d_model=32, n_layers=1, n_heads=2, max_seq_len=max_seq_len, encoding=encoding,
                   warmup_steps=2, **kw)


def tiny_data(seq_len: int = 16, batch_size: int = 4, **kw: Any) -> CorpusDataModule:
    kw.setdefault("max_val_windows", 2)
    return CorpusDataModule(seq_len=seq_len, batch_size=batch_size, max_bytes=200_000, **kw)


def trainer(max_steps: int, callbacks: list, **kw: Any) -> pl.Trainer:
    kw.setdefault("logger", False)
    kw.setdefault("enable_checkpointing", False)
    kw.setdefault("limit_val_batches", 0)
    return pl.Trainer(max_steps=max_steps, callbacks=callbacks, accelerator="cpu", devices=kw.pop("devices", 1),
                      enable_progress_bar=False, enable_model_summary=False, deterministic=True, **kw)


def losses(rows: list[dict[str, Any]]) -> torch.Tensor:
    return torch.tensor([r["loss"] for r in rows], dtype=torch.float64)
