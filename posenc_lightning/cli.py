"""The ``posenc`` command: ``posenc list``, ``posenc train``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def _cmd_list(args: argparse.Namespace) -> int:
    from posenc_lightning.encodings.registry import describe

    rows = describe()
    width = max(len(n) for n, _, _ in rows)
    fam = max(len(f) for _, f, _ in rows)
    for name, family, desc in rows:
        print(f"{name:<{width}}  {family:<{fam}}  {desc}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger

    from posenc_lightning.callbacks import PosEncCallback
    from posenc_lightning.data import CorpusDataModule
    from posenc_lightning.models import TinyGPT

    pl.seed_everything(args.seed, workers=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg = json.loads(args.encoding_cfg) if args.encoding_cfg else {}
    model = TinyGPT(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                    max_seq_len=args.seq_len, lr=args.lr, encoding=None)
    data = CorpusDataModule(seq_len=args.seq_len, batch_size=args.batch_size, max_bytes=args.max_bytes,
                            max_val_windows=args.val_windows, seed=args.seed)
    logger = TensorBoardLogger(args.root_dir, name=args.encoding)
    trainer = pl.Trainer(max_steps=args.max_steps, val_check_interval=min(args.val_every, args.max_steps),
                         check_val_every_n_epoch=None, limit_val_batches=1.0, logger=logger,
                         callbacks=[PosEncCallback(args.encoding, backend=args.backend, **cfg)],
                         accelerator=args.accelerator, devices=args.devices, log_every_n_steps=10,
                         enable_progress_bar=not args.quiet, default_root_dir=args.root_dir)
    trainer.fit(model, data)
    metrics = trainer.callback_metrics
    ppl = float(metrics["val/ppl"]) if "val/ppl" in metrics else float("nan")
    print(f"encoding={args.encoding} steps={trainer.global_step} val_loss={float(metrics.get('val/loss', float('nan'))):.4f} "
          f"val_ppl={ppl:.3f} logs={logger.log_dir}")
    return 0


def _recipe_dirs() -> list:
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return [Path.cwd(), root]


def recipe_command(recipe: str, overrides: Sequence[str]) -> list[str]:
    """The command ``posenc run`` executes: ``python recipes/NAME.py --config configs/NAME.yaml
    [--trainer.devices=N --trainer.strategy=ddp] [overrides]``."""
    from pathlib import Path

    rest, devices, config = [], None, None
    it = iter(overrides)
    for a in it:
        if a in ("--devices", "--config"):
            val = next(it, None)
            if val is None:
                raise SystemExit(f"posenc run: {a} needs a value")
            devices, config = (val, config) if a == "--devices" else (devices, val)
        elif a.startswith("--devices=") or a.startswith("--config="):
            key, val = a.split("=", 1)
            devices, config = (val, config) if key == "--devices" else (devices, val)
        else:
            rest.append(a)
    script = Path(recipe) if recipe.endswith(".py") else None
    for d in _recipe_dirs():
        if script is None and (d / "recipes" / f"{recipe}.py").is_file():
            script = d / "recipes" / f"{recipe}.py"
            if config is None and (d / "configs" / f"{recipe}.yaml").is_file():
                config = str(d / "configs" / f"{recipe}.yaml")
    if script is None or not script.is_file():
        known = sorted({p.stem for d in _recipe_dirs() for p in (d / "recipes").glob("*.py") if not p.stem.startswith("_")})
        raise SystemExit(f"posenc run: unknown recipe {recipe!r}; known: {known} (or give a path to a .py)")
    cmd = [sys.executable, str(script)] + (["--config", config] if config else [])
    if devices is not None:
        cmd.append(f"--trainer.devices={devices}")
        if devices not in ("1", "auto") and not any(a.startswith("--trainer.strategy") for a in rest):
            cmd.append("--trainer.strategy=ddp")
    return cmd + rest


def _cmd_run(args: argparse.Namespace) -> int:
    import shlex
    import subprocess

    cmd = recipe_command(args.recipe, args.overrides)
    print("+ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    if args.dry_run:
        return 0
    return subprocess.call(cmd)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="posenc", description="Positional encodings for PyTorch Lightning")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list the encodings").set_defaults(fn=_cmd_list)
    t = sub.add_parser("train", help="train TinyGPT on the bundled corpus with an encoding")
    t.add_argument("--encoding", default="rope")
    t.add_argument("--encoding-cfg", default=None, help='JSON dict of encoding arguments, e.g. \'{"theta": 500000}\'')
    t.add_argument("--backend", default="auto")
    t.add_argument("--max-steps", type=int, default=300)
    t.add_argument("--val-every", type=int, default=100)
    t.add_argument("--val-windows", type=int, default=32)
    t.add_argument("--seq-len", type=int, default=128)
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--d-model", type=int, default=128)
    t.add_argument("--n-layers", type=int, default=4)
    t.add_argument("--n-heads", type=int, default=4)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--max-bytes", type=int, default=4_000_000)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--accelerator", default="auto")
    t.add_argument("--devices", default="auto")
    t.add_argument("--root-dir", default="runs")
    t.add_argument("--quiet", action="store_true")
    t.set_defaults(fn=_cmd_train)
    r = sub.add_parser("run", help="run a recipe: posenc run yarn_extend [--devices N] [--trainer.max_steps=...]",
                       description="Runs recipes/RECIPE.py --config configs/RECIPE.yaml with your overrides "
                                   "(LightningCLI syntax); --devices N > 1 adds --trainer.strategy=ddp.")
    r.add_argument("--dry-run", action="store_true", help="print the command only")
    r.add_argument("recipe", help="yarn_extend, longrope_extend, clex_train, fire_train or a path to a .py")
    r.add_argument("overrides", nargs=argparse.REMAINDER, help="--devices N, --config FILE, --group.key=value ...")
    r.set_defaults(fn=_cmd_run)
    rep = sub.add_parser("report", help="summarize a run directory: recipe tables, ppl by length, every scalar series",
                         description="Reads a run directory (a logger's version dir, a recipe's results_dir, a "
                                     "compare_encodings results_dir) and writes report.md, report.json and, when "
                                     "the run has perplexity by length, report_ppl_vs_length.png. Never writes "
                                     "over a recipe's own results.* files.")
    rep.add_argument("run_dir", help="the run directory (TensorBoard event files and/or a recipe's results.json)")
    rep.add_argument("--out", default=None, help="output directory (default: RUN_DIR/report)")
    rep.set_defaults(fn=_cmd_report)
    return p


def _cmd_report(args: argparse.Namespace) -> int:
    from posenc_lightning.eval.compare import report

    print(report(args.run_dir, args.out))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
