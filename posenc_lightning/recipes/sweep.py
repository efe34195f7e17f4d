"""Perplexity on the same validation tokens at any length, and the train-then-sweep recipe body
(fire_train, clex_train)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from posenc_lightning.curriculum.search import windows_nll
from posenc_lightning.recipes.cli import make_cli
from posenc_lightning.recipes.results import encoding_name, run_dir, stop_reason, write_results


def perplexity(model: torch.nn.Module, tokens: torch.Tensor, seq_len: int, eval_tokens: int, offset_tokens: int = 0,
               batch_size: int = 8) -> float:
    """Perplexity over the same ``eval_tokens`` validation tokens cut into windows of ``seq_len``
    (so lengths are compared on the same text), starting ``offset_tokens`` into the text."""
    n = max(1, eval_tokens // seq_len)
    return math.exp(windows_nll(model, tokens, seq_len, n, offset=offset_tokens // seq_len,
                                batch_size=max(1, batch_size * 128 // seq_len)))


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
