"""`LMEvalCallback` inside `trainer.fit`: per-length metrics, offline, RNG untouched, DDP == 1 process."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest

pytest.importorskip("lm_eval")

from posenc_lightning.callbacks.lm_eval import LMEvalCallback
from posenc_lightning.data import CorpusDataModule
from posenc_lightning.models import TinyGPT


class LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def _fit(callbacks, lr=3e-3, steps=2):
    pl.seed_everything(0)
    model = TinyGPT(d_model=32, n_layers=1, n_heads=2, max_seq_len=64, lr=lr, warmup_steps=1)
    data = CorpusDataModule(seq_len=64, batch_size=4, max_bytes=200_000, max_val_windows=2)
    rec = LossRecorder()
    trainer = pl.Trainer(max_steps=steps, val_check_interval=2, check_val_every_n_epoch=None, limit_val_batches=1,
                         num_sanity_val_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
                         callbacks=[rec, *callbacks])
    trainer.fit(model, data)
    return rec.losses, trainer


def test_lm_eval_callback_logs_each_length_offline_and_leaves_training_unchanged(monkeypatch):
    import socket

    def no_network(*a, **k):
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)  # offline means offline
    cb = LMEvalCallback(tasks=["niah_single_1"], max_seq_lengths=[512, 1024], limit=2)
    t0 = time.perf_counter()
    losses_with, trainer = _fit([cb])
    elapsed = time.perf_counter() - t0
    assert [h["step"] for h in cb.history] == [2]  # the validation at step 2, not the sanity check
    for h in cb.history:
        assert set(h["metrics"]) == {"lm_eval/niah_single_1/512", "lm_eval/niah_single_1/1024"}
        assert all(0.0 <= v <= 1.0 for v in h["metrics"].values())
    assert "lm_eval/niah_single_1/1024" in trainer.callback_metrics
    assert cb.built.samples["niah_single_1"] == [0, 1, 2, 3]  # 2 per length
    secs = [h["seconds"] for h in cb.history]
    print(f"fit with LMEvalCallback: {elapsed:.1f}s (evaluations: {secs})")
    assert max(secs) < 60  # seconds, not minutes (2 samples x 2 lengths x 128 greedy tokens, loaded 2-core CPU)
    losses_without, _ = _fit([])
    assert losses_with == losses_without  # bit-identical: the RNG streams were restored


def _fit_lr0(devices: int) -> dict[str, float]:
    pl.seed_everything(0)
    model = TinyGPT(d_model=32, n_layers=1, n_heads=2, max_seq_len=64, lr=0.0, warmup_steps=1)  # weights fixed
    data = CorpusDataModule(seq_len=64, batch_size=2, max_bytes=200_000, max_val_windows=2)
    cb = LMEvalCallback(tasks=["niah_single_1", "ppl_by_length"], max_seq_lengths=[512, 1024], limit=2)
    trainer = pl.Trainer(max_steps=1, val_check_interval=1, check_val_every_n_epoch=None, limit_val_batches=1,
                         num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         devices=devices, strategy="ddp_fork" if devices > 1 else "auto", callbacks=[cb])
    trainer.fit(model, data)
    assert trainer.world_size == devices
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("lm_eval/")}


@pytest.mark.slow
def test_lm_eval_ddp_two_processes_equal_one():
    """2 DDP processes (gloo, CPU; forked, so RULER's slow import is paid once) shard the requests
    through the Lightning strategy and give the numbers of 1 process."""
    from posenc_lightning.eval import harness

    one = _fit_lr0(1)
    harness._BUILT.clear()  # the forked ranks build their own tasks (seeded: the same documents)
    two = _fit_lr0(2)
    assert set(one) == {f"lm_eval/{t}/{n}" for t in ("niah_single_1", "ppl_by_length") for n in (512, 1024)}
    assert one.keys() == two.keys()
    for k in one:
        assert two[k] == pytest.approx(one[k], rel=1e-5, abs=1e-6), k
    assert one["lm_eval/ppl_by_length/512"] > 1.0  # a real number (nll/token of an untrained model)
