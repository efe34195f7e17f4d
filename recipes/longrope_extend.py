"""Extend a rope model's context with LongRoPE (Ding et al., 2024) and compare with pi and yarn at
the same factor: pre-train rope at L (or load ``--extend.pretrained``), then at s*L:

1. zero-shot pi and yarn (factor s);
2. LongRoPE's evolutionary search of the long factors, scored on the first ``search_windows``
   validation windows at s*L; every method is then evaluated on *other* validation text;
3. fine-tune with `LongRoPECurriculum` (the found factors, then the short factors re-searched
   at L after training), evaluate again.

    python recipes/longrope_extend.py --config configs/longrope_extend.yaml
    posenc run longrope_extend [--devices 2] [overrides]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from posenc_lightning.curriculum import N_HAT_CANDIDATES, LongRoPECurriculum
from posenc_lightning.curriculum.longrope import set_factors
from posenc_lightning.inject import inject, restore_from_checkpoint
from posenc_lightning.recipes import (
    finetune_trainer,
    make_cli,
    perplexity,
    rope_base,
    run_dir,
    start_from_pretrained,
    stop_reason,
    write_results,
)


@dataclass
class LongRoPEExtendOptions:
    """``--extend.*`` of longrope_extend.

    Args:
        factor: context extension ratio s.
        pretrained: a rope checkpoint to start from (e.g. yarn_extend's pretrained.ckpt); '' = pre-train
            (a Hugging Face directory instead: --model=posenc_lightning.models.hf.HFCausalLM
            --model.pretrained_dir=DIR).
        population: search population.
        parents: search parents kept per iteration.
        iterations: search iterations.
        search_windows: validation windows at s*L scored per candidate.
        finetune_steps: fine-tuning steps at s*L (-1: 5% of the pre-training steps that ran).
        finetune_lr: peak learning rate of the fine-tune.
        eval_tokens: held-out validation tokens scored at every length.
        results_dir: where results.json / results.md go ('' = the run's log dir; with
            --trainer.logger=false, runs/longrope_extend).
    """

    factor: float = 8.0
    pretrained: str = ""
    population: int = 16
    parents: int = 4
    iterations: int = 6
    search_windows: int = 4
    finetune_steps: int = -1
    finetune_lr: float = 1e-3
    eval_tokens: int = 32768
    results_dir: str = ""


def main(args: list[str] | None = None) -> dict[str, float]:
    cli = make_cli(LongRoPEExtendOptions, args, "longrope_extend", __doc__, any_model=True)
    ext = cli.options
    model, data, trainer = cli.model, cli.datamodule, cli.trainer
    pre_steps, pre_reason = start_from_pretrained(model, data), None  # a Hugging Face directory: no pre-training
    if pre_steps is None and ext.pretrained:
        ckpt = torch.load(ext.pretrained, map_location="cpu", weights_only=False)
        restore_from_checkpoint(model, ckpt)
        model.load_state_dict(ckpt["state_dict"])
        pre_steps = int(ckpt.get("global_step", 0))
        data.setup("fit")
    elif pre_steps is None:
        trainer.fit(model, data)
        pre_steps, pre_reason = trainer.global_step, stop_reason(trainer)
    L, s = data.seq_len, float(ext.factor)
    n = round(L * s)
    ft_steps = ext.finetune_steps if ext.finetune_steps >= 0 else max(1, pre_steps // 20)
    tokens = data.val_tokens
    held_out = ext.search_windows * n  # evaluation text starts after the search windows
    ppl = lambda m: perplexity(model, tokens, m, ext.eval_tokens, offset_tokens=held_out)
    theta = rope_base(model)  # the pre-trained rope's base; a Hugging Face model gives its own (and its partial rotary)
    r: dict[str, float] = {"L": L, "factor": s, "pretrain_steps": pre_steps, "pretrain_stop_reason": pre_reason,
                           "rope_ppl_L": ppl(L), "rope_ppl_sL": ppl(n)}
    for name in ("pi", "yarn"):
        inject(model, name, factor=s, original_max_position_embeddings=L, **theta)
        r[f"{name}_ppl_sL"], r[f"{name}_ppl_L"] = ppl(n), ppl(L)

    inject(model, "long_rope", factor=s, original_max_position_embeddings=L, max_position_embeddings=n, **theta)
    cur = LongRoPECurriculum(original_length=L, target_length=n, steps_per_stage=max(1, ft_steps), start_length=n,
                             population=ext.population, parents=ext.parents, iterations=ext.iterations,
                             search_windows=ext.search_windows, seed=cli.config.get("seed_everything") or 0,
                             n_hat_candidates=list(N_HAT_CANDIDATES))
    res = cur.search(model, tokens, n, s, "long")
    cur.found[0] = list(res.best)
    set_factors(model, long=cur.found[0])
    r["longrope_search_ppl_on_search_windows"] = res.best_score
    r["longrope_ppl_sL"], r["longrope_ppl_L"] = ppl(n), ppl(L)
    n_hat, n_hat_ppl = cur.search_n_hat(model, tokens, n, cur.found[0])  # on the same search windows
    cur.found_n_hat[0] = n_hat
    set_factors(model, n_hat=n_hat)
    r["n_hat"], r["n_hat_search_ppl"] = n_hat, n_hat_ppl  # type: ignore[assignment]
    r["longrope_nhat_ppl_sL"], r["longrope_nhat_ppl_L"] = ppl(n), ppl(L)
    r["longrope_vs_pi_sL"] = r["longrope_ppl_sL"] / r["pi_ppl_sL"] - 1
    r["longrope_vs_yarn_sL"] = r["longrope_ppl_sL"] / r["yarn_ppl_sL"] - 1

    data.seq_len, data.batch_size = n, max(1, data.batch_size * L // n)
    model.hparams.lr, model.hparams.warmup_steps = ext.finetune_lr, max(1, ft_steps // 10)
    ft = finetune_trainer(cli, ft_steps, "finetune", callbacks=[cur])
    ft.fit(model, data)  # the curriculum keeps the found long factors and re-searches the short ones at L
    out = run_dir(trainer, ext.results_dir)  # collective: every rank, before rank 0 writes
    r["finetune_steps"], r["finetune_max_steps"] = ft.global_step, ft_steps
    r["finetune_stop_reason"] = stop_reason(ft) if ft_steps > 0 else None
    r["finetuned_ppl_sL"], r["finetuned_ppl_L"] = ppl(n), ppl(L)
    r["long_factor"] = cur.found[0]  # type: ignore[assignment]
    r["short_factor"] = cur.short  # type: ignore[assignment]
    r["search_history"] = cur.histories  # type: ignore[assignment]

    def f(k):
        return f"{r[k]:.4f}"
    table = [("rope (pre-trained)", f("rope_ppl_L"), f("rope_ppl_sL")),
             (f"pi s={s:g} zero-shot", f("pi_ppl_L"), f("pi_ppl_sL")),
             (f"yarn s={s:g} zero-shot", f("yarn_ppl_L"), f("yarn_ppl_sL")),
             (f"long_rope searched s={s:g} zero-shot (n_hat=0)", f("longrope_ppl_L"), f("longrope_ppl_sL")),
             (f"long_rope searched s={s:g} zero-shot, n_hat={n_hat}", f("longrope_nhat_ppl_L"),
              f("longrope_nhat_ppl_sL")),
             (f"long_rope (n_hat={n_hat}) + {ft.global_step} fine-tune steps + short re-search", f("finetuned_ppl_L"),
              f("finetuned_ppl_sL"))]
    notes = (f"Search: population {ext.population}, {ext.parents} parents, {ext.iterations} iterations, scored on "
             f"{ext.search_windows} windows of {n}; all rows evaluated on {ext.eval_tokens} other validation tokens. "
             f"long_rope vs pi at {n}: {100 * r['longrope_vs_pi_sL']:+.2f}%, vs yarn: "
             f"{100 * r['longrope_vs_yarn_sL']:+.2f}%.\n\nlong_factor: {[round(x, 2) for x in cur.found[0]]}\n\n"
             f"n_hat (initial positions not interpolated, chosen after the factors on the search windows): "
             f"{n_hat}; search-window ppl by n_hat: {', '.join(f'{k}: {v:.3f}' for k, v in n_hat_ppl.items())}\n\n"
             f"short_factor: {[round(x, 2) for x in cur.short] if cur.short else None}")
    stops = [f"{k}: {r[k + '_stop_reason']}" for k in ("pretrain", "finetune") if r[k + "_stop_reason"]]
    notes = (f"Pre-training: {pre_steps} steps at L={L}{' (from ' + ext.pretrained + ')' if ext.pretrained else ''}; "
             f"fine-tune: {ft.global_step} steps at {n}." + (f" Shortened: {'; '.join(stops)}." if stops else "")
             + "\n\n" + notes)
    write_results(trainer, "longrope_extend", out, r, table, ("model", f"ppl @ L={L}", f"ppl @ {n}"), notes,
                  cli.recipe_command)
    return r


if __name__ == "__main__":
    main()
