"""`LengthEvalCallback`: perplexity at several lengths (the length-generalization curve)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor

from posenc_lightning.eval.length_report import length_plot, length_table
from posenc_lightning.parallel.group import engaged
from posenc_lightning.parallel.shard import shard_batch

__all__ = ["LengthEvalCallback", "base_length", "length_plot", "length_table", "token_nll"]


def token_nll(module: torch.nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Per-token NLL ``[B, N]``: the module's ``token_nll`` when it has one, else from its logits."""
    if hasattr(module, "token_nll"):
        return module.token_nll(x, y)
    out = module(x)
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.float().transpose(1, 2), y, reduction="none")



def base_length(base_len: int | None, trainer: pl.Trainer | None) -> int | None:
    """``base_len``, else the trainer's datamodule's ``val_seq_len`` or ``seq_len`` (None if none)."""
    if base_len is not None:
        return base_len
    dm = getattr(trainer, "datamodule", None) if trainer is not None else None
    return (getattr(dm, "val_seq_len", None) or getattr(dm, "seq_len", None)) if dm is not None else None

class LengthEvalCallback(pl.Callback):
    """Validation perplexity at several lengths, logged as ``length_eval/ppl/<L>`` (and ``nll``),
    plus a perplexity-vs-length chart (TensorBoard image) and a markdown table (text).

    The windows come from the datamodule's ``length_dataloader(seq_len, max_windows, batch_size)``
    (`CorpusDataModule` has it) or from ``dataloader_fn(seq_len)``. Ranks split the windows and
    a torchmetrics `MeanMetric` averages the token NLL over all of them; under `ContextParallel`
    the ranks of a group share each window, each scoring its shard (lengths a multiple of 2 x size).
    A length the model cannot run (a learned table shorter than it) is logged as NaN and named in ``failures``.

    Args:
        lengths: evaluation lengths; default ``multiples`` of ``base_len``.
        multiples: multiples of ``base_len`` (1x..16x).
        base_len: the training length (default: the datamodule's ``val_seq_len`` or ``seq_len``).
        max_windows: windows of the longest length; shorter lengths cut the same text finer, so
            every length is scored on the same tokens.
        batch_size: windows of the longest length per batch (shorter ones: as many tokens).
        every_n_epochs: run at validation ends of every n-th epoch.
        dataloader_fn: ``seq_len -> iterable of (input_ids, targets)`` instead of the datamodule's.
        scale_with_length: zero-shot extension protocol of PI / NTK / YaRN / CLEX: at length ``n``
            every scalable encoding (`Encoding.scalable`) is set to ``max(1, n / base_len)``
            and restored afterwards (train at factor 1, evaluate with the factor the length needs).
    """

    def __init__(self, lengths: Sequence[int] | None = None, multiples: Sequence[int] = (1, 2, 4, 8, 16),
                 base_len: int | None = None, max_windows: int = 4, batch_size: int = 1, every_n_epochs: int = 1,
                 dataloader_fn: Any = None, scale_with_length: bool = False) -> None:
        self.scale_with_length = scale_with_length
        self.lengths = [int(n) for n in lengths] if lengths else None
        self.multiples = list(multiples)
        self.base_len = base_len
        self.max_windows = max_windows
        self.batch_size = batch_size
        self.every_n_epochs = every_n_epochs
        self.dataloader_fn = dataloader_fn
        self.results: dict[int, float] = {}  # length -> perplexity (last evaluation)
        self.failures: dict[int, str] = {}
        self.history: list[dict[str, Any]] = []

    def resolve_lengths(self, trainer: pl.Trainer | None) -> list[int]:
        """Args:
            trainer: the trainer, whose datamodule gives the training length; None: ``base_len`` only.

        Returns:
            The evaluation lengths: ``lengths``, or ``multiples`` of the training length.

        Raises:
            ValueError: neither ``lengths`` nor a training length is known.
        """
        if self.lengths:
            return self.lengths
        base = base_length(self.base_len, trainer)
        if base is None:
            raise ValueError("LengthEvalCallback: give lengths=[...] or base_len= (no datamodule with val_seq_len)")
        return [int(base) * m for m in self.multiples]

    def _batches(self, trainer: pl.Trainer | None, n: int, longest: int):
        if self.dataloader_fn is not None:
            return self.dataloader_fn(n)
        dm = getattr(trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "length_dataloader"):
            raise ValueError("LengthEvalCallback needs a datamodule with length_dataloader(seq_len, ...) "
                             "(CorpusDataModule has one) or dataloader_fn=")
        # the same text at every length: max_windows windows of the longest length, cut finer
        return dm.length_dataloader(n, max_windows=self.max_windows * max(1, longest // n),
                                    batch_size=self.batch_size * max(1, longest // n))

    @torch.no_grad()
    def evaluate(self, pl_module: pl.LightningModule, trainer: pl.Trainer | None = None) -> dict[int, float]:
        """Evaluate now (the callback calls this at validation ends).

        Args:
            pl_module: the model.
            trainer: its trainer (ranks split the windows); None: one process.

        Returns:
            ``{length: perplexity}``; NaN where the model fails (named in ``failures``).
        """
        from torchmetrics import MeanMetric

        rank = trainer.global_rank if trainer is not None else 0
        world = trainer.world_size if trainer is not None else 1
        group = _context_parallel_group(trainer)
        # under context parallelism the ranks of a group share each window, each scoring its shard
        shards, parts = (group, group.dp_size) if group is not None else (None, world)
        part = group.dp_rank if group is not None else rank
        was_training = pl_module.training
        pl_module.eval()
        self.failures = {}
        out: dict[int, float] = {}
        try:
            lengths = self.resolve_lengths(trainer)
            base = self.base_len or min(lengths)
            scalable = _scalable_encodings(pl_module) if self.scale_with_length else []
            saved = [e.factor for e in scalable]
            for n in lengths:
                for e in scalable:
                    e.set_scale(max(1.0, n / base))
                metric = MeanMetric().to(pl_module.device)
                error = None
                try:
                    for i, (x, y) in enumerate(self._batches(trainer, n, max(lengths))):
                        if i % parts != part:
                            continue
                        x, y = x.to(pl_module.device), y.to(pl_module.device)
                        if shards is None:
                            metric.update(token_nll(pl_module, x, y))
                            continue
                        x, y = shard_batch((x, y), shards)
                        with engaged(pl_module, shards):
                            metric.update(token_nll(pl_module, x, y))
                except ValueError as e:  # e.g. beyond a learned table: reported, not raised
                    error = str(e)
                if world > 1:  # any rank failing makes the length fail everywhere
                    failed = trainer.strategy.reduce(torch.tensor(float(error is not None)), reduce_op="sum")
                    error = error or ("failed on another rank" if float(failed) > 0 else None)
                if error is not None:
                    self.failures[n] = error
                    out[n] = float("nan")
                    continue
                out[n] = math.exp(float(metric.compute()))
        finally:
            pl_module.train(was_training)
            if self.scale_with_length:
                for e, f in zip(scalable, saved):
                    e.set_scale(f)
        self.results = out
        return out

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.current_epoch % self.every_n_epochs:
            return
        res = self.evaluate(pl_module, trainer)
        # every rank holds the same values (the metric's compute() gathers all ranks, a failure on one
        # fails the length on all): sync_dist=True averages equal values and tells Lightning so
        for n, ppl in res.items():
            pl_module.log(f"length_eval/ppl/{n}", ppl, sync_dist=True)
            pl_module.log(f"length_eval/nll/{n}", math.log(ppl) if not math.isnan(ppl) else ppl, sync_dist=True)
        self.history.append({"step": trainer.global_step, "ppl": dict(res), "failures": dict(self.failures)})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                exp = getattr(logger, "experiment", None)
                if hasattr(exp, "add_text"):
                    exp.add_text("length_eval/table", length_table({"model": res}, self.failures and {"model": self.failures}),
                                 global_step=trainer.global_step)
                if hasattr(exp, "add_figure"):
                    fig = length_plot({"model": res})
                    if fig is not None:
                        exp.add_figure("length_eval/ppl_vs_length", fig, global_step=trainer.global_step)


def _context_parallel_group(trainer: pl.Trainer | None) -> Any:
    """The groups of the trainer's `ContextParallel` callback (None without one)."""
    from posenc_lightning.parallel.group import trainer_group

    return trainer_group(trainer)


def _scalable_encodings(module: torch.nn.Module) -> list[Any]:
    """Distinct injected encodings that can change their scale at run time."""
    seen: dict[int, Any] = {}
    for m in module.modules():
        enc = getattr(m, "posenc", None)
        if enc is not None and enc.scalable:
            seen.setdefault(id(enc), enc)
    return list(seen.values())
