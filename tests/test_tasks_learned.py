"""Every synthetic task is learned in distribution by a small TinyGPT: exact match at the training
length L reaches a stated bar after a short run. Each setting is a shortened version of the task's
entry in ``configs/compare_tasks.yaml`` (``tasks.task_settings``): the same format, loss (answer
tokens only) and encoding, with a smaller L, model or step count so that each test takes about
20 s on one CPU thread. A task that no small model learns in distribution makes every
length-generalization verdict on it meaningless; these tests keep the tasks learnable."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from posenc_lightning.callbacks import TaskEvalCallback
from posenc_lightning.data.tasks import TaskDataModule
from posenc_lightning.inject import inject
from posenc_lightning.models import TinyGPT


def learned(task: str, encoding: str, L: int, steps: int, task_cfg: dict[str, Any] | None = None,
            d_model: int = 64, n_layers: int = 2, n_heads: int = 4, lr: float = 3e-3, batch_size: int = 32,
            **model_kw: Any) -> float:
    """Exact match at L on 128 held-out sequences after ``steps`` AdamW steps at lengths L/4..L
    (``model_kw``: further TinyGPT arguments)."""
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    dm = TaskDataModule(task, task_cfg, train_len=L, batch_size=batch_size, test_examples=128, seed=0)
    model = TinyGPT(vocab_size=dm.vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads, max_seq_len=L,
                    encoding=None, lr=lr, weight_decay=0.0, warmup_steps=20, **model_kw)
    inject(model, encoding)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, barebones=True, limit_val_batches=0,
                         num_sanity_val_steps=0)
    trainer.fit(model, dm)
    return TaskEvalCallback(multiples=[1], base_len=L, examples=128).evaluate(model, None, datamodule=dm)[L]


def test_flip_flop_is_learned():
    """FFL(0.8) (Liu et al. 2023) at L=16, 400 steps (300 give 88%). Full setting (L=32, 1000 steps): RoPE 100%."""
    assert learned("flip_flop", "rope", L=16, steps=400) >= 0.9


def test_passkey_is_learned():
    """Passkey retrieval at L=16, 400 steps. Full setting (L=32, 500 steps): RoPE 97%."""
    assert learned("passkey", "rope", L=16, steps=400) >= 0.9


def test_selective_copy_is_learned():
    """Selective copy (Golovneva et al. 2024) of 3 items at L=16, 600 steps. Full setting (4 items,
    L=32, 1000 steps): RoPE 94%."""
    assert learned("selective_copy", "rope", L=16, steps=600, task_cfg={"n_items": 3}) >= 0.9


def test_counting_is_learned():
    """Counting (Golovneva et al. 2024) at L=16, 800 steps. Full setting (L=32, see
    configs/compare_tasks.yaml): RoPE reaches 88% after 1500 steps."""
    assert learned("counting", "rope", L=16, steps=800) >= 0.9


def test_copy_is_learned():
    """Copy (Kazemnejad et al. 2023) at L=16, 800 steps. Full setting (L=32, 2000 steps): RoPE 98%."""
    assert learned("copy", "rope", L=16, steps=800) >= 0.9


def test_reverse_is_learned():
    """Reverse (Kazemnejad et al. 2023) at L=16, 1200 steps. Full setting (L=32, 1500 steps): RoPE 96%."""
    assert learned("reverse", "rope", L=16, steps=1200) >= 0.9


def test_mqar_is_learned():
    """MQAR in Zoology's format (Arora et al. 2023: the value a hidden label, power-law query gaps,
    random filler; 1-head attention, lr 1e-3) with 2 pairs at L=16, 600 steps at constant lr: 95%.
    With the query/key/value init at 0.02 (TinyGPT's and Zoology's) the same run gives 17%: the
    recall circuit waits on the plateau. Full setting (4 pairs, L=32, 3000 steps): RoPE 96-99%."""
    assert learned("mqar", "rope", L=16, steps=600, n_heads=1, lr=1e-3, min_lr_ratio=1.0, qkv_init_std=0.08,
                   task_cfg={"n_pairs": 2, "hidden_values": True, "power_a": 0.01, "random_filler": True}) >= 0.9


def test_addition_is_learned():
    """Addition (Kazemnejad et al. 2023; digits least significant first) with operands of up to 2
    digits at L=11, 1600 steps, lr 1e-3, the query/key/value init at 0.08 (the MQAR setting's): 95%.
    1200 steps give 57%, and the init at 0.02 gives 8% (trials.md). Full setting (its own L=14,
    3-digit operands, 4000 steps): RoPE 99% / 100% at seeds 0 / 1."""
    assert learned("addition", "rope", L=11, steps=1600, lr=1e-3, qkv_init_std=0.08) >= 0.9


def test_qkv_init_std_sets_the_attention_inputs_only():
    """``qkv_init_std`` (what the MQAR setting uses) draws the query/key/value weights at that std
    and leaves every other weight at 0.02; an encoding injected afterwards keeps them."""
    torch.manual_seed(0)
    for std in (None, 0.08):
        model = TinyGPT(vocab_size=50, d_model=64, n_layers=2, n_heads=1, max_seq_len=16, encoding=None, qkv_init_std=std)
        inject(model, "rope")
        for block in model.blocks:  # 12288 weights each: the sample std is within 2% of the drawn one
            assert float(block.attn.qkv.weight.std()) == pytest.approx(std or 0.02, rel=0.02)
            assert float(block.attn.proj.weight.std()) == pytest.approx(0.02, rel=0.03)
        assert float(model.embed.tok.weight.std()) == pytest.approx(0.02, rel=0.1)
