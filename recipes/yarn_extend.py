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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from posenc_lightning.curriculum.extend import finetune_trainer, make_cli, perplexity, write_results
from posenc_lightning.inject import inject

EXTEND_ARGS = {
    "factor": (float, 8.0, "context extension ratio s (evaluate at s * L)"),
    "encoding": (str, "yarn", "the scaled rotary encoding to extend with (yarn, pi, ntk, ...)"),
    "finetune_steps": (int, -1, "fine-tuning steps at s * L (-1: 5% of the pre-training steps)"),
    "finetune_lr": (float, 1e-3, "peak learning rate of the fine-tune"),
    "eval_tokens": (int, 32768, "validation tokens scored at every length (the same text)"),
    "results_dir": (str, "", "where results.json / results.md / pretrained.ckpt go (default: the run's log dir)"),
}


def main(args: list[str] | None = None) -> dict[str, float]:
    cli = make_cli(EXTEND_ARGS, args, "yarn_extend")
    ext = cli.config["extend"]
    model, data, trainer = cli.model, cli.datamodule, cli.trainer
    L, s = data.seq_len, float(ext.factor)
    long_len = round(L * s)
    pre_steps = trainer.max_steps
    ft_steps = ext.finetune_steps if ext.finetune_steps >= 0 else max(1, pre_steps // 20)

    trainer.fit(model, data)  # 1. pre-train rope at L
    out = Path(ext.results_dir) if ext.results_dir else Path(trainer.log_dir or "runs/yarn_extend")
    trainer.save_checkpoint(str(out / "pretrained.ckpt"))  # longrope_extend can start from it
    tokens = data.val_tokens
    def ppl(n):
        return perplexity(model, tokens, n, ext.eval_tokens)
    r = {"L": L, "factor": s, "pretrain_steps": pre_steps, "finetune_steps": ft_steps,
         "rope_ppl_L": ppl(L), "rope_ppl_sL": ppl(long_len)}

    theta = float(model.hparams.encoding_cfg.get("theta", 10000.0)) if model.hparams.encoding_cfg else 10000.0
    inject(model, ext.encoding, factor=s, original_max_position_embeddings=L, theta=theta)  # 2. zero-shot
    r["zero_shot_ppl_sL"] = ppl(long_len)
    r["zero_shot_ppl_L"] = ppl(L)

    data.seq_len = long_len  # 3. fine-tune at sL, same tokens per batch
    data.batch_size = max(1, data.batch_size * L // long_len)
    model.hparams.lr = ext.finetune_lr
    model.hparams.warmup_steps = max(1, ft_steps // 10)
    finetune_trainer(cli, ft_steps, "finetune").fit(model, data)
    r["finetuned_ppl_sL"] = ppl(long_len)
    r["finetuned_ppl_L"] = ppl(L)
    r["finetuned_sL_vs_rope_L"] = r["finetuned_ppl_sL"] / r["rope_ppl_L"] - 1.0
    r["target_met"] = bool(r["finetuned_sL_vs_rope_L"] <= 0.05 and ft_steps <= 0.05 * pre_steps)

    e = ext.encoding
    table = [("rope (pre-trained)", f"{r['rope_ppl_L']:.4f}", f"{r['rope_ppl_sL']:.4f}"),
             (f"{e} zero-shot (s={s:g})", f"{r['zero_shot_ppl_L']:.4f}", f"{r['zero_shot_ppl_sL']:.4f}"),
             (f"{e} + {ft_steps} fine-tune steps", f"{r['finetuned_ppl_L']:.4f}", f"{r['finetuned_ppl_sL']:.4f}")]
    notes = (f"Perplexity (bytes) on the same {ext.eval_tokens} validation tokens cut into windows of each length. "
             f"Pre-training: {pre_steps} steps at L={L}; fine-tune: {ft_steps} steps at {long_len} "
             f"({100 * ft_steps / max(1, pre_steps):.1f}% of pre-training). Target (fine-tuned {e} at {long_len} "
             f"within 5% of rope at L): {'met' if r['target_met'] else 'NOT met'} "
             f"({100 * r['finetuned_sL_vs_rope_L']:+.2f}%).")
    write_results(trainer, "yarn_extend", r, table, ("model", f"ppl @ L={L}", f"ppl @ {long_len}"), notes,
                  ext.results_dir or None, cli.recipe_command)
    return r


if __name__ == "__main__":
    main()
