"""A pretrained Hugging Face directory (model + a tokenizer trained locally) inside fit: the data in its
own tokens, RULER prompts sized by its tokenizer, lm-eval's own HFLM on the in-memory model, offline."""

from __future__ import annotations

import math
import socket

import lightning.pytorch as pl
import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

from posenc_lightning import PosEncCallback
from posenc_lightning.callbacks.lm_eval import LMEvalCallback
from posenc_lightning.data import CorpusDataModule
from posenc_lightning.data.corpus import stdlib_files
from posenc_lightning.eval.harness import build_tasks
from posenc_lightning.eval.tokenizer import byte_tokenizer_dir, train_bpe_tokenizer
from posenc_lightning.models.hf import HFCausalLM

VOCAB = 384


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("hf_llama")
    tok = train_bpe_tokenizer((p.read_text(errors="replace") for p in stdlib_files()[:40]), VOCAB)
    tok.save_pretrained(str(out))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(str(out))
    return str(out)


def test_ruler_inside_fit_with_the_models_own_tokenizer_through_hflm(pretrained_dir, monkeypatch):
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    def no_network(*a, **k):
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    module = HFCausalLM(pretrained_dir=pretrained_dir, lr=1e-3)
    assert module.tokenizer_dir == pretrained_dir
    data = CorpusDataModule(seq_len=64, batch_size=4, max_bytes=100_000, max_val_windows=2, tokenizer=pretrained_dir)
    cb = LMEvalCallback(tasks=["niah_single_1"], max_seq_lengths=[512], limit=2)
    trainer = pl.Trainer(max_steps=2, val_check_interval=2, check_val_every_n_epoch=None, limit_val_batches=1,
                         num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[PosEncCallback("yarn", factor=4.0), cb])
    trainer.fit(module, data)
    assert cb.tokenizer == pretrained_dir
    value = cb.history[-1]["metrics"]["lm_eval/niah_single_1/512"]
    assert 0.0 <= value <= 1.0 and not math.isnan(value)
    assert isinstance(cb._lm(trainer, module), HFLM)
    # the training windows are the model's tokens (ids above 255 occur), not bytes
    x, _ = next(iter(data.train_dataloader()))
    assert int(x.max()) >= 256 and int(x.max()) < VOCAB
    # RULER sized its prompts with the BPE tokenizer: the same task sized in bytes gives shorter texts
    tok = AutoTokenizer.from_pretrained(pretrained_dir, local_files_only=True)
    prompts = [s["arguments"][0][0] for s in cb.last_results["samples"]["niah_single_1"]]
    by_bytes = build_tasks(["niah_single_1"], [512], 2, tokenizer=byte_tokenizer_dir())
    task = by_bytes.task_dict["tasks"]["niah_single_1"]
    byte_prompts = [task.doc_to_text(d) for d in task.eval_docs][:2]
    for p, q in zip(prompts, byte_prompts):
        assert len(tok(p, add_special_tokens=False)["input_ids"]) <= 512
        assert len(p.encode()) > len(q.encode())
