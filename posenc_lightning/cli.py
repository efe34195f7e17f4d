"""The ``posenc`` command.

- ``posenc list``: the registered encodings (name, family, description).
- ``posenc train``: train TinyGPT on the bundled corpus with an encoding (LightningCLI,
  `posenc_lightning.cli_train`; ``posenc train --help``).
- ``posenc run RECIPE``: run ``recipes/RECIPE.py`` with ``configs/RECIPE.yaml`` and overrides
  (``--devices N``, ``--context-parallel K``).
- ``posenc report RUN_DIR``: summarize a run directory (report.md, report.json, a perplexity-by-length
  plot).
- ``posenc export RUN_OR_CHECKPOINT OUT --format hf|remote-code``: write a trained Hugging Face model
  for serving; ``posenc check-serving DIR``: what each serving engine computes from it
  (`posenc_lightning.cli_export`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _cmd_list(args: argparse.Namespace) -> int:
    from posenc_lightning.encodings.registry import describe

    rows = describe()
    width = max(len(n) for n, _, _ in rows)
    fam = max(len(f) for _, f, _ in rows)
    for name, family, desc in rows:
        print(f"{name:<{width}}  {family:<{fam}}  {desc}")
    return 0


def _recipe_dirs() -> list:
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return [Path.cwd(), root]


def known_recipes() -> list[str]:
    """The recipe names ``posenc run`` finds (``recipes/*.py`` here and in the checkout)."""
    return sorted({p.stem for d in _recipe_dirs() for p in (d / "recipes").glob("*.py") if not p.stem.startswith("_")})


def recipe_command(recipe: str, overrides: Sequence[str]) -> list[str]:
    """The command ``posenc run`` executes: ``python recipes/NAME.py --config configs/NAME.yaml
    [--trainer.devices=N --trainer.strategy=ddp] [a ContextParallel(K) callback] [overrides]``."""
    from pathlib import Path

    rest: list[str] = []
    opts: dict[str, str | None] = {"--devices": None, "--config": None, "--context-parallel": None}
    it = iter(overrides)
    for a in it:
        key, eq, val = a.partition("=")
        if key in opts:
            val = val if eq else next(it, None)
            if val is None:
                raise SystemExit(f"posenc run: {a} needs a value")
            opts[key] = val
        else:
            rest.append(a)
    devices, config, cp = opts["--devices"], opts["--config"], opts["--context-parallel"]
    script = Path(recipe) if recipe.endswith(".py") else None
    for d in _recipe_dirs():
        if script is None and (d / "recipes" / f"{recipe}.py").is_file():
            script = d / "recipes" / f"{recipe}.py"
            if config is None and (d / "configs" / f"{recipe}.yaml").is_file():
                config = str(d / "configs" / f"{recipe}.yaml")
    if script is None or not script.is_file():
        known = known_recipes()
        raise SystemExit(f"posenc run: unknown recipe {recipe!r}; known: {known} (or give a path to a .py)")
    cmd = [sys.executable, str(script)] + (["--config", config] if config else [])
    if devices is not None:
        cmd.append(f"--trainer.devices={devices}")
        if devices not in ("1", "auto") and not any(a.startswith("--trainer.strategy") for a in rest):
            cmd.append("--trainer.strategy=ddp")
    if cp is not None:
        if not cp.isdigit() or int(cp) < 1:
            raise SystemExit(f"posenc run: --context-parallel needs a positive integer (ranks per sequence), got {cp!r}")
        if devices is not None and devices.isdigit() and int(devices) % int(cp):
            raise SystemExit(f"posenc run: --devices {devices} is not divisible by --context-parallel {cp}")
        cmd += ["--trainer.callbacks+=posenc_lightning.callbacks.ContextParallel", f"--trainer.callbacks.size={cp}"]
    return cmd + rest


def _cmd_run(args: argparse.Namespace) -> int:
    import shlex
    import subprocess

    # --dry-run is posenc run's own wherever it stands (after RECIPE it lands among the overrides):
    # never handed to the recipe, whose parser does not know it
    dry_run = args.dry_run or "--dry-run" in args.overrides
    cmd = recipe_command(args.recipe, [a for a in args.overrides if a != "--dry-run"])
    print("+ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    if dry_run:
        return 0
    return subprocess.call(cmd)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="posenc", description="Positional encodings for PyTorch Lightning")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list the encodings: name, family (stage), description").set_defaults(fn=_cmd_list)
    t = sub.add_parser("train", add_help=False,
                       help="train TinyGPT on the bundled corpus with an encoding (LightningCLI: posenc train --help)")
    t.add_argument("args", nargs=argparse.REMAINDER)
    recipes = ", ".join(known_recipes())
    r = sub.add_parser("run", help=f"run a recipe ({recipes})",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description=f"Runs recipes/RECIPE.py --config configs/RECIPE.yaml with your overrides "
                                   f"(LightningCLI syntax: --trainer.max_steps=100 --model.d_model=128 ...); "
                                   f"--devices N > 1 adds --trainer.strategy=ddp; --context-parallel K splits each sequence "
                                   f"over K of the N ranks (posenc_lightning.ContextParallel). Recipes: {recipes}. "
                                   f"A recipe's own options: posenc run RECIPE --help.")
    r.add_argument("--dry-run", action="store_true", help="print the command only, run nothing (anywhere on the line: "
                                                         "posenc run RECIPE ... --dry-run)")
    r.add_argument("recipe", help=f"one of {recipes}, or a path to a .py")
    r.add_argument("overrides", nargs=argparse.REMAINDER,
                   help="--devices N, --context-parallel K, --config FILE (default: configs/RECIPE.yaml), "
                        "--group.key=value ...")
    r.set_defaults(fn=_cmd_run)
    rep = sub.add_parser("report", help="summarize a run directory: recipe tables, ppl by length, every scalar series",
                         description="Reads a run directory (a logger's version dir, a recipe's results_dir, a "
                                     "compare_encodings results_dir) and writes report.md, report.json and, when "
                                     "the run has perplexity by length, report_ppl_vs_length.png. Never writes "
                                     "over a recipe's own results.* files.")
    rep.add_argument("run_dir", help="the run directory (TensorBoard event files and/or a recipe's results.json)")
    rep.add_argument("--out", default=None, help="output directory (default: RUN_DIR/report)")
    rep.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    rep.set_defaults(fn=_cmd_report)
    from posenc_lightning.cli_export import add_parsers

    add_parsers(sub)
    return p


def _cmd_report(args: argparse.Namespace) -> int:
    from posenc_lightning.eval.compare import report

    print(report(args.run_dir, args.out))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # LightningCLI parses its own arguments (and --help, --print_config)
        # a misspelt encoding or encoding argument fails here, before Lightning is imported (seconds)
        # and before the Trainer creates a run directory: one line, nothing written
        from posenc_lightning.cli_checks import precheck_train

        error = None if {"-h", "--help"} & set(argv) else precheck_train(argv[1:])
        if error is not None:
            print(f"posenc train: error: {error}", file=sys.stderr)
            return 2
        from posenc_lightning.cli_train import main as train

        return train(argv[1:])
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
