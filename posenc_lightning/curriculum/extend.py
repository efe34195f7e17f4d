"""Shared pieces of the context-extension recipes (``recipes/*.py``): a LightningCLI with an
``extend`` argument group, perplexity on the same validation tokens at any length, and the
results writer (JSON + Markdown in the run directory, scalars + text in TensorBoard)."""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def run_dir(trainer: pl.Trainer, results_dir: str | Path | None = None) -> Path:
    """Where a recipe's files go: ``results_dir`` if given, else the run's log dir (with no
    logger: ``trainer.default_root_dir``, which `RecipeCLI` points at ``runs/<recipe>``).
    Collective under DDP (``trainer.log_dir`` broadcasts rank 0's): call it on every rank."""
    log_dir = trainer.log_dir  # every rank takes part in the broadcast, even with results_dir
    return Path(results_dir) if results_dir else Path(log_dir or trainer.default_root_dir)


def stop_reason(trainer: pl.Trainer) -> str | None:
    """None when the last ``fit`` ran its configured length (``max_steps``, else ``max_epochs``);
    otherwise why not, in words (for results: a verdict needs the configured run)."""
    step, epoch = trainer.global_step, trainer.current_epoch
    if trainer.max_steps is not None and trainer.max_steps > 0:
        if step >= trainer.max_steps:
            return None
        what = f"stopped at step {step} of max_steps={trainer.max_steps}"
    elif trainer.max_epochs is not None and trainer.max_epochs > 0:
        if epoch >= trainer.max_epochs:
            return None
        what = f"stopped in epoch {epoch} of max_epochs={trainer.max_epochs} (step {step})"
    else:
        return f"no max_steps or max_epochs configured: ran {step} steps"
    from lightning.pytorch.callbacks import Timer

    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    if timer is not None and timer.time_remaining() is not None and timer.time_remaining() <= 0:
        return what + " (max_time reached)"
    if trainer.max_steps > 0 and trainer.max_epochs not in (None, -1) and epoch >= trainer.max_epochs:
        return what + f" (max_epochs={trainer.max_epochs} reached first)"
    return what + (" (interrupted)" if trainer.interrupted else " (should_stop set, e.g. early stopping)")


def write_results(trainer: pl.Trainer, name: str, out: Path, results: dict[str, Any], table: list[tuple[str, ...]],
                  header: tuple[str, ...], notes: str = "", command: str | None = None) -> Path | None:
    """Rank 0 only, with no collective call (so call it after the last one): write
    ``results.json`` and ``results.md`` into ``out`` (from `run_dir`), log the numeric results
    to every logger and the Markdown to TensorBoard's text tab. Other ranks return None."""
    if not trainer.is_global_zero:
        return None
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
    print(text, flush=True)
    return out


