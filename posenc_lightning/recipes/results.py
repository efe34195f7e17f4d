"""The recipes' results: where a run's files go, whether it ran its configured length, the
results writer (JSON + Markdown in the run directory, scalars + text in TensorBoard) and the
verdict of the context-extension recipes with its bigram baseline."""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch


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
