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
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from posenc_lightning.callbacks.lm_eval import LMEvalCallback
from posenc_lightning.inject import inject
from posenc_lightning.recipes import (
    bigram_perplexity,
    extension_verdict,
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
        lm_eval_tasks: lm-eval tasks (e.g. niah_single_1) evaluated inside the fine-tune's fit, at its
            last step, with the model's own tokenizer; [] = none.
        lm_eval_lengths: their prompt lengths in tokens (RULER needs >= 512).
        lm_eval_limit: samples per length.
        export_dir: a Hugging Face model is exported here after the fine-tune (``export_pretrained``)
            and reloaded in plain transformers; the largest logit difference is recorded.
    """

    factor: float = 8.0
    encoding: str = "yarn"
    finetune_steps: int = -1
    finetune_lr: float = 1e-3
    eval_tokens: int = 32768
    results_dir: str = ""
    lm_eval_tasks: list[str] = field(default_factory=list)
    lm_eval_lengths: list[int] = field(default_factory=lambda: [512, 1024])
    lm_eval_limit: int = 4
    export_dir: str = ""


def main(args: list[str] | None = None) -> dict[str, float]:
    cli = make_cli(YarnExtendOptions, args, "yarn_extend", __doc__, any_model=True)
    ext = cli.options
    model, data, trainer = cli.model, cli.datamodule, cli.trainer
    pre_steps, pre_reason = start_from_pretrained(model, data), None  # a Hugging Face directory: no pre-training
    pretrained = pre_steps is not None
    if not pretrained:
        trainer.fit(model, data)  # 1. pre-train rope at L
        pre_steps, pre_reason = trainer.global_step, stop_reason(trainer)
    L, s = data.seq_len, float(ext.factor)
    long_len = round(L * s)
    ft_steps = ext.finetune_steps if ext.finetune_steps >= 0 else max(1, pre_steps // 20)
    out = run_dir(trainer, ext.results_dir)  # collective: every rank
    if not pretrained:
        trainer.save_checkpoint(str(out / "pretrained.ckpt"))  # longrope_extend can start from it
    tokens = data.val_tokens

    def ppl(n: int) -> float:
        return perplexity(model, tokens, n, ext.eval_tokens)

    r = {"L": L, "factor": s, "pretrain_steps": pre_steps,
         "pretrain_max_steps": pre_steps if pretrained else trainer.max_steps,
         "rope_ppl_L": ppl(L), "rope_ppl_sL": ppl(long_len)}

    # 2. zero-shot, at the pre-trained rope's base (a Hugging Face model gives its own, and its partial rotary)
    inject(model, ext.encoding, factor=s, original_max_position_embeddings=L, **rope_base(model))
    r["zero_shot_ppl_sL"] = ppl(long_len)
    r["zero_shot_ppl_L"] = ppl(L)

    data.seq_len = long_len  # 3. fine-tune at sL, same tokens per batch
    data.batch_size = max(1, data.batch_size * L // long_len)
    model.hparams.lr = ext.finetune_lr
    model.hparams.warmup_steps = max(1, ft_steps // 10)
    lm_eval = [LMEvalCallback(ext.lm_eval_tasks, ext.lm_eval_lengths, limit=ext.lm_eval_limit)] if ext.lm_eval_tasks else []
    ft = finetune_trainer(cli, ft_steps, "finetune", callbacks=lm_eval, validate_at_end=bool(lm_eval))
    ft.fit(model, data)
    r["finetune_steps"], r["finetune_max_steps"] = ft.global_step, ft_steps
    r["finetuned_ppl_sL"] = ppl(long_len)
    r["finetuned_ppl_L"] = ppl(L)
    r["finetuned_sL_vs_rope_L"] = r["finetuned_ppl_sL"] / r["rope_ppl_L"] - 1.0
    r["bigram_ppl"] = bigram_perplexity(data.train_tokens, tokens, ext.eval_tokens)
    met, why = extension_verdict(pre_reason, stop_reason(ft) if ft_steps > 0 else None, ft.global_step, pre_steps,
                                 r["finetuned_sL_vs_rope_L"], r["rope_ppl_L"], r["bigram_ppl"])
    r["target_met"], r["target"] = met, why
    for cb in lm_eval:  # logged inside fit, at the fine-tune's last step
        r.update({k: v for k, v in (cb.history[-1]["metrics"] if cb.history else {}).items()})
    if ext.export_dir:
        r.update(export_and_reload(model, ext.export_dir, tokens, long_len, ft))

    e = ext.encoding
    unit = "bytes" if getattr(data, "tokenizer", None) is None else "tokens of the model's own tokenizer"
    first = "pretrained (rope)" if pretrained else "rope (pre-trained)"
    table = [(first, f"{r['rope_ppl_L']:.4f}", f"{r['rope_ppl_sL']:.4f}"),
             (f"{e} zero-shot (s={s:g})", f"{r['zero_shot_ppl_L']:.4f}", f"{r['zero_shot_ppl_sL']:.4f}"),
             (f"{e} + {ft.global_step} fine-tune steps", f"{r['finetuned_ppl_L']:.4f}", f"{r['finetuned_ppl_sL']:.4f}")]
    notes = (f"Perplexity ({unit}) on the same {ext.eval_tokens} validation tokens cut into windows of each length. "
             f"Pre-training: {pre_steps} steps at L={L}{' (the pretrained directory)' if pretrained else ''}; "
             f"fine-tune: {ft.global_step} steps at {long_len} "
             f"({100 * ft.global_step / max(1, pre_steps):.1f}% of pre-training). Target (fine-tuned {e} at {long_len} "
             f"within 5% of rope at L, fine-tune <= 5% of the steps): {why}.")
    evals = {k: v for k, v in r.items() if k.startswith("lm_eval/")}
    if evals:
        notes += (" lm-eval inside the fine-tune's fit (its last step, the model's own tokenizer): "
                  + ", ".join(f"{k[len('lm_eval/'):]} {v:.3f}" for k, v in evals.items()) + ".")
    if "export_format" in r:
        notes += (f" Exported to {r['export_dir']} ({r['export_format']} format); reloaded in plain transformers: "
                  f"max |logit difference| {r['export_reload_max_abs_logit_diff']:.3g} at {long_len} tokens.")
    write_results(trainer, "yarn_extend", out, r, table, ("model", f"ppl @ L={L}", f"ppl @ {long_len}"), notes,
                  cli.recipe_command)
    return r


def export_and_reload(model, export_dir: str, tokens, n: int, trainer) -> dict[str, object]:
    """Export the extended Hugging Face model (rank 0), reload it in plain transformers and compare
    logits on a validation window of ``n`` tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from posenc_lightning.models.hf_export import export_pretrained

    out: dict[str, object] = {}
    if trainer.is_global_zero:
        res = export_pretrained(model, export_dir)
        plain = AutoModelForCausalLM.from_pretrained(export_dir, local_files_only=True).eval()
        x = tokens[: n].long()[None].to(model.device)
        model.eval()
        with torch.no_grad():
            diff = (plain(x).logits - model(x)).abs().max().item()
        out = {"export_dir": export_dir, "export_format": res["format"], "export_reload_max_abs_logit_diff": diff}
    trainer.strategy.barrier("posenc_export")
    return out


if __name__ == "__main__":
    main()