class RunDirSaveConfig(SaveConfigCallback):
    """Saves the config next to the run's logs; a Trainer without a logger saves it in its
    ``default_root_dir`` (the recipe's run directory, see `RecipeCLI`)."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.logger is None and trainer.default_root_dir == str(Path.cwd()):
            return  # no run directory of its own: write nothing into the working directory
        super().setup(trainer, pl_module, stage)


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
    """``--help`` names the recipe and shows its docstring (not "Lightning Trainer command line tool")."""
    return {"prog": f"recipes/{name}.py", "description": (description or name).strip()}


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


@dataclass
class SweepOptions:
    """``--extend.*`` of the train-then-sweep recipes (fire_train, clex_train).

    Args:
        lengths: evaluation lengths as multiples of the training length.
        eval_tokens: validation tokens scored at every length (the same text at every length).
        results_dir: where results.json / results.md go ('' = the run's log dir; with
            --trainer.logger=false, runs/<recipe>).
    """

    lengths: list[float] = field(default_factory=lambda: [1.0, 2.0, 4.0, 8.0])
    eval_tokens: int = 32768
    results_dir: str = ""


def train_and_sweep(name: str, options: type, args: list[str] | None = None,
                    before_each: Any = None, label: str = "", description: str | None = None) -> dict[str, Any]:
    """The train-then-evaluate-by-length recipe body (clex_train, fire_train): fit with the CLI's
    trainer and callbacks, then perplexity at ``extend.lengths`` (multiples of the training length)."""
    cli = make_cli(options, args, name, description)
    ext = cli.options
    model, data, trainer = cli.model, cli.datamodule, cli.trainer
    trainer.fit(model, data)
    out = run_dir(trainer, ext.results_dir)  # collective: every rank, before rank 0 writes
    L = data.seq_len
    lengths = [round(m * L) for m in ext.lengths]
    hook = (lambda n: before_each(cli, n)) if before_each is not None else None
    sweep = length_sweep(model, data.val_tokens, lengths, ext.eval_tokens, hook)
    enc = model.hparams.encoding or encoding_name(model)
    stopped = stop_reason(trainer)
    r: dict[str, Any] = {"L": L, "steps": trainer.global_step, "max_steps": trainer.max_steps, "encoding": enc,
                         "completed": stopped is None, "stop_reason": stopped}
    r.update({f"ppl_{n}": v for n, v in sweep.items()})
    table = [(f"{n} ({n / L:g} L)", f"{v:.4f}") for n, v in sweep.items()]
    notes = (f"{enc} trained {trainer.global_step} steps at L={L}{label}"
             f"{'' if stopped is None else ' (' + stopped + ')'}; perplexity (bytes) on the same "
             f"{ext.eval_tokens} validation tokens cut into windows of each length.")
    write_results(trainer, name, out, r, table, ("eval length", "ppl"), notes, cli.recipe_command)
    return r


def encoding_name(model: torch.nn.Module) -> str | None:
    """The name of the encoding injected into ``model`` (None if none)."""
    from posenc_lightning.inject import injected_spec

    spec = injected_spec(model)
    return None if spec is None else spec.get("encoding")


def rope_base(model: torch.nn.Module) -> dict[str, float]:
    """``{"theta": base}`` of the rotary encoding injected into ``model``, or ``{}`` when it records
    none: the scaled encoding then takes its default, or a Hugging Face model's own ``rope_theta``."""
    from posenc_lightning.inject import injected_spec

    theta = ((injected_spec(model) or {}).get("config") or {}).get("theta")
    return {} if theta is None else {"theta": float(theta)}


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


def bigram_perplexity(train_tokens: torch.Tensor, tokens: torch.Tensor, eval_tokens: int, vocab: int = 256) -> float:
    """Perplexity of a bigram table (add-one counts over ``train_tokens``: bytes, or a tokenizer's
    ids) on the first ``eval_tokens`` + 1 of ``tokens``: the bar a model must beat to be using any
    context at all. ``vocab`` grows to the largest id seen."""
    tr, ev = train_tokens.long(), tokens[: eval_tokens + 1].long()
    vocab = max(vocab, int(tr.max()) + 1, int(ev.max()) + 1)
    counts = torch.ones(vocab, vocab, dtype=torch.float64)
    counts.index_put_((tr[:-1], tr[1:]), torch.ones(len(tr) - 1, dtype=torch.float64), accumulate=True)
    logp = (counts / counts.sum(1, keepdim=True)).log()
    return math.exp(-float(logp[ev[:-1], ev[1:]].mean()))


def extension_verdict(pre_reason: str | None, ft_reason: str | None, ft_steps: int, pre_steps: int, gap: float,
                      rope_ppl: float, bigram_ppl: float) -> tuple[bool | None, str]:
    """``(target_met, why)``: the target (fine-tuned at sL within 5% of rope at L, with at most 5%
    of the pre-training steps) is judged only when both runs reached their configured steps and
    the pre-trained rope beats a byte-bigram table (else it has not learned to use context)."""
    if pre_reason is not None:
        return None, f"no verdict: pre-training {pre_reason}"
    if ft_reason is not None:
        return None, f"no verdict: fine-tune {ft_reason}"
    if ft_steps > 0.05 * pre_steps:
        return False, f"NOT met: {ft_steps} fine-tune steps are more than 5% of {pre_steps}"
    if rope_ppl >= bigram_ppl:
        return None, (f"no verdict: the pre-trained rope (ppl {rope_ppl:.2f} at L) does not beat a byte-bigram "
                      f"table of the training text (ppl {bigram_ppl:.2f}): too little training to judge")
    return gap <= 0.05, f"{'met' if gap <= 0.05 else 'NOT met'} ({100 * gap:+.2f}%)"
