"""`HFCausalLM`: a Hugging Face causal LM inside a LightningModule, for the recipes and callbacks.

Loads a local pretrained directory (``from_pretrained(..., local_files_only=True)``: nothing is
downloaded) or builds a fresh model from a config dict; trains on ``(input_ids, targets)``
windows like `TinyGPT` (the same `CorpusDataModule` batches), so every callback and recipe of
the project runs on it. Encodings enter through `posenc_lightning.inject` /
`PosEncCallback` (the Hugging Face adapter); checkpoints carry the encoding and reload it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import MeanMetric

from posenc_lightning.inject import CHECKPOINT_KEY, injected_spec, restore_from_checkpoint


class HFCausalLM(pl.LightningModule):
    """A transformers ``AutoModelForCausalLM`` trained with Lightning.

    Args:
        pretrained_dir: a local directory written by ``save_pretrained`` (tokenizer files beside it
            are used for evaluation); None to build a fresh model from ``config``.
        config: ``AutoConfig.for_model(**config)`` arguments (``model_type`` included) when no
            ``pretrained_dir`` is given, e.g. ``{"model_type": "llama", "hidden_size": 64, ...}``.
        attn_implementation: transformers' attention (``sdpa``, ``eager``, ``flex_attention``); an
            injected encoding wraps it.
        lr, weight_decay, warmup_steps, min_lr_ratio: AdamW with linear warm-up and cosine decay
            to ``min_lr_ratio * lr`` over ``trainer.max_steps``.
    """

    def __init__(self, pretrained_dir: str | None = None, config: dict[str, Any] | None = None,
                 attn_implementation: str = "sdpa", lr: float = 1e-3, weight_decay: float = 0.1,
                 warmup_steps: int = 0, min_lr_ratio: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        from transformers import AutoConfig, AutoModelForCausalLM

        if (pretrained_dir is None) == (config is None):
            raise ValueError("HFCausalLM: give exactly one of pretrained_dir (a local save_pretrained "
                             "directory) or config (a dict with model_type and sizes)")
        if pretrained_dir is not None:
            if not (Path(pretrained_dir) / "config.json").is_file():
                raise ValueError(f"HFCausalLM: pretrained_dir={pretrained_dir!r} has no config.json; give a "
                                 f"directory written by save_pretrained (e.g. by recipes/hf_pretrain.py)")
            self.model = AutoModelForCausalLM.from_pretrained(pretrained_dir, local_files_only=True,
                                                              attn_implementation=attn_implementation)
        else:
            cfg = dict(config)
            model_type = cfg.pop("model_type", None)
            if model_type is None:
                raise ValueError("HFCausalLM: config needs a 'model_type' (e.g. 'llama', 'gpt2')")
            self.model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg),
                                                          attn_implementation=attn_implementation)
        self.val_nll = MeanMetric()

    @property
    def max_seq_len(self) -> int:
        """The model's trained context (``max_position_embeddings`` / ``n_positions``)."""
        cfg = self.model.config
        return int(getattr(cfg, "max_position_embeddings", None) or cfg.n_positions)

    @property
    def tokenizer_dir(self) -> str | None:
        """The pretrained directory when it holds a tokenizer (evaluation uses the model's own)."""
        d = self.hparams.pretrained_dir
        if d and any((Path(d) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return str(d)
        return None

    @property
    def pretrained_info(self) -> dict[str, Any] | None:
        """What made the pretrained directory: ``posenc_pretrain.json`` (steps, seq_len, ...) written
        by recipes/hf_pretrain.py, else ``{"steps": None, "seq_len": max_seq_len}``; None without a
        pretrained directory (a model to train from scratch)."""
        d = self.hparams.pretrained_dir
        if not d:
            return None
        meta = Path(d) / "posenc_pretrain.json"
        if meta.is_file():
            import json

            return json.loads(meta.read_text())
        return {"steps": None, "seq_len": self.max_seq_len}

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def forward(self, input_ids: Tensor, positions: Tensor | None = None, cache: Any = None,
                attention_mask: Tensor | None = None) -> Tensor:
        out = self.model(input_ids=input_ids, position_ids=positions, attention_mask=attention_mask,
                         past_key_values=cache, use_cache=cache is not None)
        return out.logits

    def token_nll(self, input_ids: Tensor, targets: Tensor, **kw: Any) -> Tensor:
        """Per-token negative log-likelihood ``[B, N]`` (float32)."""
        logits = self(input_ids, **kw)
        return F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.token_nll(x, y).mean()
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_nll.update(self.token_nll(x, y))

    def on_validation_epoch_end(self) -> None:
        mean = self.val_nll.compute()
        self.val_nll.reset()
        self.log("val/loss", mean, prog_bar=True)
        self.log("val/ppl", torch.exp(mean), prog_bar=True)

    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if p.requires_grad and p.dim() >= 2 and "posenc" not in n]
        ids = {id(p) for p in decay}
        rest = [p for p in self.parameters() if p.requires_grad and id(p) not in ids]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.hparams.weight_decay},
                                 {"params": rest, "weight_decay": 0.0}], lr=self.hparams.lr, betas=(0.9, 0.95))
        total = self.trainer.max_steps if self.trainer and self.trainer.max_steps > 0 else None
        if total is None:
            return opt
        warm, floor = self.hparams.warmup_steps, self.hparams.min_lr_ratio

        def lr_lambda(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            t = min(1.0, (step - warm) / max(1, total - warm))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))

        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda), "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        spec = injected_spec(self)
        if spec is not None:
            checkpoint[CHECKPOINT_KEY] = dict(spec)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        restore_from_checkpoint(self, checkpoint)
