"""Injection never discards trained state: the same spec is a no-op, another spec replaces,
``reset=True`` re-initializes on purpose (issue 16)."""

import lightning.pytorch as pl
import pytest
import torch

from posenc_lightning import PosEncCallback, inject
from posenc_lightning.data import CorpusDataModule
from posenc_lightning.inject import injected_spec
from posenc_lightning.models import TinyGPT

TRAINED = ["fire", "learned", "relative_bias", "cope"]


def tiny(**kw):
    kw.setdefault("encoding", None)
    return TinyGPT(d_model=32, n_layers=2, n_heads=2, max_seq_len=32, **kw)


def fit(tmp_path, model, cb, steps):
    t = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, callbacks=[cb],
                   default_root_dir=tmp_path, limit_val_batches=0, num_sanity_val_steps=0)
    t.fit(model, CorpusDataModule(seq_len=32, batch_size=2, max_bytes=50_000, max_val_windows=2))
    return t


def posenc_state(model):
    out = {k: v.detach().clone() for k, v in model.named_parameters() if "posenc" in k}
    assert out, "the encoding has parameters"
    return out


@pytest.mark.parametrize("name", TRAINED)
def test_load_from_checkpoint_then_callback_keeps_trained_encoding(tmp_path, name):
    model = tiny(lr=3e-2, warmup_steps=1)
    assert getattr(model.blocks[0].attn, "posenc", None) is None  # the callback builds it
    t = fit(tmp_path, model, PosEncCallback(name), steps=2)
    trained = posenc_state(model)
    ckpt = tmp_path / "a.ckpt"
    t.save_checkpoint(ckpt)
    loaded = TinyGPT.load_from_checkpoint(ckpt, lr=0.0)
    for k, v in posenc_state(loaded).items():
        assert torch.equal(v, trained[k]), k
    cb = PosEncCallback(name)
    fit(tmp_path, loaded, cb, steps=1)  # lr 0: nothing may move
    after = posenc_state(loaded)
    assert after.keys() == trained.keys()
    for k, v in after.items():
        assert torch.equal(v, trained[k]), f"{name}: {k} was re-initialized"
    assert cb.injected is next(m.posenc for m in loaded.modules() if getattr(m, "posenc", None) is not None)


@pytest.mark.parametrize("name", TRAINED)
def test_inject_same_spec_is_noop_other_spec_replaces_reset_reinitializes(name):
    model = tiny()
    enc = inject(model, name)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.5)  # "trained"
    before = posenc_state(model)
    assert inject(model, name) is enc  # defaults resolved from the model (max_seq_len) compare equal
    for k, v in posenc_state(model).items():
        assert torch.equal(v, before[k]), k
    fresh = inject(model, name, reset=True)
    assert fresh is not enc
    assert any(not torch.equal(v, before[k]) for k, v in posenc_state(model).items())
    other = inject(model, name, share_across_layers=False)
    assert other is not fresh
    if name != "learned":  # learned lives on the embedding: one table either way
        assert model.blocks[0].attn.posenc is not model.blocks[1].attn.posenc
    assert injected_spec(model)["share_across_layers"] is False


def test_inject_different_config_replaces():
    model = tiny()
    enc = inject(model, "fire", mlp_width=8)
    assert inject(model, "fire", mlp_width=8) is enc
    other = inject(model, "fire", mlp_width=16)
    assert other is not enc and other.mlp[0].out_features == 16
    assert inject(model, "alibi") is not other and model.blocks[0].attn.posenc.name == "alibi"


def test_inject_backend_only_switches_backend_and_keeps_parameters():
    model = tiny()
    enc = inject(model, "relative_bias", backend="sdpa")
    assert inject(model, "relative_bias", backend="eager") is enc
    assert all(b.attn.posenc_backend == "eager" for b in model.blocks)
    assert injected_spec(model)["backend"] == "eager"


def test_inject_instance_is_kept_by_identity_only():
    from posenc_lightning import build_encoding

    model = tiny()
    a = build_encoding("fire")
    assert inject(model, a) is a and inject(model, a) is a
    b = build_encoding("fire")
    assert inject(model, b) is b and model.blocks[0].attn.posenc is b  # an explicit instance replaces
