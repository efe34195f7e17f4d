"""`CausalLMSteps`: the Lightning side shared by the project's causal LMs (`TinyGPT`, `HFCausalLM`):
per-token NLL, training / validation steps, AdamW with warm-up and cosine decay, and the encoding
spec in checkpoints. A model supplies ``forward(input_ids, **kw) -> logits`` and the hyperparameters
``lr``, ``weight_decay``, ``warmup_steps``, ``min_lr_ratio``; it creates ``self.val_nll`` (a MeanMetric)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc_lightning.inject import CHECKPOINT_KEY, injected_spec, restore_from_checkpoint
from posenc_lightning.parallel.group import ContextParallelGroup

#: the target of an unscored token (``F.cross_entropy``'s default ``ignore_index``)
IGNORE_INDEX = -100


def masked_mean(nll: Tensor, targets: Tensor, group: ContextParallelGroup | None = None) -> Tensor:
    """The mean of ``nll`` over scored tokens (``targets != IGNORE_INDEX``; the cross-entropy is 0
    at the others): the plain mean when every token is scored.

    Under context parallelism (``group``) ``nll`` is this rank's shard: the result is the shard's sum over the
    whole sequence's scored-token count, times the group size, so that the ranks' mean (what DDP's
    gradient averaging takes) is the sequence's mean however the scored tokens fall on the shards.
    """
    scored = (targets != IGNORE_INDEX).sum()
    if group is None:
        return nll.sum() / scored.clamp(min=1)
    return nll.sum() * group.size / group.sum(scored).clamp(min=1)


class CausalLMSteps:
    """Mixin for a ``LightningModule`` that is a causal language model over ``(input_ids, targets)``."""

    #: the context-parallel group the batches in flight are sharded over (`parallel.group.engage`)
    posenc_context_parallel: ContextParallelGroup | None = None

    def token_nll(self, input_ids: Tensor, targets: Tensor, **kw: Any) -> Tensor:
        """Per-token negative log-likelihood ``[B, N]`` (float32); 0 where ``targets`` is
        ``IGNORE_INDEX`` (-100: tokens outside a task's answer). Under context parallelism the
        inputs are this rank's shard, and the model gets the tokens' global positions."""
        group = self.posenc_context_parallel
        if group is not None and kw.get("positions") is None and kw.get("cache") is None:
            kw["positions"] = group.positions(input_ids.shape[0], input_ids.shape[1], input_ids.device)
        logits = self(input_ids, **kw)
        return F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = masked_mean(self.token_nll(x, y), y, self.posenc_context_parallel)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        nll = self.token_nll(x, y)
        self.val_nll.update(nll[y != IGNORE_INDEX])  # scored tokens only (all of them for plain LM data)

    def on_validation_epoch_end(self) -> None:
        # the MeanMetric's compute() already gathers every rank's tokens: the same global mean on
        # every rank. sync_dist=True averages those equal values (no change) and says so to Lightning,
        # which otherwise warns that an epoch-level value is not synced across processes
        mean = self.val_nll.compute()
        self.val_nll.reset()
        self.log("val/loss", mean, prog_bar=True, sync_dist=True)
        self.log("val/ppl", torch.exp(mean), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            (decay if p.dim() >= 2 and "posenc" not in name else no_decay).append(p)
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.hparams.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=self.hparams.lr, betas=(0.9, 0.95))
        total = self.trainer.max_steps if self.trainer and self.trainer.max_steps > 0 else None
        if total is None:
            return opt
        warm, floor = self.hparams.warmup_steps, self.hparams.min_lr_ratio

        def lr_lambda(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            t = min(1.0, (step - warm) / max(1, total - warm))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        spec = injected_spec(self)
        if spec is not None:
            checkpoint[CHECKPOINT_KEY] = dict(spec)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        restore_from_checkpoint(self, checkpoint)
