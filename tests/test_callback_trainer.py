"""PosEncCallback in real Lightning Trainer runs: injection, idempotence, checkpoints, errors."""

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from posenc_lightning import PosEncAttentionMixin, PosEncCallback, build_encoding, inject
from posenc_lightning.data import CorpusDataModule
from posenc_lightning.models import TinyGPT
from tests.helpers import Attn, qkv

FOUNDATION = ["nope", "sinusoidal", "learned", "rope", "alibi", "relative_bias"]


def tiny(**kw):
    kw.setdefault("encoding", None)
    return TinyGPT(d_model=32, n_layers=2, n_heads=2, max_seq_len=64, **kw)


def trainer(tmp_path, callbacks, steps=3, **kw):
    kw.setdefault("limit_val_batches", 1)
    return pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=callbacks, default_root_dir=tmp_path,
                      num_sanity_val_steps=0, **kw)


def data():
    return CorpusDataModule(seq_len=32, batch_size=4, max_bytes=200_000, max_val_windows=4)


@pytest.mark.parametrize("name", FOUNDATION)
def test_trainer_fit_with_every_foundation_encoding(tmp_path, name):
    model = tiny()
    cb = PosEncCallback(name)
    t = trainer(tmp_path, [cb])
    t.fit(model, data())
    assert t.global_step == 3 and torch.isfinite(t.callback_metrics["train/loss"])
    assert cb.injected.name == name
    holders = [m.posenc for m in (model.embed, model.blocks[0].attn, model.blocks[1].attn) if m.posenc is not None]
    assert all(h is cb.injected for h in holders) and (bool(holders) == (name != "nope"))


def test_swapping_encoding_changes_outputs():
    x = torch.randint(0, 256, (1, 24))
    outs = {}
    for name in FOUNDATION:
        torch.manual_seed(0)
        model = tiny()
        torch.manual_seed(1)
        inject(model, name)
        with torch.no_grad():
            outs[name] = model(x)
    names = list(outs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not torch.allclose(outs[a], outs[b]), (a, b)


def test_injecting_twice_is_a_noop(tmp_path):
    model = tiny()
    cb = PosEncCallback("relative_bias")
    t = trainer(tmp_path, [cb], steps=2)
    t.fit(model, data())
    enc = model.blocks[0].attn.posenc
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cb.setup(t, model, "validate")  # a second setup (fit -> validate) keeps encoding and weights
    assert model.blocks[0].attn.posenc is enc
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_inject_replaces_whole_scheme():
    model = tiny()
    inject(model, "learned")
    assert model.embed.posenc is not None and model.blocks[0].attn.posenc is None
    inject(model, "alibi")
    assert model.embed.posenc is None
    assert not any("table" in k for k in model.state_dict()), "learned table left behind"


def test_checkpoint_reload_restores_encoding_and_logits(tmp_path):
    model = tiny(encoding="rope")  # the module's own default ...
    cb = PosEncCallback("relative_bias", num_buckets=16, max_distance=32)  # ... replaced by the callback
    t = trainer(tmp_path, [cb], steps=3)
    t.fit(model, data())
    path = tmp_path / "m.ckpt"
    t.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=False)
    assert ckpt["posenc_lightning"]["encoding"] == "relative_bias"
    assert any(k.startswith("PosEncCallback") and "relative_bias" in k for k in ckpt["callbacks"])
    fresh = TinyGPT.load_from_checkpoint(path)
    enc = fresh.blocks[0].attn.posenc
    assert enc.name == "relative_bias" and enc.num_buckets == 16 and enc.max_distance == 32
    x = torch.randint(0, 256, (2, 40))
    model.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(model(x), fresh(x))


def test_resume_restores_learned_encoding_parameters(tmp_path):
    model = tiny()
    t = trainer(tmp_path, [PosEncCallback("learned")], steps=2)
    t.fit(model, data())
    path = tmp_path / "a.ckpt"
    t.save_checkpoint(path)
    model2 = tiny()
    t2 = trainer(tmp_path, [PosEncCallback("learned")], steps=2)
    t2.fit(model2, data(), ckpt_path=path)  # already at max_steps: restores, trains nothing
    torch.testing.assert_close(model2.embed.posenc.table, model.embed.posenc.table)


