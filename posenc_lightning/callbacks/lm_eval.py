"""`LMEvalCallback`: lm-eval tasks (RULER, passkey, perplexity by length) at validation end."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from posenc_lightning.plain import plain


class LMEvalCallback(pl.Callback):
    """Runs lm-eval in-process at the end of validation and logs ``lm_eval/<task>/<length>``.

    Tasks are built once at ``setup`` (offline, seeded: every rank builds the same documents)
    and evaluated at each selected validation end, never during the sanity check. Every rank
    evaluates its shard through the Lightning strategy; rank 0 aggregates, the numbers are
    broadcast so every rank logs the same values, and rank 0 writes a markdown table as
    TensorBoard text. The python/numpy/torch RNG streams are saved and restored around
    building and evaluation, so training is unchanged by the callback.

    Args:
        tasks: lm-eval task names: RULER's ``niah_single_1``, ``niah_multikey_2/3``, ``ruler_fwe``,
            ``ruler_vt``, ``ruler_cwe``, the essay niah variants (local haystack), and ours
            ``passkey_generate``, ``passkey_loglikelihood``, ``ppl_by_length``.
        max_seq_lengths: prompt lengths in tokens (RULER needs >= 512).
        limit: samples *per length* (None = all that the task generates).
        every_n_epochs: evaluate at validation ends of every n-th epoch.
        tokenizer: a local Hugging Face tokenizer directory (default: the module's ``tokenizer_dir``,
            e.g. `HFCausalLM`'s pretrained directory, else the byte tokenizer). Modules holding a
            Hugging Face model are evaluated by lm-eval's own ``HFLM`` on the in-memory model.
        seed: the seed the documents are built with.
        haystack_files: text files for the essay haystack (default: the bundled corpus).
        max_length: left-truncate contexts to this many tokens (None = never).
        include_path: extra directories of task YAMLs.
        metadata: extra task metadata (passed to every task's dataset function).
    """

    def __init__(self, tasks: Sequence[str], max_seq_lengths: Sequence[int] = (1024,), limit: int | None = 8,
                 every_n_epochs: int = 1, tokenizer: str | None = None, seed: int = 1234,
                 haystack_files: Sequence[str] | None = None, max_length: int | None = None,
                 include_path: Sequence[str] | None = None, metadata: dict[str, Any] | None = None) -> None:
        if isinstance(tasks, str):
            tasks = [tasks]
        if not tasks:
            raise ValueError("LMEvalCallback: give at least one task, e.g. tasks=['niah_single_1']")
        if every_n_epochs < 1:
            raise ValueError(f"LMEvalCallback: every_n_epochs must be >= 1, got {every_n_epochs}")
        self.tasks = list(tasks)
        self.max_seq_lengths = [int(x) for x in max_seq_lengths]
        self.limit = limit
        self.every_n_epochs = every_n_epochs
        self.tokenizer = tokenizer
        self.seed = seed
        self.haystack_files = list(haystack_files) if haystack_files else None
        self.max_length = max_length
        self.include_path = list(include_path) if include_path else None
        self.metadata = plain(metadata)  # an OmegaConf DictConfig (Hydra) as a dict: lm-eval copies it
        self.built: Any = None
        self.history: list[dict[str, Any]] = []  # per evaluation: {"step", "metrics"}
        self.last_results: dict[str, Any] | None = None
        self.last_eval_seconds: float | None = None
        self.failure: str | None = None  # why the last evaluation gave NaN

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.built is None:
            from posenc_lightning.eval.harness import build_tasks
            from posenc_lightning.eval.tokenizer import byte_tokenizer_dir

            if self.tokenizer is None:  # the model's own (HFCausalLM's pretrained directory), else bytes
                self.tokenizer = getattr(pl_module, "tokenizer_dir", None)
            if self.tokenizer is None:  # rank 0 writes the directory first, the others read it
                if trainer.is_global_zero:
                    byte_tokenizer_dir()
                trainer.strategy.barrier("posenc_tokenizer")
            self.built = build_tasks(self.tasks, self.max_seq_lengths, self.limit, tokenizer=self.tokenizer,
                                     seed=self.seed, haystack_files=self.haystack_files,
                                     include_path=self.include_path, metadata=self.metadata)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.current_epoch % self.every_n_epochs:
            return
        t0 = time.perf_counter()
        metrics = self.evaluate(trainer, pl_module)
        self.last_eval_seconds = time.perf_counter() - t0
        for key, value in metrics.items():
            pl_module.log(key, value, sync_dist=True)  # equal on all ranks: the mean is the value
        self.history.append({"step": trainer.global_step, "metrics": metrics, "seconds": self.last_eval_seconds})
        if trainer.is_global_zero:
            self._log_table(trainer, metrics)

    # ------------------------------------------------------------------ work
    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """Evaluate now (the callback calls this at validation ends).

        Args:
            trainer: the trainer (ranks share the requests).
            pl_module: the model.

        Returns:
            ``{"lm_eval/<task>/<length>": value}``, on every rank.
        """
        from posenc_lightning.eval.harness import evaluate_tasks, preserved_rng

        if self.built is None:
            self.setup(trainer, pl_module, "validate")
        was_training = pl_module.training
        pl_module.eval()
        self.failure = None
        try:
            with preserved_rng(self.seed), torch.no_grad():
                res = evaluate_tasks(self._lm(trainer, pl_module), self.built)
        except ValueError as e:  # the model cannot run these lengths (a learned table): NaN, not a crash
            self.failure = str(e)
            res = {"per_length": {t: {n: float("nan") for n in self.built.lengths[t]} for t in self.built.lengths}}
        finally:
            pl_module.train(was_training)
        metrics: dict[str, float] | None = None
        if res is not None:
            self.last_results = res
            metrics = {}
            for task, by_len in res["per_length"].items():
                for length, value in by_len.items():
                    metrics[f"lm_eval/{task}/{length if length is not None else 'all'}"] = float(value)
        if trainer.world_size > 1:
            metrics = trainer.strategy.broadcast(metrics, src=0)
        return metrics or {}

    def _lm(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        """lm-eval's ``HFLM`` on a Hugging Face model the module holds (the adapter's case), else
        `LightningLM` on the module's forward."""
        from posenc_lightning.adapters.hf import find_hf_models
        from posenc_lightning.eval.lm import LightningLM

        models = find_hf_models(pl_module)
        if len(models) == 1:
            from posenc_lightning.eval.hf_lm import module_hflm

            return module_hflm(models[0], self.tokenizer, trainer.strategy, self.max_length)
        return LightningLM(pl_module, tokenizer=self.tokenizer, strategy=trainer.strategy, max_length=self.max_length)

    def _log_table(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        text = results_table(metrics)
        for logger in trainer.loggers:
            exp = getattr(logger, "experiment", None)
            if hasattr(exp, "add_text"):
                exp.add_text("lm_eval/results", text, global_step=trainer.global_step)

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))


def results_table(metrics: dict[str, float]) -> str:
    """A markdown table: one row per task, one column per length."""
    rows: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        _, task, length = key.split("/", 2)
        rows.setdefault(task, {})[length] = value
    lengths = sorted({n for r in rows.values() for n in r}, key=lambda s: (not s.isdigit(), int(s) if s.isdigit() else 0))
    out = ["| task | " + " | ".join(lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for task, r in rows.items():
        out.append(f"| {task} | " + " | ".join(f"{r[n]:.3f}" if n in r else "" for n in lengths) + " |")
    return "\n".join(out)
