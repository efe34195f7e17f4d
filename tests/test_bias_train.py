"""Every encoding of the bias / normalizer family trains in TinyGPT through PosEncCallback(name):
finite loss, and the learned ones get non-zero gradients on every parameter and are updated."""

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from posenc_lightning import PosEncCallback
from posenc_lightning.models import TinyGPT

FAMILY = ["fire", "cope", "fox", "sba", "rse", "rope_alibi", "mixture"]
LEARNED = {"fire", "cope", "fox", "rse", "mixture"}


class GradProbe(pl.Callback):
    """Records |grad| of every encoding parameter after each backward."""

    def __init__(self):
        self.grads = []
        self.start = {}

    def on_train_start(self, trainer, pl_module):
        self.start = {n: p.detach().clone() for n, p in pl_module.named_parameters() if ".posenc." in n}

    def on_after_backward(self, trainer, pl_module):
        self.grads.append({n: (p.grad.abs().sum().item() if p.grad is not None else 0.0)
                           for n, p in pl_module.named_parameters() if ".posenc." in n and p.requires_grad})


@pytest.mark.parametrize("name", FAMILY)
def test_trains_in_tinygpt_with_gradients_on_its_parameters(tmp_path, name):
    torch.manual_seed(0)
    data = torch.randint(0, 256, (16, 33))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)
    model = TinyGPT(d_model=32, n_layers=2, n_heads=2, max_seq_len=32, encoding=None)
    cb, probe = PosEncCallback(name), GradProbe()
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[cb, probe], default_root_dir=tmp_path)
    trainer.fit(model, loader)
    assert trainer.global_step == 3 and cb.injected.name == name
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    enc = model.blocks[0].attn.posenc
    assert enc is cb.injected and enc is model.blocks[1].attn.posenc  # shared across layers
    if name in LEARNED:
        params = dict(enc.named_parameters())
        assert params and len(probe.grads) == 3
        zero = [n for n, g in probe.grads[0].items() if not g > 0]
        assert not zero, f"{name}: no gradient on {zero}"
        start = {n.split(".posenc.", 1)[1]: p for n, p in probe.start.items() if n.startswith("blocks.0.")}
        stuck = [n for n, p in params.items() if p.requires_grad and torch.equal(p.detach(), start[n])]
        assert not stuck, f"{name}: the optimizer did not update {stuck}"
