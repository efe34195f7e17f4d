"""Evaluation: an lm-eval wrapper for LightningModules, an offline byte tokenizer, our task YAMLs.

``lm_eval`` / ``transformers`` are imported only when these are used (the ``eval`` extra).
"""

from posenc_lightning.eval.harness import BuiltTasks, build_tasks, evaluate_tasks, preserved_rng
from posenc_lightning.eval.offline import OfflineTaskError, local_haystack, local_text
from posenc_lightning.eval.tokenizer import byte_tokenizer_dir, load_byte_tokenizer


def __getattr__(name: str):
    if name == "LightningLM":
        from posenc_lightning.eval.lm import LightningLM

        return LightningLM
    raise AttributeError(name)


__all__ = ["BuiltTasks", "LightningLM", "OfflineTaskError", "build_tasks", "byte_tokenizer_dir", "evaluate_tasks",
           "load_byte_tokenizer", "local_haystack", "local_text", "preserved_rng"]
