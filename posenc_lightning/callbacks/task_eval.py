"""`TaskEvalCallback`: exact-match accuracy of a synthetic task at several lengths."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from posenc_lightning.callbacks.length_eval import _scalable_encodings


class TaskEvalCallback(pl.Callback):
    """At each validation end: exact-match accuracy (and answer-token accuracy) of the model on the
    datamodule's test sets at several lengths, logged as ``task_eval/exact_match/<n>`` and
    ``task_eval/token_accuracy/<n>``.

    The test sets come from the datamodule's ``length_dataloader(seq_len, max_windows, batch_size)``
    (`TaskDataModule` has it); ranks split the batches and `ExactMatchByLength` sums over them. A
    length the model cannot run (a learned table shorter than it) gives NaN and is named in
    ``failures``.

    Args:
        lengths: evaluation lengths; default ``multiples`` of ``base_len``.
        multiples: multiples of the training length.
        base_len: the training length (default: the datamodule's ``train_len`` / ``seq_len``).
        examples: examples per length (default: the datamodule's ``test_examples``).
        batch_tokens: about this many tokens per evaluation batch (at least one sequence).
        scale_with_length: the zero-shot extension protocol (PI / NTK / YaRN): at length ``n`` every
            scalable encoding gets the factor ``max(1, n / base_len)``, restored afterwards.
    """

    def __init__(self, lengths: Sequence[int] | None = None, multiples: Sequence[int] = (1, 2, 4, 8),
                 base_len: int | None = None, examples: int | None = None, batch_tokens: int = 4096,
                 scale_with_length: bool = False) -> None:
        self.lengths = [int(n) for n in lengths] if lengths else None
        self.multiples = list(multiples)
        self.base_len, self.examples, self.batch_tokens = base_len, examples, batch_tokens
        self.scale_with_length = scale_with_length
        self.results: dict[int, float] = {}
        self.token_accuracy: dict[int, float] = {}
        self.failures: dict[int, str] = {}

    def resolve_lengths(self, datamodule: Any) -> list[int]:
        """The evaluation lengths: ``lengths`` when given, else ``multiples`` of the base length.

        Args:
            datamodule: the run's datamodule; its ``train_len`` (or ``seq_len``) is the base length
                when ``base_len`` is not set.

        Returns:
            The sequence lengths to evaluate, in order.
        """
        if self.lengths:
            return self.lengths
        base = self.base_len or getattr(datamodule, "train_len", None) or getattr(datamodule, "seq_len", None)
        if base is None:
            raise ValueError("TaskEvalCallback: give lengths=[...] or base_len= (no datamodule with train_len)")
        return [int(base) * m for m in self.multiples]

    @torch.no_grad()
    def evaluate(self, pl_module: pl.LightningModule, trainer: pl.Trainer | None = None,
                 datamodule: Any = None) -> dict[int, float]:
        """Exact-match accuracy per length (NaN where the model fails, see ``failures``).

        Args:
            pl_module: the model to score.
            trainer: the running trainer (its ranks share the test examples), or None for one process.
            datamodule: a datamodule with ``length_dataloader``; default the trainer's.

        Returns:
            ``{length: accuracy}`` over the examples of every rank.
        """
        from posenc_lightning.data.tasks.metric import ExactMatchByLength

        dm = datamodule if datamodule is not None else getattr(trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "length_dataloader"):
            raise ValueError("TaskEvalCallback needs a datamodule with length_dataloader(seq_len, ...) "
                             "(TaskDataModule has one)")
        rank = trainer.global_rank if trainer is not None else 0
        world = trainer.world_size if trainer is not None else 1
        lengths = self.resolve_lengths(dm)
        base = self.base_len or getattr(dm, "train_len", None) or min(lengths)
        metric = ExactMatchByLength(lengths).to(pl_module.device)
        scalable = _scalable_encodings(pl_module) if self.scale_with_length else []
        saved = [e.factor for e in scalable]
        was_training = pl_module.training
        pl_module.eval()
        self.failures = {}
        try:
            for n in lengths:
                for e in scalable:
                    e.set_scale(max(1.0, n / base))
                loader = dm.length_dataloader(n, max_windows=self.examples, batch_size=max(1, self.batch_tokens // n))
                try:
                    for i, (x, y) in enumerate(loader):
                        if i % world == rank:
                            out = pl_module(x.to(pl_module.device))
                            metric.update(getattr(out, "logits", out), y.to(pl_module.device), n)
                except ValueError as e:  # e.g. beyond a learned table: reported, not raised
                    self.failures[n] = str(e)
        finally:
            pl_module.train(was_training)
            for e, f in zip(scalable, saved):
                e.set_scale(f)
        res = metric.compute()
        em, tok = res["exact_match"].reshape(-1).tolist(), res["token_accuracy"].reshape(-1).tolist()  # one length: 0-d
        self.results = {n: math.nan if n in self.failures else em[i] for i, n in enumerate(lengths)}
        self.token_accuracy = {n: math.nan if n in self.failures else tok[i] for i, n in enumerate(lengths)}
        return self.results

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        res = self.evaluate(pl_module, trainer)
        # the same values on every rank (the metric's compute() gathers all ranks): sync_dist=True
        # averages equal values and tells Lightning so (no "use sync_dist=True" warning under DDP)
        for n, v in res.items():
            pl_module.log(f"task_eval/exact_match/{n}", v, sync_dist=True)
            pl_module.log(f"task_eval/token_accuracy/{n}", self.token_accuracy[n], sync_dist=True)
