"""Compare positional encodings by length generalization: train TinyGPT with each encoding at L on
the bundled corpus, evaluate perplexity at L, 2L, 4L, 8L, 16L; write ``results.md`` (table),
``results.json`` and ``ppl_vs_length.png`` in the run directory, and one TensorBoard run per
encoding (scalars, attention maps / bias / spectra images, text tables).

    python recipes/compare_encodings.py --config configs/compare_encodings.yaml
    posenc run compare_encodings --compare.encodings='[rope,alibi,fire]' --trainer.max_steps=100
    posenc report runs/compare_encodings          # the same table + plot from the TensorBoard logs
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import lightning.pytorch as pl

from posenc_lightning.callbacks import LengthEvalCallback, LMEvalCallback, PosEncCallback, PosEncVisualizer
from posenc_lightning.data import CorpusDataModule
from posenc_lightning.encodings import available_encodings
from posenc_lightning.eval.compare import flatness, render
from posenc_lightning.inject import inject
from posenc_lightning.models import TinyGPT
from posenc_lightning.recipes import RecipeCLI, RunDirSaveConfig, recipe_parser_kwargs


@dataclass
class CompareOptions:
    """``--compare.*`` of compare_encodings.

    Args:
        encodings: encodings to train ('all' = every registered one).
        exclude: encodings to skip.
        encoding_cfg: per-encoding arguments, e.g. {learned: {max_seq_len: 64}}.
        multiples: evaluation lengths as multiples of the training length.
        scale_with_length: encodings evaluated zero-shot with factor n/L at length n (PI/NTK/YaRN protocol).
        max_windows: validation windows per length.
        lm_eval_tasks: lm-eval tasks run at validation end (e.g. passkey_loglikelihood).
        lm_eval_lengths: lengths the lm-eval tasks run at.
        lm_eval_limit: lm-eval samples per length.
        visualize: PosEncVisualizer images (attention maps, bias, spectra) in TensorBoard.
        results_dir: the run directory: one TensorBoard run per encoding, results.md / results.json /
            ppl_vs_length.png.
        num_threads: torch CPU threads (0 = torch's default; 1 is fastest on a busy shared machine).
    """

    encodings: list[str] = field(default_factory=lambda: ["all"])
    exclude: list[str] = field(default_factory=list)
    encoding_cfg: dict[str, dict[str, Any]] = field(default_factory=dict)
    multiples: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    scale_with_length: list[str] = field(default_factory=list)
    max_windows: int = 4
    lm_eval_tasks: list[str] = field(default_factory=list)
    lm_eval_lengths: list[int] = field(default_factory=lambda: [256, 512])
    lm_eval_limit: int = 4
    visualize: bool = True
    results_dir: str = "runs/compare_encodings"
    num_threads: int = 0


class CompareCLI(RecipeCLI):
    options_class = CompareOptions
    recipe = "compare_encodings"
    results_group = "compare"


def main(args: list[str] | None = None) -> dict[str, dict[int, float]]:
    cli = CompareCLI(TinyGPT, CorpusDataModule, run=False, args=args, save_config_callback=RunDirSaveConfig,
                     save_config_kwargs={"overwrite": True}, trainer_defaults={"logger": False},
                     parser_kwargs=recipe_parser_kwargs("compare_encodings", __doc__))
    cfg = cli.options_value
    if cfg.num_threads > 0:
        import torch

        torch.set_num_threads(cfg.num_threads)
    names = available_encodings() if "all" in cfg.encodings else list(cfg.encodings)
    names = [n for n in names if n not in set(cfg.exclude)]
    data: CorpusDataModule = cli.datamodule
    L = data.seq_len
    data.val_seq_len = L
    out = Path(cfg.results_dir)
    model_cfg = {k: v for k, v in dict(cli.config["model"]).items() if k not in ("encoding", "encoding_cfg")}
    seed = cli.config.get("seed_everything") or 0
    ppl: dict[str, dict[int, float]] = {}
    failures: dict[str, dict[int, str]] = {}
    seconds: dict[str, float] = {}
    steps: dict[str, int] = {}
    stopped: dict[str, str] = {}
    barebones = bool(cli.config["trainer"].get("barebones"))
    from lightning.pytorch.loggers import TensorBoardLogger

    from posenc_lightning.recipes import stop_reason

    for name in names:
        t0 = time.perf_counter()
        enc_cfg = dict(cfg.encoding_cfg.get(name, {}))
        try:  # a dry build: an encoding that cannot run in TinyGPT is reported, the rest go on
            inject(TinyGPT(**{**model_cfg, "max_seq_len": L, "encoding": None}), name, **enc_cfg)
        except Exception as e:  # noqa: BLE001  an encoding that cannot build in TinyGPT: reported, the rest go on
            failures[name] = {n: f"cannot build: {e}" for n in [L * m for m in cfg.multiples]}
            ppl[name] = {n: float("nan") for n in failures[name]}
            continue
        pl.seed_everything(seed)
        model = TinyGPT(**{**model_cfg, "max_seq_len": L, "encoding": None})
        length_cb = LengthEvalCallback(multiples=cfg.multiples, base_len=L, max_windows=cfg.max_windows,
                                       scale_with_length=name in cfg.scale_with_length)
        callbacks: list[pl.Callback] = [PosEncCallback(name, config=enc_cfg), length_cb]  # injects at setup
        if cfg.visualize:
            callbacks.append(PosEncVisualizer(lengths=[L, 4 * L]))
        if cfg.lm_eval_tasks:
            callbacks.append(LMEvalCallback(cfg.lm_eval_tasks, cfg.lm_eval_lengths, limit=cfg.lm_eval_limit))
        logger = False if barebones else TensorBoardLogger(str(out), name="", version=name, default_hp_metric=False)
        trainer = cli.instantiate_trainer(logger=logger, callbacks=callbacks, enable_checkpointing=False)
        trainer.fit(model, data)
        steps[name] = trainer.global_step
        if (why := stop_reason(trainer)) is not None:
            stopped[name] = why
        if not length_cb.history:  # no validation ran at the end: evaluate now
            length_cb.evaluate(model, trainer)
        ppl[name] = dict(length_cb.results)
        failures[name] = dict(length_cb.failures)
        seconds[name] = time.perf_counter() - t0
        print(f"[compare] {name}: " + ", ".join(f"{n}: {v:.2f}" for n, v in ppl[name].items())
              + f" ({seconds[name]:.0f}s)", flush=True)
    if pl.utilities.rank_zero.rank_zero_only.rank == 0:  # after every collective call (each fit, each evaluate)
        ran = sorted(set(steps.values()))
        notes = (f"{'/'.join(map(str, ran)) or 0} steps at L={L}, batch {data.batch_size}, TinyGPT d_model={model_cfg.get('d_model')} "
                 f"n_layers={model_cfg.get('n_layers')} n_heads={model_cfg.get('n_heads')}; {cfg.max_windows} "
                 f"validation windows per length. ppl(longest)/ppl(L): "
                 + ", ".join(f"{k} {flatness(v):.2f}" for k, v in ppl.items() if flatness(v) == flatness(v))
                 + ". Wall time per encoding (s): " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items())
                 + "".join(f". {k} {v}" for k, v in stopped.items()))
        md = render(ppl, out, base_len=L, failures=failures, title="compare_encodings", notes=notes,
                    steps=steps, stopped=stopped)
        if not barebones:  # the picture and the table in TensorBoard too (run "summary")
            from torch.utils.tensorboard import SummaryWriter

            from posenc_lightning.eval.plots import ppl_heatmap

            writer = SummaryWriter(str(out / "summary"))
            fig = ppl_heatmap(ppl, title="compare_encodings: perplexity vs length", base_len=L)
            if fig is not None:
                writer.add_figure("compare/ppl_vs_length", fig)  # closes the figure
            writer.add_text("compare/results", md)
            writer.close()
        print(md)
    return ppl


if __name__ == "__main__":
    main()
