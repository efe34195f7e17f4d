"""Progress bars (on by default in recipes; labelled and totalled right for step budgets) and
the `posenc` subcommands' help texts."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest

from posenc_lightning.callbacks.progress import StepRichProgressBar, StepTQDMProgressBar, run_label
from posenc_lightning.data import CorpusDataModule
from posenc_lightning.models import TinyGPT
from tests.helpers import run_posenc as _posenc

ROOT = Path(__file__).resolve().parents[1]


class Spy(pl.Callback):
    """(label, total, completed) of the training bar after every step."""

    def __init__(self, bar):
        self.bar, self.seen = bar, []

    def on_train_batch_end(self, trainer, *args):
        b = self.bar
        if isinstance(b, StepRichProgressBar):
            t = b.progress.tasks[b.train_progress_bar_id]
            self.seen.append((t.description.strip(), t.total, t.completed))
        else:
            tq = b.train_progress_bar
            self.seen.append((tq.desc.rstrip(": "), tq.total, tq.n))


@pytest.mark.parametrize("cls", [StepRichProgressBar, StepTQDMProgressBar])
def test_bar_label_and_total_follow_max_steps(cls):
    bar = cls()
    spy = Spy(bar)
    data = CorpusDataModule(seq_len=16, batch_size=2, max_bytes=50_000, samples_per_epoch=8)  # 4 batches per epoch
    trainer = pl.Trainer(max_steps=6, logger=False, enable_checkpointing=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=[bar, spy], accelerator="cpu")
    trainer.fit(TinyGPT(d_model=16, n_layers=1, n_heads=2, max_seq_len=16), data)
    # epoch 0: 4 batches; epoch 1: the 2 steps left of max_steps=6 (not the epoch's 4, not "Epoch 0/-2")
    assert spy.seen == [("Epoch 0 (max_steps 6)", 4, k) for k in (1, 2, 3, 4)] + \
        [("Epoch 1 (max_steps 6)", 2, k) for k in (1, 2)]


def test_run_label_by_budget():
    class T:
        current_epoch, max_epochs, max_steps = 0, -1, 300

    assert run_label(T) == "Epoch 0 (max_steps 300)"
    T.max_epochs, T.max_steps = 3, -1
    assert run_label(T) == "Epoch 0/2"


def test_recipes_show_a_progress_bar_by_default(tmp_path):
    from posenc_lightning.recipes import SweepOptions, make_cli

    args = ["--config", str(ROOT / "configs" / "fire_train.yaml"), "--trainer.logger=false",
            f"--extend.results_dir={tmp_path}"]
    assert isinstance(make_cli(SweepOptions, args).trainer.progress_bar_callback, StepRichProgressBar)
    cli = make_cli(SweepOptions, [*args, "--trainer.enable_progress_bar=false"])
    assert cli.trainer.progress_bar_callback is None
    for name in ("fire_train", "clex_train", "yarn_extend", "longrope_extend", "compare_encodings", "compare_tasks",
                 "drope_extend"):
        assert "enable_progress_bar" not in (ROOT / "configs" / f"{name}.yaml").read_text()


def test_posenc_run_help_lists_every_recipe_and_list_has_no_internal_notes():
    code, text = _posenc("run", "--help")
    assert code == 0
    for name in ("clex_train", "compare_encodings", "compare_tasks", "drope_extend", "fire_train", "longrope_extend",
                 "yarn_extend"):
        assert name in text
    code, text = _posenc("list")
    assert code == 0 and "seed 004" not in text and "sec. 5" not in text
    code, text = _posenc("report", "--help")
    assert "default: RUN_DIR/report" in " ".join(text.split())


@pytest.mark.parametrize("name", ["fire_train", "clex_train", "yarn_extend", "longrope_extend", "compare_encodings",
                                  "compare_tasks", "drope_extend"])
def test_recipe_help_describes_the_recipe(name):
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        mod = __import__(name)
    finally:
        sys.path.pop(0)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        mod.main(["--help"])
    text = " ".join(buf.getvalue().split())
    assert text.startswith(f"usage: recipes/{name}.py")
    assert "Lightning Trainer command line tool" not in text
    assert " ".join(mod.__doc__.split())[:60] in text
    group = {"compare_encodings": "compare", "compare_tasks": "tasks"}.get(name, "extend")
    assert f"--{group}.results_dir" in text and "default:" in text.split(f"--{group}.results_dir")[-1][:400]
