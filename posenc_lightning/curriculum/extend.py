"""Shared pieces of the context-extension recipes (``recipes/*.py``): a LightningCLI with an
``extend`` argument group, perplexity on the same validation tokens at any length, and the
results writer (JSON + Markdown in the run directory, scalars + text in TensorBoard)."""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

from posenc_lightning.curriculum.search import windows_nll


def perplexity(model: torch.nn.Module, tokens: torch.Tensor, seq_len: int, eval_tokens: int, offset_tokens: int = 0,
               batch_size: int = 8) -> float:
    """Perplexity over the same ``eval_tokens`` validation tokens cut into windows of ``seq_len``
    (so lengths are compared on the same text), starting ``offset_tokens`` into the text."""
    n = max(1, eval_tokens // seq_len)
    return math.exp(windows_nll(model, tokens, seq_len, n, offset=offset_tokens // seq_len,
                                batch_size=max(1, batch_size * 128 // seq_len)))


def log_dir_of(trainer: pl.Trainer, fallback: str = "runs/recipe") -> Path:
    d = trainer.log_dir or fallback
    return Path(d)


def write_results(trainer: pl.Trainer, name: str, results: dict[str, Any], table: list[tuple[str, ...]],
                  header: tuple[str, ...], notes: str = "", out_dir: str | Path | None = None,
                  command: str | None = None) -> Path | None:
    """Write ``results.json`` and ``results.md`` (rank 0) into ``out_dir`` (default: the run's log
    dir), log the numeric results to every logger, and the Markdown to TensorBoard's text tab."""
    if not trainer.is_global_zero:
        return None
    out = Path(out_dir) if out_dir else log_dir_of(trainer, f"runs/{name}")
    out.mkdir(parents=True, exist_ok=True)
    command = command or " ".join(shlex.quote(a) for a in [Path(sys.executable).name] + sys.argv)
    payload = {"recipe": name, "command": command, "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "torch": torch.__version__, "results": results}
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    md = [f"# {name}", "", f"Command: `{command}`", "", "| " + " | ".join(header) + " |",
          "|" + "---|" * len(header)]
    md += ["| " + " | ".join(row) + " |" for row in table]
    if notes:
        md += ["", notes]
    text = "\n".join(md) + "\n"
    (out / "results.md").write_text(text)
    flat = {f"{name}/{k}": float(v) for k, v in results.items() if isinstance(v, (int, float))}
    for lg in trainer.loggers:
        lg.log_metrics(flat, step=trainer.global_step)
        exp = getattr(lg, "experiment", None)
        if hasattr(exp, "add_text"):
            exp.add_text(f"{name}/results", text, trainer.global_step)
        if hasattr(lg, "save"):
            lg.save()
    print(text)
    return out


class RunDirSaveConfig(SaveConfigCallback):
    """Saves the config next to the run's logs; a Trainer without a logger has no run directory
    of its own (its log_dir is the working directory), so nothing is written there."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.logger is None:
            return
        super().setup(trainer, pl_module, stage)


class RecipeCLI(LightningCLI):
    """``LightningCLI(TinyGPT, CorpusDataModule)`` plus the recipe's own ``--extend.*`` arguments
    (declared by the recipe in ``extend_args``: name -> (type, default, help))."""

    extend_args: ClassVar[dict[str, tuple[Any, Any, str]]] = {}

    def add_arguments_to_parser(self, parser: Any) -> None:
        for name, (typ, default, doc) in self.extend_args.items():
            parser.add_argument(f"--extend.{name}", type=typ, default=default, help=doc)


def make_cli(extend_args: dict[str, tuple[Any, Any, str]], args: list[str] | None = None,
             name: str = "recipe") -> LightningCLI:
    """The recipe's CLI (``args=None``: the command line); ``cli.recipe_command`` is the command
    that reproduces the run (recorded with the results)."""
    from posenc_lightning.data import CorpusDataModule
    from posenc_lightning.models import TinyGPT

    cls = type("RecipeCLI", (RecipeCLI,), {"extend_args": extend_args})
    cli = cls(TinyGPT, CorpusDataModule, run=False, args=args, save_config_callback=RunDirSaveConfig,
              save_config_kwargs={"overwrite": True})
    argv = sys.argv if args is None else [f"recipes/{name}.py", *args]
    cli.recipe_command = " ".join(shlex.quote(a) for a in ["python"] + list(argv))
    return cli


def finetune_trainer(cli: LightningCLI, max_steps: int, sub: str, callbacks: list | None = None) -> pl.Trainer:
    """A second Trainer with the CLI's trainer settings, ``max_steps`` steps, logging to
    ``<run dir>/<sub>`` and no validation loop (the recipe evaluates itself)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    first = cli.trainer
    logger = TensorBoardLogger(str(log_dir_of(first)), name=sub, version="") if first.logger else False
    return cli.instantiate_trainer(max_steps=max_steps, logger=logger, limit_val_batches=0, callbacks=list(callbacks or []),
                                   enable_checkpointing=False)


def length_sweep(model: torch.nn.Module, tokens: torch.Tensor, lengths: list[int], eval_tokens: int,
                 before_each: Any = None) -> dict[int, float]:
    """Perplexity at each length on the same validation tokens; ``before_each(n)`` runs first
    (e.g. CLEX's ``set_scale(n / L)``)."""
    out = {}
    for n in lengths:
        if before_each is not None:
            before_each(n)
        out[int(n)] = perplexity(model, tokens, int(n), eval_tokens)
    return out


def train_and_sweep(name: str, extend_args: dict[str, tuple[Any, Any, str]], args: list[str] | None = None,
                    before_each: Any = None, label: str = "") -> dict[str, Any]:
    """The train-then-evaluate-by-length recipe body (clex_train, fire_train): fit with the CLI's
    trainer and callbacks, then perplexity at ``extend.lengths`` (multiples of the training length)."""
    cli = make_cli(extend_args, args, name)
    ext = cli.config["extend"]
    model, data, trainer = cli.model, cli.datamodule, cli.trainer
    trainer.fit(model, data)
    L = data.seq_len
    lengths = [round(m * L) for m in ext.lengths]
    hook = (lambda n: before_each(cli, n)) if before_each is not None else None
    sweep = length_sweep(model, data.val_tokens, lengths, ext.eval_tokens, hook)
    enc = model.hparams.encoding
    r: dict[str, Any] = {"L": L, "steps": trainer.global_step, "encoding": enc}
    r.update({f"ppl_{n}": v for n, v in sweep.items()})
    table = [(f"{n} ({n / L:g} L)", f"{v:.4f}") for n, v in sweep.items()]
    notes = (f"{enc} trained {trainer.global_step} steps at L={L}{label}; perplexity (bytes) on the same "
             f"{ext.eval_tokens} validation tokens cut into windows of each length.")
    write_results(trainer, name, r, table, ("eval length", "ppl"), notes, ext.results_dir or None,
                  cli.recipe_command)
    return r
