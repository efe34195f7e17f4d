"""One TinyGPT training run in its own process, for tests/test_sigkill_resume.py.

``python -m tests.sigkill_run OUT [--resume CKPT] [--hang-at STEP]``: a CLEX-encoded TinyGPT (a
learned, scalable encoding) under a `ContextCurriculum` with length, batch size, scale and LR
warm-restart stages, a `ModelCheckpoint` every `CKPT_EVERY` steps into ``OUT/ckpt``. Every step
appends ``{step, loss, seq_len, batch, scale, lr}`` (the LR the step applied) to ``OUT/steps.jsonl`` (flushed: a killed
run keeps what it logged) and saves the encoding's parameters as they are when the step begins
to ``OUT/enc-<step>.pt``. ``--hang-at``: at that step's start, write ``OUT/hung`` and wait to be
killed (the test kills it there with SIGKILL, past a checkpoint, mid-stage). An `LMEvalCallback`
(perplexity by length) evaluates every `EVAL_EVERY` steps; a finished run writes its history to
``OUT/lm_eval.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

MAX_STEPS = 10
CKPT_EVERY = 4
#: stages at 0, 3 and 7: the checkpoint at step 4 falls inside the second stage's LR warm restart
STAGES = [(0, 16, None, 1.0, 0), (3, 32, 2, 2.0, 3), (7, 48, None, 3.0, 0)]
#: lm-eval's perplexity task at validation every 2 steps (its history is in the checkpoint)
EVAL_EVERY = 2


def curriculum():
    from posenc_lightning.curriculum.context import ContextCurriculum, Stage

    return ContextCurriculum([Stage(s, n, b, sc, w) for s, n, b, sc, w in STAGES], seed=3)
CLEX = {"max_scale": 4.0, "original_max_position_embeddings": 16}


class StepLog(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from posenc_lightning.curriculum.context import encodings_of

        enc = encodings_of(pl_module)[0]
        torch.save({k: v.detach().clone() for k, v in enc.state_dict().items()},
                   self.out / f"enc-{trainer.global_step}.pt")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lr = optimizer.param_groups[0]["lr"]  # what this step applies (warm restart included)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from posenc_lightning.curriculum.context import encodings_of

        row = {"step": trainer.global_step - 1, "loss": float(outputs["loss"]), "seq_len": int(batch[0].shape[-1]),
               "batch": int(batch[0].shape[0]), "scale": encodings_of(pl_module)[0].factor,
               "lr": self.lr}
        with open(self.out / "steps.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


class HangAt(pl.Callback):
    def __init__(self, step: int, out: Path) -> None:
        self.step, self.out = step, out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            (self.out / "hung").write_text(str(self.step))
            time.sleep(600)  # until SIGKILL


def main(argv: list[str] | None = None) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from posenc_lightning.callbacks.lm_eval import LMEvalCallback
    from tests.curriculum_helpers import tiny_data, tiny_model, trainer

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--resume")
    ap.add_argument("--hang-at", type=int)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lm_eval = LMEvalCallback(tasks=["ppl_by_length"], max_seq_lengths=[32], limit=1)
    cbs = [curriculum(), StepLog(out), lm_eval,
           ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=CKPT_EVERY, save_top_k=-1)]
    if args.hang_at is not None:
        cbs.append(HangAt(args.hang_at, out))
    model = tiny_model("clex", encoding_cfg=CLEX, lr=3e-3)
    trainer(MAX_STEPS, cbs, enable_checkpointing=True, val_check_interval=EVAL_EVERY, check_val_every_n_epoch=None,
            limit_val_batches=1, num_sanity_val_steps=0).fit(model, tiny_data(samples_per_epoch=16), ckpt_path=args.resume)
    (out / "lm_eval.json").write_text(json.dumps(lm_eval.history))


if __name__ == "__main__":
    main()
