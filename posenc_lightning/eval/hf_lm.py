"""lm-eval's own ``HFLM`` on the in-memory Hugging Face model of a LightningModule, with the model's
own tokenizer, sharded over the Lightning strategy's ranks (`StrategyDistributed`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from posenc_lightning.eval.lm import StrategyDistributed


def module_hflm(hf_model: nn.Module, tokenizer: Any, strategy: Any = None, max_length: int | None = None,
                batch_size: int = 1) -> Any:
    """``HFLM(pretrained=hf_model, tokenizer=...)`` whose rank, world size, gathers and barriers are the
    Lightning strategy's. ``max_length`` caps contexts (default: never truncate: an extended model is
    evaluated past its config's ``max_position_embeddings``)."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    if tokenizer is None or isinstance(tokenizer, str):
        from posenc_lightning.eval.tokenizer import byte_tokenizer_dir

        tokenizer = AutoTokenizer.from_pretrained(tokenizer or byte_tokenizer_dir(), local_files_only=True)

    class ModuleHFLM(StrategyDistributed, HFLM):
        """HFLM over a model already in memory, its requests sharded by the Lightning strategy."""

    lm = ModuleHFLM(pretrained=hf_model, tokenizer=tokenizer, batch_size=batch_size,
                    max_length=max_length or (1 << 30))
    lm.strategy = strategy
    return lm
