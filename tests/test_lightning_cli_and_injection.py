"""LightningCLI YAML (class_path / init_args) builds encodings; injection options."""

import torch
import yaml
from lightning.pytorch.cli import LightningCLI

from posenc_lightning import inject
from posenc_lightning.data import CorpusDataModule
from posenc_lightning.models import TinyGPT
from tests.helpers import Attn, qkv


def _cli(tmp_path, encoding):
    cfg = {
        "trainer": {"max_steps": 2, "logger": False, "enable_progress_bar": False, "enable_checkpointing": False,
                    "limit_val_batches": 0, "default_root_dir": str(tmp_path),
                    "callbacks": [{"class_path": "posenc_lightning.PosEncCallback",
                                   "init_args": {"encoding": encoding}}]},
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "encoding": None},
        "data": {"seq_len": 32, "batch_size": 2, "max_bytes": 100_000},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return LightningCLI(TinyGPT, CorpusDataModule, args=["fit", "--config", str(path)])


def test_lightning_cli_class_path_encoding(tmp_path):
    cli = _cli(tmp_path, {"class_path": "posenc_lightning.encodings.rope.RoPE",
                          "init_args": {"theta": 500000.0, "layout": "interleaved"}})
    enc = cli.model.blocks[0].attn.posenc
    assert type(enc).__name__ == "RoPE" and enc.theta == 500000.0 and enc.layout == "interleaved"
    assert cli.trainer.global_step == 2


def test_lightning_cli_encoding_by_name(tmp_path):
    cli = _cli(tmp_path, "alibi")
    assert cli.model.blocks[0].attn.posenc.name == "alibi"


def test_share_across_layers_false_gives_independent_parameters():
    model = TinyGPT(d_model=32, n_layers=3, n_heads=2, encoding=None)
    inject(model, "relative_bias", share_across_layers=False)
    encs = [b.attn.posenc for b in model.blocks]
    assert len({id(e) for e in encs}) == 3
    w = [e.relative_attention_bias.weight for e in encs]
    assert not torch.equal(w[0], w[1])  # own initialisation
    inject(model, "relative_bias")
    assert len({id(b.attn.posenc) for b in model.blocks}) == 1


def test_learned_qk_adds_positions_to_q_and_k_not_v():
    m = Attn(n_heads=2, head_dim=8)
    enc = inject(m, "learned", mode="qk", max_seq_len=32)
    q, k, v = qkv(1, 2, 6, 8)
    out = m(q, k, v)
    p = enc.table[:6].permute(1, 0, 2)[None]  # [1, H, N, D]
    qq, kk = q + p, k + p
    logits = qq @ kk.transpose(-1, -2) / 8 ** 0.5
    logits = logits.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(out, torch.softmax(logits, -1) @ v, rtol=1e-5, atol=1e-6)
