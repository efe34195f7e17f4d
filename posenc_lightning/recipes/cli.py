"""The recipes' LightningCLI (`RecipeCLI`, also the base of ``posenc train``): an ``extend``
argument group of the recipe's own options, a run directory of its own, a second Trainer for a
fine-tune, and a model loaded from a pretrained directory."""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback


class RunDirSaveConfig(SaveConfigCallback):
    """Saves the config next to the run's logs; a Trainer without a logger saves it in its
    ``default_root_dir`` (the recipe's run directory, see `RecipeCLI`)."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.logger is None and trainer.default_root_dir == str(Path.cwd()):
            return  # no run directory of its own: write nothing into the working directory
        super().setup(trainer, pl_module, stage)


class _NoTips(logging.Filter):
    """Drops Lightning's advertising ("💡 Tip: For seamless cloud ... try installing litlogger /
    litmodels"), printed on every Trainer construction; every other message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def silence_lightning_tips() -> None:
    """Keep Lightning's advertising tips out of ``posenc train`` and the recipes' output (idempotent)."""
    from lightning_utilities.core import rank_zero

    loggers = {logging.getLogger("lightning.pytorch.utilities.rank_zero"),
               logging.getLogger("lightning.fabric.utilities.rank_zero"), rank_zero.log}
    for log in loggers:  # rank_zero_info logs through the one Lightning last set on lightning_utilities
        if not any(isinstance(f, _NoTips) for f in log.filters):
            log.addFilter(_NoTips())


#: Trainer options that ``barebones=True`` refuses unless off, and the value that turns them off
BAREBONES_OFF = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                 "enable_model_summary": False, "log_every_n_steps": None, "num_sanity_val_steps": None}


class RecipeCLI(LightningCLI):
    """``LightningCLI(TinyGPT, CorpusDataModule)`` for the recipes and ``posenc train``.

    - ``options_class``: a dataclass of the recipe's own options, added as the ``--extend.*`` group
      (typed, documented, in ``--print_config``); ``cli.options`` is the instance.
    - ``--trainer.barebones=true`` turns off what barebones refuses (logger, checkpointing,
      progress bar, summary, ``log_every_n_steps``) and says so.
    - With no logger, ``default_root_dir`` (checkpoints, config) defaults to the results
      directory (``--extend.results_dir``, else ``runs/<recipe>``): nothing lands in the working
      directory.
    - A progress bar labelled for step budgets (`step_progress_bar`) unless disabled.
    """

    options_class: type | None = None
    any_model: bool = False
    recipe: str = "recipe"
    results_group: str = "extend"

    def add_arguments_to_parser(self, parser: Any) -> None:
        if self.any_model:  # TinyGPT unless --model names another class (e.g. HFCausalLM)
            parser.set_defaults({"model": {"class_path": "posenc_lightning.models.TinyGPT"}})
        if self.options_class is not None:
            parser.add_class_arguments(self.options_class, self.results_group)

    def before_instantiate_classes(self) -> None:
        cfg = self.config.get(self.subcommand) if self.subcommand else self.config
        t = cfg["trainer"]
        if t.get("barebones"):
            changed = {k: v for k, v in BAREBONES_OFF.items() if t.get(k) not in (v, None, False, 0)}
            for k, v in BAREBONES_OFF.items():
                t[k] = v
            if changed:
                print(f"[{self.recipe}] --trainer.barebones=true: turned off {', '.join(sorted(changed))} "
                      f"(barebones refuses them); results are still written", file=sys.stderr, flush=True)
        if t.get("logger") is False and not t.get("default_root_dir"):
            group = cfg.get(self.results_group)
            t["default_root_dir"] = (group.get("results_dir") if group is not None else None) or f"runs/{self.recipe}"

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> pl.Trainer:
        from lightning.pytorch.callbacks import ProgressBar

        from posenc_lightning.callbacks.progress import step_progress_bar

        silence_lightning_tips()
        config = dict(config)  # a copy: the parsed config's callback list is not extended in place
        given = config.get("callbacks") or []
        config["callbacks"] = list(given) if isinstance(given, (list, tuple)) else [given]
        defaults = self.trainer_defaults.get("callbacks") or []
        present = [*config["callbacks"], *callbacks, *(defaults if isinstance(defaults, list) else [defaults])]
        if (config.get("enable_progress_bar") is not False and not config.get("barebones")
                and not any(isinstance(c, ProgressBar) for c in present)):
            callbacks = [*callbacks, step_progress_bar()]
        return super()._instantiate_trainer(config, callbacks)

    @property
    def options_value(self) -> Any:
        return (self.config_init.get(self.subcommand) if self.subcommand else self.config_init)[self.results_group]


