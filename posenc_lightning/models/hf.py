"""`HFCausalLM`: a Hugging Face causal LM inside a LightningModule, for the recipes and callbacks.

Loads a local pretrained directory (``from_pretrained(..., local_files_only=True)``: nothing is
downloaded) or builds a fresh model from a config dict; trains on ``(input_ids, targets)``
windows like `TinyGPT` (the same `CorpusDataModule` batches), so every callback and recipe of
the project runs on it. Encodings enter through `posenc_lightning.inject` /
`PosEncCallback` (the Hugging Face adapter); checkpoints carry the encoding and reload it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch import Tensor
from torchmetrics import MeanMetric

from posenc_lightning.models.lm import CausalLMSteps


class HFCausalLM(CausalLMSteps, pl.LightningModule):
    """A transformers ``AutoModelForCausalLM`` trained with Lightning.

    Args:
        pretrained_dir: a local directory written by ``save_pretrained`` (tokenizer files beside it
            are used for evaluation); None to build a fresh model from ``config``.
        config: ``AutoConfig.for_model(**config)`` arguments (``model_type`` included) when no
            ``pretrained_dir`` is given, e.g. ``{"model_type": "llama", "hidden_size": 64, ...}``.
        attn_implementation: transformers' attention (``sdpa``, ``eager``, ``flex_attention``); an
            injected encoding wraps it.
        lr: AdamW's peak learning rate.
        weight_decay: AdamW's weight decay.
        warmup_steps: linear warm-up steps, after which the rate decays by a cosine over
            ``trainer.max_steps``.
        min_lr_ratio: the cosine ends at ``min_lr_ratio * lr``.
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
