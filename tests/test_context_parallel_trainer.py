"""`ContextParallel` in real Trainer runs (2 gloo processes, ddp_spawn): each rank trains on its
head-tail shard of the batch, the mean of the ranks' losses equals a 1-process run on the full
sequences step by step (through a `ContextCurriculum` stage that doubles the length), a run resumed from a checkpoint under context parallelism ends with the
parameters of an uninterrupted one, `LengthEvalCallback` scores shards under the same groups, and
bad setups fail at setup with the rule named.

Tolerance: losses to 1e-5 (step 0: the same parameters; later steps: AdamW on gradients summed
in another order, as in test_ddp.py); resumed vs uninterrupted: bitwise equal parameters. The
1-process run is a ddp_spawn run of world size 1, so that its distributed sampler shuffles the windows
as the context-parallel run's does (over its data-parallel axis of size 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from posenc_lightning import ContextCurriculum, ContextParallel, LengthEvalCallback, Stage
from posenc_lightning.encodings.base import Encoding
from tests.curriculum_helpers import tiny_data, tiny_model

STEPS, SEQ = 3, 16


class Record(pl.Callback):
    """Per step: the loss and the shard length training_step saw; at the end the parameters."""

    def __init__(self, out: str) -> None:
        self.out, self.rows = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append({"loss": float(outputs["loss"]), "n": batch[0].shape[1], "sharded": pl_module.posenc_context_parallel is not None})

    def on_train_end(self, trainer, pl_module):
        params = {n: p.detach().flatten().tolist() for n, p in pl_module.named_parameters()}
        length = next((cb.results for cb in trainer.callbacks if isinstance(cb, LengthEvalCallback)), {})
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(
            {"rows": self.rows, "params": params, "ppl": {str(k): v for k, v in length.items()}}))


def _fit(out: Path, devices: int, steps: int = STEPS, ckpt: str | None = None, save: bool = False) -> None:
    out.mkdir(exist_ok=True)
    pl.seed_everything(0)
    # a curriculum doubling the length at step 2: the shards follow it (8 tokens, then 16)
    cbs = [Record(str(out)), LengthEvalCallback(lengths=[SEQ, 2 * SEQ], max_windows=2),
           ContextCurriculum([Stage(0, SEQ), Stage(2, 2 * SEQ)], seed=3)]
    if save:  # by rank 0 inside the run, at the end of epoch 0 (step 2), with the optimizer's state
        cbs.append(ModelCheckpoint(dirpath=str(out), filename="step", save_on_train_epoch_end=True, save_top_k=-1))
    if devices > 1:
        cbs.append(ContextParallel(devices))
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=devices,
                         strategy="ddp_spawn", callbacks=cbs, logger=False,
                         enable_checkpointing=save, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=1, val_check_interval=steps, check_val_every_n_epoch=None, num_sanity_val_steps=0, deterministic=True)
    # 2 batches per epoch: the checkpoint at step 2 is at an epoch end, where Lightning resumes a
    # plain (not stateful) dataloader exactly
    trainer.fit(tiny_model("fox"), tiny_data(seq_len=SEQ, batch_size=2, samples_per_epoch=4), ckpt_path=ckpt)


def _read(d: Path, rank: int) -> dict:
    return json.loads((d / f"rank{rank}.json").read_text())


def test_trainer_two_ranks_equal_one_process_and_resume(tmp_path):
    _fit(tmp_path / "cp", 2)
    _fit(tmp_path / "one", 1)
    cp = [_read(tmp_path / "cp", r) for r in (0, 1)]
    one = _read(tmp_path / "one", 0)
    assert [r["n"] for r in cp[0]["rows"]] == [SEQ // 2, SEQ // 2, SEQ] and all(r["sharded"] for r in cp[0]["rows"])
    assert [r["n"] for r in one["rows"]] == [SEQ, SEQ, 2 * SEQ]
    mean = torch.tensor([(a["loss"] + b["loss"]) / 2 for a, b in zip(cp[0]["rows"], cp[1]["rows"])])
    torch.testing.assert_close(mean, torch.tensor([r["loss"] for r in one["rows"]]), rtol=1e-5, atol=1e-5)
    assert cp[0]["params"] == cp[1]["params"]  # DDP kept the ranks in sync
    for name, p in one["params"].items():
        torch.testing.assert_close(torch.tensor(cp[0]["params"][name]), torch.tensor(p), rtol=1e-4, atol=1e-5)
    # perplexity by length under the same groups: the shards' mean NLL is the 1-process one
    assert set(cp[0]["ppl"]) == {str(SEQ), str(2 * SEQ)}
    for n, ppl in one["ppl"].items():
        assert cp[0]["ppl"][n] == pytest.approx(ppl, rel=1e-4)

    # resume under context parallelism: 2 steps, a checkpoint, then to STEPS == uninterrupted
    _fit(tmp_path / "first", 2, steps=2, save=True)
    _fit(tmp_path / "resumed", 2, ckpt=str(tmp_path / "first" / "step.ckpt"))
    resumed = _read(tmp_path / "resumed", 0)
    assert resumed["params"] == cp[0]["params"]


class _StatefulKeys(Encoding):
    """Per-token state beside the cached keys, without reading the gathered ``ctx.k_hidden``."""

    name = "stateful_keys"
    keeps_cache_state = True

    def bias(self, q, k, ctx):
        return None


@pytest.mark.parametrize("size, seq_len, encoding, match", [
    (2, SEQ, None, "world size 1 .*not divisible by size"),
    (1, 17, None, r"datamodule.seq_len = 17 is not divisible by 2 x context-parallel size = 2"),
    (1, SEQ, "stateful", "'stateful_keys' cannot run with the keys gathered"),
])
def test_bad_setup_is_a_clear_error_at_setup(size, seq_len, encoding, match):
    from posenc_lightning import inject

    model = tiny_model(None)
    if encoding:
        inject(model, _StatefulKeys())
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, callbacks=[ContextParallel(size)], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=match):
        trainer.fit(model, tiny_data(seq_len=seq_len, batch_size=2))