def test_resume_with_a_different_encoding_is_a_clear_error(tmp_path):
    model = tiny()
    t = trainer(tmp_path, [PosEncCallback("alibi")], steps=1)
    t.fit(model, data())
    path = tmp_path / "a.ckpt"
    t.save_checkpoint(path)
    with pytest.raises(Exception, match="trained with encoding 'alibi'|alibi"):
        trainer(tmp_path, [PosEncCallback("rope")], steps=2).fit(tiny(), data(), ckpt_path=path)


class ConfigureModelLM(pl.LightningModule):
    """A user module that builds its layers in configure_model."""

    def __init__(self):
        super().__init__()
        self.attn = None

    def configure_model(self):
        if self.attn is None:
            self.emb = nn.Embedding(256, 32)
            self.attn = Attn(n_heads=2, head_dim=16)
            self.qkv = nn.Linear(32, 96)
            self.out = nn.Linear(32, 256)

    def forward(self, x):
        h = self.emb(x)
        b, n, _ = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return self.out(self.attn(q, k, v).transpose(1, 2).reshape(b, n, 32))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self(x).transpose(1, 2), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_modules_built_in_configure_model_get_the_encoding(tmp_path):
    model = ConfigureModelLM()
    cb = PosEncCallback("relative_bias")
    trainer(tmp_path, [cb], steps=2, limit_val_batches=0).fit(model, data())
    assert model.attn.posenc is cb.injected and model.attn.posenc.relative_attention_bias.weight.grad is not None


def test_encoding_hparams_are_logged(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path)
    model = tiny()
    pl.Trainer(max_steps=1, logger=logger, enable_progress_bar=False, limit_val_batches=0,
               callbacks=[PosEncCallback("rope", theta=500000.0)]).fit(model, data())
    text = (tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text()
    # one entry names the encoding used: the model's own hyperparameter (it was built bare, None)
    assert "\nencoding: rope\n" in f"\n{text}" and "encoding: null" not in text and "posenc/encoding" not in text
    assert "posenc/theta: 500000.0" in text and model.hparams.encoding_cfg == {"theta": 500000.0}


# ------------------------------------------------------------------------------- clear errors
def test_unknown_encoding_lists_known_ones():
    with pytest.raises(ValueError, match="Known encodings: .*alibi.*rope"):
        build_encoding("ropee")
    with pytest.raises(ValueError, match="Did you mean 'rope'"):
        PosEncCallback("ropee").setup(None, tiny(), "fit")


def test_odd_head_dim_for_rotary_is_an_error():
    m = Attn(n_heads=2, head_dim=15)
    with pytest.raises(ValueError, match="even head_dim"):
        inject(m, "rope")
    inject(m, "alibi")  # a non-rotary encoding is fine


def test_sequence_longer_than_learned_table():
    model = tiny(encoding="learned")
    with pytest.raises(ValueError, match="beyond the learned table .*max_seq_len=64"):
        model(torch.randint(0, 256, (1, 65)))


def test_backend_that_cannot_run_the_encoding():
    from posenc_lightning.encodings.base import Encoding, Normalizer, Walk

    class SigmoidWeights(Normalizer):  # no fused form: only the eager reference runs it
        walk = Walk.SOFTMAX
        fused_in = frozenset()

        def weights(self, logits, mask, q_pos, k_pos):
            return torch.sigmoid(logits) * (mask if mask is not None else 1)

    class Sigmoidish(Encoding):
        name = "sigmoidish"
        normalizer_kind = SigmoidWeights

        def normalize(self, ctx):
            return SigmoidWeights(self.name)

    m = Attn()
    with pytest.raises(ValueError, match="backend 'sdpa' cannot run encoding 'sigmoidish'.*'eager'"):
        inject(m, Sigmoidish(), backend="sdpa")
    inject(m, Sigmoidish(), backend="auto")
    q, k, v = qkv()
    assert m(q, k, v).shape == q.shape


def test_unknown_backend_and_missing_mixin_errors():
    with pytest.raises(ValueError, match="unknown backend"):
        inject(Attn(), "rope", backend="fast")
    with pytest.raises(ValueError, match="inherit"):
        inject(nn.Linear(2, 2), "rope")
    with pytest.raises(TypeError, match="unknown argument"):
        build_encoding("rope", thetta=3)


def test_attention_module_without_sizes_is_an_error():
    class Bad(nn.Module, PosEncAttentionMixin):
        pass

    with pytest.raises(ValueError, match="n_heads"):
        inject(Bad(), "rope")
