"""`TaskDataModule`: a synthetic task as training batches at the training length and test sets
at any length, every example a pure function of (seed, split, length, index)."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import numpy as np
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from posenc_lightning.data.tasks.base import Task
from posenc_lightning.data.tasks.registry import build_task

TRAIN, TEST = 0, 1


class TrainSet(Dataset):
    """Item ``i`` is example ``start + i``: a length drawn in ``[min_len, max_len]``, right-padded
    to ``max_len``."""

    def __init__(self, task: Task, min_len: int, max_len: int, size: int, seed: int, start: int = 0) -> None:
        self.task, self.min_len, self.max_len, self.size, self.seed = task, min_len, max_len, size, seed
        self.start = start

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        rng = np.random.default_rng([self.seed, TRAIN, 0, self.start + i])
        n = int(rng.integers(self.min_len, self.max_len + 1))
        return self.task.sample(rng, n).input_target(pad_to=self.max_len)


class TestSet(Dataset):
    """``size`` examples of exactly ``length`` input tokens (seeds disjoint from training's)."""

    def __init__(self, task: Task, length: int, size: int, seed: int) -> None:
        self.task, self.length, self.size, self.seed = task, length, size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        rng = np.random.default_rng([self.seed, TEST, self.length, i])
        return self.task.sample(rng, self.length).input_target()


class TaskDataModule(pl.LightningDataModule):
    """A synthetic task (``posenc_lightning.data.tasks.TASKS``) for a causal LM.

    Batches are ``(input_ids, targets)`` with ``targets = -100`` except on answer tokens, so the
    model's cross-entropy (``ignore_index=-100``) trains on answers only. Training examples have
    lengths drawn uniformly in ``[min_train_len, train_len]`` (right-padded); validation and
    `length_dataloader` give examples of exactly the requested length.

    Args:
        task: a task name (``copy``, ``reverse``, ``addition``, ``flip_flop``, ``selective_copy``,
            ``counting``, ``mqar``, ``passkey``).
        task_cfg: the task's arguments (e.g. ``{n_pairs: 8}`` for mqar).
        train_len: the longest training input (the training length L).
        min_train_len: the shortest training input (default: the task's smallest, at least L/4).
        batch_size: sequences per training batch.
        train_examples: training examples per epoch.
        test_examples: examples per evaluation length.
        seed: the generator seed (training and test examples never share a seed).
        num_workers: DataLoader workers.

    Attributes:
        first_example: the index of the first training example (0; `continued` sets it).
    """

    def __init__(self, task: str = "copy", task_cfg: dict[str, Any] | None = None, train_len: int = 32,
                 min_train_len: int | None = None, batch_size: int = 32, train_examples: int = 1_000_000,
                 test_examples: int = 64, seed: int = 0, num_workers: int = 0) -> None:
        super().__init__()
        self.task_name = task
        self.task_cfg = dict(task_cfg or {})
        self.task = build_task(task, **self.task_cfg)
        if train_len < self.task.min_len:
            raise ValueError(f"TaskDataModule: train_len={train_len} is shorter than {task}'s min_len="
                             f"{self.task.min_len}; use train_len >= {self.task.min_len}")
        lo = min_train_len if min_train_len is not None else max(self.task.min_len, train_len // 4)
        if not self.task.min_len <= lo <= train_len:
            raise ValueError(f"TaskDataModule: min_train_len={lo} must be in [{self.task.min_len}, train_len={train_len}]")
        for k, v in (("batch_size", batch_size), ("train_examples", train_examples), ("test_examples", test_examples)):
            if v < 1:
                raise ValueError(f"TaskDataModule: {k}={v} must be >= 1")
        self.train_len, self.min_train_len = train_len, lo
        self.seq_len = self.val_seq_len = train_len  # what length-aware callbacks read as the training length
        self.batch_size, self.train_examples, self.test_examples = batch_size, train_examples, test_examples
        self.seed, self.num_workers = seed, num_workers
        self.first_example = 0

    def continued(self, seen: int) -> TaskDataModule:
        """A copy whose training examples start after the ``seen`` this one's training has drawn
        (a second fit on fresh examples); its test sets are this one's.

        Args:
            seen: training examples already drawn (steps x batch size).
        """
        if seen < 0:
            raise ValueError(f"TaskDataModule.continued: seen={seen} must be >= 0")
        out = copy.copy(self)
        out.first_example = self.first_example + seen
        return out

    @property
    def vocab_size(self) -> int:
        return self.task.vocab_size

    def train_dataloader(self) -> DataLoader:
        ds = TrainSet(self.task, self.min_train_len, self.train_len, self.train_examples, self.seed,
                      self.first_example)
        return DataLoader(ds, batch_size=self.batch_size, shuffle=False, drop_last=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self.length_dataloader(self.train_len)

    def length_dataloader(self, seq_len: int, max_windows: int | None = None,
                          batch_size: int | None = None) -> DataLoader:
        """The test set at input length ``seq_len`` (``max_windows`` examples, default
        ``test_examples``; batches of about ``batch_size * train_len`` tokens by default)."""
        size = max_windows or self.test_examples
        bs = batch_size or max(1, self.batch_size * self.train_len // seq_len)
        return DataLoader(TestSet(self.task, seq_len, size, self.seed), batch_size=bs, shuffle=False,
                          num_workers=self.num_workers)
