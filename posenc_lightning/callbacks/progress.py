"""A progress bar whose label is right for step-budgeted runs.

Lightning's bars label the training bar ``Epoch e/max_epochs-1``, which reads ``Epoch 0/-2``
when a run is bounded by ``max_steps`` (``max_epochs=-1``). These label it ``Epoch e`` plus the
step budget and keep Lightning's per-epoch total (the batches left in the epoch, capped by the
steps left: ``total_train_batches``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar


def run_label(trainer: Any) -> str:
    """``Epoch e``, ``/last`` only when the run is bounded by epochs, and the step budget."""
    label = f"Epoch {trainer.current_epoch}"
    if trainer.max_epochs not in (None, -1):
        label += f"/{trainer.max_epochs - 1}"
    if trainer.max_steps is not None and trainer.max_steps > 0:
        label += f" (max_steps {trainer.max_steps})"
    return label


class StepRichProgressBar(RichProgressBar):
    """`RichProgressBar` labelled by `run_label`."""

    def _get_train_description(self, current_epoch: int) -> str:
        label = run_label(self.trainer)
        width = len(self.validation_description)
        return f"{label:{width}}" if width > len(label) else label


class StepTQDMProgressBar(TQDMProgressBar):
    """`TQDMProgressBar` labelled by `run_label`."""

    def on_train_epoch_start(self, trainer: Any, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(run_label(trainer))


def step_progress_bar() -> RichProgressBar | TQDMProgressBar:
    """The Rich bar when rich is installed (Lightning's own default), else TQDM."""
    from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE

    return StepRichProgressBar() if _RICH_AVAILABLE else StepTQDMProgressBar()
