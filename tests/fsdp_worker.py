"""The 2-process side of tests/test_fsdp.py, run as ``python -m tests.fsdp_worker OUT ENCODING...``.

Lightning's ``ModelParallelStrategy`` launches its processes by running this script again (rank 1
with ``LOCAL_RANK=1``), so it is a script, not a test. For each encoding, 2 CPU processes (gloo,
FSDP2: `TinyGPT.configure_model` shards the model over the data-parallel mesh) train TinyGPT with
``PosEncCallback(encoding)`` for 5 steps and save a distributed checkpoint at step 3 (``run``);
a fresh model then resumes from it with ``ckpt_path`` for steps 3 and 4 (``resume``). `Probe`
writes each rank's losses, the encoding's sharding and its full parameters to ``OUT/<enc>/<run>/``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from posenc_lightning import PosEncCallback
from posenc_lightning.curriculum.context import ContextCurriculum, Stage
from posenc_lightning.models import TinyGPT
from tests.curriculum_helpers import tiny_data, trainer

STEPS, SAVE_AT = 5, 3


def tiny_gpt(seed: int = 0) -> TinyGPT:
    """2 layers (the encoding is shared by both), d_model 32, 2 heads; the encoding comes from the callback."""
    pl.seed_everything(seed)
    return TinyGPT(d_model=32, n_layers=2, n_heads=2, max_seq_len=64, encoding=None, warmup_steps=2)


def callbacks(encoding: str, out: Path) -> list[pl.Callback]:
    """`Probe` first: it seeds at ``setup``, before `PosEncCallback` builds the encoding, so every
    rank and the 1-process run initialise it alike (FSDP2 shards each rank's own values; it
    broadcasts nothing)."""
    return [Probe(out), PosEncCallback(encoding), ContextCurriculum([Stage(0, 16)], seed=7)]


def _full(p: torch.Tensor) -> list[float]:
    from torch.distributed.tensor import DTensor

    t = p.full_tensor() if isinstance(p, DTensor) else p
    return t.detach().double().flatten().tolist()


class Probe(pl.Callback):
    """Seeds at ``setup``; records per rank the loss of every step and the encoding's parameters
    (kind, placements, local and global shape, full values at train start and end) as JSON."""

    def __init__(self, out: Path, seed: int = 0) -> None:
        self.out, self.seed = Path(out), seed
        self.rec: dict[str, Any] = {"loss": [], "step": []}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        pl.seed_everything(self.seed)

    def _params(self, pl_module: pl.LightningModule) -> dict[str, list[float]]:
        return {n: _full(p) for n, p in pl_module.named_parameters() if "posenc" in n}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        self.rec["world"] = trainer.world_size
        self.rec["shards"] = {
            n: {"dtensor": isinstance(p, DTensor), "placements": [str(x) for x in getattr(p, "placements", ())],
                "mesh": p.device_mesh.size() if isinstance(p, DTensor) else 1, "shape": list(p.shape),
                "local": list(p.to_local().shape) if isinstance(p, DTensor) else list(p.shape)}
            for n, p in pl_module.named_parameters() if "posenc" in n}
        self.rec["start"] = self._params(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.rec["loss"].append(float(outputs["loss"]))
        self.rec["step"].append(trainer.global_step - 1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rec["end"] = self._params(pl_module)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.rec))


def fsdp_fit(encoding: str, out: Path) -> None:
    """The 2-process run (checkpoint at step `SAVE_AT`), then the resumed one."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    def strategy() -> ModelParallelStrategy:
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo")

    ckpt = ModelCheckpoint(dirpath=out / "ckpt", filename="step3", every_n_train_steps=SAVE_AT, save_top_k=-1)
    trainer(STEPS, [*callbacks(encoding, out / "run"), ckpt], devices=2, strategy=strategy(),
            enable_checkpointing=True).fit(tiny_gpt(), tiny_data(batch_size=2))
    # a model with other weights: what the resumed run trains comes from the checkpoint alone
    trainer(STEPS, callbacks(encoding, out / "resume"), devices=2, strategy=strategy(),
            ).fit(tiny_gpt(seed=1), tiny_data(batch_size=2), ckpt_path=str(out / "ckpt" / "step3.ckpt"))


def one_process_fit(encoding: str, out: Path) -> None:
    """The reference: 1 process, the same global batch (4 windows; the curriculum splits them by rank)."""
    trainer(STEPS, callbacks(encoding, out)).fit(tiny_gpt(), tiny_data(batch_size=4))


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for name in sys.argv[2:]:
        fsdp_fit(name, root / name)
