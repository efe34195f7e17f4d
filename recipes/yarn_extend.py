"""Extend a rope model's context 8x with YaRN (Peng et al., 2023): pre-train rope at L, evaluate at
8L; switch to yarn (zero-shot), evaluate; fine-tune briefly at 8L (<= 5% of the pre-training
steps), evaluate again. Results: ``results.json`` / ``results.md`` in the run directory and the
TensorBoard run (scalars ``yarn_extend/*``, text tab).

    python recipes/yarn_extend.py --config configs/yarn_extend.yaml [--trainer.max_steps=...]
    posenc run yarn_extend [--devices 2] [overrides]
    torchrun --nproc_per_node 2 recipes/yarn_extend.py --config configs/yarn_extend.yaml \
        --trainer.devices=2 --trainer.strategy=ddp
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from posenc_lightning.curriculum.extend import (
    bigram_perplexity,
    extension_verdict,
    finetune_trainer,
    make_cli,
    perplexity,
    rope_theta,
    run_dir,
    stop_reason,
    write_results,
)
from posenc_lightning.inject import inject


@dataclass
class YarnExtendOptions:
    """``--extend.*`` of yarn_extend.

    Args:
        factor: context extension ratio s (evaluate at s * L).
        encoding: the scaled rotary encoding to extend with (yarn, pi, ntk, ...).
        finetune_steps: fine-tuning steps at s * L (-1: 5% of the pre-training steps that ran).
        finetune_lr: peak learning rate of the fine-tune.
        eval_tokens: validation tokens scored at every length (the same text).
        results_dir: where results.json / results.md / pretrained.ckpt go ('' = the run's log dir;
            with --trainer.logger=false, runs/yarn_extend).
    """

    factor: float = 8.0
    encoding: str = "yarn"
    finetune_steps: int = -1
    finetune_lr: float = 1e-3
    eval_tokens: int = 32768
    results_dir: str = ""


def main(args: list[str] | None = None) -> dict[str, float]:
    cli = make_cli(YarnExtendOptions, args, "yarn_extend", __doc__)
    ext = cli.options
    model, data, trainer = cli.model, cli.datamodule, cli.trainer
    L, s = data.seq_len, float(ext.factor)
    long_len = round(L * s)

    trainer.fit(model, data)  # 1. pre-train rope at L
    pre_steps, pre_reason = trainer.global_step, stop_reason(trainer)
    ft_steps = ext.finetune_steps if ext.finetune_steps >= 0 else max(1, pre_steps // 20)
    out = run_dir(trainer, ext.results_dir)  # collective: every rank
    trainer.save_checkpoint(str(out / "pretrained.ckpt"))  # longrope_extend can start from it
    tokens = data.val_tokens
    ppl = lambda n: perplexity(model, tokens, n, ext.eval_tokens)
    r = {"L": L, "factor": s, "pretrain_steps": pre_steps, "pretrain_max_steps": trainer.max_steps,
         "rope_ppl_L": ppl(L), "rope_ppl_sL": ppl(long_len)}

    theta = rope_theta(model)  # the pre-trained rope's base
    inject(model, ext.encoding, factor=s, original_max_position_embeddings=L, theta=theta)  # 2. zero-shot
    r["zero_shot_ppl_sL"] = ppl(long_len)
    r["zero_shot_ppl_L"] = ppl(L)

    data.seq_len = long_len  # 3. fine-tune at sL, same tokens per batch
    data.batch_size = max(1, data.batch_size * L // long_len)
    model.hparams.lr = ext.finetune_lr
    model.hparams.warmup_steps = max(1, ft_steps // 10)
    ft = finetune_trainer(cli, ft_steps, "finetune")
    ft.fit(model, data)
    r["finetune_steps"], r["finetune_max_steps"] = ft.global_step, ft_steps
    r["finetuned_ppl_sL"] = ppl(long_len)
    r["finetuned_ppl_L"] = ppl(L)
    r["finetuned_sL_vs_rope_L"] = r["finetuned_ppl_sL"] / r["rope_ppl_L"] - 1.0
    r["bigram_ppl"] = bigram_perplexity(data.train_tokens, tokens, ext.eval_tokens)
    met, why = extension_verdict(pre_reason, stop_reason(ft) if ft_steps > 0 else None, ft.global_step, pre_steps,
                       r["finetuned_sL_vs_rope_L"], r["rope_ppl_L"], r["bigram_ppl"])
    r["target_met"], r["target"] = met, why

    e = ext.encoding
    table = [("rope (pre-trained)", f"{r['rope_ppl_L']:.4f}", f"{r['rope_ppl_sL']:.4f}"),
             (f"{e} zero-shot (s={s:g})", f"{r['zero_shot_ppl_L']:.4f}", f"{r['zero_shot_ppl_sL']:.4f}"),
             (f"{e} + {ft.global_step} fine-tune steps", f"{r['finetuned_ppl_L']:.4f}", f"{r['finetuned_ppl_sL']:.4f}")]
    notes = (f"Perplexity (bytes) on the same {ext.eval_tokens} validation tokens cut into windows of each length. "
             f"Pre-training: {pre_steps} steps at L={L}; fine-tune: {ft.global_step} steps at {long_len} "
             f"({100 * ft.global_step / max(1, pre_steps):.1f}% of pre-training). Target (fine-tuned {e} at {long_len} "
             f"within 5% of rope at L, fine-tune <= 5% of the steps): {why}.")
    write_results(trainer, "yarn_extend", out, r, table, ("model", f"ppl @ L={L}", f"ppl @ {long_len}"), notes,
                  cli.recipe_command)
    return r


if __name__ == "__main__":
    main()
