"""Every rotary encoding of issue 3 trains in TinyGPT through PosEncCallback(name), default args."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from posenc_lightning import PosEncCallback
from posenc_lightning.data import CorpusDataModule
from posenc_lightning.models import TinyGPT

ROTARY = ["pi", "ntk", "dynamic_ntk", "yarn", "llama3", "long_rope", "resonance_rope", "multiscale_rope", "xpos",
          "rope_2d", "liere", "comrope", "clex", "exposb"]
#: clex at its default scale t = 1 is exactly rope (the ODE runs from 1 to 1), so its parameters
#: only get gradients at t > 1 (the curriculum samples t); train it at t = 3 here
CFG = {"clex": {"factor": 3.0}}


@pytest.mark.parametrize("name", ROTARY)
def test_rotary_encoding_trains_in_tinygpt(tmp_path, name):
    model = TinyGPT(d_model=64, n_layers=1, n_heads=2, max_seq_len=32, encoding=None, warmup_steps=1)
    data = CorpusDataModule(seq_len=32, batch_size=2, max_bytes=20_000, max_val_windows=1)
    cb = PosEncCallback(name, **CFG.get(name, {}))
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[cb], default_root_dir=tmp_path)
    trainer.fit(model, data)
    enc = cb.injected
    assert enc.name == name and trainer.global_step == 2
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    before = {k: v.clone() for k, v in TinyGPT(d_model=64, n_layers=1, n_heads=2, max_seq_len=32,
                                                encoding=name, encoding_cfg=CFG.get(name)).blocks[0].attn.posenc.state_dict().items()}
    # learnable encodings (liere, comrope, clex, exposb) were updated by the optimizer
    for key, p in enc.named_parameters():
        assert not torch.equal(p.detach(), before[key]), f"{name}.{key} did not train"
    # and the trained model decodes with its KV cache like a full forward
    model.eval()
    x = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        full = model(x)[:, -1]
        cache = model.new_cache()
        model(x[:, :7], cache=cache)
        for t in range(7, 12):
            step = model(x[:, t:t + 1], cache=cache)[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-4)