def make_cli(options: type, args: list[str] | None = None, name: str = "recipe", description: str | None = None,
             any_model: bool = False) -> RecipeCLI:
    """The recipe's CLI (``args=None``: the command line) with ``options`` (a dataclass) as its
    ``--extend.*`` group; ``cli.options`` is the parsed dataclass and ``cli.recipe_command``
    the command that reproduces the run (recorded with the results). ``any_model``: ``--model``
    may name any LightningModule class (default TinyGPT), e.g.
    ``--model=posenc_lightning.models.hf.HFCausalLM --model.pretrained_dir=DIR``."""
    import lightning.pytorch as pl_

    from posenc_lightning.data import CorpusDataModule
    from posenc_lightning.models import TinyGPT

    cls = type("RecipeCLI", (RecipeCLI,), {"options_class": options, "recipe": name, "any_model": any_model})
    model_cls = pl_.LightningModule if any_model else TinyGPT
    cli = cls(model_cls, CorpusDataModule, run=False, args=args, save_config_callback=RunDirSaveConfig,
              save_config_kwargs={"overwrite": True}, parser_kwargs=recipe_parser_kwargs(name, description),
              subclass_mode_model=any_model)
    cli.options = cli.options_value
    argv = sys.argv if args is None else [f"recipes/{name}.py", *args]
    cli.recipe_command = " ".join(shlex.quote(a) for a in ["python"] + list(argv))
    return cli


def recipe_parser_kwargs(name: str, description: str | None) -> dict[str, Any]:
    """``--help`` names the recipe and shows its docstring (not "Lightning Trainer command line tool"),
    its examples on lines of their own (`ExamplesHelpFormatter`); config files are read in
    jsonargparse's ``omegaconf`` mode, so they may use ``${...}`` interpolation."""
    from posenc_lightning.recipes.help import ExamplesHelpFormatter

    return {"prog": f"recipes/{name}.py", "description": (description or name).strip("\n"),
            "formatter_class": ExamplesHelpFormatter,
            # config files (and mapping values) are read by OmegaConf: ${...} interpolation, as in Hydra
            "parser_mode": "omegaconf"}


def finetune_trainer(cli: LightningCLI, max_steps: int, sub: str, callbacks: list | None = None,
                     validate_at_end: bool = False) -> pl.Trainer:
    """A second Trainer with the CLI's trainer settings, ``max_steps`` steps, logging to
    ``<run dir>/<sub>`` and no validation loop (the recipe evaluates itself), or one validation at
    the last step (``validate_at_end``: callbacks such as `LMEvalCallback` evaluate inside fit).
    Collective under DDP (reads ``trainer.log_dir``): call it on every rank."""
    from lightning.pytorch.loggers import TensorBoardLogger

    first = cli.trainer
    log_dir = first.log_dir
    logger = TensorBoardLogger(str(log_dir), name=sub, version="") if first.logger else False
    val = ({"limit_val_batches": 1, "val_check_interval": max(1, max_steps), "check_val_every_n_epoch": None,
            "num_sanity_val_steps": 0} if validate_at_end else {"limit_val_batches": 0})
    return cli.instantiate_trainer(max_steps=max_steps, logger=logger, callbacks=list(callbacks or []),
                                   enable_checkpointing=False, **val)


def start_from_pretrained(model: torch.nn.Module, data: Any) -> int | None:
    """For a model loaded from a pretrained directory (`HFCausalLM(pretrained_dir=...)`): the data
    take its tokenizer (None: bytes) and training length; returns the steps it was pretrained for.
    None for a model the recipe pre-trains itself."""
    info = getattr(model, "pretrained_info", None)
    if info is None:
        return None
    data.tokenizer = model.tokenizer_dir
    data.seq_len = int(info["seq_len"])
    data.setup("fit")
    return int(info.get("steps") or 0)
