"""DroPE (Gelberg et al., Sakana AI, 2025): pre-train with RoPE at L, drop RoPE (the encoding becomes
nope, every trained weight kept), recalibrate with a fraction of the pre-training steps at L, and
compare perplexity by length (1-16 L by default) against RoPE scaling from the same pre-trained
weights: PI, YaRN and NTK zero-shot (factor n / L at each length n) and fine-tuned with the same
steps and tokens (at ``--extend.factor``). Results: ``results.json`` / ``results.md`` in the run
directory (the paper's expectations checked beside the numbers) and the TensorBoard run.

    python recipes/drope_extend.py --config configs/drope_extend.yaml [--trainer.max_steps=...]
    posenc run drope_extend [overrides]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from posenc_lightning.inject import inject
from posenc_lightning.recipes import (
    bigram_perplexity,
    finetune_trainer,
    length_sweep,
    make_cli,
    rope_base,
    run_dir,
    stop_reason,
    write_results,
)
from posenc_lightning.recipes.drope import (
    DROPE,
    RECALIBRATE_FRACTION,
    RECALIBRATE_LR,
    check_expectations,
    restore_weights,
    trained_weights,
)


@dataclass
class DropeOptions:
    """``--extend.*`` of drope_extend.

    Args:
        lengths: evaluation lengths as multiples of the training length L.
        laws: the RoPE scalings DroPE is compared with (registered rotary laws taking ``factor``).
        factor: the scaling factor of the fine-tuned laws (zero-shot rows use n / L at each length n).
        recalibrate_fraction: DroPE's recalibration steps as a fraction of the pre-training steps
            that ran; every fine-tuned law gets the same steps.
        finetune_lr: peak learning rate of the recalibration and of every fine-tune.
        eval_tokens: validation tokens scored at every length (the same text).
        results_dir: where results.json / results.md go ('' = the run's log dir).
    """

    lengths: list[float] = field(default_factory=lambda: [1.0, 2.0, 4.0, 8.0, 16.0])
    laws: list[str] = field(default_factory=lambda: ["pi", "yarn", "ntk"])
    factor: float = 16.0
    recalibrate_fraction: float = RECALIBRATE_FRACTION
    finetune_lr: float = RECALIBRATE_LR
    eval_tokens: int = 16384
    results_dir: str = ""


def main(args: list[str] | None = None) -> dict[str, object]:
    cli = make_cli(DropeOptions, args, "drope_extend", __doc__)
    ext = cli.options
    if not 0.0 < ext.recalibrate_fraction <= 1.0:
        raise ValueError(f"--extend.recalibrate_fraction must be in (0, 1], got {ext.recalibrate_fraction}")
    model, data, trainer = cli.model, cli.datamodule, cli.trainer
    trainer.fit(model, data)  # 1. pre-train rope at L
    pre_steps, pre_reason = trainer.global_step, stop_reason(trainer)
    out = run_dir(trainer, ext.results_dir)  # collective: every rank
    L = data.seq_len
    lengths = [round(m * L) for m in ext.lengths]
    if L not in lengths:
        raise ValueError(f"--extend.lengths must include 1.0 (the training length L={L}), got {ext.lengths}")
    recalibration = replace(DROPE, fraction=ext.recalibrate_fraction, lr=ext.finetune_lr)
    steps = recalibration.prepare(model, pre_steps)  # every fine-tune below runs these steps at this lr
    base = rope_base(model)
    weights = trained_weights(model)  # every method starts from these
    tokens = data.val_tokens

    def sweep(hook=None) -> dict[int, float]:
        return length_sweep(model, tokens, lengths, ext.eval_tokens, hook)

    def finetune(name: str) -> int:
        ft = finetune_trainer(cli, steps, name)
        ft.fit(model, data)  # at L, the same tokens per step for every method
        return ft.global_step

    ppl: dict[str, dict[int, float]] = {"rope": sweep()}
    ran: dict[str, int] = {}
    for law in ext.laws:  # 2. RoPE scaling: zero-shot (factor n / L), then fine-tuned at --extend.factor
        ppl[f"{law} zero-shot"] = sweep(lambda n, law=law: inject(
            model, law, factor=max(1.0, n / L), original_max_position_embeddings=L, **base))
        inject(model, law, factor=float(ext.factor), original_max_position_embeddings=L, **base)
        ran[law] = finetune(f"finetune_{law}")
        ppl[f"{law} fine-tuned"] = sweep()
        restore_weights(model, weights)
    inject(model, "nope")  # 3. DroPE: drop RoPE, keep every weight
    restore_weights(model, weights)  # (a no-op after inject; says the start is the same as the others')
    ppl["drope zero-shot"] = sweep()
    ran["drope"] = finetune("recalibrate")
    ppl["drope"] = sweep()

    bigram = bigram_perplexity(data.train_tokens, tokens, ext.eval_tokens)
    checks = check_expectations(ppl, L, bigram, pretrain_complete=pre_reason is None)
    r: dict[str, object] = {"L": L, "pretrain_steps": pre_steps, "pretrain_max_steps": trainer.max_steps,
                            "pretrain_stop_reason": pre_reason, "finetune_steps": ran, "factor": ext.factor,
                            "bigram_ppl": bigram, "expectations": checks}
    r.update({f"ppl/{row}/{n}": v for row, by_len in ppl.items() for n, v in by_len.items()})
    table = [(row, *(f"{v:.4f}" for v in by_len.values())) for row, by_len in ppl.items()]
    header = ("model", *(f"{n} ({n / L:g} L)" for n in lengths))
    notes = (f"Perplexity (bytes) on the same {ext.eval_tokens} validation tokens cut into windows of each length. "
             f"RoPE pre-trained {pre_steps} steps at L={L}; DroPE recalibrated and every law fine-tuned "
             f"{steps} steps at L ({100 * steps / max(1, pre_steps):.1f}% of pre-training) from the same weights; "
             f"zero-shot laws at factor n/L, fine-tuned at factor {ext.factor:g}; byte bigram {bigram:.4f}.\n\n"
             "## The paper's expectations\n\n| expectation | source | verdict | measured |\n|---|---|---|---|\n"
             + "\n".join(f"| {c['expectation']} | {c['source']} | **{c['verdict']}** | {c['measured']} |"
                         for c in checks))
    write_results(trainer, "drope_extend", out, r, table, header, notes, cli.recipe_command)
    return r


if __name__ == "__main__":
    main()
