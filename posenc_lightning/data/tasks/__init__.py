"""Synthetic length-generalization tasks: generators, a DataModule and an exact-match metric.

Every task builds an example of any input length from a seeded generator, with an exact answer;
the loss and the metric see only the answer tokens (targets are ``IGNORE`` elsewhere).

    from posenc_lightning.data.tasks import TaskDataModule
    dm = TaskDataModule("copy", train_len=32)       # trains on 8..32 tokens; TaskEvalCallback tests 32 x 1..8
"""

from __future__ import annotations

from posenc_lightning.data.tasks.arithmetic import Addition, Counting
from posenc_lightning.data.tasks.base import BOS, IGNORE, PAD, SEP, Example, Task
from posenc_lightning.data.tasks.copying import Copy, Reverse, SelectiveCopy
from posenc_lightning.data.tasks.datamodule import TaskDataModule
from posenc_lightning.data.tasks.memory import MQAR, FlipFlop, Passkey
from posenc_lightning.data.tasks.metric import ExactMatchByLength, exact_match
from posenc_lightning.data.tasks.registry import TASKS, build_task

__all__ = ["BOS", "IGNORE", "MQAR", "PAD", "SEP", "TASKS", "Addition", "Copy", "Counting", "ExactMatchByLength",
           "Example", "FlipFlop", "Passkey", "Reverse", "SelectiveCopy", "Task", "TaskDataModule",
           "build_task", "exact_match"]
