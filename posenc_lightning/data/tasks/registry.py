"""The task table: name -> class, and `build_task`."""

from __future__ import annotations

from typing import Any

from posenc_lightning.data.tasks.arithmetic import Addition, Counting
from posenc_lightning.data.tasks.base import Task
from posenc_lightning.data.tasks.copying import Copy, Reverse, SelectiveCopy
from posenc_lightning.data.tasks.memory import MQAR, FlipFlop, Passkey

#: task name -> class
TASKS: dict[str, type[Task]] = {cls.name: cls for cls in
                                (Copy, Reverse, Addition, FlipFlop, SelectiveCopy, Counting, MQAR, Passkey)}


def build_task(name: str, **cfg: Any) -> Task:
    """The task ``name`` with its arguments.

    Raises:
        ValueError: an unknown task name (the message lists the known ones) or a bad argument.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    try:
        return TASKS[name](**cfg)
    except TypeError as e:
        raise ValueError(f"task {name!r}: bad arguments {cfg!r} ({e})") from None
