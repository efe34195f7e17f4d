"""`ContextParallel`: split each training and validation sequence over a group of ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from torch import nn

from posenc_lightning.parallel.group import ContextParallelGroup, check_world, engage
from posenc_lightning.parallel.layout import check_length
from posenc_lightning.parallel.shard import check_shardable, narrow_sampler, shard_batch

__all__ = ["ContextParallel"]


class ContextParallel(pl.Callback):
    """Context (sequence) parallelism for every encoding: ``size`` ranks share each sequence.

    The world (``devices x nodes`` ranks of a DDP-style strategy) is split into data-parallel groups
    of ``size`` consecutive ranks. Ranks of one group read the same batch (the distributed sampler
    runs over the data-parallel axis only); each keeps a head and a tail chunk of every sequence
    (causal load balancing) with the tokens' true global positions, and every attention layer
    gathers the keys of the whole sequence from the group (`posenc_lightning.parallel`). Each rank's
    loss is the mean over its tokens; the all-gather's backward sums every rank's use of a token,
    and the strategy's gradient average over the world then equals the gradient of the
    data-parallel mean loss (docs/guides/context-parallel.md).

    Args:
        size: ranks per sequence (1: nothing is sharded).

    Raises:
        ValueError: at setup, when the world size is not divisible by ``size``, a known sequence
            length (datamodule ``seq_len`` / ``val_seq_len``, curriculum stages) is not divisible
            by ``2 * size``, or a module cannot run sharded (named, with why).
    """

    def __init__(self, size: int = 2) -> None:
        if int(size) < 1:
            raise ValueError(f"ContextParallel(size={size}): size must be >= 1")
        self.size = int(size)
        self.group: ContextParallelGroup | None = None
        self._hooked: nn.Module | None = None
        self._restore_sampler: Any = None
        self._restore_hf: Any = None

    # ---------------------------------------------------------------- setup
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        check_world(trainer.world_size, self.size)
        self._check_lengths(trainer)
        check_shardable(pl_module)
        if self.size == 1 or self.group is not None:
            return
        self.group = ContextParallelGroup.from_world(self.size, trainer.strategy.root_device.type)
        self._restore_sampler = narrow_sampler(trainer.strategy, self.group.dp_size, self.group.dp_rank)
        self._restore_hf = _fused_hf_attention(pl_module)
        self._hook(pl_module)

    def _check_lengths(self, trainer: pl.Trainer) -> None:
        dm = getattr(trainer, "datamodule", None)
        for attr in ("seq_len", "val_seq_len"):
            n = getattr(dm, attr, None)
            if isinstance(n, int):
                check_length(n, self.size, f"datamodule.{attr} =")
        for cb in trainer.callbacks:
            for s in getattr(cb, "stages", None) or ():
                n = getattr(s, "seq_len", None)
                if isinstance(n, int):
                    check_length(n, self.size, f"{type(cb).__name__} stage seq_len =")

    def _hook(self, pl_module: pl.LightningModule) -> None:
        """Shard each batch after it reached the device: the module's own ``on_after_batch_transfer``
        runs first, then this rank keeps its tokens (training and validation, sanity check included)."""
        own = pl_module.on_after_batch_transfer
        group = self.group

        def on_after_batch_transfer(batch: Any, dataloader_idx: int) -> Any:
            batch = own(batch, dataloader_idx)
            trainer = pl_module._trainer
            if trainer is not None and (trainer.training or trainer.validating or trainer.sanity_checking):
                batch = shard_batch(batch, group)
            return batch

        pl_module.on_after_batch_transfer = on_after_batch_transfer  # type: ignore[method-assign]
        self._hooked = pl_module

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        engage(pl_module, None)
        if self._hooked is not None:
            self._hooked.__dict__.pop("on_after_batch_transfer", None)
            self._hooked = None
        for undo in (self._restore_sampler, self._restore_hf):
            if undo is not None:
                undo()
        self._restore_sampler = self._restore_hf = None
        self.group = None

    # ---------------------------------------------------------------- batches
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        engage(pl_module, self.group)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        engage(pl_module, None)

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        engage(pl_module, self.group)

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        engage(pl_module, None)


def _fused_hf_attention(model: nn.Module) -> Callable[[], None] | None:
    """`switch_to_fused_attention` for the Hugging Face models in ``model``; returns its undo, or None
    when there is none (without transformers imported there can be none: it is not imported here)."""
    import sys

    if "transformers" not in sys.modules:
        return None
    from posenc_lightning.adapters.hf import switch_to_fused_attention

    return switch_to_fused_attention(model)
