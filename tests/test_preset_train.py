"""Every preset's layer schedule trains in TinyGPT through a real Trainer and `PosEncCallback`:
the loss is finite and falls, each layer holds its scheduled encoding and window, and the
checkpoint brings the schedule back."""

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from posenc_lightning import PosEncCallback, available_presets, build_preset
from posenc_lightning.models import TinyGPT
from tests.helpers import PRESET_CASES


class Losses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_the_cases_cover_every_preset():
    assert sorted(PRESET_CASES) == available_presets()


def _fit(tmp_path, cb, steps=12):
    torch.manual_seed(0)
    text = torch.arange(64).repeat(8)[None].expand(8, -1) % 17  # a periodic sequence: learnable in a few steps
    data = text[:, :33]
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=8)
    model = TinyGPT(d_model=32, n_layers=4, n_heads=2, max_seq_len=32, encoding=None, lr=1e-2, warmup_steps=1)
    losses = Losses()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[cb, losses], default_root_dir=tmp_path)
    trainer.fit(model, loader)
    return model, trainer, losses.losses


@pytest.mark.parametrize("name", sorted(PRESET_CASES))
def test_preset_trains_in_tinygpt(tmp_path, name):
    cb = PosEncCallback(name, config=PRESET_CASES[name])
    model, trainer, losses = _fit(tmp_path, cb)
    assert trainer.global_step == 12 and len(losses) == 12
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.75 * losses[0], losses  # ln(256) = 5.5 at the start
    specs = build_preset(name, **PRESET_CASES[name]).resolve(4)
    for block, spec in zip(model.blocks, specs):
        assert block.attn.posenc.name == spec.encoding
        assert (block.attn.posenc_window, block.attn.posenc_chunk) == (spec.window, spec.chunk)
    ckpt = tmp_path / "m.ckpt"
    trainer.save_checkpoint(ckpt)
    back = TinyGPT.load_from_checkpoint(ckpt)
    x = torch.randint(0, 17, (2, 32))
    torch.testing.assert_close(back(x), model(x))
    assert [b.attn.posenc_window for b in back.blocks] == [s.window for s in specs]


def test_yaml_form_schedule(tmp_path):
    """The YAML form: ``schedule: [rules]``, as LightningCLI passes it."""
    cb = PosEncCallback(schedule=[{"layers": "every 2", "encoding": "alibi"},
                                  {"layers": "rest", "encoding": "rope", "window": 8}])
    model, trainer, losses = _fit(tmp_path, cb, steps=3)
    assert trainer.global_step == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert [b.attn.posenc.name for b in model.blocks] == ["rope", "alibi", "rope", "alibi"]
    assert [b.attn.posenc_window for b in model.blocks] == [8, None, 8, None]
    with pytest.raises(ValueError, match="either schedule"):
        PosEncCallback("rope", schedule=[{"layers": "rest", "encoding": "rope"}], config={"theta": 10.0})


@pytest.mark.parametrize("name", sorted(PRESET_CASES))
def test_preset_cached_decode_equals_full_forward(name):
    """Token-by-token decoding with the KV cache (windows and chunks masked at the cache's offset)
    equals the full forward, past the window and across chunk boundaries."""
    torch.manual_seed(0)
    model = TinyGPT(d_model=32, n_layers=4, n_heads=2, max_seq_len=64, encoding=name,
                    encoding_cfg=PRESET_CASES[name]).eval()
    x = torch.randint(0, 256, (2, 27))
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache()
        steps = [model(x[:, :5], cache=cache)] + [model(x[:, t:t + 1], cache=cache) for t in range(5, 27)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)


def test_the_guide_lists_every_preset():
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "layer-schedules.md").read_text()
    assert [p for p in available_presets() if f"| `{p}` |" not in guide] == []
