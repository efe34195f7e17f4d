"""A model trained in two phases (`TwoPhase`): one encoding for the usual steps, then another in its
place, every trained weight kept, trained on for a fraction of those steps at a peak learning rate of
its own. DroPE (`posenc_lightning.recipes.drope.DROPE`) is one: RoPE, then NoPE recalibrated. The
synthetic-task grid (``recipes/compare_tasks.py``, ``--tasks.two_phase``) runs any such entry by name;
``recipes/drope_extend.py`` takes its recalibration's steps and learning rate from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["TwoPhase", "finetune_schedule"]


def finetune_schedule(model: Any, lr: float, steps: int) -> None:
    """Set the peak learning rate and warmup of a short second ``fit`` of ``model``.

    The model's optimizer and schedule (`CausalLMSteps.configure_optimizers`) are built again by the
    next Trainer: peak ``lr``, a warmup of a tenth of ``steps`` (at least one), then the cosine decay
    over the Trainer's ``max_steps``.

    Args:
        model: a LightningModule with ``hparams.lr`` and ``hparams.warmup_steps`` (TinyGPT, HFCausalLM).
        lr: the peak learning rate.
        steps: the second fit's steps.
    """
    model.hparams.lr, model.hparams.warmup_steps = lr, max(1, steps // 10)


@dataclass(frozen=True)
class TwoPhase:
    """Train with ``first``, switch to ``then`` (weights kept), train ``fraction`` of the steps more.

    Args:
        first: the encoding of the first phase (a registered name or a preset).
        then: the encoding put in its place for the second phase and for evaluation.
        fraction: the second phase's steps as a fraction of the steps the first ran (at least one).
        lr: the second phase's peak learning rate (`finetune_schedule`).
        source: the paper the entry follows.

    Raises:
        ValueError: ``fraction`` outside (0, 1] or ``lr`` not positive.
    """

    first: str
    then: str
    fraction: float
    lr: float
    source: str = ""

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"TwoPhase: fraction must be in (0, 1], got {self.fraction}")
        if not self.lr > 0.0:
            raise ValueError(f"TwoPhase: lr must be > 0, got {self.lr}")

    def steps(self, first_steps: int) -> int:
        """The second phase's steps after a first phase of ``first_steps`` (at least one)."""
        return max(1, round(first_steps * self.fraction))

    def prepare(self, model: Any, first_steps: int) -> int:
        """Set ``model``'s learning rate and warmup for the second phase; returns its steps."""
        steps = self.steps(first_steps)
        finetune_schedule(model, self.lr, steps)
        return steps

    def signature(self) -> dict[str, Any]:
        """What a finished result of this entry depends on (its ``source`` is a citation, not a setting)."""
        return {"first": self.first, "then": self.then, "fraction": self.fraction, "lr": self.lr}

    def config(self) -> dict[str, Any]:
        """The entry as the keyword arguments that build it again (``TwoPhase(**spec.config())``)."""
        return {**self.signature(), "source": self.source}
