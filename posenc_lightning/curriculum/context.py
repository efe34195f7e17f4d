"""`ContextCurriculum`: grow the training context by a pure function of ``trainer.global_step``.

The stage of step ``s`` (sequence length, batch size, encoding scale, learning-rate warm restart)
depends on ``s`` only, so a resumed run and every DDP rank agree without extra state. The length
change lands exactly at the stage's first step: the training DataLoader is rebuilt around a
`CurriculumSampler` that tags every batch it yields with the step it is for (it counts batches
from the global step at which the iterator was made, so the fetcher's prefetching cannot lag),
and the window indices of a step are drawn from ``(seed, step)``, split by rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.data._utils.collate import default_collate

from posenc_lightning.encodings.base import Encoding
from posenc_lightning.parallel.group import trainer_group


@dataclass(frozen=True)
class Stage:
    """One stage of a curriculum (from ``start_step`` until the next stage's ``start_step``).

    Args:
        start_step: first optimizer step of the stage.
        seq_len: training window length.
        batch_size: windows per device and micro-batch (None: the DataLoader's own, or the
            tokens-per-batch-constant value when the curriculum keeps tokens constant).
        scale: the encoding's scale factor (``set_scale``), None to leave it alone.
        lr_warmup_steps: learning-rate warm restart: the LR ramps linearly from ~0 back to the
            schedule's value over this many steps from ``start_step`` (0 = no restart).
    """

    start_step: int
    seq_len: int
    batch_size: int | None = None
    scale: float | None = None
    lr_warmup_steps: int = 0


def encodings_of(module: torch.nn.Module) -> list[Encoding]:
    """The distinct encodings injected into ``module``: its mixin modules' and those the adapters
    placed in a model it holds (a transformers model's attention or rotary modules), in order."""
    out: list[Encoding] = []
    for m in module.modules():
        enc = getattr(m, "posenc", None)
        if isinstance(enc, Encoding) and all(enc is not e for e in out):
            out.append(enc)
    return out


class StagedDataset(Dataset):
    """Wraps a window dataset; ``ds[(indices, seq_len)]`` is the collated batch at that length.

    The length is read by the wrapped dataset at ``__getitem__`` time from ``dataset.seq_len``
    or ``dataset.owner.seq_len`` (`CorpusDataModule`'s windows); it is overridden only for the
    duration of the call, so nothing leaks between batches or DataLoader workers.
    """

    def __init__(self, dataset: Dataset, collate_fn: Any = None) -> None:
        holder = getattr(dataset, "owner", None) if hasattr(getattr(dataset, "owner", None), "seq_len") else dataset
        if not hasattr(holder, "seq_len"):
            raise TypeError(f"ContextCurriculum needs a dataset whose window length is read at __getitem__ time "
                            f"from `dataset.seq_len` or `dataset.owner.seq_len` (CorpusDataModule's is); "
                            f"{type(dataset).__name__} has neither")
        self.dataset, self.holder = dataset, holder
        self.collate_fn = collate_fn or default_collate

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[list[int], int]) -> Any:
        indices, seq_len = key
        old = self.holder.seq_len
        self.holder.seq_len = seq_len
        try:
            return self.collate_fn([self.dataset[i] for i in indices])
        finally:
            self.holder.seq_len = old


class CurriculumSampler(DistributedSampler):
    """Yields ``(indices, seq_len)`` batch keys, one per micro-batch, for this rank.

    Micro-batch ``k`` of an iterator made at global step ``g`` belongs to step
    ``g + k // accumulate``; its global batch (``batch_size * world_size`` indices) is drawn from
    ``numpy.random.default_rng([seed, step, micro])`` and rank ``r`` takes the ``r``-th slice, so
    a 2-process run sees exactly the windows of a 1-process run with twice the batch. It is a
    `DistributedSampler` so that Lightning does not wrap it in another one.
    """

    def __init__(self, dataset: Dataset, curriculum: ContextCurriculum, trainer: pl.Trainer,
                 base_batch_size: int, batches_per_epoch: int, seed: int = 0) -> None:
        split = trainer.distributed_sampler_kwargs or {}  # the data-parallel axis (`ContextParallel`)
        super().__init__(dataset, num_replicas=split.get("num_replicas", max(1, trainer.world_size)),
                         rank=split.get("rank", trainer.global_rank), shuffle=False, seed=seed)
        self.curriculum, self.trainer = curriculum, trainer
        self.base_batch_size, self.batches_per_epoch = base_batch_size, batches_per_epoch

    def __len__(self) -> int:
        return self.batches_per_epoch

    def key(self, step: int, micro: int) -> tuple[list[int], int]:
        stage = self.curriculum.stage_at(step)
        bs = self.curriculum.batch_size_of(stage, self.base_batch_size)
        rng = np.random.default_rng([self.seed, step, micro])
        idx = rng.integers(0, len(self.dataset), size=bs * self.num_replicas)  # type: ignore[arg-type]
        return idx[self.rank * bs:(self.rank + 1) * bs].tolist(), stage.seq_len

    def __iter__(self) -> Iterator[tuple[list[int], int]]:  # type: ignore[override]
        start = self.trainer.global_step
        accum = max(1, int(getattr(self.trainer, "accumulate_grad_batches", 1) or 1))
        for k in range(self.batches_per_epoch):
            yield self.key(start + k // accum, k % accum)


class CurriculumDataLoader(DataLoader):
    """The curriculum's DataLoader. Resumable by construction (a step's batch depends on the step
    only), which its empty ``state_dict`` tells Lightning."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class ContextCurriculum(pl.Callback):
    """A context-length curriculum: the stage is a pure function of ``trainer.global_step``.

    Args:
        stages: `Stage` list (or dicts with its fields); the first must start at step 0.
        keep_tokens_per_batch: stages without an explicit ``batch_size`` use
            ``base_batch_size * stages[0].seq_len // seq_len`` (tokens per batch constant).
        seed: seed of the per-step window draw.
        log: log ``curriculum/seq_len``, ``curriculum/scale``, ``curriculum/batch_size``,
            ``curriculum/stage`` every step.

    Use `progressive` for doubling stages; `CLEXCurriculum` and `LongRoPECurriculum`
    (``posenc_lightning.curriculum``) are the CLEX and LongRoPE presets.
    """

    def __init__(self, stages: Sequence[Stage | dict[str, Any]], keep_tokens_per_batch: bool = False,
                 seed: int = 0, log: bool = True) -> None:
        self.stages = sorted((s if isinstance(s, Stage) else Stage(**s) for s in stages), key=lambda s: s.start_step)
        if not self.stages or self.stages[0].start_step != 0:
            raise ValueError("ContextCurriculum: give at least one stage, and start the first at start_step=0")
        for s in self.stages:
            if s.seq_len < 1 or (s.batch_size is not None and s.batch_size < 1) or (s.scale is not None and s.scale <= 0):
                raise ValueError(f"ContextCurriculum: invalid stage {s}: seq_len, batch_size and scale must be positive")
        self.keep_tokens_per_batch = keep_tokens_per_batch
        self.seed = seed
        self.log = log
        self.base_batch_size: int | None = None
        self.history: list[tuple[int, int, int, float | None]] = []  # (step, batch length, batch size, scale)
        self._lr: list[tuple[float, float]] | None = None
        self._restore: list[tuple[Any, str, Any]] = []

    # ---------------------------------------------------------------- presets
    @classmethod
    def progressive(cls, start: int, target: int, steps_per_stage: int, growth: int = 2,
                    scale_with_length: bool = False, keep_tokens_per_batch: bool = False,
                    lr_warmup_steps: int = 0, seed: int = 0) -> ContextCurriculum:
        """Stages at ``start, start*growth, ...`` up to ``target``, each ``steps_per_stage`` long.
        With ``scale_with_length`` the encoding scale of a stage is ``seq_len / start`` (pi, yarn)."""
        if start < 1 or target < start or growth < 2:
            raise ValueError(f"progressive: need 1 <= start <= target and growth >= 2 (got {start}, {target}, {growth})")
        lengths = [start]
        while lengths[-1] < target:
            lengths.append(min(lengths[-1] * growth, target))
        stages = [Stage(i * steps_per_stage, n, None, (n / start) if scale_with_length else None,
                        lr_warmup_steps if i else 0) for i, n in enumerate(lengths)]
        return cls(stages, keep_tokens_per_batch=keep_tokens_per_batch, seed=seed)

    # ---------------------------------------------------------------- the pure schedule
    def stage_index(self, step: int) -> int:
        """Args:
            step: a global step.

        Returns:
            The index of the stage that step trains in.
        """
        return max(i for i, s in enumerate(self.stages) if s.start_step <= step)

    def stage_at(self, step: int) -> Stage:
        """Args:
            step: a global step.

        Returns:
            The `Stage` that step trains in.
        """
        return self.stages[self.stage_index(step)]

    def batch_size_of(self, stage: Stage, base: int | None = None) -> int:
        """The batch size of a stage: its own, or the base one (scaled by length with
        ``keep_tokens_per_batch``).

        Args:
            stage: one of `stages`.
            base: the train DataLoader's batch size; None: the one seen when it was wrapped.

        Returns:
            Sequences per batch.

        Raises:
            RuntimeError: the base batch size is needed before the train DataLoader was built.
        """
        base = base or self.base_batch_size
        if stage.batch_size is not None:
            return stage.batch_size
        if base is None:
            raise RuntimeError("ContextCurriculum: the base batch size is unknown before the train DataLoader is built")
        if self.keep_tokens_per_batch:
            return max(1, base * self.stages[0].seq_len // stage.seq_len)
        return base

    def lr_factor(self, step: int) -> float:
        """Warm-restart multiplier on the scheduled learning rate.

        Args:
            step: a global step.

        Returns:
            A factor in ``(0, 1]``, rising linearly over the stage's ``lr_warmup_steps``.
        """
        stage = self.stage_at(step)
        if stage.lr_warmup_steps <= 0:
            return 1.0
        return min(1.0, (step - stage.start_step + 1) / stage.lr_warmup_steps)

    def eval_scale(self, seq_len: int, step: int) -> float | None:
        """The encoding scale used to evaluate at a length (subclasses: CLEX uses ``n / L``).

        Args:
            seq_len: the evaluation length.
            step: the global step.

        Returns:
            The scale, or None to leave the encoding as it is (default: the current stage's).
        """
        return self.stage_at(step).scale

    # ---------------------------------------------------------------- applying a stage
    def apply_scale(self, pl_module: torch.nn.Module, scale: float | None) -> None:
        """Set every injected encoding's scale.

        Args:
            pl_module: the module holding the encodings.
            scale: the factor; None: nothing to do.

        Raises:
            ValueError: an injected encoding is not scalable.
        """
        if scale is None:
            return
        for enc in encodings_of(pl_module):
            if not enc.scalable:
                raise ValueError(f"ContextCurriculum sets an encoding scale but {enc.name!r} has no set_scale(); "
                                 f"use a scalable encoding (pi, yarn, dynamic_ntk, clex, ...) or stages with scale=None")
            enc.set_scale(float(scale))

    def wrap_dataloader(self, loader: DataLoader, trainer: pl.Trainer) -> DataLoader:
        """Rebuild the train DataLoader so that each batch has its step's length and size.

        Args:
            loader: the datamodule's train DataLoader.
            trainer: the trainer (its world size and global step drive the sampler).

        Returns:
            A DataLoader over ``loader``'s dataset driven by a `CurriculumSampler`.

        Raises:
            TypeError: ``loader`` is not a torch DataLoader with a ``batch_size``.
        """
        if not isinstance(loader, DataLoader) or loader.batch_size is None:
            raise TypeError("ContextCurriculum needs the train dataloader to be a torch DataLoader with a batch_size")
        self.base_batch_size = loader.batch_size
        ds = StagedDataset(loader.dataset, loader.collate_fn)
        replicas = (trainer.distributed_sampler_kwargs or {}).get("num_replicas", trainer.world_size)
        per_rank = max(1, len(loader) // max(1, replicas))  # an epoch as long as a DistributedSampler's
        sampler = CurriculumSampler(ds, self, trainer, loader.batch_size, per_rank, self.seed)
        return CurriculumDataLoader(ds, batch_size=None, sampler=sampler, num_workers=loader.num_workers,
                          pin_memory=loader.pin_memory, collate_fn=lambda b: b,
                          persistent_workers=loader.persistent_workers if loader.num_workers else False)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        dm = getattr(trainer, "datamodule", None)
        if dm is not None and isinstance(getattr(dm, "seq_len", None), int):
            self._restore.append((dm, "seq_len", dm.seq_len))  # given back at teardown
        source = trainer.fit_loop._data_source  # where Lightning gets the train dataloader
        owner = source.instance
        if isinstance(owner, DataLoader):
            source.instance = self.wrap_dataloader(owner, trainer)
            self._restore.append((source, "instance", owner))
            return
        if owner is None or not hasattr(owner, "train_dataloader"):
            raise ValueError("ContextCurriculum: no train dataloader found (pass a datamodule or train_dataloaders)")
        original = owner.train_dataloader
        if getattr(original, "_curriculum", None) is self:
            return

        def train_dataloader() -> DataLoader:
            return self.wrap_dataloader(original(), trainer)

        train_dataloader._curriculum = self  # type: ignore[attr-defined]
        owner.train_dataloader = train_dataloader
        self._restore.append((owner, "train_dataloader", None))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for obj, attr, value in reversed(self._restore):
            if value is None:
                obj.__dict__.pop(attr, None)
            else:
                setattr(obj, attr, value)
        self._restore.clear()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.apply_scale(pl_module, self.stage_at(trainer.global_step).scale)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = trainer.global_step
        stage = self.stage_at(step)
        self.apply_scale(pl_module, stage.scale)
        dm = getattr(trainer, "datamodule", None)
        if dm is not None and hasattr(dm, "seq_len"):
            dm.seq_len = stage.seq_len  # for anyone reading it (the batch itself comes from the sampler)
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        shards = trainer_group(trainer)  # under context parallelism each rank holds 1 / size of the sequence
        want = stage.seq_len // (shards.size if shards is not None else 1)
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-1] != want:
            raise RuntimeError(f"ContextCurriculum: step {step} got a batch of length {x.shape[-1]} but its stage "
                               f"says {want}; is the train dataloader built by the curriculum?")
        if isinstance(x, torch.Tensor):
            self.history.append((step, int(x.shape[-1]), int(x.shape[0]), stage.scale))
        f = self.lr_factor(step)
        self._lr = None
        if f != 1.0:
            self._lr = []
            for opt in trainer.optimizers:
                for g in opt.param_groups:
                    self._lr.append((g["lr"], g["lr"] * f))
                    g["lr"] = g["lr"] * f
        if self.log:
            scale = stage.scale if stage.scale is not None else 1.0
            pl_module.log_dict({"curriculum/seq_len": float(stage.seq_len), "curriculum/scale": float(scale),
                                "curriculum/batch_size": float(self.batch_size_of(stage)),
                                "curriculum/stage": float(self.stage_index(step)), "curriculum/lr_factor": f},
                               on_step=True, on_epoch=False, batch_size=1)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._lr is None:
            return
        groups = [g for opt in trainer.optimizers for g in opt.param_groups]
        for g, (raw, scaled) in zip(groups, self._lr):
            if g["lr"] == scaled:  # no scheduler rewrote it: undo the restart factor
                g["lr"] = raw
        self._lr = None

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dm = getattr(trainer, "datamodule", None)
        n = getattr(dm, "val_seq_len", None) or self.stage_at(trainer.global_step).seq_len
        self.apply_scale(pl_module, self.eval_scale(int(n), trainer.global_step))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit":  # back to the training scale (validation inside fit)
            self.apply_scale(pl_module, self.stage_at(trainer.global_step).scale)

    def describe(self) -> str:
        """Returns:
            One line per stage: first step, length, batch size, scale, warm-up.
        """
        rows = [f"step {s.start_step:>6}: seq_len={s.seq_len} batch={s.batch_size or 'base'} scale={s.scale} "
                f"lr_warmup={s.lr_warmup_steps}" for s in self.stages]
        return "\n".join(rows)


def round_to(n: float, multiple: int) -> int:
    return max(multiple, math.ceil(n / multiple) * multiple)


__all__ = ["ContextCurriculum", "CurriculumDataLoader", "CurriculumSampler", "Stage", "StagedDataset", "encodings_of",
           "round_to"]
