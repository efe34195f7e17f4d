"""ContextCurriculum: the stage is a pure function of the global step, lands at the stage's first
step exactly (also across epoch boundaries and with gradient accumulation), survives resume."""

from __future__ import annotations

import csv
import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from posenc_lightning.curriculum.context import ContextCurriculum, Stage
from tests.curriculum_helpers import Recorder, losses, tiny_data, tiny_model, trainer


def test_progressive_stages_and_tokens_per_batch():
    cur = ContextCurriculum.progressive(64, 512, steps_per_stage=10, scale_with_length=True,
                                        keep_tokens_per_batch=True, lr_warmup_steps=4)
    assert [(s.start_step, s.seq_len, s.scale) for s in cur.stages] == [
        (0, 64, 1.0), (10, 128, 2.0), (20, 256, 4.0), (30, 512, 8.0)]
    assert [cur.stage_at(s).seq_len for s in (0, 9, 10, 29, 30, 10_000)] == [64, 64, 128, 256, 512, 512]
    assert [cur.batch_size_of(s, 32) for s in cur.stages] == [32, 16, 8, 4]  # 2048 tokens each
    # warm restart: linear ramp over 4 steps from each later stage's first step, never at step 0
    assert [cur.lr_factor(s) for s in (0, 9, 10, 11, 13, 14)] == [1.0, 1.0, 0.25, 0.5, 1.0, 1.0]
    # a target that is not a power-of-two multiple ends exactly at the target
    assert [s.seq_len for s in ContextCurriculum.progressive(100, 300, 5).stages] == [100, 200, 300]


def test_bad_input_is_explained():
    with pytest.raises(ValueError, match="start_step=0"):
        ContextCurriculum([Stage(5, 64)])
    with pytest.raises(ValueError, match="positive"):
        ContextCurriculum([Stage(0, 0)])
    cur = ContextCurriculum([Stage(0, 16, scale=2.0)])
    with pytest.raises(ValueError, match="set_scale"):
        cur.apply_scale(tiny_model("rope"), 2.0)


def test_length_changes_at_the_stage_first_step_across_epochs_and_accumulation(tmp_path):
    # 3 batches per epoch (samples_per_epoch=12, batch 4): stage boundaries at steps 2 and 5 fall
    # inside and at the edge of epochs; accumulate 2 micro-batches per step.
    cur = ContextCurriculum([Stage(0, 16), Stage(2, 24, batch_size=3), Stage(5, 40)], seed=1)
    rec = Recorder()
    logger = CSVLogger(tmp_path, name="", version="")
    trainer(7, [cur, rec], accumulate_grad_batches=2, logger=logger, log_every_n_steps=1).fit(
        tiny_model(), tiny_data(samples_per_epoch=12))
    logged = {}
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        if row.get("curriculum/seq_len"):
            logged[int(row["step"])] = (float(row["curriculum/seq_len"]), float(row["curriculum/batch_size"]))
    assert logged == {s: (float(n), float(b)) for s, (n, b) in {0: (16, 4), 1: (16, 4), 2: (24, 3), 3: (24, 3),
                                                                  4: (24, 3), 5: (40, 4), 6: (40, 4)}.items()}
    want = {0: (16, 4), 1: (16, 4), 2: (24, 3), 3: (24, 3), 4: (24, 3), 5: (40, 4), 6: (40, 4)}
    seen = [(step, n, b) for step, n, b, _ in cur.history]
    # Lightning steps at an epoch's end even with an incomplete accumulation: steps 1, 3, 5 of
    # these 3-batch epochs have one micro-batch, the others two
    assert [s for s, *_ in seen] == [0, 0, 1, 2, 2, 3, 4, 4, 5, 6, 6]
    assert all((n, b) == want[step] for step, n, b in seen), seen


def test_lr_warm_restart_multiplies_the_schedule():
    cur = ContextCurriculum([Stage(0, 16), Stage(4, 32, lr_warmup_steps=3)])
    plain, rec = Recorder(), Recorder()
    trainer(8, [plain]).fit(tiny_model(lr=1e-3), tiny_data())
    lr_plain = [r["lr"] for r in plain.rows]  # LR after each step = the next step's scheduled LR
    seen = []

    class LR(Recorder):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(optimizer.param_groups[0]["lr"])

    trainer(8, [cur, rec, LR()]).fit(tiny_model(lr=1e-3), tiny_data())
    sched = [1e-3 * 0.5] + lr_plain[:-1]  # warmup_steps=2: step 0 runs at lr/2
    want = [lr * cur.lr_factor(s) for s, lr in enumerate(sched)]
    assert seen == pytest.approx(want, rel=1e-12)
    assert seen[4] == pytest.approx(sched[4] / 3) and seen[7] == pytest.approx(sched[7])


class StopAt(pl.Callback):
    """Stops the run after ``step`` optimizer steps (a run killed mid-stage; same max_steps, so
    the same LR schedule)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def _run(tmp_path, max_steps, ckpt_every=None, resume=None, stop_at=None):
    cur = ContextCurriculum([Stage(0, 16, scale=1.0), Stage(3, 32, batch_size=2, scale=2.0, lr_warmup_steps=2),
                             Stage(7, 48, scale=3.0)], seed=3)
    rec = Recorder()
    cbs = [cur, rec]
    kw = {}
    if stop_at:
        cbs.append(StopAt(stop_at))
    if ckpt_every:
        cbs.append(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=ckpt_every, save_top_k=-1))
        kw["enable_checkpointing"] = True
    pi = {"factor": 1.0, "original_max_position_embeddings": 16}
    trainer(max_steps, cbs, **kw).fit(tiny_model("pi", encoding_cfg=pi), tiny_data(samples_per_epoch=16), ckpt_path=resume)
    return cur, rec.rows


def test_resume_mid_stage_reproduces_stage_length_scale_and_loss(tmp_path):
    _, full = _run(tmp_path / "a", 8)
    _, first = _run(tmp_path / "b", 8, ckpt_every=5, stop_at=5)  # stopped at step 5: inside stage [3, 7)
    ckpt = next((tmp_path / "b").glob("*step=5*.ckpt"))
    cur, rest = _run(tmp_path / "c", 8, resume=str(ckpt))
    assert [r["step"] for r in rest] == [5, 6, 7]
    assert cur.stage_at(5).seq_len == 32 and rest[0]["seq_len"] == 32 and rest[0]["batch"] == 2
    assert [r["scale"] for r in rest] == [2.0, 2.0, 3.0]  # the encoding's factor, set by the curriculum
    for a, b in zip(full[5:], rest):
        assert (a["step"], a["seq_len"], a["batch"], a["scale"]) == (b["step"], b["seq_len"], b["batch"], b["scale"])
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
    torch.testing.assert_close(losses(rest), losses(full[5:]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(losses(first), losses(full[:5]), rtol=0, atol=0)
    assert not math.isnan(rest[0]["loss"])
