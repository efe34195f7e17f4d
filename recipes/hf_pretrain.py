"""Make a small pretrained Hugging Face model offline: a Llama-architecture `HFCausalLM` trained on
the bundled corpus with a tokenizer trained locally (byte-level BPE with ``tokenizers``; or bytes),
saved with ``save_pretrained`` and the tokenizer beside it. The directory then feeds
``yarn_extend`` / ``longrope_extend`` (``--model.pretrained_dir``) and loads in plain transformers.

    python recipes/hf_pretrain.py --config configs/hf_pretrain.yaml [--pretrain.out=runs/hf_pretrain/model]
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from posenc_lightning.data import CorpusDataModule
from posenc_lightning.models.hf import HFCausalLM
from posenc_lightning.recipes import RecipeCLI, RunDirSaveConfig, recipe_parser_kwargs


@dataclass
class PretrainOptions:
    """Where the pretrained directory goes and which tokenizer it gets.

    Args:
        out: the directory written by ``save_pretrained`` (model, tokenizer, ``posenc_pretrain.json``).
        tokenizer_vocab: 0 for the byte tokenizer (256 ids); more than 256 for a byte-level BPE with
            that many ids, trained on the corpus's training files.
        tokenizer_files: how many training files the BPE is trained on (the first ones, sorted).
    """

    out: str = "runs/hf_pretrain/model"
    tokenizer_vocab: int = 1024
    tokenizer_files: int = 400


class PretrainCLI(RecipeCLI):
    """The recipes' CLI (barebones, progress bar, no files in the working directory without a
    logger: checkpoints go to runs/hf_pretrain) with `PretrainOptions` as ``--pretrain.*``."""

    options_class = PretrainOptions
    recipe = "hf_pretrain"
    results_group = "pretrain"


def make_tokenizer(opts: PretrainOptions, files: list[str] | None):
    from posenc_lightning.data.corpus import stdlib_files
    from posenc_lightning.eval.tokenizer import build_byte_tokenizer, train_bpe_tokenizer

    if opts.tokenizer_vocab == 0:
        return build_byte_tokenizer()
    paths = [Path(f) for f in files] if files else stdlib_files()
    texts = (p.read_text(errors="replace") for p in paths[:opts.tokenizer_files])
    return train_bpe_tokenizer(texts, opts.tokenizer_vocab)


def main(args: list[str] | None = None) -> str:
    cli = PretrainCLI(HFCausalLM, CorpusDataModule, run=False, args=args, save_config_callback=RunDirSaveConfig,
                      save_config_kwargs={"overwrite": True}, parser_kwargs=recipe_parser_kwargs("hf_pretrain", __doc__))
    opts = cli.options_value
    data, trainer = cli.datamodule, cli.trainer
    out = Path(opts.out)
    tok = make_tokenizer(opts, list(data.files) if data.files else None)
    if trainer.is_global_zero:
        tok.save_pretrained(str(out))
    trainer.strategy.barrier("posenc_tokenizer")
    data.tokenizer = str(out)
    model = cli.model
    if model.model.config.vocab_size != len(tok):  # the model's vocabulary is the tokenizer's
        cfg = dict(model.hparams.config)
        cfg["vocab_size"] = len(tok)
        kw = {k: v for k, v in model.hparams.items() if not k.startswith("_")}  # not LightningCLI's _instantiator
        model = HFCausalLM(**{**kw, "config": cfg})
    trainer.fit(model, data)
    if trainer.is_global_zero:
        model.model.save_pretrained(str(out))
        (out / "posenc_pretrain.json").write_text(json.dumps(
            {"steps": trainer.global_step, "seq_len": data.seq_len, "tokenizer_vocab": len(tok),
             "val_ppl": float(trainer.callback_metrics.get("val/ppl", float("nan")))}, indent=2))
        print(f"pretrained model + tokenizer: {out}")
    return str(out)


if __name__ == "__main__":
    main()
